"""Accuracy and load memory of quantize-on-load against the float checkpoint, on the tiny HF fixture
and on the shipped trained model (its GGUF's dequantized weights written as an HF bf16 folder by
`mtp_engine.convert.to_hf`, the converter's inverse).

For each format: teacher-forced trunk logits along the float model's own greedy continuation of
the prompts (a few hundred positions in all): mean and max KL(float || quantized) in nats and top-1
agreement; the same for the MTP head (input token t and the model's own hidden state at t-1);
greedy draft-mtp (n-max 3) token-identical to plain decoding; weights held; the load's MLX peak
above the finished model; and, in a fresh process, the load's max RSS growth.

`--gguf-modes`: instead, the GGUF loader's default and exact modes against llama.cpp's
exact-dequantized references (max logit error per file), and the shipped Q4_K_M model's load memory.

Usage: python scripts/bench/quant_accuracy.py [--fixtures DIR] [--out docs/bench/hf-quant] [--gguf-modes]
(CPU is fine: the models are small.)
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from mtp_engine import api
from mtp_engine.convert import convert
from mtp_engine.convert.to_hf import gguf_to_hf

ROOT = Path(__file__).resolve().parents[2]

ON_LOAD = ["4g32", "4g64", "4g128", "8g32", "8g64", "8g128", "4g64,output=8g64,mtp=8g64"]
SOURCE_SCALES = ["4g64", "8g64"]  # converted with bf16 scales, as mlx_lm.convert does
MEASURE_LOAD = """
import json, sys
import mlx.core as mx
from mtp_engine.model.hf import load_checkpoint


def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


mx.eval(mx.zeros(1))  # the allocator's own start-up is not the load's
before = rss("VmRSS")
m, ck, info = load_checkpoint(sys.argv[1], quantize=None if sys.argv[2] == "none" else sys.argv[2])
print(json.dumps({"rss_growth": rss("VmHWM") - before, "weights": info.weight_bytes,
                  "largest": info.largest_tensor_bytes, "mlx_peak": info.peak_memory_bytes}))
