"""`mtp-engine bench`: the original report's table as one command.

No speculation, then draft-mtp at each n-max (and p-min), on the same prompts at temperature 0:
per config an unmeasured warm-up pass over the first prompt (every shape the runs use is compiled
there: on a fresh GPU the compiles made a profiled pass 20x slower and its cost model meaningless),
one precise-profiled pass (the stage breakdown), then timed repeats over all prompts (profiler off,
interleaved across configs, medians). The cost model's components come from the profiled
passes themselves (no separate calibration), and its predicted speedup stands beside the measured
one. The stage column is the profiled shares scaled to the timed row's ms per token, so a row and
its stages agree; a profiled pass that ran far from the timed speed is flagged.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import api
from ..errors import MTPEngineError
from ..speculative.costmodel import Costs, expected_tokens, predict_speedup
from ..speculative.scheduler import AUTO_MAX
from .bench_report import write_outputs

DEFAULT_PROMPTS = [
    "def parse_args(argv):\n    parser = argparse.ArgumentParser(",
    "class LRUCache:\n    def __init__(self, capacity):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "def quicksort(items):\n    \"\"\"Sort a list.\"\"\"\n",
    "# Read a CSV file and print the sum of each column\nimport csv\n",
]


@dataclass
class BenchConfig:
    model: str | None = None
    n_max: tuple = (0, 1, 2, 3, 4, 5, 6, "auto")
    p_min: tuple[float, ...] = (0.0,)
    tokens: int = 128
    repeats: int = 3
    prompts: list | None = None
    out: str | None = None
    exact: bool = False
    max_context: int | None = None  # -c/--ctx-size: the API's max_context
    profile_prompts: int = 1  # prompts in each config's profiled (and warm-up) pass
    prompt_tokens: int | None = None  # one synthetic prompt of this many tokens instead of `prompts`


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, stream=sys.stderr):
        self.total, self.done, self.stream, self.t0 = total, 0, stream, time.perf_counter()

    def tick(self, label: str) -> None:
        self.done += 1
        width = 30
        filled = int(width * self.done / self.total)
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done)
        self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                          f"{label:<24} {el:5.0f}s elapsed, ~{eta:4.0f}s left")
        self.stream.flush()
        if self.done == self.total:
            self.stream.write("\n")


def _run_prompts(m, prompts, cfg: BenchConfig, spec: str, n_max: int, p_min: float, profile=None):
    """Generates on every prompt; returns (decode tok/s over all prompts, stats list)."""
    tok, sec, stats = 0, 0.0, []
    for p in prompts:
        r = api.generate(p, m, max_tokens=cfg.tokens, ignore_eos=True, spec=spec, n_max=n_max, p_min=p_min,
                         profile=profile)
        s = r.stats
        from_prefill = 0 if spec == "draft-mtp" else 1
        tok += s["generated_tokens"] - from_prefill
        sec += s["decode_seconds"]
        stats.append(s)
    return (tok / sec if sec else 0.0), stats


def _stage_ms_per_token(stats: list[dict]) -> dict[str, float]:
    """Decode-stage milliseconds per generated token, summed over prompts (prefill excluded)."""
    total: dict[str, float] = {}
    gen = sum(s["generated_tokens"] for s in stats)
    for s in stats:
        for name, v in s["profile"]["stages"].items():
            if name != "prefill":
                total[name] = total.get(name, 0.0) + v["seconds"]
    return {k: v * 1e3 / gen for k, v in total.items()}


def _merge_acceptance(stats: list[dict], k: int) -> list[float | None]:
    """Per-position acceptance over all prompts (weighted by rounds)."""
    out = []
    rounds = sum(s["rounds"] for s in stats)
    for i in range(k):
        vals = [(s["acceptance_per_position"][i], s["rounds"]) for s in stats
                if s["acceptance_per_position"][i] is not None]
        out.append(sum(a * r for a, r in vals) / sum(r for _, r in vals) if vals else None)
    return out if rounds else [None] * k


def synthetic_prompt(tokenizer, n: int) -> list[int]:
    """A prompt of exactly `n` token ids: the default prompts' text repeated (real text, so a
    model's acceptance there is its acceptance on code), cut to n tokens."""
    ids: list[int] = []
    text = "\n".join(DEFAULT_PROMPTS)
    unit = tokenizer.encode(text)
    if not unit:
        raise MTPEngineError("the tokenizer encodes the default prompts to nothing", field="prompt-tokens")
    while len(ids) < n:
        ids += unit
    return ids[:n]


