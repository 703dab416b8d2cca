"""`mtp-engine bench`'s files: bench.json (rows), bench.csv, bench.md (the table, each speedup
inside plain's own spread said so) and bench.png (tok/s per config, where the time goes)."""
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

from ..output_files import atomic_open, write_text

ROUND_STAGES = ("draft", "verify", "sample", "sync", "accept", "rollback", "catch_up", "other", "emit")


def write_outputs(result: dict, out: Path) -> None:
    """bench.json (rows), bench.csv, bench.md and bench.png in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    write_text(out / "bench.json", json.dumps(rows, indent=1))
    cols = ["spec", "n_max", "p_min", "tok_s", "speedup", "predicted_speedup", "acceptance", "mean_accepted_length",
            "profile_overhead", "ttft_s", "compile_seconds"]
    with atomic_open(out / "bench.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols + [f"ms_per_token_{s}" for s in ROUND_STAGES + ("decode",)])
        for r in rows:
            st = r["stage_ms_per_token"]
            w.writerow([r.get(c) for c in cols] + [round(st.get(s, 0.0), 4) for s in ROUND_STAGES + ("decode",)])
    write_text(out / "bench.md", format_markdown(result))
    try:
        plot(result, out / "bench.png")
    except ImportError:
        print("matplotlib not installed: bench.png skipped (pip install matplotlib)", file=sys.stderr)


def format_markdown(result: dict) -> str:
    c = result["costs"]
    lines = [f"# mtp-engine bench ({result['date']})", "",
             f"model `{Path(result['model']).name}`, device {result['device']}, "
             + (f"a {result['prompt_tokens']}-token prompt x " if result.get("prompt_tokens")
                else f"{result['prompts']} prompts x ") +
             f"{result['tokens']} tokens, temperature 0, median of {result['repeats']}; model load "
             f"{result.get('load_seconds', 0.0):.2f} s, whole bench {result.get('bench_seconds', 0.0):.0f} s", "",
             f"cost model (from the profiled passes): decode step {c['step_ms']:.2f} ms; V(S) = "
             + ", ".join(f"{s}: {v:.2f}" for s, v in c["verify"].items()) + f"; draft step c = {c['draft']:.2f}", "",
             "| config | tok/s | speedup | predicted | acceptance | accepted/round | TTFT ms | compile s "
             "| stage ms/token (profiled shares of the timed ms/token) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        name = "plain" if r["spec"] == "none" else f"draft-mtp n-max {r['n_max']} p-min {r['p_min']:g}"
        stages = r.get("stage_ms_per_token_timed") or r["stage_ms_per_token"]
        st = ", ".join(f"{k} {v:.2f}" for k, v in sorted(stages.items(), key=lambda kv: -kv[1]) if v >= 0.005)
        if _noisy(r):
            st += f" (noisy: the profiled pass ran at {r['profiled_tok_s']:.1f} tok/s)"
        acc = f"{r['acceptance']:.1%}" if r.get("acceptance") is not None else "-"
        mal = f"{r['mean_accepted_length']:.2f}" if "mean_accepted_length" in r else "-"
        pred = f"{r['predicted_speedup']:.2f}x" if "predicted_speedup" in r else "-"
        if "moe_experts_per_verify" in r or "moe_experts_per_step" in r:
            st += "; MoE experts/layer: " + ", ".join(f"{k} {r[f'moe_experts_per_{k}']:.1f}" for k in ("step", "verify")
                                                      if f"moe_experts_per_{k}" in r)
        ttft = f"{r['ttft_s'] * 1e3:.0f}" if r.get("ttft_s") is not None else "-"
        comp = f"{r.get('compile_seconds', 0.0):.2f}"
        speed = f"{r['speedup']:.2f}x" + _within_noise(r, result["rows"][0])
        lines.append(f"| {name} | {r['tok_s']:.1f} | {speed} | {pred} | {acc} | {mal} | {ttft} | {comp} | {st} |")
    notes = [f"- n-max {r['n_max']} p-min {r['p_min']:g}: {r['explanation']}" for r in result["rows"]
             if r.get("explanation")]
    if notes:
        lines += ["", "Prediction vs measurement:"] + notes
    return "\n".join(lines) + "\n"


def _within_noise(row: dict, plain: dict) -> str:
    """What the speedup cell adds when its ratio says nothing: a draft-mtp run that drafted in no
    round decoded plainly, and a ratio inside plain's own spread over the repeats is noise."""
    if row is plain or row["spec"] == "none":
        return ""
    runs = [t for t in plain.get("tok_s_all", []) if t]
    spread = (max(runs) / min(runs) - 1.0) if len(runs) > 1 else 0.0
    if row.get("drafted") == 0:
        return f" (no round drafted: plain decoding, repeats spread {spread:.0%})"
    if spread and abs(row["speedup"] - 1.0) <= spread:
        return f" (within plain's spread of {spread:.0%})"
    return ""


def _noisy(row: dict) -> bool:
    """Whether a row's profiled pass ran far from its timed speed (its stage shares are then a
    poor guide): the table says so beside the stages, the plot beside the bar."""
    return bool(row.get("profile_overhead")) and not 0.8 <= row["profile_overhead"] <= 1.25


def bar_labels(rows: list[dict]) -> list[str]:
    """The plot's bar names: plain or n-max/p-min, with the table's noisy mark."""
    return [("plain" if r["spec"] == "none" else f"{r['n_max']}/{r['p_min']:g}") + (" (noisy)" if _noisy(r) else "")
            for r in rows]


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    base = rows[0]["tok_s"]
    spec_rows = [r for r in rows if r["spec"] != "none" and r["n_max"] != "auto"]
    for r in rows:
        if r["n_max"] == "auto":
            a1.axhline(r["tok_s"], color="g", ls="-.", label="draft-mtp n-max auto")
    for p in sorted({r["p_min"] for r in spec_rows}):
        rs = [r for r in spec_rows if r["p_min"] == p]
        a1.plot([r["n_max"] for r in rs], [r["tok_s"] for r in rs], "o-", label=f"draft-mtp p-min {p:g}")
        a1.plot([r["n_max"] for r in rs], [base * r.get("predicted_speedup", 1.0) for r in rs], "x:",
                label=f"predicted p-min {p:g}")
    a1.axhline(base, color="k", ls="--", label="plain decoding")
    a1.set_xlabel("n-max")
    a1.set_ylabel("decode tok/s")
    a1.set_title("throughput")
    a1.legend(fontsize=8)
    labels = bar_labels(rows)
    bottom = [0.0] * len(rows)
    for stage in ("decode",) + ROUND_STAGES:
        vals = [r["stage_ms_per_token"].get(stage, 0.0) for r in rows]
        if any(vals):
            a2.bar(labels, vals, bottom=bottom, label=stage)
            bottom = [b + v for b, v in zip(bottom, vals)]
    a2.set_ylabel("ms per generated token")
    a2.set_xlabel("n-max / p-min")
    a2.set_title("where the time goes (precise profile)")
    a2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
