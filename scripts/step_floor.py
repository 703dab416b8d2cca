"""The host-side floor of a decode step: the Qwen3.5-9B layer graph (32 layers, the same kernels
and launches) at tiny widths, so the device work is negligible and what is left is graph building,
launch and synchronisation. Compared with the 9B step it says how much of a step the device is
actually busy. Run once per MLX setting (e.g. MLX_MAX_OPS_PER_BUFFER, MLX_USE_CUDA_GRAPHS).

Usage: python3 scripts/step_floor.py [--configs compiled+kernel,fused] [--steps 64]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_9b_oracle import random_model  # noqa: E402
from bench_gpu import use  # noqa: E402

from mtp_engine.model.config import Qwen35Config  # noqa: E402


def tiny_32() -> Qwen35Config:
    n = 32
    return Qwen35Config(vocab_size=1024, hidden_size=256, n_layer=n, n_mtp=1, ffn_size=[512] * (n + 1),
                        n_head=4, n_head_kv=2, head_dim=64, n_rot=16, rope_base=1e7, eps=1e-6, conv_kernel=4,
                        ssm_key_dim=32, ssm_key_heads=2, ssm_value_heads=4, ssm_inner=128,
                        recurrent=[(i + 1) % 4 != 0 for i in range(n)], context_length=8192)


def step_parts(model, steps: int) -> dict:
    """Median ms of building a step's graph (the Python call) and of evaluating it, token by token."""
    cache = model.make_cache()
    mx.eval(model.forward(mx.array([list(range(10, 74))]), cache), *cache.arrays())
    tok = mx.array([[5]])
    build, run = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        h = model.forward(tok, cache)
        nxt = mx.argmax(model.logits(h[0, -1]))
        t1 = time.perf_counter()
        mx.eval(nxt, *cache.arrays())
        t2 = time.perf_counter()
        build.append((t1 - t0) * 1e3)
        run.append((t2 - t1) * 1e3)
    k = min(5, steps - 1)
    return {"build_ms": statistics.median(build[k:]), "eval_ms": statistics.median(run[k:])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="compiled+kernel,fused")
    ap.add_argument("--steps", type=int, default=64)
    a = ap.parse_args()
    model = random_model(tiny_32())
    out = {}
    for name in a.configs.split(","):
        use(model, name)
        step_parts(model, 8)
        out[name] = step_parts(model, a.steps)
    print(json.dumps({"device": str(mx.default_device()), "tiny_32_layers": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
