"""What the benchmarks share: models of named shapes with random 4-bit group-32 weights built in
memory (the Qwen3.5-9B shape, the 35B-A3B MoE shape, a smoke shape for a CPU), one greedy run's
decode rate with oracle acceptance (each draft right with probability a, the drafter doing all its
work: random weights draft nothing useful), and `bench_gpu.py`'s sections for the decode loop and
n-max auto:

  loop  plain decode tok/s of our pipelined loop, our unpipelined loop, and mlx-lm's own
        `generate_step` (its pipelined path) on the same shape and weight format, one process,
        repeats interleaved
  auto  fixed n-max rows and n-max auto at oracle acceptance a, as speedups over plain decoding
        measured in the same repeat; auto starts from the GPU prior (no stored costs: a first run)

Both print progress as JSON lines on stderr and return plain dicts.
"""
from __future__ import annotations

import statistics
import sys
import time


import peer as mlx_lm_peer
from mtp_engine.generation.decode import PlainDecoder
from mtp_engine.generation.loop import run
from mtp_engine.model.build import build_model
from mtp_engine.model.config import Qwen35Config
from mtp_engine.model.miniature import random_linear, random_vector
from mtp_engine.generation.sampling import Sampler, SamplerConfig
from mtp_engine.speculative import calibration
from mtp_engine.speculative.ablations import ablation_decoder
from mtp_engine.speculative.config import DraftParams
from mtp_engine.speculative.scheduler import DraftLengthScheduler


def config_9b(small: bool) -> Qwen35Config:
    n = 8 if small else 32
    return Qwen35Config(vocab_size=248320, hidden_size=4096, n_layer=n, n_mtp=1, ffn_size=[12288] * (n + 1),
                        n_head=16, n_head_kv=4, head_dim=256, n_rot=64, rope_base=1e7, eps=1e-6, conv_kernel=4,
                        ssm_key_dim=128, ssm_key_heads=16, ssm_value_heads=32, ssm_inner=4096,
                        recurrent=[(i + 1) % 4 != 0 for i in range(n)], context_length=8192)


def config_a3b(n: int) -> Qwen35Config:
    """The Qwen3.5/3.6-35B-A3B shape (qwen35moe: 256 experts, 8 active, a shared expert), n layers."""
    return Qwen35Config(vocab_size=248320, hidden_size=2048, n_layer=n, n_mtp=1, ffn_size=[], n_head=16,
                        n_head_kv=2, head_dim=256, n_rot=64, rope_base=1e7, eps=1e-6, conv_kernel=4,
                        ssm_key_dim=128, ssm_key_heads=16, ssm_value_heads=32, ssm_inner=4096,
                        recurrent=[(i + 1) % 4 != 0 for i in range(n)], context_length=8192, arch="qwen35moe",
                        n_expert=256, n_expert_used=8, expert_ffn_size=512, shared_ffn_size=512)


def smoke_config() -> Qwen35Config:
    """A tiny shape of the same architecture: a benchmark checked end to end on a CPU."""
    n = 4
    return Qwen35Config(vocab_size=1024, hidden_size=256, n_layer=n, n_mtp=1, ffn_size=[512] * (n + 1),
                        n_head=4, n_head_kv=2, head_dim=64, n_rot=16, rope_base=1e7, eps=1e-6, conv_kernel=4,
                        ssm_key_dim=32, ssm_key_heads=2, ssm_value_heads=4, ssm_inner=128,
                        recurrent=[(i + 1) % 4 != 0 for i in range(n)], context_length=8192)


LAYOUTS = ("uniform", "q4_k_m")


def q4_k_m_bits(name: str, n_blocks: int) -> int:
    """The bits the loader gives a matrix of a llama.cpp Q4_K_M file: its Q6_K tensors (the output
    head; v, the recurrent layers' qkv and the FFN's down product in the first and last eighth of
    the blocks and every third block between: llama.cpp's `use_more_bits`) load as 8-bit, its Q4_K
    ones as 4-bit. A Q4_K_M layer's q, k and v are therefore not all alike."""
    if name == "output.weight":
        return 8
    parts = name.split(".")
    if parts[0] != "blk" or parts[2] not in ("attn_v", "attn_qkv", "ffn_down", "ffn_down_exps", "ffn_down_shexp"):
        return 4
    i = int(parts[1])
    more = i < n_blocks // 8 or i >= 7 * n_blocks // 8 or (i - n_blocks // 8) % 3 == 2
    return 8 if more else 4


