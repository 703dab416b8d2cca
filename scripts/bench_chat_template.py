"""Render time of chat templates with and without the engine's budget: kept for its command line;
the measurement is scripts/bench_template.py's (the same --repeats and --templates).

    python scripts/bench_chat_template.py --repeats 200
    python scripts/bench_chat_template.py --templates path/to/llama.cpp/models/templates
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_template import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