def run_bench(cfg: BenchConfig, load_progress=None) -> dict:
    """Runs the sweep; returns {"rows": [...], "costs": {...}, "device": str} and writes files to cfg.out."""
    import mlx.core as mx

    t_start = time.perf_counter()
    m = api.load(cfg.model, exact=cfg.exact, max_context=cfg.max_context, progress=load_progress)
    prompts = [synthetic_prompt(m.tokenizer, cfg.prompt_tokens)] if cfg.prompt_tokens else cfg.prompts or DEFAULT_PROMPTS
    configs = [("none", 0, 0.0)] + [("draft-mtp", k, p) for k in cfg.n_max for p in cfg.p_min]
    bar = Progress(2 * len(configs) + cfg.repeats * len(prompts))
    for c in configs:  # first use of each shape compiles here, outside every measured pass
        _run_prompts(m, prompts[:1], cfg, *c)
        bar.tick(_label(c) + " warm-up")
    profiled: dict = {}
    for c in configs:
        profiled[c] = _run_prompts(m, prompts[:cfg.profile_prompts], cfg, *c, profile="precise")
        bar.tick(_label(c) + " profiled")
    costs = _costs_from_profiles(profiled)
    speeds, ttft, last_stats = _timed_repeats(m, prompts, configs, cfg, bar)
    base_tps = statistics.median(speeds[configs[0]])
    rows = [_row(c, speeds[c], ttft[c], last_stats[c], profiled[c], costs, base_tps) for c in configs]
    result = {"device": str(mx.default_device()), "model": m.path, "tokens": cfg.tokens, "repeats": cfg.repeats,
              "prompts": len(prompts), "prompt_tokens": cfg.prompt_tokens, "costs": costs.to_json(), "rows": rows,
              "date": time.strftime("%Y-%m-%d"), "load_seconds": m.load_seconds,
              "bench_seconds": time.perf_counter() - t_start}
    if cfg.out:
        write_outputs(result, Path(cfg.out))
    return result


def _timed_repeats(m, prompts: list, configs: list, cfg: BenchConfig, bar: Progress) -> tuple[dict, dict, dict]:
    """Decode tok/s per repeat, times to first token and the last repeat's stats, per config.
    Repeats are interleaved across configs, prompt by prompt, so slow drifts of the device (clocks,
    allocator, other tenants) hit every row alike instead of biasing whichever row ran during them."""
    speeds: dict = {c: [] for c in configs}
    ttft: dict = {c: [] for c in configs}
    last_stats: dict = {}
    for rep in range(cfg.repeats):
        per: dict = {c: (0, 0.0, []) for c in configs}
        for p in prompts:
            for c in configs:
                _, st = _run_prompts(m, [p], cfg, *c)
                tok, sec, sts = per[c]
                gen = st[0]["generated_tokens"] - (0 if c[0] == "draft-mtp" else 1)
                per[c] = (tok + gen, sec + st[0]["decode_seconds"], sts + st)
            bar.tick(f"repeat {rep + 1}/{cfg.repeats}")
        for c in configs:
            tok, sec, last_stats[c] = per[c]
            speeds[c].append(tok / sec if sec else 0.0)
            ttft[c] += [s["time_to_first_token_seconds"] for s in last_stats[c]]
    return speeds, ttft, last_stats


