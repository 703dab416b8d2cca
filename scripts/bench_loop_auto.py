"""GPU sections of `scripts/bench_gpu.py` for the decode loop and n-max auto:

  loop  plain decode tok/s of our pipelined loop, our unpipelined loop, and mlx-lm's own
        `generate_step` (its pipelined path) on the same shape and weight format, one process,
        repeats interleaved
  auto  draft-mtp at oracle acceptance a (each draft right with probability a, the drafter doing
        all its work): fixed n-max rows and n-max auto, as speedups over plain decoding measured
        in the same repeat; auto starts from the GPU prior (no stored costs: a first run)

Both print progress as JSON lines on stderr and return plain dicts (written by bench_gpu.py).
"""
from __future__ import annotations

import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import mlx_lm_ref  # noqa: E402
from bench_9b_oracle import _Tok, decode_tps  # noqa: E402

from mtp_engine.generation.decode import PlainDecoder  # noqa: E402
from mtp_engine.generation.loop import run  # noqa: E402
from mtp_engine.generation.sampling import Sampler, SamplerConfig  # noqa: E402


def _ours_tps(model, prompt, tokens, pipeline: bool) -> float:
    dec = PlainDecoder(model, Sampler(SamplerConfig(seed=0)))
    dec.pipeline = pipeline
    last = None
    for last in run(dec, _Tok(), prompt, tokens, ignore_eos=True):
        pass
    return last.stats["decode_tokens_per_second"]


def loop_section(model, ref, prompt, tokens: int, repeats: int, log) -> dict:
    """ms/token of ours (pipelined, unpipelined) and mlx-lm's generate_step, interleaved."""
    runs = {"ours pipelined": lambda: _ours_tps(model, prompt, tokens, True),
            "ours unpipelined": lambda: _ours_tps(model, prompt, tokens, False)}
    if ref is not None:
        runs["mlx-lm generate_step"] = lambda: mlx_lm_ref.generate_step_tps(ref, len(prompt), tokens)
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


def auto_section(model, prompt, tokens: int, repeats: int, accs, ks, log, shape: str) -> dict:
    """Speedup over plain at each oracle acceptance for each fixed n-max and auto."""
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
                tps, st = decode_tps(model, prompt, tokens, "draft-mtp", k, a)
                r = rows.setdefault((a, k), {"a": a, "n_max": k, "speedup": [], "tok_s": []})
                r["speedup"].append(tps / plain)
                r["tok_s"].append(tps)
                if k == "auto":
                    r["draft_lengths"] = st.get("draft_length_histogram")
                    r["auto_message"] = st.get("auto_message")
                    r["compile_seconds"] = st.get("compile_seconds")
                log({"shape": shape, "rep": rep + 1, "a": a, "n_max": k, "speedup": round(tps / plain, 3),
                     **({"draft_lengths": st.get("draft_length_histogram")} if k == "auto" else {})})
    table = []
    for a in accs:
        row = {"a": a}
        for k in configs:
            row[str(k)] = statistics.median(rows[(a, k)]["speedup"])
        best = max(row[str(k)] for k in ks)
        row["auto_vs_plain"] = row["auto"]
        row["auto_vs_best_fixed"] = row["auto"] / max(best, 1.0)  # plain (1.0) is a fixed choice too
        row["auto_draft_lengths"] = rows[(a, "auto")].get("draft_lengths")
        table.append(row)
    return {"shape": shape, "rows": table, "raw": [dict(v, key=str(k)) for k, v in rows.items()]}


def markdown(result: dict) -> str:
    lines = []
    if "loop" in result:
        ms = result["loop"]["ms_per_token"]
        lines += ["| loop | ms/token |", "|---|---|"] + [f"| {k} | {v:.2f} |" for k, v in ms.items()] + [""]
    for sec in result.get("auto", []):
        ks = [k for k in sec["rows"][0] if k not in ("a", "auto", "auto_vs_plain", "auto_vs_best_fixed",
                                                        "auto_draft_lengths")]
        lines += [f"{sec['shape']}: speedup over plain at oracle acceptance a", "",
                  "| a | " + " | ".join(f"n-max {k}" for k in ks) + " | auto | auto / best fixed (incl. plain) |",
                  "|---|" + "---|" * (len(ks) + 2)]
        for r in sec["rows"]:
            lines.append(f"| {r['a']} | " + " | ".join(f"{r[k]:.2f}x" for k in ks)
                         + f" | {r['auto']:.2f}x | {r['auto_vs_best_fixed']:.2f} |")
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
    ref = mlx_lm_ref.build(m.model.cfg)
    prompt = m.tokenizer.encode("def parse_args(argv):\n    parser = argparse.ArgumentParser(")
    out = loop_section(m.model, ref, prompt, a.tokens, a.repeats,
                       lambda o: print(json.dumps(o), file=sys.stderr, flush=True))
    print(markdown({"loop": out}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