"""


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _outputs(model, seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Trunk and teacher-forced MTP logits of every position of every sequence, stacked."""
    trunk, mtp = [], []
    for s in seqs:
        t = mx.array([s])
        h = model.forward(t, model.make_cache())
        trunk.append(np.array(model.logits(h)[0]))
        h_prev = mx.concatenate([mx.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
        hm = model.mtp(model.embed_tokens(t), h_prev, model.mtp.make_cache())
        mtp.append(np.array(model.logits(hm)[0]))
    return np.concatenate(trunk), np.concatenate(mtp)


def _compare(ref: np.ndarray, got: np.ndarray) -> dict:
    lp, lq = _log_softmax(ref), _log_softmax(got)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1": float((ref.argmax(-1) == got.argmax(-1)).mean())}


def _spec_check(m, prompt_ids: list[int], n: int = 64) -> dict:
    plain = api.generate(prompt_ids, m, max_tokens=n, spec="none", ignore_eos=True)
    spec = api.generate(prompt_ids, m, max_tokens=n, spec="draft-mtp", n_max=3, ignore_eos=True)
    return {"draft_mtp_identical": spec.token_ids == plain.token_ids, "acceptance": spec.stats["acceptance_rate"]}


def _measure_load(folder: Path, spec: str) -> dict:
    out = subprocess.run([sys.executable, "-c", MEASURE_LOAD, str(folder), spec], capture_output=True, text=True,
                         check=True, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def evaluate(name: str, folder: Path, prompts: list[list[int]], cont: int, work: Path) -> list[dict]:
    ref = api.load(folder)
    seqs = [p + api.generate(p, ref, max_tokens=cont, ignore_eos=True).token_ids for p in prompts]
    n_pos = sum(len(s) for s in seqs)
    ref_trunk, ref_mtp = _outputs(ref.model, seqs)
    rows = []
    formats = [("float (bf16 weights)", None, folder)] + [(f, f, folder) for f in ON_LOAD]
    for f in SOURCE_SCALES:
        out = work / f"{name}-{f}-source"
        convert(folder, out, f, scales="source", overwrite=True)
        formats.append((f"{f} bf16 scales (converted)", None, out))
    for label, spec, path in formats:
        m = ref if spec is None and path == folder else api.load(path, quantize=spec)
        trunk, mtp = _outputs(m.model, seqs)
        row = {"model": name, "format": label, "positions": n_pos, "weights_mib": m.info.weight_bytes / 2**20,
               "trunk": _compare(ref_trunk, trunk), "mtp": _compare(ref_mtp, mtp), **_spec_check(m, prompts[0]),
               "load_peak_over_model_mib": m.info.peak_memory_bytes / 2**20 - m.info.weight_bytes / 2**20,
               "largest_tensor_mib": m.info.largest_tensor_bytes / 2**20}
        rows.append(row)
        print(f"{name:8s} {label:34s} KL {row['trunk']['kl_mean']:.5f} top1 {row['trunk']['top1']:.3f} "
              f"mtp top1 {row['mtp']['top1']:.3f} identical {row['draft_mtp_identical']}", file=sys.stderr)
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | format | weights MiB | trunk KL mean / max (nats) | trunk top-1 | MTP KL mean | MTP top-1 | "
             "draft-mtp = plain | acceptance |", "|---|---|---:|---|---:|---:|---:|---|---:|"]
    for r in rows:
        t, m = r["trunk"], r["mtp"]
        lines.append(f"| {r['model']} | {r['format']} | {r['weights_mib']:.2f} | {t['kl_mean']:.4f} / {t['kl_max']:.3f} | "
                     f"{t['top1']:.1%} | {m['kl_mean']:.4f} | {m['top1']:.1%} | "
                     f"{'yes' if r['draft_mtp_identical'] else 'NO'} | {r['acceptance']:.1%} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
    for ax, name in zip(axes[0], models):
        sub = [r for r in rows if r["model"] == name and not r["format"].startswith("float")]
        y = np.arange(len(sub))
        ax.barh(y + 0.2, [r["trunk"]["kl_mean"] for r in sub], height=0.4, color="tab:blue", label="trunk")
        ax.barh(y - 0.2, [r["mtp"]["kl_mean"] for r in sub], height=0.4, color="tab:orange", label="MTP head")
        ax.set_yticks(y, [r["format"] for r in sub])
        ax.set_xscale("log")
        ax.set_xlabel("mean KL(float || quantized), nats")
        ax.set_title(f"{name}: {sub[0]['positions']} positions")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)



MEASURE_GGUF_LOAD = """
import resource, sys, os, mlx.core as mx
from mtp_engine import load
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
m = load(sys.argv[1])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before * 1024, after * 1024, m.info.weight_bytes, m.info.file_bytes, mx.get_peak_memory())
"""


def gguf_modes(fix: Path) -> None:
    """Per-file logit error of the GGUF default and exact load modes against llama.cpp's
    exact-dequantized references, and peak memory of loading the shipped Q4_K_M model against its
    file size."""
    from mtp_engine import load

    print("| file | Q6_K tensors | default mode max abs logit error | exact mode |")
    print("|---|---|---|---|")
    for name in ["f16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K"]:
        ref = np.load(fix / "llamacpp" / f"qwen35-mtp-tiny-{name}.dequant.logits.npz")
        errs = []
        for exact in (False, True):
            m = load(fix / "llamacpp" / f"qwen35-mtp-tiny-{name}.gguf", exact=exact)
            e = 0.0
            for k in range(4):
                t = ref[f"tokens_p{k}"]
                h = m.model.forward(mx.array(t[None]), m.model.make_cache())
                e = max(e, float(np.abs(np.array(m.model.logits(h)[0]) - ref[f"logits_p{k}"]).max()))
            errs.append(e)
        print(f"| {name} | {m.info.tensor_types.get('Q6_K', 0)} | {errs[0]:.3g} | {errs[1]:.3g} |")
    path = ROOT / "models" / "qwen35-mtp-code-Q4_K_M.gguf"
    out = subprocess.run([sys.executable, "-c", MEASURE_GGUF_LOAD, str(path)], capture_output=True, text=True, check=True)
    before, after, wbytes, fbytes, peak = (int(x) for x in out.stdout.split())
    print(f"\nQ4_K_M load: file {fbytes / 2**20:.1f} MiB, weights held {wbytes / 2**20:.1f} MiB, "
          f"process max RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB "
          f"(+{(after - before) / 2**20:.1f} MiB), MLX peak {peak / 2**20:.1f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default=os.environ.get("MTP_FIXTURES", str(ROOT.parent / "shared" / "fixtures")))
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "hf-quant"))
    ap.add_argument("--loads-only", action="store_true", help="only the load-memory table")
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from OUT/hf-quant.json")
    ap.add_argument("--gguf-modes", action="store_true", help="the GGUF load modes' logit error and load memory")
    args = ap.parse_args()
    fx, out = Path(args.fixtures), Path(args.out)
    if args.gguf_modes:
        gguf_modes(fx)
        return
    if args.plot_only:
        plot(json.loads((out / "hf-quant.json").read_text())["rows"], out / "hf-quant.png")
        return
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="hf-quant-"))
    tiny = fx / "llamacpp" / "hf" / "qwen35-mtp-tiny"
    ref_json = json.loads((fx / "llamacpp" / "qwen35-mtp-tiny-f32.gguf.ref.json").read_text())
    tiny_prompts = [p["prompt_ids"] for p in ref_json["prompts"]]
    trained = work / "trained-hf"
    gguf_to_hf(ROOT / "models" / "qwen35-mtp-code-Q4_K_M.gguf", trained, fx / "trained" / "hf")
    code_prompts = [p["token_ids"] for p in json.loads((fx / "trained" / "prompts.json").read_text())["prompts"]][:4]
    loads = {f"{name} {spec}": _measure_load(folder, spec) for name, folder in (("tiny", tiny), ("trained", trained))
             for spec in ("none", "4g64", "8g64")}
    rows = [] if args.loads_only else \
        evaluate("tiny", tiny, tiny_prompts, 56, work) + evaluate("trained", trained, code_prompts, 64, work)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    md = markdown(rows) if rows else ""
    md += "\n\n| load | weights MiB | largest tensor MiB | MLX peak above the model MiB | max RSS growth MiB |\n" \
          "|---|---:|---:|---:|---:|\n"
    for k, v in loads.items():
        md += (f"| {k} | {v['weights'] / 2**20:.2f} | {v['largest'] / 2**20:.2f} | "
               f"{(v['mlx_peak'] - v['weights']) / 2**20:.2f} | {v['rss_growth'] / 2**20:.1f} |\n")
    md += f"\n({stamp}, {mx.default_device()}, `python scripts/bench/quant_accuracy.py`)\n"
    if rows:
        (out / "hf-quant.md").write_text(md)
        (out / "hf-quant.json").write_text(json.dumps({"rows": rows, "loads": loads, "date": stamp}, indent=1))
        plot(rows, out / "hf-quant.png")
    print(md)


if __name__ == "__main__":
    main()
