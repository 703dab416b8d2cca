"""MLX CUDA graph settings against decode speed: runs `step_floor.py` (host floor, tiny widths) and
bench_gpu.py's plain section (9B shape) in a fresh process per setting, since MLX reads them once.

MLX's CUDA backend records kernels into a CUDA graph and launches it every
MLX_MAX_OPS_PER_BUFFER kernels (30 on an H100/H200) or MLX_MAX_MB_PER_BUFFER MB of inputs (400):
a 9B step reads ~6 GB of weights, so it is cut into ~15 graphs whatever the kernel count.

Usage: python3 scripts/mlx_env_sweep.py [--config fused] [--out DIR]; prints a table and, last,
`export ...` for the fastest setting.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETTINGS = {
    "default": {},
    "one graph per step": {"MLX_MAX_OPS_PER_BUFFER": "4000", "MLX_MAX_MB_PER_BUFFER": "1000000"},
    "graphs of 100 ops": {"MLX_MAX_OPS_PER_BUFFER": "100", "MLX_MAX_MB_PER_BUFFER": "1000000"},
    "no graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
}


def _json_lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="fused")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = {}
    for name, env in SETTINGS.items():
        e = {**os.environ, **env}
        floor = subprocess.run([sys.executable, str(HERE / "step_floor.py"), "--configs", a.config, "--steps", "40"],
                               env=e, capture_output=True, text=True, timeout=300)
        plain = subprocess.run([sys.executable, str(HERE / "bench_gpu.py"), "--sections", "plain", "--configs",
                                a.config, "--tokens", "64", "--repeats", "2", "--no-peer"],
                               env=e, capture_output=True, text=True, timeout=300)
        f = [j for j in _json_lines(floor.stdout) if "tiny_32_layers" in j]
        p = [j for j in _json_lines(plain.stderr) if "plain_ms_per_token" in j]
        rows[name] = {"env": env, "floor": f[0]["tiny_32_layers"][a.config] if f else floor.stderr[-300:],
                      "plain_ms": p[0]["plain_ms_per_token"][a.config] if p else plain.stderr[-300:]}
        print(json.dumps({name: rows[name]}), flush=True)
    ok = {k: v for k, v in rows.items() if isinstance(v["plain_ms"], float)}
    best = min(ok, key=lambda k: ok[k]["plain_ms"]) if ok else "default"
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "env_sweep.json").write_text(json.dumps(rows, indent=1))
    print("export " + " ".join(f"{k}={v}" for k, v in SETTINGS[best].items()) if SETTINGS[best] else "true")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
