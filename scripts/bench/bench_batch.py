"""Continuous batching against one stream at a time, in one process.

For each concurrency C (default 1, 2, 4, 8, 16): C threads each stream one greedy (or --temperature) completion of
T tokens (a different prompt each, EOS ignored) from a model loaded with `parallel=C`
(`batching`: every step one batched forward of the running sequences), plain and draft-mtp
(n-max auto: the draft length the batch measures best for its size), and the same C plain
requests one after another on a model without batching (the engine's turn-taking, what `serve`
did before --parallel). Reported per C and mode, medians over the repeats (interleaved):
  aggregate tok/s   all generated tokens / wall time from the first request to the last token;
  ttft p50 / p95    per request, from its arrival to its first token (queueing included: all C
                    requests arrive at once, so one at a time the last waits for the others);
                    batched, split in two: waiting for a slot and the scheduler (queue), then
                    its prompt read and first token (read), each its p50;
  stream tok/s      per request, tokens after the first / time from its first token to its last;
  outputs equal     every batched answer equals its sequential one (greedy: token for token).
Writes JSON (--out) and a plot of aggregate tok/s and TTFT against C (--plot).

    python scripts/bench/bench_batch.py                         # the model in models/, this machine
    python scripts/bench/bench_batch.py -m FILE.gguf -t 128 --concurrency 1,4,8 --out b.json --plot b.png
    python3 scripts/bench/bench_batch.py --random-9b ...       # GPU: the Qwen3.5-9B shape, random 4-bit g32

`--random-9b`: the 9B shape (scripts/bench/harness.py) with random weights and the shipped model's
tokenizer, so its vocabulary is the tokenizer's 8192 rows instead of 248320 (the output head reads
16 MB instead of 0.5 GB, ~10% of a step's weights); every other matrix is the 9B one. Random
weights draft nothing useful: `--oracle A` makes the batched draft-mtp rounds accept each draft
with probability A (`batching.ablations.OracleBatchScheduler`; their outputs are not compared),
the figure of "draft-mtp at 4 streams against plain batching at acceptance 0.8".
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _random_9b(shipped, layout: str):
    """The 9B shape with random weights behind the shipped model's tokenizer (see the docstring)."""
    import dataclasses

    from harness import config_9b, random_model

    from mtp_engine.model.loaded import Model
    from mtp_engine.threads import evaluate_all

    cfg = dataclasses.replace(config_9b(False), vocab_size=shipped.model.cfg.vocab_size)
    t = time.perf_counter()
    net = random_model(cfg, layout)
    print(f"random 9B-shape model built in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    m = Model(model=net, tokenizer=shipped.tokenizer, info=shipped.info, path="")
    evaluate_all(m)  # lazy weights would fail in the scheduler's thread (no stream there for them)
    return m


class _PeerTok:
    """What mlx-lm's batch_generate asks of a tokenizer: no end token (every stream runs to
    max_tokens, as ours with ignore_eos), and a decode."""

    eos_token_ids: set = set()

    def decode(self, ids) -> str:
        return ""


def mlx_lm_batch(net, prompt_ids: list[list[int]], tokens: int) -> float | None:
    """mlx-lm's `batch_generate` (its users' batched call) on its own qwen3_5 model at our shape
    (random 4-bit g32 weights, scripts/bench/peer.py): one run's aggregate tok/s (None without
    mlx-lm). The caller warms it up (`tokens` 4) and interleaves its repeats with ours."""
    try:
        from mlx_lm import batch_generate
    except Exception:
        return None
    if net is None:
        return None
    t = time.perf_counter()
    r = batch_generate(net, _PeerTok(), prompt_ids, max_tokens=tokens)
    rate = len(prompt_ids) * tokens / (time.perf_counter() - t)
    del r
    return rate


def _with_scheduler(model, parallel: int, oracle: float | None = None, profile: str = "off"):
    """Another handle on the same weights whose generations share batches of `parallel` (with
    `oracle`, draft-mtp rounds accept each draft with that probability: benchmark-only; `profile`
    "precise": an MTP batch that times its rounds' stages)."""
    import dataclasses

    from mtp_engine.batching import MTPBatchScheduler, batch_scheduler
    from mtp_engine.batching.ablations import OracleBatchScheduler

    m = dataclasses.replace(model, scheduler=None)
    if oracle is not None:
        m.scheduler = OracleBatchScheduler(m, parallel, oracle, profile=profile)
    else:
        m.scheduler = batch_scheduler(m, parallel) if profile == "off" else MTPBatchScheduler(m, parallel, profile=profile)
    return m


def _stage_breakdown(alone, parallel: int, oracle: float | None, prompts: list[str], tokens: int) -> dict:
    """A plain run and a draft-mtp run, each through a fresh MTP batch that times every round's
    stages (each synchronised: slower than the timed runs, for where a batch round's time goes;
    the graphs are compiled by then): ms per stage call, calls, and the draft-mtp run's rounds by k."""
    out = {}
    for spec in ("none", "draft-mtp"):
        m = _with_scheduler(alone, parallel, oracle, "precise")
        try:
            run_streams(m, prompts, tokens, True, spec)
        finally:
            m.scheduler.stop()
        out[spec] = {name: {"ms": round(v["seconds"] * 1e3 / max(v["count"], 1), 3), "calls": v["count"]}
                     for name, v in m.scheduler.prof.report()["stages"].items() if v["count"]}
        out["rounds_by_k"] = dict(m.scheduler.rounds_by_k)
    return out


def _round_costs(scheduler, batch: int) -> dict:
    """n-max auto's measured costs at this batch size: {k: t(k)/t(0)} and t(0) in seconds (empty
    where the scheduler has no controller: plain batching)."""
    controller = getattr(scheduler, "controller", None)
    if controller is None:
        return {}
    c = controller(batch)
    t0 = c.step_seconds()
    return {"t0_s": t0, **{str(k): round(v, 3) for k, v in c.measured_round_steps().items()}}


def _prompts(n: int, tokenizer=None, tokens: int = 0) -> list[str]:
    """n different prompts: a task number and a stem (~10 tokens); with `tokens`, each grown by
    lines of code before its stem to at least that many tokens (a request's usual length)."""
    stems = ["def parse_args(argv):\n", "class Cache:\n    def __init__(self, size):\n", "import json\n\ndef load(",
             "for i in range(10):\n", "def fib(n):\n", "async def fetch(url):\n", "SELECT name FROM", "x = ["]
    out = []
    for i in range(n):
        head, k = f"# task {i}\n", 0
        while tokens and len(tokenizer.encode(head + stems[i % len(stems)])) < tokens:
            head += f"value_{i}_{k} = compute({k}, {i + k} * scale)\n"
            k += 1
        out.append(head + stems[i % len(stems)])
    return out


def run_streams(model, prompts: list[str], tokens: int, concurrent: bool, spec: str = "none",
                sampling: dict | None = None) -> dict:
    """`sampling`: temperature / top_p for every stream, stream i seeded with i (so a batched
    answer can equal its sequential one); None: greedy."""
    from mtp_engine import stream_generate

    sub, first, last, out, stats = {}, {}, {}, {}, {}

    def one(i: int) -> None:
        sub.setdefault(i, time.perf_counter())
        toks = []
        kw = {**sampling, "seed": i} if sampling else {}
        for c in stream_generate(prompts[i], model, max_tokens=tokens, ignore_eos=True, spec=spec, **kw):
            if c.token_ids and i not in first:
                first[i] = time.perf_counter()
            toks += c.token_ids
            if c.stats:
                stats[i] = c.stats
        last[i] = time.perf_counter()
        out[i] = toks

    t0 = time.perf_counter()
    if not concurrent:  # the C requests all arrive now and take turns: a turn's wait is its queueing
        sub.update((i, t0) for i in range(len(prompts)))
    if concurrent:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(prompts)):
            one(i)
    wall = time.perf_counter() - t0
    n = len(prompts)
    ttft = sorted(first[i] - sub[i] for i in range(n))
    rates = [(len(out[i]) - 1) / (last[i] - first[i]) for i in range(n) if last[i] > first[i]]
    return {"aggregate_tok_s": sum(len(o) for o in out.values()) / wall,
            "ttft_p50_s": ttft[n // 2], "ttft_p95_s": ttft[min(n - 1, int(0.95 * n))],
            "stream_tok_s": statistics.median(rates) if rates else 0.0,
            **_ttft_split(list(stats.values())), "outputs": [out[i] for i in range(n)]}


def _ttft_split(stats: list[dict]) -> dict:
    """Where a batched request's first token waited (p50s): for a slot and the scheduler's next
    pass (`batch_queue_seconds`), then for its prompt's read and first draw (the rest of its
    time to first token); {} for requests that did not go through a batch."""
    queued = [st["batch_queue_seconds"] for st in stats if "batch_queue_seconds" in st]
    if not queued:
        return {}
    read = [st["time_to_first_token_seconds"] - st["batch_queue_seconds"] for st in stats if "batch_queue_seconds" in st]
    return {"ttft_queue_p50_s": statistics.median(queued), "ttft_read_p50_s": statistics.median(read)}


def _first_differences(batched: list[dict], alone: list[dict]) -> list[tuple[int, int, int]]:
    """(repeat, stream, first differing token) of every batched plain answer unequal to its answer
    alone: a flip late in a stream points at a near tie of accumulated rounding, one at token 0
    at the prompt's prefill or first draw."""
    out = []
    for r, (b, s) in enumerate(zip(batched, alone)):
        for i, (x, y) in enumerate(zip(b["outputs"], s["outputs"])):
            if x != y:
                out.append((r, i, next((j for j, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the model in models/)")
    ap.add_argument("-t", "--tokens", type=int, default=32)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--random-9b", action="store_true", help="the 9B shape, random weights (see above)")
    ap.add_argument("--layout", default="uniform", choices=("uniform", "q4_k_m"),
                    help="--random-9b's bits: 4 everywhere, or a llama.cpp Q4_K_M file's mix of 4 and 8; "
                         "mlx-lm's model gets the same")
    ap.add_argument("--peer", action="store_true",
                    help="mlx-lm's batch_generate beside ours at the model's shape (random 4-bit g32 weights; "
                         "always on with --random-9b)")
    ap.add_argument("--profile", action="store_true",
                    help="after each concurrency's timed runs, one plain and one draft-mtp run whose rounds' stages "
                         "are timed (synchronised: where a batch round's time goes)")
    ap.add_argument("--oracle", type=float, default=None,
                    help="draft-mtp rounds accept each draft with this probability (random weights draft nothing "
                         "useful); their outputs are then not compared")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampled streams (each seeded by its index; 0: greedy): their rows draw on the device, and "
                         "draft-mtp rows draft and verify by the rejection sampler")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature: top-p (1: off)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="each prompt grown to at least this many tokens (0: the ~10-token stems)")
    args = ap.parse_args(argv)
    import mlx.core as mx

    from mtp_engine import load

    levels = [int(x) for x in args.concurrency.split(",")]
    sampling = {"temperature": args.temperature, "top_p": args.top_p} if args.temperature > 0 else None
    alone = load(args.model) if not args.random_9b else _random_9b(load(args.model), args.layout)
    peer = None
    if args.random_9b or args.peer:  # mlx-lm's batch_generate at the same shape, beside ours
        from harness import peer_model
        peer = peer_model(alone.model.cfg, args.layout)
    rows = []
    for c in levels:
        batched = load(args.model, parallel=max(c, 2)) if not (args.random_9b or args.oracle is not None) \
            else _with_scheduler(alone, max(c, 2), args.oracle)
        prompts = _prompts(c, alone.tokenizer, args.prompt_tokens)
        # warm-up (first-use costs out of the timings): draft-mtp as long as a timed run, so n-max
        # auto's exploration of every draft length at this batch size, and each length's first
        # verify and head shapes (compiles: a 1.9 s TTFT in a timed run on an H100), happen here
        # plain as long as a timed run too: its steps' shapes (batch sizes, KV capacities) are new
        # compiled graphs at first use, which a timed run must not pay
        run_streams(batched, prompts, args.tokens, True, sampling=sampling)
        run_streams(batched, prompts, args.tokens, True, "draft-mtp", sampling)
        run_streams(alone, prompts[:1], 4, False, sampling=sampling)
        ids = [alone.tokenizer.encode(p) for p in prompts]
        peer_rates = None if mlx_lm_batch(peer, ids, 4) is None else []  # its warm-up; None: no peer
        res = {"batched": [], "batched_mtp": [], "sequential": []}
        mtp_rounds: dict[int, int] = {}  # the timed draft-mtp runs' rounds by k (the plain runs' are k = 0 too)
        for _ in range(args.repeats):  # every repeat runs each config once, the peer's included
            res["batched"].append(run_streams(batched, prompts, args.tokens, True, sampling=sampling))
            before = dict(getattr(batched.scheduler, "rounds_by_k", {}))
            res["batched_mtp"].append(run_streams(batched, prompts, args.tokens, True, "draft-mtp", sampling))
            for k, n in getattr(batched.scheduler, "rounds_by_k", {}).items():
                if n > before.get(k, 0):
                    mtp_rounds[k] = mtp_rounds.get(k, 0) + n - before.get(k, 0)
            res["sequential"].append(run_streams(alone, prompts, args.tokens, False, sampling=sampling))
            if peer_rates is not None:
                peer_rates.append(mlx_lm_batch(peer, ids, args.tokens))
        row = {"concurrency": c,
               # a sampled draft-mtp run's answers are its own draws (lossless, not plain's)
               "outputs_equal": all(b["outputs"] == s["outputs"] and (args.oracle is not None or sampling is not None
                                                                     or d["outputs"] == s["outputs"])
                                    for b, d, s in zip(res["batched"], res["batched_mtp"], res["sequential"])),
               # where a batched plain answer first leaves its answer alone: (repeat, stream, token index)
               "first_differences": _first_differences(res["batched"], res["sequential"]),
               "oracle_acceptance": args.oracle, "sampling": sampling,
               "mtp_rounds_by_k": dict(sorted(mtp_rounds.items())),
               # what auto measured at this batch size: t(k)/t(0) per k and the plain round's seconds
               # (the cost curve a batch's draft length is chosen on)
               "mtp_round_steps": _round_costs(batched.scheduler, c)}
        for kind, runs in res.items():
            for key in ("aggregate_tok_s", "ttft_p50_s", "ttft_p95_s", "stream_tok_s", "ttft_queue_p50_s",
                        "ttft_read_p50_s"):
                if all(key in r for r in runs):
                    row[f"{kind}_{key}"] = statistics.median(r[key] for r in runs)
        row["aggregate_ratio"] = row["batched_aggregate_tok_s"] / row["sequential_aggregate_tok_s"]
        if peer_rates:
            row["mlx_lm_batch_tok_s"] = statistics.median(peer_rates)
        row["mtp_ratio"] = row["batched_mtp_aggregate_tok_s"] / row["batched_aggregate_tok_s"]
        if args.profile:
            row["stages"] = _stage_breakdown(alone, max(c, 2), args.oracle, prompts, args.tokens)
        rows.append(row)
        split = (f": queue {row['batched_ttft_queue_p50_s']:.3f} + read {row['batched_ttft_read_p50_s']:.3f}"
                 if "batched_ttft_read_p50_s" in row else "")
        print(f"C={c:2d}  batched {row['batched_aggregate_tok_s']:7.1f} tok/s (ttft p50 {row['batched_ttft_p50_s']:.3f}{split} "
              f"p95 {row['batched_ttft_p95_s']:.3f} s, stream {row['batched_stream_tok_s']:.1f})  draft-mtp "
              f"{row['batched_mtp_aggregate_tok_s']:7.1f} (x{row['mtp_ratio']:.2f} of batched plain, rounds by k "
              f"{row['mtp_rounds_by_k']}, t(k)/t(0) {row['mtp_round_steps']})  one at a time {row['sequential_aggregate_tok_s']:7.1f} (ttft p50 "
              f"{row['sequential_ttft_p50_s']:.3f} s, stream {row['sequential_stream_tok_s']:.1f})  batched/one-at-a-time x{row['aggregate_ratio']:.2f}  "
              f"outputs equal: {row['outputs_equal']}"
              + (f" (first differences, repeat/stream/token: {row['first_differences']})" if row["first_differences"] else "")
              + (f"  mlx-lm batch_generate {row['mlx_lm_batch_tok_s']:.1f}" if row.get("mlx_lm_batch_tok_s") else ""),
              flush=True)
        if "stages" in row:  # ms per call of each stage, synchronised
            for spec in ("none", "draft-mtp"):
                st = row["stages"][spec]
                print(f"      stages {spec:9s} " + ", ".join(f"{k} {v['ms']:.2f} ms x{v['calls']}"
                                                          for k, v in sorted(st.items(), key=lambda kv: -kv[1]["ms"] * kv[1]["calls"])),
                      flush=True)
            print(f"      stages rounds by k {row['stages']['rounds_by_k']}", flush=True)
    report = {"device": str(mx.default_device()), "date": time.strftime("%Y-%m-%d"), "tokens": args.tokens,
              "prompt_tokens": args.prompt_tokens,
              "repeats": args.repeats, "model": args.model or "models/ (default)", "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.plot:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        cs = [r["concurrency"] for r in rows]
        a.plot(cs, [r["batched_aggregate_tok_s"] for r in rows], "o-", label="batched plain (parallel=C)")
        a.plot(cs, [r["batched_mtp_aggregate_tok_s"] for r in rows], "^-", label="batched draft-mtp")
        a.plot(cs, [r["sequential_aggregate_tok_s"] for r in rows], "s--", label="one at a time")
        a.set(xlabel="concurrent streams", ylabel="aggregate tok/s", xscale="log", title="throughput")
        b.plot(cs, [r["batched_ttft_p50_s"] for r in rows], "o-", label="batched p50")
        b.plot(cs, [r["batched_ttft_p95_s"] for r in rows], "o:", label="batched p95")
        b.plot(cs, [r["sequential_ttft_p50_s"] for r in rows], "s--", label="one at a time p50")
        b.set(xlabel="concurrent streams", ylabel="time to first token (s)", xscale="log", title="TTFT")
        for ax in (a, b):
            ax.legend()
            ax.grid(alpha=0.3)
        fig.suptitle(f"continuous batching, {report['device']}, {args.tokens} tokens per stream")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
