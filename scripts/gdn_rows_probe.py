"""Probe for issue 27's GPU gap: a batched decode step runs every gated-delta-net layer on the MLX
path, because the fused GDN kernel takes one sequence (`gdn_kernel.supports(..., batch == 1)`).
This runs the kernel once per row of the batch instead (row slices of the batch's inputs and
states, each row's rollback slot) and compares, at the 9B shape with random 4-bit weights:
  - the hidden states of a batched step: per-row kernel vs the MLX path (must match);
  - the time of a batched step of B rows (MLX path, per-row kernel) against one sequence's step,
    as aggregate tokens/s over one stream's.
Nothing in the engine changes; if the per-row path wins, it moves into `qwen35.GatedDeltaNet`.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/gdn_rows_probe.py [--batch 8] [--steps 20]   # a CUDA GPU
    python scripts/gdn_rows_probe.py --small --mlx-rows      # this CPU: the per-row composition, checked
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

from mtp_engine.model import gdn, gdn_kernel  # noqa: E402
from mtp_engine.model.batch_cache import BatchCache  # noqa: E402
from mtp_engine.model.cache import pick_state  # noqa: E402
from mtp_engine.model.qwen35 import GatedDeltaNet  # noqa: E402


def per_row_call(mlx_rows: bool):
    """GatedDeltaNet.__call__ with a batch run row by row through the fused kernel (or, with
    `mlx_rows`, through the MLX mixer: the same composition, checkable on a CPU)."""
    original = GatedDeltaNet.__call__

    def call(self, x: mx.array, cache) -> mx.array:
        c = self.cfg
        b, s, _ = x.shape
        d = gdn.Dims(c.ssm_key_heads, c.ssm_key_dim, c.ssm_value_heads, c.ssm_value_dim, c.conv_kernel, c.eps)
        if b == 1 or getattr(cache, "valid", None) is not None:
            return original(self, x, cache)
        if not mlx_rows and not (self.fused_kernel and gdn_kernel.supports(d.kh, d.kd, d.vh, d.vd, 1, s)):
            return original(self, x, cache)
        qkv_x, z_x, alpha_x, beta_x = self._inputs(x)
        conv0, state0, kept = cache.sources()
        capture = cache.capturing
        outs = []
        for i in range(b):
            row = slice(i, i + 1)
            k_i = None if kept is None else kept[row]
            if mlx_rows:
                cv, st = (conv0[row], state0[row]) if k_i is None else pick_state(conv0[row], state0[row], k_i, d.kernel)
                r = gdn.mix(d, qkv_x[row], z_x[row], alpha_x[row], beta_x[row], cv, st, self.conv_w, self.dt_bias,
                            self.a, self.norm, capture=capture)
                outs.append((r.y, r.state, r.conv))
            else:
                outs.append(gdn_kernel.gated_delta(qkv_x[row], z_x[row], alpha_x[row], beta_x[row], conv0[row],
                                                   self.conv_w, self.dt_bias, self.a, self.norm, state0[row],
                                                   d.kh, d.kd, d.vh, d.vd, d.eps, kept=k_i, capture=capture))
        y, state, conv = (mx.concatenate(parts, axis=0) for parts in zip(*outs))
        cache.update(conv, state)
        return self.out(y)

    return call


def batch_of(m, prompts: list[list[int]]) -> BatchCache:
    batch = BatchCache(m)
    for p in prompts:
        c = m.make_cache()
        m.forward(mx.array([p]), c)
        mx.eval(*c.arrays())
        batch.add(c)
    return batch


def steps(m, batch: BatchCache, n: int, rows: int) -> tuple[float, mx.array]:
    """Median seconds of n batched decode steps (after 2 uncounted), and the first step's hidden states."""
    times, first = [], None
    tok = mx.full((rows, 1), 7, mx.int32)
    for i in range(n + 2):
        t = time.perf_counter()
        h = m.forward_batch(tok, batch)
        mx.eval(h, *batch.arrays())
        if first is None:
            first = h
        if i >= 2:
            times.append(time.perf_counter() - t)
    return statistics.median(times), first


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="8 layers instead of 32")
    ap.add_argument("--mlx-rows", action="store_true", help="rows through the MLX mixer (a CPU check of the composition)")
    a = ap.parse_args()
    cfg = config_9b(a.small)
    t = time.perf_counter()
    m = random_model(cfg)
    print(f"built in {time.perf_counter() - t:.0f} s on {mx.default_device()}; fused GDN kernel: "
          f"{[getattr(l.mixer, 'fused_kernel', None) for l in m.layers][:4]}", flush=True)
    prompts = [[(13 * b + 5 * i) % 1000 + 1 for i in range(12 + b)] for b in range(a.batch)]
    one, _ = steps(m, batch_of(m, prompts[:1]), a.steps, 1)
    base, h_base = steps(m, batch_of(m, prompts), a.steps, a.batch)
    original = GatedDeltaNet.__call__
    GatedDeltaNet.__call__ = per_row_call(a.mlx_rows)
    try:
        rows, h_rows = steps(m, batch_of(m, prompts), a.steps, a.batch)
    finally:
        GatedDeltaNet.__call__ = original
    err = float(mx.abs(h_rows - h_base).max())
    print(f"B={a.batch}: one sequence {one * 1e3:.2f} ms/step; batched, MLX GDN path {base * 1e3:.2f} ms "
          f"({a.batch * one / base:.2f}x one stream's tokens/s); per-row {'MLX mixer' if a.mlx_rows else 'kernel'} "
          f"{rows * 1e3:.2f} ms ({a.batch * one / rows:.2f}x); hidden states max |diff| {err:.2e}")
    return 0 if err < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
