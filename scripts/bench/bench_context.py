"""Long prompts and long contexts at the Qwen3.5-9B shape (random 4-bit g32 weights, an 8192-token
vocabulary): where a long prefill's time goes, decode attention over long caches, and time to
first token / prefill / decode tok/s against the prompt's length, ours beside mlx-lm's
`generate_step` on the same shape in one process.

    python3 scripts/bench/bench_context.py [--sections parts,attn,context] [--lengths 512,2048,8192,32768]
        [--tokens 48] [--repeats 2] [--oracle 0.8] [--peer-max 8192] [--out DIR]

Sections:
  step     a plain decode step at each context length, pipelined (cache filled by fiat): ms and
           memory allocated beyond the cache, as the model runs, with a float32 cache, without
           the attention kernel, uncompiled;
  parts    one prefill chunk's pieces timed apart (rows 512 / 2048 / 4096): a 4096x12288 product as
           MLX's quantized matmul on float32 rows, dequantized to float32, to bf16; a gated-delta-net
           mixer; an attention mixer at offsets 0 and 8192; a whole chunk's forward;
  attn     one decode step's attention over L keys (1, 4 and 9 query rows), launches queued: our
           split kernel per cache type (float32, float16) and keys per block, MLX's sdpa;
  context  per prompt length: ours plain and draft-mtp (oracle acceptance `--oracle`, n-max auto
           and 3), with `--batch` plain as a batch of one (the `--parallel` path), mlx-lm (up to
           `--peer-max` tokens: its 32k prefill takes over a minute);
           repeats interleaved, medians; a plot of decode tok/s against context.
Writes DIR/context.json (and context.png); prints one table per section.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from harness import LAYOUTS, NullTokenizer, config_9b, peer_model, random_model, store, stored_scheduler

from mtp_engine.generation.decode import PlainDecoder
from mtp_engine.generation.loop import run
from mtp_engine.generation.sampling import Sampler, SamplerConfig
from mtp_engine.model.step import Pass
from mtp_engine.model import delta_rule
from mtp_engine.model import kernels
from mtp_engine.speculative.ablations import ablation_decoder
from mtp_engine.speculative.config import DraftParams


def _ms(fn, repeats: int = 5) -> float:
    """Median ms of fn() evaluated, after one warm-up call."""
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def parts(model, rows_list=(512, 2048, 4096)) -> list[dict]:
    cfg = model.cfg
    lin = getattr(model.layers[0].mlp, "down", None)  # [ffn -> hidden]: the 4096 x 12288 product
    gdn_at = next(i for i, layer in enumerate(model.layers) if not hasattr(layer.mixer, "q_norm"))
    attn_at = next(i for i, layer in enumerate(model.layers) if hasattr(layer.mixer, "q_norm"))
    gdn_layer, attn_layer = model.layers[gdn_at], model.layers[attn_at]
    out = []
    for rows in rows_list:
        x = mx.random.normal((1, rows, cfg.hidden_size))
        row: dict = {"rows": rows}
        if lin is not None and lin.quantized:
            w = lin
            xf = mx.random.normal((1, rows, cfg.ffn_size[0]))

            def qmm():
                return mx.quantized_matmul(xf, w.weight, w.scales, w.biases, transpose=True, group_size=w.group_size,
                                           bits=w.bits)

            def deq(dtype):
                def f():
                    wd = mx.dequantize(w.weight, w.scales, w.biases, group_size=w.group_size, bits=w.bits).astype(dtype)
                    return (xf.astype(dtype) @ wd.T).astype(mx.float32)
                return f

            flop = 2 * rows * cfg.ffn_size[0] * cfg.hidden_size
            for name, fn in (("qmm_f32", qmm), ("deq_f32", deq(mx.float32)), ("deq_bf16", deq(mx.bfloat16))):
                ms = _ms(fn)
                row[name + "_ms"] = round(ms, 3)
                row[name + "_tflops"] = round(flop / ms / 1e9, 1)
        vh, kd, vd = cfg.ssm_value_heads, cfg.ssm_key_dim, cfg.ssm_value_dim
        ks = mx.random.split(mx.random.key(rows), 5)
        kk = mx.random.normal((1, rows, vh, kd), key=ks[1])
        dr_in = (mx.random.normal((1, rows, vh, kd), key=ks[0]), kk / mx.linalg.norm(kk, axis=-1, keepdims=True),
                 mx.random.normal((1, rows, vh, vd), key=ks[2]), -mx.random.uniform(0, 1, (1, rows, vh), key=ks[3]),
                 mx.random.uniform(0, 1, (1, rows, vh), key=ks[4]), mx.zeros((1, vh, kd, vd)))
        mx.eval(*dr_in)
        row["delta_rule_ms"] = round(_ms(lambda: delta_rule.delta_rule_chunked(*dr_in)), 2)
        row["gdn_mixer_ms"] = round(_ms(lambda: gdn_layer.mixer(x, model.make_cache().layers[gdn_at])), 2)
        for offset in (0, 8192):
            def attn(offset=offset):
                c = model.make_cache().layers[attn_at]
                if offset:
                    c.reserve(offset + rows)
                    c.offset = offset
                return attn_layer.mixer(x, c)
            row[f"attn_mixer_at{offset}_ms"] = round(_ms(attn), 2)
        row["mlp_ms"] = round(_ms(lambda: attn_layer.mlp(x)), 2)
        ids = mx.array([[(7 * i) % 8000 + 5 for i in range(rows)]])
        row["forward_ms"] = round(_ms(lambda: model.forward(ids, model.make_cache(), Pass.PREFILL), repeats=3), 1)
        row["forward_tok_s"] = round(rows / row["forward_ms"] * 1e3)
        out.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return out


def _ms_queued(fn, n: int = 20) -> float:
    """ms per call of fn() with `n` calls queued before one evaluation (the GPU's time, not the
    launch-and-wait latency a synchronous call adds), median of 3, after a warm-up."""
    mx.eval(fn())
    times = []
    for _ in range(3):
        t = time.perf_counter()
        mx.eval([fn() for _ in range(n)])
        times.append((time.perf_counter() - t) * 1e3 / n)
    return statistics.median(times)


def attn(model, lengths, per_split=(128, 256, 512), dtypes=("float32", "float16")) -> list[dict]:
    """Decode-step attention at the model's head shape over `lengths` keys, 20 launches queued:
    our split kernel per cache type and keys per block, MLX's sdpa on the same cache (float32)."""
    cfg = model.cfg
    nh, nkv, d = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    out = []
    for length in lengths:
        for s in (1, 4, 9):
            cap = length + s + 7
            keys32 = mx.random.normal((1, nkv, cap, d))
            values32 = mx.random.normal((1, nkv, cap, d))
            y = mx.random.normal((1, s, (2 * nh + 2 * nkv) * d))
            qn = mx.ones((d,))
            pos = mx.array([length], mx.int32)
            row: dict = {"keys": length, "rows": s}
            kept = kernels.attn.KEYS_PER_SPLIT
            for dt in dtypes if kernels.cuda() else ():
                keys, values = keys32.astype(getattr(mx, dt)), values32.astype(getattr(mx, dt))
                mx.eval(keys, values)
                for n in per_split:
                    kernels.attn.KEYS_PER_SPLIT = n
                    ms = _ms_queued(lambda: kernels.attn.attend(y, qn, keys, values, pos, nh, nkv, d, cfg.n_rot, cfg.eps,
                                                               cfg.rope_base))
                    row[f"{dt}_split{n}_ms"] = round(ms, 4)
                    row[f"{dt}_split{n}_gb_s"] = round(s * keys.nbytes * 2 * (length + s) / cap / ms / 1e6)
            kernels.attn.KEYS_PER_SPLIT = kept
            q = mx.random.normal((1, nh, s, d))
            kk, vv = keys32[:, :, :length + s], values32[:, :, :length + s]
            mx.eval(kk, vv)
            row["sdpa_f32_ms"] = round(_ms_queued(lambda: mx.fast.scaled_dot_product_attention(
                q, kk, vv, scale=d ** -0.5, mask="causal" if s > 1 else None)), 4)
            out.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return out


