"""Start-up of a new process, side by side (repeats interleaved): `mtp-engine generate -n N` on the
shipped model (plain and draft-mtp, wall time of the whole process and its time to first token)
against mlx-lm's `generate_step` loop on a model of the same shape and weight format (4-bit g32,
random weights saved once as safetensors, loaded from disk in the child like a checkpoint).
`--baseline DIR`: also an older checkout of this repository (same commands, its own package).

Usage: python scripts/startup.py [--tokens 64] [--repeats 3] [--baseline DIR] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "models" / "qwen35-mtp-code-Q4_K_M.gguf"
PROMPT = "def parse_args(argv):"

CHILD = r'''
import json, sys, time
t0 = time.perf_counter()
import mlx.core as mx, mlx.nn as nn
from mlx_lm.models import qwen3_5
from mlx_lm.generate import generate_step
kw = json.load(open(sys.argv[1] + "/args.json"))
model = qwen3_5.TextModel(qwen3_5.TextModelArgs(**kw))
nn.quantize(model, group_size=32, bits=4)
model.load_weights(sys.argv[1] + "/weights.safetensors")
mx.eval(model.parameters())
t_load = time.perf_counter() - t0
first = None
n = 0
for tok, _ in generate_step(mx.array([151, 2361, 62, 2242, 7, 3388]), model, max_tokens=int(sys.argv[2])):
    n += 1
    if first is None:
        first = time.perf_counter() - t0
print(json.dumps({"load_seconds": t_load, "time_to_first_token_seconds": first - t_load, "tokens": n,
                  "after_first": time.perf_counter() - t0 - first}))
'''


def prepare_mlx_lm(folder: Path) -> None:
    """mlx-lm's qwen3_5 at the shipped model's shape, 4-bit g32, saved once."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    sys.path.insert(0, str(ROOT / "scripts"))
    sys.path.insert(0, str(ROOT))
    import mlx_lm_ref
    from mtp_engine import load

    cfg = load(MODEL).model.cfg
    model = mlx_lm_ref.build(cfg)
    if model is None:
        raise SystemExit("mlx-lm is not installed")
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "weights.safetensors"), dict(tree_flatten(model.parameters())))
    args = {k: v for k, v in vars(model.args).items() if isinstance(v, (int, float, str, bool)) or v is None}
    (folder / "args.json").write_text(json.dumps(args))


def ours(root: Path, spec: str, tokens: int, cache: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(root), MTP_ENGINE_CACHE_DIR=cache)
    cmd = [sys.executable, "-m", "mtp_engine.cli", "generate", "-m", str(MODEL), "-p", PROMPT, "-n", str(tokens),
           "--ignore-eos", "--json", "--spec-type", spec]
    t = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=root, check=True).stdout
    wall = time.perf_counter() - t
    st = json.loads(out)["stats"]
    ttft = st.get("time_to_first_token_seconds")
    # first token after the process started: the wall time less what came after the first token
    proc = wall - (st["prefill_seconds"] + st["decode_seconds"] - ttft) if ttft is not None else None
    return {"wall": wall, "ttft": ttft, "load": st.get("load_seconds"), "prefill": st["prefill_seconds"],
            "process_ttft": proc}


def mlx_lm(folder: Path, tokens: int) -> dict:
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(tokens)], capture_output=True, text=True,
                         check=True).stdout
    wall = time.perf_counter() - t
    st = json.loads(out)
    return {"wall": wall, "ttft": st["time_to_first_token_seconds"], "load": st["load_seconds"],
            "process_ttft": wall - st["after_first"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", default=None, help="an older checkout to compare (its own package)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mtp-startup-"))
    prepare_mlx_lm(tmp / "mlx_lm")
    runs = {}
    for name, root in (("ours", ROOT), ("baseline", Path(a.baseline) if a.baseline else None)):
        if root is None:
            continue
        for spec in ("none", "draft-mtp"):
            fresh = str(tmp / f"cache-{name}-{spec}")  # first run: no stored costs; later runs: what it kept
            runs[f"{name} {spec}"] = (lambda r=root, s=spec, c=fresh: ours(r, s, a.tokens, c))
    runs["mlx-lm generate_step"] = lambda: mlx_lm(tmp / "mlx_lm", a.tokens)
    res: dict = {k: [] for k in runs}
    for rep in range(a.repeats):
        for k, fn in runs.items():
            res[k].append(fn())
            print(json.dumps({"rep": rep + 1, k: {x: round(v, 3) for x, v in res[k][-1].items() if v is not None}}),
                  file=sys.stderr, flush=True)
    lines = [f"`-n {a.tokens}`, {a.repeats} repeats interleaved, medians (first repeat = first run: no stored costs)",
             "", "| run | wall s | first repeat wall s | first token after process start s | TTFT s (from generate) "
             "| load s |", "|---|---|---|---|---|---|"]
    for k, v in res.items():
        med = {x: [r[x] for r in v if r.get(x) is not None] for x in ("wall", "process_ttft", "ttft", "load")}
        f = {x: f"{statistics.median(m):.3f}" if m else "-" for x, m in med.items()}
        lines.append(f"| {k} | {f['wall']} | {v[0]['wall']:.2f} | {f['process_ttft']} | {f['ttft']} | {f['load']} |")
    print("\n".join(lines))
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "startup.json").write_text(json.dumps(res, indent=1))
        (Path(a.out) / "startup.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
