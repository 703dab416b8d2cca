"""Where a batched decode step's time goes: the 9B shape with random 4-bit weights, one
step of B sequences split into its parts, each part timed alone (synchronised, median of n):
  - a gated-delta-net mixer, an attention mixer, an FFN, the output head over B rows;
  - the whole trunk step, uncompiled and compiled (`forward_batch`), compiled without the fused GDN
    kernel (the MLX path), and one sequence's plain step;
  - the sum the parts predict (24 GDN + 8 attention layers + 32 FFNs), to see what is left over.
Nothing in the engine changes.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/batch_step_probe.py [--batches 1,4,8] [--n 20]   # a CUDA GPU
    python scripts/batch_step_probe.py --small --batches 1,2 --n 2                             # this CPU: runs
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_9b_oracle import config_9b, random_model  # noqa: E402

from mtp_engine.model.batch_cache import BatchCache  # noqa: E402
from mtp_engine.model.blocks import GatedAttention  # noqa: E402


def timed(fn, n: int) -> float:
    """Median ms of n synchronised calls of fn (after 2 uncounted)."""
    out = []
    for i in range(n + 2):
        t = time.perf_counter()
        mx.eval(fn())
        if i >= 2:
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def batch_of(m, rows: int) -> BatchCache:
    batch = BatchCache(m)
    for b in range(rows):
        c = m.make_cache()
        m.forward(mx.array([[(13 * b + 5 * i) % 1000 + 1 for i in range(40 + 3 * b)]]), c)
        mx.eval(*c.arrays())
        batch.add(c)
    return batch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="8 layers instead of 32")
    a = ap.parse_args()
    cfg = config_9b(a.small)
    m = random_model(cfg)
    gdn_i = next(i for i, l in enumerate(m.layers) if not isinstance(l.mixer, GatedAttention))
    att_i = next(i for i, l in enumerate(m.layers) if isinstance(l.mixer, GatedAttention))
    n_gdn = sum(not isinstance(l.mixer, GatedAttention) for l in m.layers)
    n_att = len(m.layers) - n_gdn
    print(f"{mx.default_device()}: {len(m.layers)} layers ({n_gdn} GDN, {n_att} attention), "
          f"hidden {cfg.hidden_size}", flush=True)
    head = m.lm_head if hasattr(m, "lm_head") else None

    # one sequence, the plain decode path (batch-1 caches, fused kernels where they apply)
    single = m.make_cache()
    m.forward(mx.array([[5] * 40]), single)
    mx.eval(*single.arrays())
    one = timed(lambda: [m.forward(mx.array([[7]]), single), *single.arrays()], a.n)
    print(f"plain one sequence, synchronised step: {one:.2f} ms", flush=True)

    for rows in [int(b) for b in a.batches.split(",")]:
        batch = batch_of(m, rows)
        x = mx.random.normal((rows, 1, cfg.hidden_size)).astype(mx.float32) * 0.1
        lg, la = batch.layers[gdn_i], batch.layers[att_i]
        parts = {
            "gdn mixer": timed(lambda: [m.layers[gdn_i].mixer(x, lg), *lg.arrays()], a.n),
            "attn mixer": timed(lambda: [m.layers[att_i].mixer(x, la), *la.arrays()], a.n),
            "ffn": timed(lambda: m.layers[gdn_i].mlp(x), a.n),
        }
        if head is not None:
            parts["output head"] = timed(lambda: head(x), a.n)
        predicted = n_gdn * parts["gdn mixer"] + n_att * parts["attn mixer"] + len(m.layers) * parts["ffn"]
        tok = mx.full((rows, 1), 7, mx.int32)
        whole = timed(lambda: [m.forward_batch(tok, batch), *batch.arrays()], a.n)
        m._compile_steps, keep = False, m._compile_steps
        try:
            eager = timed(lambda: [m.forward_batch(tok, batch), *batch.arrays()], a.n)
        finally:
            m._compile_steps = keep
        before = m.options
        m.use(before.updated(kernels=",".join(sorted(before.kernel_set - {"gdn"})) or "mlx"))
        try:
            mlx_gdn = timed(lambda: [m.forward_batch(tok, batch), *batch.arrays()], a.n)
        finally:
            m.use(before)
        print(f"B={rows}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in parts.items())
              + f"; trunk predicted from parts {predicted:.2f} ms, eager {eager:.2f}, compiled {whole:.2f} "
              f"({rows * one / whole:.2f}x one stream's tokens/s at a synchronised step), compiled with "
              f"the MLX GDN path {mlx_gdn:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