def step(model, lengths, steps: int = 40) -> list[dict]:
    """A plain decode step at each context length, pipelined as the decode loop runs (step r+1
    queued before step r's token is read), the cache filled by fiat (its contents do not change
    the time): ms a step, and the memory the steps allocated beyond what they started with (a KV
    buffer copied instead of written in place shows as its size). Variants: the defaults (a
    16-bit cache on a GPU), a float32 cache, without the attention kernel (MLX's sdpa over the
    capacity under a mask), uncompiled."""
    from mtp_engine.model.kv_cache import KVCache

    before = model.options
    variants = {"default": before, "kv_f32": before.updated(kv_dtype="float32"),
                "no_attn_kernel": before.updated(kernels="qmv,gdn,norm"),
                "uncompiled": before.updated(compile_steps=False)}
    out = []
    for length in lengths:
        row: dict = {"context": length}
        for name, opts in variants.items():
            model.use(opts)
            cache = model.make_cache()
            for c in cache.layers:
                if isinstance(c, KVCache):
                    c.reserve(length + 2 * steps + 16)
                    c.offset = length
            cache.offset = length
            mx.eval([c.keys for c in cache.layers if isinstance(c, KVCache)])

            def one(tok):
                h = model.forward(tok, cache)
                return mx.argmax(model.logits(h[0, -1]), axis=-1).reshape(1, 1).astype(mx.int32)

            tok = one(mx.array([[5]]))
            for _ in range(4):  # warm-up: traces and compiles
                tok = one(tok)
            tok.item()
            mx.reset_peak_memory()
            start = mx.get_active_memory()
            t = time.perf_counter()
            nxt = one(tok)
            mx.async_eval(nxt)
            for _ in range(steps - 1):
                after = one(nxt)
                mx.async_eval(after)
                nxt.item()
                nxt = after
            nxt.item()
            row[f"{name}_ms"] = round((time.perf_counter() - t) * 1e3 / steps, 3)
            row[f"{name}_extra_mb"] = round((mx.get_peak_memory() - start) / 2 ** 20, 1)
            row[f"{name}_kv_mb"] = round(sum(c.nbytes() for c in cache.layers if isinstance(c, KVCache)) / 2 ** 20)
            del cache
        model.use(before)
        out.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return out


