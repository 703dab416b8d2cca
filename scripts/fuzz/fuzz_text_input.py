"""Hypothesis run over hostile text, larger than the test suite's: any code point (lone
surrogates included) as `prompt`, `stop` and message `role`/`content` through `generate`, and
any bytes as a prompt file (`-f`) and as `-p` / `--stop` argv through the CLI. Every case must
generate or end in MTPEngineError naming the argument (CLI: exit 2, one line, no traceback).

    python scripts/fuzz/fuzz_text_input.py --examples 2000 --model ../shared/fixtures/llamacpp/qwen35-mtp-tiny-Q8_0.gguf
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import resource
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtp_engine import api
from mtp_engine.cli.main import main as cli_main
from mtp_engine.errors import MTPEngineError

# any code point; one character in 15 a surrogate, so about half the strings hold one
_SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())
ANY_TEXT = st.lists(st.integers(0, 14).flatmap(lambda k: _SURROGATE if k == 0 else st.characters(exclude_categories=())),
                    max_size=60).map("".join)
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=500, help="examples per entry point")
    ap.add_argument("--model", default=str(ROOT.parent / "shared" / "fixtures" / "llamacpp" / "qwen35-mtp-tiny-Q8_0.gguf"))
    args = ap.parse_args()
    model = api.load(args.model)
    model.tokenizer.chat_template = CHATML
    api.load = lambda *a, **k: model  # the CLI's load: the model loaded once
    counts: dict[str, Counter] = {}
    slowest = [0.0]
    cfg = settings(max_examples=args.examples, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck))

    def api_case(name: str, fields: tuple, kwargs: dict) -> None:
        t = time.perf_counter()
        try:
            api.generate(model=model, max_tokens=1, **kwargs)
            outcome = "generated"
        except MTPEngineError as e:
            outcome = "clean_error" if e.field and e.field.split("[")[0] in fields else f"error naming {e.field}"
        except Exception as e:  # noqa: BLE001 - a finding
            outcome = f"unexpected {type(e).__name__}"
        slowest[0] = max(slowest[0], time.perf_counter() - t)
        counts.setdefault(name, Counter())[outcome] += 1

    def cli_case(name: str, argv: list[str]) -> None:
        out, err = io.StringIO(), io.StringIO()
        t = time.perf_counter()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = cli_main(argv)
            except SystemExit as e:
                rc = e.code
            except BaseException as e:  # noqa: BLE001 - a finding
                rc = f"raised {type(e).__name__}"
        slowest[0] = max(slowest[0], time.perf_counter() - t)
        text = err.getvalue()
        if rc == 0:
            outcome = "generated"
        elif rc == 2 and len(text.strip().splitlines()) == 1 and "Traceback" not in text:
            outcome = "clean_error"
        else:
            outcome = f"bad exit {rc}: {text[-120:]!r}"
        counts.setdefault(name, Counter())[outcome] += 1

    given(ANY_TEXT)(cfg(lambda p: api_case("api prompt", ("prompt",), {"prompt": p})))()
    given(st.lists(ANY_TEXT, max_size=3))(cfg(lambda s: api_case("api stop", ("stop",), {"prompt": "Hi", "stop": s})))()
    given(ANY_TEXT, ANY_TEXT)(cfg(lambda r, c: api_case("api messages", ("messages",),
                                                        {"messages": [{"role": r, "content": c}]})))()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "prompt.txt")

        def file_case(data: bytes) -> None:
            with open(path, "wb") as f:
                f.write(data)
            cli_case("cli -f FILE", ["generate", "-f", path, "-n", "1", "--json"])

        given(st.binary(max_size=80))(cfg(file_case))()
    argv_bytes = st.binary(max_size=60).filter(lambda b: b"\0" not in b)
    given(argv_bytes, argv_bytes)(cfg(lambda p, s: cli_case(
        "cli -p/--stop argv", ["generate", "-p", os.fsdecode(p), "--stop", os.fsdecode(s), "-n", "1", "--json"])))()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    bad = 0
    for name, c in counts.items():
        print(f"{name:20} {sum(c.values()):6} cases  {dict(c)}")
        bad += sum(v for k, v in c.items() if k not in ("generated", "clean_error"))
    print(f"slowest case {slowest[0]:.3f} s, peak memory (process max RSS) {peak / 2**20:.0f} MiB, failures {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
