"""Render time of chat templates: the engine's budgeted sandbox against a plain Jinja sandbox (what
transformers renders with), on the templates of tests/chat_templates.py and any *.jinja files
given with --templates. Medians of interleaved repeats, side by side in one process.

    python scripts/bench_chat_template.py --repeats 200
    python scripts/bench_chat_template.py --templates path/to/llama.cpp/models/templates
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.chat_templates import TEMPLATES  # noqa: E402
from mtp_engine.chat_template import compile_chat_template, render_chat_template  # noqa: E402

CHAT = [{"role": "system", "content": "You are terse."}] + [
    m for i in range(10) for m in ({"role": "user", "content": f"Question {i}: " + "word " * 60},
                                   {"role": "assistant", "content": f"<think>\nhm {i}\n</think>\n\nAnswer " + "x " * 60})
] + [{"role": "user", "content": "Last question?"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def _plain_env():
    from tests.test_chat_template_budget import _reference_env

    return _reference_env()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--templates", help="a folder of *.jinja chat templates to add")
    args = ap.parse_args()
    templates = dict(TEMPLATES)
    if args.templates:
        for p in sorted(Path(args.templates).glob("*.jinja")):
            templates[p.stem] = p.read_text(encoding="utf-8")
    env = _plain_env()
    tok = None
    shipped = ROOT / "models" / "qwen35-mtp-code-Q4_K_M.gguf"
    if shipped.exists():  # for scale: tokenizing the rendered prompt, which always follows a render
        from mtp_engine.gguf.reader import GGUFFile
        from mtp_engine.tokenizer import Tokenizer

        gf = GGUFFile(shipped)
        tok = Tokenizer.from_gguf(gf.reader, gf.path)
    variables = {"bos_token": "<s>", "eos_token": "</s>", "tools": TOOLS}
    print(f"{'template':28} {'plain ms':>9} {'budgeted ms':>12} {'ratio':>6} {'added ms':>9} {'encode ms':>10}")
    ratios = []
    for name, src in templates.items():
        try:
            plain = env.from_string(src)
            ours = compile_chat_template(src, file=None, field="chat_template")
            expected = plain.render(messages=CHAT, add_generation_prompt=True, **variables)
        except Exception as e:  # a template that needs other inputs: skipped, said so
            print(f"{name:28} skipped ({type(e).__name__}: {str(e)[:60]})")
            continue
        got = render_chat_template(ours, CHAT, True, variables, file=None, field="chat_template")
        if got != expected and "strftime" not in src:
            print(f"{name:28} OUTPUT DIFFERS")
            continue
        a, b, c = [], [], []
        for _ in range(args.repeats):  # interleaved: the machine's drift hits both alike
            t = time.perf_counter()
            plain.render(messages=CHAT, add_generation_prompt=True, **variables)
            a.append(time.perf_counter() - t)
            t = time.perf_counter()
            render_chat_template(ours, CHAT, True, variables, file=None, field="chat_template")
            b.append(time.perf_counter() - t)
            if tok is not None:
                t = time.perf_counter()
                tok.encode(got)
                c.append(time.perf_counter() - t)
        ma, mb = statistics.median(a), statistics.median(b)
        mc = statistics.median(c) * 1e3 if c else float("nan")
        ratios.append(mb / ma)
        print(f"{name:28} {ma * 1e3:9.3f} {mb * 1e3:12.3f} {mb / ma:6.2f} {(mb - ma) * 1e3:9.3f} {mc:10.3f}")
    if ratios:
        print(f"median ratio budgeted/plain over {len(ratios)} templates: {statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