def _batch_of_one(model, prompt, tokens) -> dict:
    """Plain decoding of the prompt as one row of a batch (`BatchScheduler`, the server's
    `--parallel` path), driven here: its first token's time and its tokens' rate as they reach
    the reader."""
    from mtp_engine.batching.scheduler import BatchScheduler
    from mtp_engine.batching.sequence import Sequence
    from mtp_engine.model.loaded import Model
    from mtp_engine.model.loader import LoadInfo

    scheduler = BatchScheduler(Model(model, None, LoadInfo(""), ""), 2, own_thread=False)
    seq = Sequence(list(prompt), Sampler(SamplerConfig(seed=0)), tokens)
    times: list[float] = []

    def read() -> bool:
        while not seq.out.empty():
            item = seq.out.get_nowait()
            if isinstance(item, BaseException):
                raise item
            if item is not None:
                times.extend([time.perf_counter()] * len(item[0]))
        return seq.done and seq.out.empty()

    t0 = time.perf_counter()
    scheduler.submit(seq)
    scheduler.drive(read)
    read()
    return {"ttft_s": times[0] - t0, "prefill_tok_s": len(prompt) / (times[0] - t0),
            "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0}


def _ours(model, prompt, tokens, spec, n_max=None, oracle=None, on=None, batch=False) -> dict:
    if batch:
        return _batch_of_one(model, prompt, tokens)
    model = on if on is not None else model
    sampler = Sampler(SamplerConfig(seed=0))
    sched = None
    if spec == "none":
        dec = PlainDecoder(model, sampler)
    else:
        # auto starts from the round costs earlier runs on this model measured (the API's cache
        # folder; the untimed run of each length measures them first)
        sched = stored_scheduler(model) if n_max == "auto" else None
        dec = ablation_decoder(model, sampler, DraftParams(None if n_max == "auto" else n_max), scheduler=sched,
                               oracle_acceptance=oracle)
    last = None
    for last in run(dec, NullTokenizer(), prompt, tokens, ignore_eos=True):
        pass
    if sched is not None:
        store(model, sched)
    st = last.stats
    return {"ttft_s": st["time_to_first_token_seconds"], "prefill_tok_s": len(prompt) / st["prefill_seconds"],
            "decode_tok_s": st["decode_tokens_per_second"]}


def _peer(peer, prompt, tokens) -> dict:
    from mlx_lm.generate import generate_step

    t0 = time.perf_counter()
    t_first, n = None, 0
    for _tok, _ in generate_step(mx.array(prompt), peer, max_tokens=tokens):
        if t_first is None:
            t_first = time.perf_counter()
        else:
            n += 1
    end = time.perf_counter()
    return {"ttft_s": t_first - t0, "prefill_tok_s": len(prompt) / (t_first - t0),
            "decode_tok_s": n / (end - t_first) if n else 0.0}


def context(model, peer, lengths, tokens, repeats, oracle, peer_max, n_maxes=("auto", 3),
            others: dict | None = None, batch: bool = False) -> list[dict]:
    """`others`: name -> a second model of the same shape run plain beside (another cache type);
    `batch`: plain decoding as a batch of one beside (`_batch_of_one`)."""
    runs = {"plain": dict(spec="none")}
    if batch:
        runs["batch_of_one"] = dict(spec="none", batch=True)
    for n in n_maxes:
        runs[f"mtp_{n}_a{oracle}"] = dict(spec="draft-mtp", n_max=n, oracle=oracle)
    for name, other in (others or {}).items():
        runs[f"plain_{name}"] = dict(spec="none", on=other)
    out = []
    warm = [(31 * i) % (model.cfg.vocab_size - 10) + 5 for i in range(300)]
    for kw in runs.values():  # first uses trace and compile: not timed
        _ours(model, warm, 8, **kw)
    if peer is not None:
        _peer(peer, warm, 8)
    for length in lengths:
        prompt = [(31 * i) % (model.cfg.vocab_size - 10) + 5 for i in range(length)]
        got: dict[str, list[dict]] = {}
        # untimed first runs at this length: a new cache capacity is a new trace of the compiled
        # steps and a first chunk of a new width MLX's JIT compiles, once per process (each took
        # 0.2-0.5 s of a 128-token run)
        for kw in runs.values():
            _ours(model, prompt, 4, **kw)
        for r in range(repeats):
            for name, kw in runs.items():
                got.setdefault(name, []).append(_ours(model, prompt, tokens, **kw))
            if peer is not None and length <= peer_max:
                got.setdefault("mlx_lm", []).append(_peer(peer, prompt, tokens))
        row: dict = {"prompt_tokens": length}
        for name, rs in got.items():
            for key in ("ttft_s", "prefill_tok_s", "decode_tok_s"):
                row[f"{name}.{key}"] = round(statistics.median(x[key] for x in rs), 3)
        plain = row["plain.decode_tok_s"]
        for name in runs:
            if name != "plain":
                row[f"{name}.speedup"] = round(row[f"{name}.decode_tok_s"] / plain, 3) if plain else None
        out.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return out


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    xs = [r["prompt_tokens"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in sorted({k for r in rows for k in r if k.endswith("decode_tok_s")}):
        pts = [(x, r[key]) for x, r in zip(xs, rows) if key in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key.rsplit(".", 1)[0])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (prompt tokens)")
    ax.set_ylabel("decode tok/s")
    ax.set_title(f"9B shape, {mx.default_device()}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sections", default="parts,attn,context")
    ap.add_argument("--lengths", default="512,2048,8192,32768")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--oracle", type=float, default=0.8)
    ap.add_argument("--n-max", default="auto,3", help="draft-mtp runs beside plain (empty: none)")
    ap.add_argument("--peer-max", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=32, help="trunk layers (8: a quick check)")
    ap.add_argument("--rows", default="512,2048,4096", help="the parts section's chunk sizes")
    ap.add_argument("--kv-dtypes", default="", help="cache types run plain beside the default (e.g. float32)")
    ap.add_argument("--prefill-chunks", default="",
                    help="prompt tokens per prefill forward run plain beside the default (e.g. 8192)")
    ap.add_argument("--no-tail", action="store_true", help="also run plain without the KV tails (KVCache.rebase)")
    ap.add_argument("--batch", action="store_true", help="also run plain as a batch of one (the --parallel path)")
    ap.add_argument("--layout", default="uniform", choices=LAYOUTS,
                    help="random weights' bits: 4 everywhere, or a llama.cpp Q4_K_M file's mix (mlx-lm's the same)")
    ap.add_argument("--out", default="out/context")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    sections = a.sections.split(",")
    cfg = dataclasses.replace(config_9b(a.layers < 32), vocab_size=8192, context_length=max(lengths) + 4096)
    if a.layers not in (8, 32):
        raise SystemExit("--layers: 8 or 32")
    t = time.perf_counter()
    model = random_model(cfg, a.layout)
    print(f"9B-shape model ({cfg.n_layer} layers) built in {time.perf_counter() - t:.0f} s on {mx.default_device()}",
          file=sys.stderr, flush=True)
    result: dict = {"device": str(mx.default_device()), "date": time.strftime("%Y-%m-%d"), "layers": cfg.n_layer,
                    "keys_per_split": kernels.attn.KEYS_PER_SPLIT}
    if "step" in sections:
        result["step"] = step(model, lengths)
    if "parts" in sections:
        result["parts"] = parts(model, [int(x) for x in a.rows.split(",")])
    if "attn" in sections:
        result["attn"] = attn(model, lengths)
    if "context" in sections:
        peer = peer_model(cfg, a.layout) if a.peer_max > 0 else None
        n_maxes = [x if x == "auto" else int(x) for x in a.n_max.split(",") if x]
        others = {}
        for dt in [x for x in a.kv_dtypes.split(",") if x and x != model.options.kv_dtype]:
            others[f"kv_{dt}"] = random_model(cfg, a.layout)
            others[f"kv_{dt}"].use(model.options.updated(kv_dtype=dt))
        for c in [int(x) for x in a.prefill_chunks.split(",") if x and int(x) != model.options.prefill_chunk]:
            others[f"chunk_{c}"] = random_model(cfg, a.layout)
            others[f"chunk_{c}"].use(model.options.updated(prefill_chunk=c))
        if a.no_tail:  # the same model without compiled steps' KV tails (what the tail costs or saves)
            others["no_tail"] = random_model(cfg, a.layout)
            others["no_tail"].use(model.options.updated(kv_tail=0))
        result["kv_dtype"] = model.options.kv_dtype
        result["context"] = context(model, peer, lengths, a.tokens, a.repeats, a.oracle, a.peer_max, n_maxes, others,
                                    a.batch)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "context.json").write_text(json.dumps(result, indent=1))
    if result.get("context"):
        plot(result["context"], out / "context.png")
    for name in ("step", "parts", "attn", "context"):
        for row in result.get(name, []):
            print(name, json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