def _row(config: tuple, speeds: list[float], ttft: list[float], stats: list[dict], profiled: tuple,
         costs: Costs, base_tps: float) -> dict:
    """One config's row: its median rate and speedup, the profiled pass's stages, and for
    draft-mtp its acceptance and what the cost model predicted or auto chose."""
    spec, k, p = config
    plain_tps, prof_stats = profiled
    tps = statistics.median(speeds)
    stages = _stage_ms_per_token(prof_stats)
    total = sum(stages.values())
    scale = (1e3 / tps) / total if tps and total else 1.0
    row = {"spec": spec, "n_max": k, "p_min": p, "tok_s": tps, "speedup": tps / base_tps,
           "tok_s_all": speeds, "stage_ms_per_token": stages,
           "stage_ms_per_token_timed": {n: v * scale for n, v in stages.items()},
           "profiled_tok_s": plain_tps, "profile_overhead": tps / plain_tps if plain_tps else None,
           "ttft_s": statistics.median(ttft) if ttft else None,
           "compile_seconds": sum(st.get("compile_seconds", 0.0) for st in prof_stats)}
    moe = [st["moe_distinct_experts_per_layer"] for st in prof_stats if "moe_distinct_experts_per_layer" in st]
    for kind in ("step", "verify"):
        vals = [d[kind] for d in moe if kind in d]
        if vals:  # MoE: distinct experts each layer reads per forward (a verify reads more)
            row[f"moe_experts_per_{kind}"] = sum(vals) / len(vals)
    if spec == "draft-mtp":
        _draft_fields(row, k, stats, prof_stats, costs, base_tps)
    return row


def _draft_fields(row: dict, k, stats: list[dict], prof_stats: list[dict], costs: Costs, base_tps: float) -> None:
    drafted = sum(s["drafted"] for s in stats)
    accepted = sum(s["accepted"] for s in stats)
    rounds = sum(s["rounds"] for s in stats)
    acc_pos = _merge_acceptance(stats, AUTO_MAX if k == "auto" else k)
    row.update(drafted=drafted, acceptance=accepted / drafted if drafted else None,
               mean_accepted_length=accepted / rounds if rounds else 0.0,
               acceptance_per_position=acc_pos)
    # f from the profiled run: per-round time outside draft/verify/catch-up, in steps
    per_round = {n: sum(s["profile"]["stages"].get(n, {}).get("seconds", 0.0) for s in prof_stats)
                 for n in ("sample", "sync", "accept", "rollback", "emit", "other")}
    prof_rounds = sum(s["rounds"] for s in prof_stats)
    f_ms = sum(per_round.values()) * 1e3 / max(prof_rounds, 1)
    c = Costs(costs.step_ms, costs.verify, costs.draft, f_ms / costs.step_ms if costs.step_ms else 0.0)
    # the model's unit is its own measured step; rescale to the plain run's per-token time so
    # prediction and measurement share one baseline
    unit = (1e3 / base_tps) / costs.step_ms if base_tps and costs.step_ms else 1.0
    if k == "auto":  # k varies per round: report what it chose instead of one prediction
        hist: dict = {}
        for st in stats:
            for kk, v in st.get("draft_length_histogram", {}).items():
                hist[kk] = hist.get(kk, 0) + v
        row["draft_length_histogram"] = hist
        row["explanation"] = "auto chose k per round: " + ", ".join(f"k={kk}: {v}" for kk, v in sorted(hist.items()))
        row["explanation"] += _plain_reasons(stats)
        msgs = {st.get("auto_message") for st in stats} - {None}
        if msgs:
            row["auto_message"] = sorted(msgs)[0]
            row["explanation"] += "; " + row["auto_message"]
    else:
        row["predicted_speedup"] = predict_speedup(c, acc_pos, k) * unit if k and k + 1 in c.verify else 1.0
        row["expected_tokens_per_round"] = expected_tokens(acc_pos, k)
        row["explanation"] = _explain(row, c, prof_stats, k)


