"""Decode-step benchmarks at Qwen3.5-9B shape (random 4-bit group-32 weights, built in memory), each
comparison measured side by side in one process with repeats interleaved:

  kernel   the custom few-row kernel against MLX's quantized_matmul: error and ms per row count
  plain    ms/token of plain decoding: uncompiled / compiled / + verify-row padding / + custom kernel, and
           mlx-lm's qwen3_5 model on the same shape and weight format (when mlx_lm is importable)
  verify   the verify curve V(S) = time(S-token forward) / time(1-token step) per configuration
  oracle   draft-mtp tok/s vs plain at oracle acceptance a in {0.5, 0.7, 0.8, 0.9}
  prefill  prompt tok/s at 512 and 4096 tokens, ours and mlx-lm's
  floor    the bandwidth floor: weight bytes read per token / measured copy bandwidth; the MTP
           head's memory (its weights + its KV cache at 8192 positions)
  loop     our pipelined decode loop vs our unpipelined one vs mlx-lm's generate_step, interleaved
  auto     fixed n-max and n-max auto at oracle acceptance 0.5..0.9, 9B shape (and with --shapes
           9b,moe the 35B-A3B MoE shape), at each --prompt-tokens length (a context axis: 512,8192,32768)
           (scripts/bench/harness.py)

Usage (GPU): python3 scripts/bench/bench_gpu.py [--sections plain,verify,oracle,prefill,floor,loop,auto] [--layers 32]
             [--shapes 9b,moe] [--prompt-tokens 64] [--quick] [--out DIR] [--smoke] (a tiny shape, to check the
             script on a CPU)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import mlx.core as mx

import harness
import peer as mlx_lm_peer
from harness import LAYOUTS, config_9b, config_a3b, decode_tps, peer_model, random_model, smoke_config

from mtp_engine.speculative.costmodel import measure
from mtp_engine.generation.decode import PlainDecoder
from mtp_engine.model import kernels
from mtp_engine.generation.sampling import Sampler, SamplerConfig

from mtp_engine.options import EngineOptions

# name -> the engine options it runs under (kernels: which custom CUDA kernels; see EngineOptions);
# the fused add + RMSNorm kernel stays on in every configuration, as the measured tables had it
CONFIGS = {"eager": EngineOptions(compile_steps=False, row_pad=0, kernels="norm"),
           "compiled": EngineOptions(compile_steps=True, row_pad=0, kernels="norm"),
           "compiled+pad8": EngineOptions(compile_steps=True, row_pad=8, kernels="norm"),
           "compiled+kernel": EngineOptions(compile_steps=True, row_pad=8, kernels="qmv,norm"),
           "fused": EngineOptions(compile_steps=True, row_pad=8, kernels="qmv,gdn,norm"),
           "fused+attn": EngineOptions(compile_steps=True, row_pad=8, kernels="custom")}
BEST = "fused+attn"
# (SiLU(gate) * up formed inside the down product was tried on 2026-12-03: verify V(2..5) rose from
# 1.12-2.95 to 1.48-4.15 and plain decoding was no faster; not kept.)


def log(obj) -> None:
    print(json.dumps(obj), file=sys.stderr, flush=True)


_GRAPHS: dict = {}  # (id of a network, configuration) -> its traced forwards under that configuration


def use(model, name: str) -> None:
    model.use(CONFIGS[name])
    # `use` drops traced graphs; keep each configuration's own so that interleaved repeats do not
    # retrace (and time the tracing) every time they switch
    for owner in (model, model.mtp):
        if owner is not None:
            owner.graphs = _GRAPHS.setdefault((id(owner), name), owner.graphs)


def check_kernel() -> dict:
    """The CUDA-core kernel against MLX's quantized_matmul, every row count, 4 and 8 bits, every
    rows-per-warp variant (scripts/bench/qmv_rows.py checks the tensor-core one)."""
    worst = {}
    for rpw in (2, 4, 8):
        for bits in (4, 8):
            for n, k in ((512, 4096), (1024, 512)):
                w = mx.random.normal((n, k)) * k ** -0.5
                q, sc, bi = mx.quantize(w, group_size=32, bits=bits)
                for m in (1, 2, 3, 5, 8):
                    x = mx.random.normal((m, k))
                    ref = mx.quantized_matmul(x, q, sc, bi, transpose=True, group_size=32, bits=bits)
                    got = kernels.qmv.simt_rows(x, q, sc, bi, bits, 32, rows_per_warp=rpw)
                    err = mx.max(mx.abs(got - ref)).item() / max(mx.max(mx.abs(ref)).item(), 1e-6)
                    worst[f"{bits}bit"] = max(worst.get(f"{bits}bit", 0.0), err)
    return worst


def copy_gb_s() -> float:
    """Device copy bandwidth (read + write) over 1 GiB, median of 10."""
    big = mx.random.uniform(shape=(256 * 2**20,))
    mx.eval(big)
    times = []
    for _ in range(10):
        t = time.perf_counter()
        mx.eval(big + 1.0)
        times.append(time.perf_counter() - t)
    return 2 * big.nbytes / statistics.median(times) / 1e9


def kernel_times() -> dict:
    """One 4096x12288 4-bit g32 product per row count: ms and achieved GB/s (weights + scales +
    biases read once) for MLX's kernels and ours (each rows-per-warp variant), interleaved."""
    w = mx.random.normal((12288, 4096)) * 0.02
    q, sc, bi = mx.quantize(w, group_size=32, bits=4)
    nbytes = q.nbytes + sc.nbytes + bi.nbytes
    fns = {"mlx": lambda x: mx.quantized_matmul(x, q, sc, bi, transpose=True, group_size=32, bits=4)}
    for rpw in (2, 4, 8):
        fns[f"ours r{rpw}"] = (lambda r: lambda x: kernels.qmv.simt_rows(x, q, sc, bi, 4, 32, rows_per_warp=r))(rpw)
    fns["ours"] = lambda x: kernels.qmv.quantized_rows(x, q, sc, bi, 4, 32)  # tensor cores from 2 rows
    times: dict[str, list[float]] = {}
    for m in (1, 2, 4, 8):
        x = mx.random.normal((m, 4096))
        for _ in range(3):
            for name, fn in fns.items():
                for _ in range(3):
                    mx.eval(fn(x))
                t = time.perf_counter()
                mx.eval([fn(x) for _ in range(50)])  # 50 independent products, one evaluation
                times.setdefault(f"{name} M={m}", []).append((time.perf_counter() - t) / 50 * 1e3)
    bw = copy_gb_s()
    out = {"copy_GB_s": bw, "bytes": nbytes}
    for key, v in times.items():
        ms = statistics.median(v)
        out[key] = {"ms": round(ms, 4), "GB_s": round(nbytes / ms / 1e6, 1)}
    return out


