"""Qwen3.5-9B shape with random 4-bit group-32 weights (built in memory): plain decoding vs
draft-mtp (fixed n-max and auto) at oracle acceptance a, the verify curve V(S), and mlx-lm's
qwen3_5 decode step on the same shape and weight format when mlx_lm is importable.

Usage (GPU): python3 scripts/bench_9b_oracle.py [--tokens 128] [--small]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import mlx.core as mx

import mlx_lm_ref  # scripts/ (beside this file)
from mtp_engine.speculative.costmodel import measure
from mtp_engine.generation.decode import PlainDecoder
from mtp_engine.generation.loop import run
from mtp_engine.model.build import build_model
from mtp_engine.model.config import Qwen35Config
from mtp_engine.model.layers import Linear
from mtp_engine.generation.sampling import Sampler, SamplerConfig
from mtp_engine.speculative.ablations import ablation_decoder
from mtp_engine.speculative.config import DraftParams
from mtp_engine.speculative.scheduler import DraftLengthScheduler


def config_9b(small: bool) -> Qwen35Config:
    n = 8 if small else 32
    return Qwen35Config(vocab_size=248320, hidden_size=4096, n_layer=n, n_mtp=1, ffn_size=[12288] * (n + 1),
                        n_head=16, n_head_kv=4, head_dim=256, n_rot=64, rope_base=1e7, eps=1e-6, conv_kernel=4,
                        ssm_key_dim=128, ssm_key_heads=16, ssm_value_heads=32, ssm_inner=4096,
                        recurrent=[(i + 1) % 4 != 0 for i in range(n)], context_length=8192)


def random_model(cfg: Qwen35Config):
    """Random weights in the loaders' conventions: 4-bit group-32 matrices (stacked experts keep
    their leading axes), F32 routers as llama.cpp keeps them, plausible recurrent parameters."""
    def fetch(name, shape, matrix):
        if matrix and "ffn_gate_inp" in name:
            return Linear(mx.random.normal(shape) * shape[-1] ** -0.5)
        if matrix:
            rows = 1
            for d in shape[:-1]:
                rows *= d
            w = mx.random.normal((rows, shape[-1])) * (shape[-1] ** -0.5)
            q = [a.reshape(*shape[:-1], -1) for a in mx.quantize(w, group_size=32, bits=4)]
            mx.eval(q)
            return Linear(q[0], q[1], q[2], 4, 32)
        return random_vector(name, shape)

    return build_model(cfg, fetch, lambda n: True)


def random_vector(name: str, shape: tuple) -> mx.array:
    """A non-matrix tensor of a random model: values in each parameter's natural range (decays,
    time-step biases, conv taps, the shared expert's gate), ones for norms."""
    if name.endswith("ssm_a"):
        return -mx.exp(mx.random.uniform(-3, 0, shape))
    if name.endswith("ssm_dt.bias"):
        return mx.random.uniform(-1, 0, shape)
    if name.endswith("ssm_conv1d.weight"):
        return mx.random.normal(shape) * 0.5
    if name.endswith("ffn_gate_inp_shexp.weight"):
        return mx.random.normal(shape) * shape[-1] ** -0.5
    return mx.ones(shape)


class _Tok:
    eos_token_ids: set = set()

    def detokenizer(self):
        class D:
            def add(self, t):
                return ""

            def flush(self):
                return ""
        return D()


def decode_tps(model, prompt, tokens, spec=None, n_max=3, oracle=None, costs=None, scheduler_type=DraftLengthScheduler,
               decoders: list | None = None) -> tuple[float, dict]:
    """tok/s and stats of one greedy run; `decoders` (a list) receives the decoder, for its clock
    and scheduler (scripts/auto_trace.py)."""
    sampler = Sampler(SamplerConfig(seed=0))
    if spec is None:
        dec = PlainDecoder(model, sampler)
    else:
        # as the API builds it (compiled steps: drafts up to 4)
        sched = scheduler_type.for_model(model, costs) if n_max == "auto" else None
        dec = ablation_decoder(model, sampler, DraftParams(n_max), scheduler=sched, oracle_acceptance=oracle)
    if decoders is not None:
        decoders.append(dec)
    last = None
    for last in run(dec, _Tok(), prompt, tokens, ignore_eos=True):
        pass
    s = last.stats
    return s["decode_tokens_per_second"], s


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--small", action="store_true", help="8 layers (a quick check)")
    a = ap.parse_args()
    cfg = config_9b(a.small)
    t = time.perf_counter()
    model = random_model(cfg)
    print(f"built {cfg.n_layer}-layer 9B-shape model in {time.perf_counter() - t:.0f}s on {mx.default_device()}, "
          f"weights {sum(model.nbytes().values()) / 2**30:.2f} GiB (MTP head {model.nbytes()['mtp'] / 2**30:.2f})",
          file=sys.stderr, flush=True)
    prompt = list(range(100, 164))
    costs = measure(model, max_verify=9, context=64, repeats=10)
    costs.fixed = 0.05
    out = {"device": str(mx.default_device()), "layers": cfg.n_layer, "step_ms": costs.step_ms,
           "verify_curve": costs.verify, "draft_cost": costs.draft, "rows": []}
    print(json.dumps({"step_ms": costs.step_ms, "V": costs.verify, "c": costs.draft}), file=sys.stderr, flush=True)
    decode_tps(model, prompt, 16)  # warm-up
    decode_tps(model, prompt, 16, "draft-mtp", 2, 0.8)
    plain = statistics.median(decode_tps(model, prompt, a.tokens)[0] for _ in range(3))
    out["plain_tok_s"] = plain
    for acc in (0.5, 0.7, 0.8, 0.9):
        for k in (1, 2, 3, 4, "auto"):
            tps, st = decode_tps(model, prompt, a.tokens, "draft-mtp", k, acc, costs)
            row = {"a": acc, "n_max": k, "tok_s": tps, "speedup": tps / plain,
                   "acceptance": st["acceptance_rate"], "draft_lengths": st.get("draft_length_histogram")}
            out["rows"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    out["mlx_lm_step_ms"] = mlx_lm_ref.build_and_time(cfg, 64, 40)
    print(json.dumps(out, indent=1))
    print(f"\nplain: {plain:.1f} tok/s ({1e3 / plain:.2f} ms/token); mlx-lm step: {out['mlx_lm_step_ms']} ms")
    print("| a | " + " | ".join(f"n-max {k}" for k in (1, 2, 3, 4, "auto")) + " |")
    print("|---|" + "---|" * 5)
    for acc in (0.5, 0.7, 0.8, 0.9):
        rs = [r for r in out["rows"] if r["a"] == acc]
        print(f"| {acc} | " + " | ".join(f"{r['speedup']:.2f}x" for r in rs) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