def _label(c) -> str:
    spec, k, p = c
    return "plain" if spec == "none" else f"n-max {k} p-min {p:g}"


def _plain_reasons(stats: list[dict]) -> str:
    """Why auto's plain rounds were plain, over the runs: measuring a plain step's time, or no
    draft length expected to pay (with what it believed then)."""
    measuring = sum(st.get("auto_plain_rounds", {}).get("measuring", 0) for st in stats)
    no_gain = [(st["auto_plain_rounds"]["no_gain"], st.get("auto_no_gain_rate", 0.0), st.get("auto_no_gain_acceptance", 0.0))
               for st in stats if st.get("auto_plain_rounds", {}).get("no_gain")]
    n = sum(c for c, _, _ in no_gain)
    if not (measuring or n):
        return ""
    out = f"; plain rounds: {measuring} measuring a plain step"
    if n:
        rate = sum(c * r for c, r, _ in no_gain) / n
        acc = sum(c * a for c, _, a in no_gain) / n
        out += f", {n} where drafting was expected at {rate:.2f}x of plain (draft 1 accepted ~{acc:.2f})"
    return out


def _costs_from_profiles(profiled: dict) -> Costs:
    """The cost model's components from the profiled passes (no separate calibration): the plain
    step's ms, V(k+1) = a fixed-k run's verify ms per round over it, c = draft ms per draft step."""
    def stage(stats, name):
        sec = sum(s["profile"]["stages"].get(name, {}).get("seconds", 0.0) for s in stats)
        cnt = sum(s["profile"]["stages"].get(name, {}).get("count", 0) for s in stats)
        return sec, cnt

    plain = profiled.get(("none", 0, 0.0), (0, []))[1]
    dec, n = stage(plain, "decode")
    syn, _ = stage(plain, "sync")
    step_ms = (dec + syn) * 1e3 / n if n else 0.0
    costs = Costs(step_ms=step_ms)
    drafts = []
    for (spec, k, _), (_, stats) in sorted(profiled.items(), key=lambda kv: str(kv[0][1])):
        if spec != "draft-mtp" or k == "auto" or not k or not step_ms:
            continue
        v, rounds = stage(stats, "verify")
        d, steps = stage(stats, "draft")
        if rounds:
            costs.verify.setdefault(k + 1, v * 1e3 / rounds / step_ms)
        if steps:
            drafts.append(d * 1e3 / steps / step_ms)
    costs.draft = statistics.median(drafts) if drafts else 0.0
    return costs


def _explain(row: dict, c: Costs, prof_stats: list[dict], k: int) -> str:
    """Where the measured round differs most from the model's components (in decode steps)."""
    if not k or not c.step_ms:
        return "no drafting: a plain step through the speculative path"
    rounds = max(sum(s["rounds"] for s in prof_stats), 1)

    def per_round(name: str) -> float:
        return sum(s["profile"]["stages"].get(name, {}).get("seconds", 0.0) for s in prof_stats) * 1e3 / rounds / c.step_ms

    if k + 1 not in c.verify:
        return "no verify cost measured for this k"
    parts = {"verify": (per_round("verify"), c.verify[k + 1]),
             "draft": (per_round("draft") + per_round("catch_up"), k * c.draft)}
    name, (meas, model) = max(parts.items(), key=lambda kv: abs(kv[1][0] - kv[1][1]))
    gap = row["speedup"] - row["predicted_speedup"]
    return (f"measured/predicted {row['speedup']:.2f}/{row['predicted_speedup']:.2f} ({gap:+.2f}); largest gap: "
            f"{name} costs {meas:.2f} steps per round in the run vs {model:.2f} in the model"
            + (" (includes fused catch-up rows)" if name == "draft" else ""))