def random_model(cfg: Qwen35Config, layout: str = "uniform"):
    """Random weights in the loaders' conventions: group-32 matrices, 4-bit everywhere (`layout`
    "uniform") or in a llama.cpp Q4_K_M file's mix of 4 and 8 bits ("q4_k_m", `q4_k_m_bits`),
    stacked experts keeping their leading axes, F32 routers as llama.cpp keeps them, plausible
    recurrent parameters."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected one of {LAYOUTS}, found {layout!r}")
    n_blocks = cfg.n_layer + cfg.n_mtp

    def fetch(name, shape, matrix):
        if matrix:
            return random_linear(name, shape, q4_k_m_bits(name, n_blocks) if layout == "q4_k_m" else 4)
        return random_vector(name, shape)

    return build_model(cfg, fetch, lambda n: True)


def peer_model(cfg: Qwen35Config, layout: str = "uniform"):
    """mlx-lm's model at cfg's shape with the same layout of bits as `random_model`'s (None
    without mlx-lm)."""
    n_blocks = cfg.n_layer + cfg.n_mtp
    return mlx_lm_peer.build(cfg, bits_of=(lambda name: q4_k_m_bits(name, n_blocks)) if layout == "q4_k_m" else None)


class NullTokenizer:
    """The loop's tokenizer for token-id benchmarks: no end of text, nothing to detokenize."""


    eos_token_ids: set = set()

    def detokenizer(self):
        class D:
            def add(self, t):
                return ""

            def flush(self):
                return ""
        return D()


# n-max auto's round costs as earlier runs on each model measured them, with the rounds behind each
# (per model object): what the API keeps in the cache folder (`speculative.calibration`), so an
# auto run here starts where the ones before it ended, as a user's second run does
STORED: dict[int, tuple[dict[int, float], dict[int, int]]] = {}


def stored_scheduler(model, scheduler_type=DraftLengthScheduler):
    """n-max auto for a run of `model`, starting from what earlier auto runs on it measured."""
    costs = STORED.get(id(model), ({}, {}))[0]
    return scheduler_type.for_model(model, costs or None)


def store(model, sched) -> None:
    """Keeps what an auto run measured for the next run on `model`, merged as the API's
    `calibration.save` merges it."""
    costs, rounds = STORED.get(id(model), ({}, {}))
    STORED[id(model)] = calibration.merge_costs(costs, rounds, sched.measured_round_steps(), sched.measured_rounds())


def decode_tps(model, prompt, tokens, spec=None, n_max=3, oracle=None, costs=None, scheduler_type=DraftLengthScheduler,
               decoders: list | None = None, stored: bool = True) -> tuple[float, dict]:
    """tok/s and stats of one greedy run; `decoders` (a list) receives the decoder, for its clock
    and scheduler. n-max auto starts from `costs`, else (`stored`) from what earlier auto runs on
    this model measured (`STORED`), else from the prior."""
    sampler = Sampler(SamplerConfig(seed=0))
    sched = None
    if spec is None:
        dec = PlainDecoder(model, sampler)
    else:
        # as the API builds it (compiled steps: drafts up to 4)
        if n_max == "auto":
            sched = scheduler_type.for_model(model, costs) if costs is not None or not stored \
                else stored_scheduler(model, scheduler_type)
        dec = ablation_decoder(model, sampler, DraftParams(n_max), scheduler=sched, oracle_acceptance=oracle)
    if decoders is not None:
        decoders.append(dec)
    last = None
    for last in run(dec, NullTokenizer(), prompt, tokens, ignore_eos=True):
        pass
    if sched is not None and stored:
        store(model, sched)
    s = last.stats
    return s["decode_tokens_per_second"], s


def _ours_tps(model, prompt, tokens, pipeline: bool) -> float:
    dec = PlainDecoder(model, Sampler(SamplerConfig(seed=0)), pipeline=pipeline)
    last = None
    for last in run(dec, NullTokenizer(), prompt, tokens, ignore_eos=True):
        pass
    return last.stats["decode_tokens_per_second"]


