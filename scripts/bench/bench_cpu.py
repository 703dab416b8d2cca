"""Plain decode speed on the CPU, side by side in one process (repeats interleaved): ours on the
trained code model (its Q4_K_M file as loaded, and the same weights dequantized to float32, each
with compiled steps off and on) against mlx-lm's qwen3_5 model at the same shape in float32 and
4-bit group 32 (random weights: speed does not depend on values; mlx-lm cannot read this GGUF).
Also times one 512x1024 matrix-vector product in MLX (float32, 4-bit) and in NumPy (OpenBLAS), the
operation that takes nearly all of a step here.

Usage: PYTHONPATH=<dir with mlx_lm> python scripts/bench/bench_cpu.py [--tokens 64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx
import numpy as np

import peer as mlx_lm_peer

from mtp_engine import load

TRAINED = "models/qwen35-mtp-code-Q4_K_M.gguf"


def dequantize_all(model) -> None:
    """Every quantized product of the model becomes a float32 matrix (its draft head, a view of
    the output head's rows, is made again from it)."""
    for lin in model.linears():
        if lin.quantized:
            lin.weight, lin.scales, lin.biases, lin.bits, lin.group_size = lin.dense(), None, None, 0, 0
            mx.eval(lin.weight)
    model.use(model.options)


def ours_ms(model, compiled: bool, tokens: int) -> float:
    model.compile_steps = compiled
    cache = model.make_cache()
    mx.eval(model.forward(mx.array([[1] * 16]), cache), *cache.arrays())
    tok = mx.array([[1]])
    times = []
    for _ in range(tokens):
        t = time.perf_counter()
        h = model.forward(tok, cache)
        tok = mx.argmax(model.logits(h[0, -1]), axis=-1).reshape(1, 1)
        mx.eval(tok, *cache.arrays())
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[2:])


def matvec_us() -> dict:
    w = np.random.default_rng(0).standard_normal((1024, 512)).astype(np.float32)
    x = np.random.default_rng(1).standard_normal((1, 512)).astype(np.float32)
    wm, xm = mx.array(w), mx.array(x)
    q, s, b = mx.quantize(wm, group_size=32, bits=4)
    out = {}
    for name, fn in (("mlx f32", lambda: xm @ wm.T),
                     ("mlx 4-bit g32", lambda: mx.quantized_matmul(xm, q, s, b, transpose=True, group_size=32, bits=4))):
        mx.eval([fn() for _ in range(5)])
        t = time.perf_counter()
        mx.eval([fn() for _ in range(100)])
        out[name] = (time.perf_counter() - t) / 100 * 1e6
    wt = np.ascontiguousarray(w.T)
    t = time.perf_counter()
    for _ in range(1000):
        x @ wt
    out["numpy f32 (OpenBLAS)"] = (time.perf_counter() - t) / 1000 * 1e6
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("-m", "--model", default=TRAINED)
    a = ap.parse_args()
    q4 = load(a.model).model
    f32 = load(a.model).model
    dequantize_all(f32)
    runs = {"ours Q4_K_M": lambda: ours_ms(q4, False, a.tokens),
            "ours Q4_K_M compiled": lambda: ours_ms(q4, True, a.tokens),
            "ours f32": lambda: ours_ms(f32, False, a.tokens),
            "ours f32 compiled": lambda: ours_ms(f32, True, a.tokens)}
    ref4, ref32 = mlx_lm_peer.build(q4.cfg, 4, tie=False), mlx_lm_peer.build(q4.cfg, None, tie=False)
    if ref4 is not None:  # mlx-lm importable
        runs["mlx-lm 4-bit g32"] = lambda: mlx_lm_peer.step_ms(ref4, 16, a.tokens)
        runs["mlx-lm f32"] = lambda: mlx_lm_peer.step_ms(ref32, 16, a.tokens)
    ms: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(a.repeats):
        for k, fn in runs.items():
            ms[k].append(fn())
            print(f"repeat {r + 1}/{a.repeats} {k}: {ms[k][-1]:.2f} ms", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in ms.items()}
    out = {"ms_per_token": med, "tok_s": {k: 1e3 / v for k, v in med.items()}, "matvec_512x1024_us": matvec_us()}
    print(json.dumps(out, indent=1))
    print("\n| run | ms/token | tok/s |\n|---|---|---|")
    for k, v in med.items():
        print(f"| {k} | {v:.2f} | {1e3 / v:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
