"""Qwen3.5/3.6-35B-A3B shape (qwen35moe: 256 experts, 8 active, shared expert) with random 4-bit
group-32 weights built in memory: plain decode vs draft-mtp at oracle acceptance 0.8 (fixed n-max
and auto), V(S), distinct experts read per verify, and mlx-lm's qwen3_5_moe decode step on the same
shape when mlx_lm is importable.

Usage (GPU): python3 scripts/bench_moe_oracle.py [--tokens 96] [--layers 40]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx

import mlx_lm_ref
from bench_9b_oracle import decode_tps, random_model  # same decode harness and weights
from mtp_engine.speculative.costmodel import measure
from mtp_engine.model.config import Qwen35Config
from mtp_engine.model.moe import experts_touched


def config_a3b(n: int) -> Qwen35Config:
    return Qwen35Config(vocab_size=248320, hidden_size=2048, n_layer=n, n_mtp=1, ffn_size=[], n_head=16,
                        n_head_kv=2, head_dim=256, n_rot=64, rope_base=1e7, eps=1e-6, conv_kernel=4,
                        ssm_key_dim=128, ssm_key_heads=16, ssm_value_heads=32, ssm_inner=4096,
                        recurrent=[(i + 1) % 4 != 0 for i in range(n)], context_length=8192, arch="qwen35moe",
                        n_expert=256, n_expert_used=8, expert_ffn_size=512, shared_ffn_size=512)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--layers", type=int, default=40)
    a = ap.parse_args()
    cfg = config_a3b(a.layers)
    t = time.perf_counter()
    model = random_model(cfg)
    nb = model.nbytes()
    print(f"built {cfg.n_layer}-layer 35B-A3B-shape model in {time.perf_counter() - t:.0f}s on {mx.default_device()}: "
          f"{(nb['trunk'] + nb['mtp']) / 2**30:.1f} GiB (MTP {nb['mtp'] / 2**30:.2f})", file=sys.stderr, flush=True)
    prompt = list(range(100, 164))
    costs = measure(model, max_verify=6, context=64, repeats=10)
    costs.fixed = 0.05
    print(json.dumps({"step_ms": costs.step_ms, "V": costs.verify, "c": costs.draft}), file=sys.stderr, flush=True)
    # distinct experts per layer: one token vs a 4-token verify of varied tokens
    cache = model.make_cache()
    model.forward(mx.array([prompt]), cache)
    model.forward(mx.array([[7]]), cache)
    one = experts_touched(model)["trunk"]
    model.forward(mx.array([[8, 900, 4000, 12000]]), cache)
    four = experts_touched(model)["trunk"]
    decode_tps(model, prompt, 16)
    decode_tps(model, prompt, 16, "draft-mtp", 2, 0.8)
    plain = statistics.median(decode_tps(model, prompt, a.tokens)[0] for _ in range(3))
    rows = []
    for k in (1, 2, 3, "auto"):
        tps, st = decode_tps(model, prompt, a.tokens, "draft-mtp", k, 0.8, costs)
        rows.append({"n_max": k, "tok_s": tps, "speedup": tps / plain, "draft_lengths": st.get("draft_length_histogram")})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    del model
    lm = mlx_lm_ref.build_and_time(cfg, 64, 30)
    print(f"plain: {plain:.1f} tok/s ({1e3 / plain:.2f} ms/token); mlx-lm qwen3_5_moe step: {lm} ms")
    print("V(S) S=1..6: " + ", ".join(f"{v:.2f}" for v in costs.verify.values()) + f"; draft c = {costs.draft:.2f}")
    print(f"distinct experts per layer: 1 token {sum(one) / len(one):.1f}, 4-token verify {sum(four) / len(four):.1f}")
    print("| oracle a = 0.8 | " + " | ".join(f"n-max {r['n_max']}" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    print("| speedup vs plain | " + " | ".join(f"{r['speedup']:.2f}x" for r in rows) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
