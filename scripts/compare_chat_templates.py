"""Do chat templates render the same under the engine's budget? Renders every template (the
vendored real ones in tests/fixtures/chat_templates, the hand-written family shapes of
tests/chat_templates.py, and the *.jinja files of any --templates folder, e.g. a llama.cpp
checkout's models/templates) on the conversations of tests/template_conversations.py, with and
without a generation prompt, three ways: the engine's budgeted render, the same compiled template
without a budget, and a plain Jinja sandbox. Exit status 1 if any output differs.

    python scripts/compare_chat_templates.py
    python scripts/compare_chat_templates.py --templates path/to/llama.cpp/models/templates --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.chat_templates import TEMPLATES  # noqa: E402
from tests.template_conversations import CASES, REAL_TEMPLATES, compare  # noqa: E402


def load_templates(folders: list[str], hand_written: bool = True) -> dict[str, str]:
    """{name: source}: the vendored real templates, the folders' *.jinja, then the hand-written ones."""
    out: dict[str, str] = {}
    for folder in [REAL_TEMPLATES, *map(Path, folders)]:
        for p in sorted(Path(folder).glob("*.jinja")):
            with open(p, encoding="utf-8", newline="") as f:
                out[p.stem] = f.read()
    if hand_written:
        out.update({f"shape:{k}": v for k, v in TEMPLATES.items()})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--templates", action="append", default=[], help="a folder of *.jinja chat templates to add")
    ap.add_argument("--no-shapes", action="store_true", help="leave out the hand-written family shapes")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    results = {}
    print(f"{len(CASES)} conversations x 2 (with/without generation prompt) per template")
    print(f"{'template':55} {'same':>5} {'refused alike':>14} {'differs':>8}")
    for name, source in load_templates(args.templates, not args.no_shapes).items():
        try:
            r = compare(source, name)
        except Exception as e:  # noqa: BLE001 - a template that does not compile is reported, not fatal
            r = {"rendered": 0, "refused": 0, "problems": [f"{name}: {type(e).__name__}: {e}"], "refusals": []}
        results[name] = r
        print(f"{name:55} {r['rendered']:5} {r['refused']:14} {len(r['problems']):8}"
              + (f"   refused: {'; '.join(sorted(set(r['refusals'])))[:150]}" if r["refusals"] else ""))
        for p in r["problems"]:
            print("   ", p)
    bad = sum(len(r["problems"]) for r in results.values())
    print(f"{len(results)} templates, {sum(r['rendered'] for r in results.values())} identical renders, "
          f"{sum(r['refused'] for r in results.values())} refused alike, {bad} differences")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, ensure_ascii=False), encoding="utf-8")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
