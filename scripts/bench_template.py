"""Render time of chat templates under the engine's budget against the unbudgeted render: a plain
Jinja sandbox (what transformers renders with; the baseline) and, for reference, the engine's own
compiled template with no budget in force. Every template renders the same conversation (a system
message, 10 turns with think blocks, a last question; the tool list when the template takes
tools); the renders alternate (plain, budgeted, unbudgeted, then the next repeat in the other
order) in one process, and the medians are compared.

Templates: the real ones in tests/fixtures/chat_templates, the family shapes of
tests/chat_templates.py (--no-shapes leaves them out), and the *.jinja of any --templates folder.

    python scripts/bench_template.py --repeats 400
    python scripts/bench_template.py --templates path/to/llama.cpp/models/templates --json out.json
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from compare_chat_templates import load_templates  # noqa: E402
from tests.template_conversations import TOOLS, reference_env  # noqa: E402

from mtp_engine.chat.template import compile_chat_template, render_chat_template  # noqa: E402

CHAT = [{"role": "system", "content": "You are terse."}] + [
    m for i in range(10) for m in ({"role": "user", "content": f"Question {i}: " + "word " * 60},
                                   {"role": "assistant", "content": f"<think>\nhm {i}\n</think>\n\nAnswer " + "x " * 60})
] + [{"role": "user", "content": "Last question?"}]


def _inputs(plain) -> tuple[list, dict] | None:
    """The chat and variables this template renders (with tools and a system message if it takes
    them), or None."""
    for messages in (CHAT, CHAT[1:]):
        for tools in (TOOLS, None):
            variables = {"bos_token": "<s>", "eos_token": "</s>", "tools": tools}
            try:
                plain.render(messages=messages, add_generation_prompt=True, **variables)
                return messages, variables
            except Exception:  # noqa: BLE001 - try the next shape of input
                continue
    return None


def bench(name: str, source: str, repeats: int, env) -> dict:
    plain = env.from_string(source)
    ours = compile_chat_template(source, file=None, field="chat_template")
    inputs = _inputs(plain)
    if inputs is None:
        return {"template": name, "skipped": "refuses every input shape"}
    messages, variables = inputs
    expected = plain.render(messages=messages, add_generation_prompt=True, **variables)
    got = render_chat_template(ours, messages, True, variables, file=None, field="chat_template")
    if got != expected:
        return {"template": name, "skipped": "OUTPUT DIFFERS"}

    def run_plain():
        plain.render(messages=messages, add_generation_prompt=True, **variables)

    def run_budgeted():
        render_chat_template(ours, messages, True, variables, file=None, field="chat_template")

    def run_unbudgeted():
        ours.render(messages=messages, add_generation_prompt=True, **variables)

    runs = {"plain": (run_plain, []), "budgeted": (run_budgeted, []), "unbudgeted": (run_unbudgeted, [])}
    for fn, _ in runs.values():  # warm-up
        for _ in range(5):
            fn()
    gc.collect()
    order = list(runs)
    for i in range(repeats):  # interleaved, the order reversed every other repeat: drift hits all alike
        for key in (order if i % 2 == 0 else order[::-1]):
            fn, times = runs[key]
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    med = {k: statistics.median(v[1]) for k, v in runs.items()}
    pairs = [b / a for a, b in zip(runs["plain"][1], runs["budgeted"][1])]
    return {"template": name, "chars": len(expected), "messages": len(messages), "tools": variables["tools"] is not None,
            "plain_ms": med["plain"] * 1e3, "budgeted_ms": med["budgeted"] * 1e3,
            "unbudgeted_ms": med["unbudgeted"] * 1e3, "ratio": med["budgeted"] / med["plain"],
            "ratio_pairs": statistics.median(pairs), "added_ms": (med["budgeted"] - med["plain"]) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=300)
    ap.add_argument("--templates", action="append", default=[], help="a folder of *.jinja chat templates to add")
    ap.add_argument("--no-shapes", action="store_true", help="leave out the hand-written family shapes")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    import jinja2

    env = reference_env()
    print(f"python {platform.python_version()}, jinja2 {jinja2.__version__}, {platform.machine()}, "
          f"{args.repeats} interleaved repeats")
    print(f"{'template':48} {'chars':>6} {'plain ms':>9} {'budgeted':>9} {'no budget':>9} {'ratio':>6} "
          f"{'pairs':>6} {'added ms':>9}")
    rows = []
    for name, source in load_templates(args.templates, not args.no_shapes).items():
        r = bench(name, source, args.repeats, env)
        rows.append(r)
        if "skipped" in r:
            print(f"{name:48} skipped: {r['skipped']}")
            continue
        print(f"{name:48} {r['chars']:6} {r['plain_ms']:9.4f} {r['budgeted_ms']:9.4f} {r['unbudgeted_ms']:9.4f} "
              f"{r['ratio']:6.3f} {r['ratio_pairs']:6.3f} {r['added_ms']:9.4f}")
    done = [r for r in rows if "skipped" not in r]
    if done:
        real = [r["ratio"] for r in done if not r["template"].startswith("shape:")]
        print(f"median ratio budgeted/plain: all {len(done)} templates {statistics.median(r['ratio'] for r in done):.3f}"
              + (f", real ones ({len(real)}) {statistics.median(real):.3f} (max {max(real):.3f})" if real else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1), encoding="utf-8")
    return 1 if any(r.get("skipped") == "OUTPUT DIFFERS" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
