"""Reproduces, with MLX alone, the abort at interpreter exit after compiled functions ran in
worker threads ("terminate called without an active exception", exit status 134), and measures
the engine's workaround (`mtp_engine.threads.release_at_exit`).

    python scripts/mlx_thread_exit_abort.py --runs 20            # pure MLX, no workaround
    python scripts/mlx_thread_exit_abort.py --runs 20 --workaround
    python scripts/mlx_thread_exit_abort.py --runs 12 --engine   # mtp-engine generate in threads, workaround off
    python scripts/mlx_thread_exit_abort.py --runs 12 --engine --workaround  # ... as shipped

Each run is a fresh interpreter (the abort happens at its exit); the table counts exit statuses.
"""
from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys

CHILD_MLX = r"""
import sys, threading
import mlx.core as mx

@mx.compile
def step(x, w):
    return mx.tanh(x @ w) + 1

w = mx.random.normal((64, 64))
mx.eval(w)

def work():
    x = mx.random.normal((8, 64))
    for _ in range(50):
        x = step(x, w)
    mx.eval(x)

threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
if "--workaround" in sys.argv:
    sys.path.insert(0, sys.argv[-1])
    from mtp_engine.threads import release_at_exit
    release_at_exit()
print("ok", flush=True)
"""

CHILD_ENGINE = r"""
import sys, threading
sys.path.insert(0, sys.argv[-1])
import mtp_engine as me
if sys.argv[-3] == "baseline":  # the engine without its workaround: MLX work in the callers' threads
    import mtp_engine.api, mtp_engine.threads
    mtp_engine.threads._engine_thread = lambda: None
    mtp_engine.api.release_at_exit = lambda: None
m = me.load(sys.argv[-2])
out = {}
def work(k):
    out[k] = me.generate("Hello there", m, max_tokens=6, spec="draft-mtp", n_max=2).token_ids
threads = [threading.Thread(target=work, args=(k,)) for k in range(3)]
for t in threads: t.start()
for t in threads: t.join()
assert len({tuple(v) for v in out.values()}) == 1, out
print("ok", flush=True)
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--workaround", action="store_true", help="pure MLX: register mtp_engine.threads.release_at_exit; "
                    "--engine: the engine as shipped (else its engine thread and exit release are switched off)")
    ap.add_argument("--engine", action="store_true", help="run mtp-engine generations instead of pure MLX")
    ap.add_argument("--model", default=None, help="GGUF for --engine (default: the tiny Q8_0 fixture)")
    args = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if args.engine:
        model = args.model or os.path.join(root, "..", "shared", "fixtures", "llamacpp", "qwen35-mtp-tiny-Q8_0.gguf")
        cmd = [sys.executable, "-c", CHILD_ENGINE, "baseline" if not args.workaround else "engine", model, root]
    else:
        cmd = [sys.executable, "-c", CHILD_MLX] + (["--workaround"] if args.workaround else []) + [root]
    counts: collections.Counter = collections.Counter()
    for i in range(args.runs):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        tail = (p.stderr.strip().splitlines() or [""])[-1][:80]
        counts[p.returncode] += 1
        print(f"run {i + 1}/{args.runs}: exit {p.returncode} {tail}", file=sys.stderr, flush=True)
    what = ("engine" if args.engine else "pure MLX") + (" + workaround" if args.workaround else "")
    print(f"{what}: {args.runs} runs, exit statuses {dict(sorted(counts.items()))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