def loop_section(model, ref, prompt, tokens: int, repeats: int, log) -> dict:
    """ms/token of ours (pipelined, unpipelined) and mlx-lm's generate_step, interleaved."""
    runs = {"ours pipelined": lambda: _ours_tps(model, prompt, tokens, True),
            "ours unpipelined": lambda: _ours_tps(model, prompt, tokens, False)}
    if ref is not None:
        runs["mlx-lm generate_step"] = lambda: mlx_lm_peer.generate_step_tps(ref, len(prompt), tokens)
    for fn in runs.values():  # warm-up: first use of every shape
        fn()
    tps: dict = {k: [] for k in runs}
    for rep in range(repeats):
        for name, fn in runs.items():
            tps[name].append(fn())
        log({"loop_repeat": rep + 1, **{k: round(v[-1], 2) for k, v in tps.items()}})
    med = {k: statistics.median(v) for k, v in tps.items()}
    out = {"tok_s": med, "ms_per_token": {k: 1e3 / v for k, v in med.items()}, "all": tps}
    if "mlx-lm generate_step" in med:
        out["ours_over_mlx_lm_time"] = med["mlx-lm generate_step"] / med["ours pipelined"]
    log({"loop": out["ms_per_token"]})
    return out


def round_ms(rounds: list[tuple[int, float, bool]]) -> dict[str, float]:
    """Median milliseconds of a run's warm rounds per draft length (a `RoundClock`'s rounds); a
    round beside a change of k (the round before or after is of another k: a pipelined round's
    interval holds a neighbour's work, and a change re-shapes the drafter) under "k*", apart, so
    that auto's steady rounds compare with a fixed run's."""
    by_k: dict[str, list[float]] = {}
    ks = [k for k, _, _ in rounds]
    for i in range(1, len(rounds)):  # the first round's interval starts at the prefill's end
        k, seconds, first = rounds[i]
        if not first:
            beside = ks[i - 1] != k or (i + 1 < len(ks) and ks[i + 1] != k)
            by_k.setdefault(f"{k}*" if beside else str(k), []).append(seconds * 1e3)
    return {k: round(statistics.median(v), 3) for k, v in sorted(by_k.items())}


def auto_section(model, prompt, tokens: int, repeats: int, accs, ks, log, shape: str) -> dict:
    """Speedup over plain at each oracle acceptance for each fixed n-max and auto. Auto's timed
    runs start from the round costs its warm-up runs measured (`STORED`): a user's second run on
    this model and device, which finds them in the cache folder."""
    configs = list(ks) + ["auto"]
    t = time.perf_counter()
    decode_tps(model, prompt, 16)
    for k in configs:  # warm-up: the shapes of every configuration (auto: its first decisions)
        decode_tps(model, prompt, 24, "draft-mtp", k, 0.8)
    # auto at each acceptance, full length: where it falls back to plain steps and drafts again, the
    # head catches up over a block width no fixed n-max runs (a trace, 0.1-0.3 s on a GPU at 9B)
    for a in accs:
        decode_tps(model, prompt, tokens, "draft-mtp", "auto", a)
    log({"shape": shape, "auto_warmup_s": round(time.perf_counter() - t, 1)})
    rows: dict = {}
    for rep in range(repeats):
        for a in accs:
            plain = decode_tps(model, prompt, tokens)[0]
            for k in configs:
                decs: list = []
                tps, st = decode_tps(model, prompt, tokens, "draft-mtp", k, a, decoders=decs)
                r = rows.setdefault((a, k), {"a": a, "n_max": k, "speedup": [], "tok_s": [], "round_ms": []})
                r["speedup"].append(tps / plain)
                r["tok_s"].append(tps)
                # what a round of each length cost in this run (warm rounds): auto's rounds against a
                # fixed length's rounds of the same k say whether auto loses by its choices or per round
                r["round_ms"].append(round_ms(decs[0].clock.rounds))
                if k == "auto":
                    r["draft_lengths"] = st.get("draft_length_histogram")
                    r["auto_message"] = st.get("auto_message")
                    r["compile_seconds"] = st.get("compile_seconds")
                    r["plain_rounds"] = st.get("auto_plain_rounds")  # why its plain rounds were plain
                log({"shape": shape, "rep": rep + 1, "a": a, "n_max": k, "speedup": round(tps / plain, 3),
                     **({"draft_lengths": st.get("draft_length_histogram"), "plain_rounds": st.get("auto_plain_rounds"),
                         "no_gain_rate": st.get("auto_no_gain_rate")} if k == "auto" else {})})
    table = []
    for a in accs:
        row = {"a": a}
        for k in configs:
            row[str(k)] = statistics.median(rows[(a, k)]["speedup"])
        best = max(row[str(k)] for k in ks)
        row["auto_vs_plain"] = row["auto"]
        row["auto_vs_best_fixed"] = row["auto"] / max(best, 1.0)  # plain (1.0) is a fixed choice too
        row["auto_vs_best_held_out"] = held_out_ratio({k: rows[(a, k)]["speedup"] for k in configs})
        row["auto_draft_lengths"] = rows[(a, "auto")].get("draft_lengths")
        table.append(row)
    return {"shape": shape, "rows": table, "raw": [dict(v, key=str(k)) for k, v in rows.items()]}


