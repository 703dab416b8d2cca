"""What one trace of a compiled step costs the host, at the Qwen3.5-9B shape: the trunk's compiled
graph for S tokens traced afresh (each new shape key is one such trace in the middle of a run)
against the same call once traced (a replay: the graph's outputs built, nothing evaluated).

Weights are lazy zeros in the loaders' layout (4-bit group-32 matrices): nothing is computed or
allocated, so this runs on any machine and times only the host's side (graph building and MLX's
compile of the traced graph), which is what a retrace adds to a round on a GPU.

    python scripts/trace_cost.py [--layers 32] [--repeats 3]
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

from bench_9b_oracle import config_9b  # noqa: E402
from mtp_engine.model.build import build_model  # noqa: E402
from mtp_engine.model.layers import Linear  # noqa: E402


def lazy_model(cfg):
    def fetch(name, shape, matrix):
        if matrix and "ffn_gate_inp" in name:
            return Linear(mx.zeros(shape))
        if matrix:
            n, k = shape[:-1], shape[-1]
            return Linear(mx.zeros((*n, k // 8), mx.uint32), mx.zeros((*n, k // 32)), mx.zeros((*n, k // 32)), 4, 32)
        return mx.ones(shape)

    return build_model(cfg, fetch, lambda n: True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    cfg = config_9b(False)
    if a.layers != cfg.n_layer:
        import dataclasses
        cfg = dataclasses.replace(cfg, n_layer=a.layers, ffn_size=[12288] * (a.layers + 1),
                                  recurrent=[(i + 1) % 4 != 0 for i in range(a.layers)])
    model = lazy_model(cfg)
    model.compile_steps = True
    print(f"9B shape, {cfg.n_layer} layers, lazy weights; ms per call, median of {a.repeats}", flush=True)
    for s, capture in ((1, False), (4, True)):
        fresh, replay = [], []
        for _ in range(a.repeats):
            model.__dict__.pop("_compiled_steps", None)  # a new trace each repeat
            for times in (fresh, replay):
                cache = model.make_cache()
                t = time.perf_counter()
                model.forward(mx.zeros((1, s), mx.int32), cache, capture=capture)
                times.append((time.perf_counter() - t) * 1e3)
        print(f"S={s}{' captured' if capture else ''}: traced {statistics.median(fresh):.1f} ms, "
              f"replayed {statistics.median(replay):.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