def ours_prefill_s(model, n: int) -> float:
    dec = PlainDecoder(model, Sampler(SamplerConfig()))
    ids = [(7 * i) % model.cfg.vocab_size for i in range(n)]
    t = time.perf_counter()
    dec.prefill(ids)
    return time.perf_counter() - t


def mlx_lm_prefill_s(model, n: int) -> float:
    cache = model.make_cache()
    ids = mx.array([[(7 * i) % 1000 for i in range(n)]])
    t = time.perf_counter()
    for s in range(0, n, 2048):  # mlx-lm's default prefill step
        mx.eval(model(ids[:, s:s + 2048], cache=cache), [c.state for c in cache])
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="kernel,plain,verify,oracle,prefill,floor")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--accs", default="0.5,0.7,0.8,0.9", help="oracle acceptances")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="which of " + ", ".join(CONFIGS))
    ap.add_argument("--no-peer", action="store_true", help="skip mlx-lm (e.g. when sweeping MLX settings)")
    ap.add_argument("--shapes", default="9b", help="auto section: 9b and/or moe")
    ap.add_argument("--prompt-tokens", default="64",
                    help="auto section: prompt lengths (comma-separated), each a row group of the table: "
                         "draft-mtp against plain at that context")
    ap.add_argument("--draft-vocab", default="0",
                    help="auto section: draft vocabularies, comma-separated (0: all ids; e.g. 0,32768)")
    ap.add_argument("--quick", action="store_true", help="loop+auto in a few minutes: 64 tokens, 1 repeat, "
                                                         "a in 0.5,0.7,0.9, n-max 1..3")
    ap.add_argument("--layout", default="uniform", choices=LAYOUTS,
                    help="random weights' bits: 4 everywhere, or a llama.cpp Q4_K_M file's mix of 4 and 8 "
                         "(its Q6_K tensors as the loader keeps them); mlx-lm gets the same")
    ap.add_argument("--out", default=None, help="write result.json and result.md here")
    a = ap.parse_args()
    if a.quick:
        a.tokens, a.repeats, a.accs = 64, 1, "0.5,0.7,0.9"
    sections = set(a.sections.split(","))
    configs = a.configs.split(",")
    if "kernel" in sections and kernels.available("qmv"):
        log({"kernel_max_rel_err": check_kernel()})
        log({"kernel_ms": kernel_times()})
    cfg = smoke_config() if a.smoke else config_9b(a.layers != 32)
    lengths = [int(x) for x in a.prompt_tokens.split(",")]
    cfg = dataclasses.replace(cfg, context_length=max(cfg.context_length, max(lengths) + a.tokens + 1024))
    t0 = time.perf_counter()
    model = random_model(cfg, a.layout)
    nb = model.nbytes()
    out: dict = {"device": str(mx.default_device()), "layers": cfg.n_layer, "layout": a.layout,
                 "weights_gib": sum(nb.values()) / 2**30}
    log({"built_s": round(time.perf_counter() - t0, 1), **out})
    ref = peer_model(cfg, a.layout) if sections & {"plain", "prefill", "loop"} and not a.no_peer else None
    prompt = list(range(100, 164))

    if "loop" in sections:
        use(model, BEST)
        out["loop"] = harness.loop_section(model, ref, prompt, a.tokens, max(a.repeats, 3), log)
        _save(out, a.out)

    if "plain" in sections:
        for name in configs:  # warm-up: trace and compile every configuration once
            use(model, name)
            decode_tps(model, prompt, 8)
        ms: dict[str, list[float]] = {k: [] for k in configs + ["mlx-lm"]}
        for _ in range(a.repeats):
            for name in configs:
                use(model, name)
                ms[name].append(1e3 / decode_tps(model, prompt, a.tokens)[0])
            if ref is not None:
                ms["mlx-lm"].append(mlx_lm_peer.step_ms(ref, steps=a.tokens))
        out["plain_ms_per_token"] = {k: statistics.median(v) for k, v in ms.items() if v}
        log({"plain_ms_per_token": out["plain_ms_per_token"], "all": ms})

    if "verify" in sections:
        out["verify"] = {}
        for name in configs:
            use(model, name)
            c = measure(model, max_verify=9, context=64, repeats=10)
            out["verify"][name] = {"step_ms": c.step_ms, "V": c.verify, "draft": c.draft}
            log({"verify": name, **out["verify"][name]})

    if "oracle" in sections:
        use(model, BEST)
        costs = measure(model, max_verify=9, context=64, repeats=10)
        costs.fixed = 0.05
        decode_tps(model, prompt, 16, "draft-mtp", 2, 0.8)  # warm-up
        for k in (1, 2, 3, 4, 5):
            decode_tps(model, prompt, 12, "draft-mtp", k, 0.99)  # trace the common verify lengths once
        plain = statistics.median(decode_tps(model, prompt, a.tokens)[0] for _ in range(3))
        out["oracle"] = {"plain_tok_s": plain, "rows": []}
        for acc in (float(x) for x in a.accs.split(",")):
            for k in (1, 2, 3, 4, "auto"):
                tps, st = decode_tps(model, prompt, a.tokens, "draft-mtp", k, acc, costs)
                row = {"a": acc, "n_max": k, "tok_s": tps, "speedup": tps / plain,
                       "acceptance": st["acceptance_rate"], "draft_lengths": st.get("draft_length_histogram")}
                out["oracle"]["rows"].append(row)
                log(row)

    if "prefill" in sections:
        use(model, BEST)
        out["prefill_tok_s"] = {}
        for n in (512, 4096):
            ours_prefill_s(model, n)  # warm-up
            o = statistics.median(ours_prefill_s(model, n) for _ in range(3))
            r = statistics.median(mlx_lm_prefill_s(ref, n) for _ in range(3)) if ref is not None else None
            out["prefill_tok_s"][n] = {"ours": n / o, "mlx-lm": n / r if r else None}
            log({"prefill": n, **out["prefill_tok_s"][n]})

    if "floor" in sections:
        bw = copy_gb_s() * 1e9
        per_token = nb["trunk"] - model.embed.nbytes() + model.embed.nbytes() // cfg.vocab_size
        if model.lm_head is model.embed:
            per_token += model.embed.nbytes()
        kv = 2 * cfg.n_head_kv * cfg.head_dim * 4 * 8192  # the head's one attention layer, float32
        out["floor"] = {"copy_GB_s": bw / 1e9, "bytes_per_token": per_token, "floor_ms": per_token / bw * 1e3,
                        "mtp_weights_gib": nb["mtp"] / 2**30, "mtp_kv_8192_gib": kv / 2**30}
        log(out["floor"])

    if "auto" in sections:
        accs = [float(x) for x in a.accs.split(",")]
        ks = (1, 2, 3) if a.quick else (1, 2, 3, 4)
        out["auto"] = []
        for shape in a.shapes.split(","):
            if shape != "9b":  # one shape's weights at a time
                del model
                mx.clear_cache()
                t0 = time.perf_counter()
                moe = smoke_config() if a.smoke else config_a3b(40 if a.layers == 32 else a.layers)
                model = random_model(dataclasses.replace(moe, context_length=cfg.context_length), a.layout)
                log({"built": shape, "s": round(time.perf_counter() - t0, 1)})
            for vocab in [int(x) for x in a.draft_vocab.split(",")]:
                use(model, BEST)
                if vocab:  # drafts over the first `vocab` ids (EngineOptions.draft_vocab)
                    model.use(model.options.updated(draft_vocab=vocab))
                for n in lengths:  # one prompt of n tokens: the verify then attends over n keys
                    ids = prompt if n == len(prompt) else [(7 * i) % (model.cfg.vocab_size - 200) + 100
                                                           for i in range(n)]
                    label = shape if len(lengths) == 1 else f"{shape}, {n}-token prompt"
                    label += f", drafts over {vocab} ids" if vocab else ""
                    out["auto"].append(harness.auto_section(model, ids, a.tokens, a.repeats, accs, ks, log,
                                                                    label))
                    _save(out, a.out)
    _save(out, a.out)
    print(json.dumps(out, indent=1, default=str))
    print(harness.markdown(out))
    return 0


def _save(out: dict, folder: str | None) -> None:
    """Results so far (a run cut short by the device's time limit keeps what it measured)."""
    if not folder:
        return
    from pathlib import Path

    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    (d / "result.json").write_text(json.dumps(out, indent=1, default=str))
    (d / "result.md").write_text(harness.markdown(out))


if __name__ == "__main__":
    raise SystemExit(main())