def held_out_ratio(speedups: dict) -> float | None:
    """auto against the best fixed n-max chosen without the repeat it is scored on: for each repeat,
    the length (plain included, at 1.0) with the best mean speedup over the other repeats, and
    auto's speedup in that repeat over that length's; the mean over repeats (None with one repeat).
    The best of several settings, each measured with noise, is biased upwards (repeats of one
    setting spread by up to 20% on a GPU): this is not."""
    fixed = {k: v for k, v in speedups.items() if k != "auto"}
    n = len(speedups["auto"])
    if n < 2:
        return None
    ratios = []
    for r in range(n):
        mean = {k: statistics.mean(v[:r] + v[r + 1:]) for k, v in fixed.items()}
        k = max(mean, key=mean.get)
        ratios.append(speedups["auto"][r] / (fixed[k][r] if mean[k] > 1.0 else 1.0))
    return statistics.mean(ratios)


def markdown(result: dict) -> str:
    lines = []
    if "loop" in result:
        ms = result["loop"]["ms_per_token"]
        lines += ["| loop | ms/token |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in ms.items()] + [""]
    for sec in result.get("auto", []):
        ks = [k for k in sec["rows"][0] if k not in ("a", "auto", "auto_vs_plain", "auto_vs_best_fixed",
                                                        "auto_vs_best_held_out", "auto_draft_lengths")]
        lines += [f"{sec['shape']}: speedup over plain at oracle acceptance a", "",
                  "| a | " + " | ".join(f"n-max {k}" for k in ks) + " | auto | auto / best fixed (incl. plain) "
                  "| auto / best held out |", "|---|" + "---|" * (len(ks) + 3)]
        for r in sec["rows"]:
            held = r.get("auto_vs_best_held_out")
            lines.append(f"| {r['a']} | " + " | ".join(f"{r[k]:.2f}x" for k in ks)
                         + f" | {r['auto']:.2f}x | {r['auto_vs_best_fixed']:.2f} | "
                         + (f"{held:.2f} |" if held is not None else "- |"))
        lines.append("")
        timed = [r for r in sec.get("raw", []) if r.get("round_ms")]
        if timed:  # what a round of each length cost under each setting (medians over the repeats)
            lines.append("round ms by draft length (warm rounds, medians of the repeats):")
            for r in timed:
                per_k: dict[str, list[float]] = {}
                for times in r["round_ms"]:
                    for k, ms in times.items():
                        per_k.setdefault(k, []).append(ms)
                cells = ", ".join(f"k={k}: {statistics.median(v):.2f}" for k, v in sorted(per_k.items()))
                lines.append(f"- a = {r['a']}, n-max {r['n_max']}: {cells}")
            lines.append("")
    return "\n".join(lines)


def main() -> int:
    """The loop section on a GGUF model (e.g. the shipped one, on the CPU): ours pipelined and
    unpipelined vs mlx-lm's generate_step on a model of the same shape, 4-bit g32."""
    import argparse
    import json

    from mtp_engine import load

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/qwen35-mtp-code-Q4_K_M.gguf")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    m = load(a.model)
    ref = peer_model(m.model.cfg)
    prompt = m.tokenizer.encode("def parse_args(argv):\n    parser = argparse.ArgumentParser(")
    out = loop_section(m.model, ref, prompt, a.tokens, a.repeats,
                       lambda o: print(json.dumps(o), file=sys.stderr, flush=True))
    print(markdown({"loop": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
