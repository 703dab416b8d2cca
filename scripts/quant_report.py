"""Per-file logit error of the default and exact load modes against llama.cpp's exact-dequantized
references, and peak memory of loading the shipped Q4_K_M model against its file size.

Usage: python scripts/quant_report.py [FIXTURES_DIR]
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

FIX = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "shared" / "fixtures"
MEASURE_LOAD = """
import resource, sys, os, mlx.core as mx
from mtp_engine import load
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
m = load(sys.argv[1])
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(before * 1024, after * 1024, m.info.weight_bytes, m.info.file_bytes, mx.get_peak_memory())
"""


def main() -> None:
    from mtp_engine import load

    print("| file | Q6_K tensors | default mode max abs logit error | exact mode |")
    print("|---|---|---|---|")
    for name in ["f16", "Q8_0", "Q4_0", "Q4_K_M", "Q5_K_M", "Q6_K"]:
        ref = np.load(FIX / "llamacpp" / f"qwen35-mtp-tiny-{name}.dequant.logits.npz")
        errs = []
        for exact in (False, True):
            m = load(FIX / "llamacpp" / f"qwen35-mtp-tiny-{name}.gguf", exact=exact)
            e = 0.0
            for k in range(4):
                t = ref[f"tokens_p{k}"]
                h = m.model.forward(mx.array(t[None]), m.model.make_cache())
                e = max(e, float(np.abs(np.array(m.model.logits(h)[0]) - ref[f"logits_p{k}"]).max()))
            errs.append(e)
        print(f"| {name} | {m.info.tensor_types.get('Q6_K', 0)} | {errs[0]:.3g} | {errs[1]:.3g} |")
    path = Path(__file__).resolve().parents[1] / "models" / "qwen35-mtp-code-Q4_K_M.gguf"
    out = subprocess.run([sys.executable, "-c", MEASURE_LOAD, str(path)], capture_output=True, text=True, check=True)
    before, after, wbytes, fbytes, peak = (int(x) for x in out.stdout.split())
    print(f"\nQ4_K_M load: file {fbytes / 2**20:.1f} MiB, weights held {wbytes / 2**20:.1f} MiB, "
          f"process max RSS {before / 2**20:.1f} -> {after / 2**20:.1f} MiB "
          f"(+{(after - before) / 2**20:.1f} MiB), MLX peak {peak / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
