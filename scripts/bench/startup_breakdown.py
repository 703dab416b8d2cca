"""Where a new process's start-up goes: import, `load()` (on a GPU it includes the custom kernels'
self-tests at the model's shapes, reported apart as `self_test_seconds`; `kernel_cache` counts the
NVRTC compiles and their seconds, wherever they fell), and three 64-token generations on the
shipped model (plain, then draft-mtp auto twice: the first pays for compiling its shapes);
`compiled_modules` lists, per phase, the modules that appeared in MLX's PTX folders (MLX's JIT:
fused graphs, gathers, quantized products; and our kernels), each with when it was written and the
gap since the one before (about its compile time, where nothing else ran between; modules MLX's
worker processes prepared during load, `mlx_prepared`, appear when they were moved in). Run it twice: the second process
shows what the caches save.

`--root DIR`: every cache this run may read or write lives under DIR (the temp folder, so MLX's
default PTX folder; the engine's cache folder, so its own PTX folder and the self-test verdicts):
an empty DIR is a fresh machine's start-up on any machine, the same DIR again its second process.

`--first-forward`: before the first generation, one uncompiled one-token forward on a scratch
cache (reported as `first_forward`): the GPU's first-use costs apart from the generation's own.

`--long N`: then a first prompt of N tokens alone, plain and draft-mtp (MLX's own prompt path).

`--batch`: then a server's first batched steps (four prompts together, plain and draft-mtp, each
twice: `batch0_*` against `batch1_*` is what the first one compiled).

Usage: python3 scripts/bench/startup_breakdown.py [--root DIR] [--first-forward] [--long N] [--batch] > startup.json
"""
from __future__ import annotations

import json
import os
import sys
import time

if "--root" in sys.argv:  # before MLX or the engine read any of these
    root = os.path.abspath(sys.argv[sys.argv.index("--root") + 1])
    os.makedirs(root, exist_ok=True)
    os.environ["TMPDIR"] = root
    os.environ["MTP_ENGINE_CACHE_DIR"] = os.path.join(root, "mtp-engine")
    os.environ.pop("MLX_PTX_CACHE_DIR", None)  # load() points it into the engine's cache folder

T: dict = {}
t = time.perf_counter()
import mtp_engine as me
from mtp_engine.model import kernels

T["import"] = time.perf_counter() - t
JIT: dict = {}  # per phase: the compiled modules that appeared in MLX's PTX folders (MLX's JIT and ours)


def modules() -> dict:
    """Module file name -> when it was written (epoch seconds)."""
    return {p.name: p.stat().st_mtime for d in kernels.cuda_kernel.mlx_cache_dirs() if d.is_dir() for p in d.rglob("*.ptx")}


def phase(name: str, before: dict, started: float) -> dict:
    now = modules()
    new = sorted((when, n) for n, when in now.items() if n not in before)
    # a module's name is its kind, then a hash of its source: kinds say what was compiled; the time
    # each was written, from the phase's start, and the gap since the one before (~ its compile)
    rows, last = [], started
    for when, n in new:
        rows.append([n[:-len(".ptx")].rsplit("_", 1)[0], round(when - started, 2), round(when - last, 2)])
        last = when
    JIT[name] = {"count": len(new), "modules": [r[0] for r in rows], "written": rows}
    return now


seen = modules()
start = time.time()
t = time.perf_counter()
m = me.load()
T["load"] = time.perf_counter() - t
seen = phase("load", seen, start)
if "--first-forward" in sys.argv:
    # one uncompiled one-token forward on a scratch cache before the first generation: the GPU's
    # first-use costs (library handles, module loads, first allocations) apart from the generation's
    import mlx.core as mx
    from mtp_engine.model.step import Pass
    start = time.time()
    t = time.perf_counter()
    mx.eval(m.model.forward(mx.array([[1]]), m.model.make_cache(), Pass.PREFILL))
    T["first_forward"] = time.perf_counter() - t
    seen = phase("first_forward", seen, start)
for i, spec in enumerate(["none", "draft-mtp", "draft-mtp"]):
    start = time.time()
    t = time.perf_counter()
    r = me.generate("def parse_args(argv):", model=m, max_tokens=64, spec=spec)
    keys = ("prefill_seconds", "time_to_first_token_seconds", "compile_seconds", "decode_tokens_per_second",
            "acceptance_rate", "auto_message")
    T[f"gen{i}_{spec}"] = {"wall": time.perf_counter() - t, **{k: r.stats.get(k) for k in keys}}
    seen = phase(f"gen{i}_{spec}", seen, start)
if "--long" in sys.argv:
    # a first long prompt alone (MLX's own prompt path past the delta-net kernel's 16 tokens, and
    # past the dequantized products' threshold): plain, then draft-mtp
    n = int(sys.argv[sys.argv.index("--long") + 1])
    text = "".join(f"def f{i}(x):\n    return x * {i}\n" for i in range(n))
    ids = m.tokenizer.encode(text)[:n]
    for spec in ("none", "draft-mtp"):
        start = time.time()
        t = time.perf_counter()
        r = me.generate(ids, model=m, max_tokens=16, spec=spec)
        T[f"long_{spec}"] = {"wall": time.perf_counter() - t, "prompt_tokens": len(ids),
                             "time_to_first_token_seconds": r.stats.get("time_to_first_token_seconds")}
        seen = phase(f"long_{spec}", seen, start)
if "--batch" in sys.argv:
    # a server's first batched steps (`serve --parallel 4`): four prompts decoding together, plain and
    # draft-mtp, each twice; the first call's wall beyond the second's is what it compiled
    prompts = ["def parse_args(argv):", "class Stack:", "import os\n", "def main():"]
    for spec in ("none", "draft-mtp"):
        for rep in (0, 1):
            start = time.time()
            t = time.perf_counter()
            me.batch_generate(prompts, model=m, max_tokens=32, parallel=4, spec=spec)
            T[f"batch{rep}_{spec}"] = {"wall": time.perf_counter() - t}
            seen = phase(f"batch{rep}_{spec}", seen, start)

# MLX's own modules compiled ahead in worker processes during load (recipe, exit status, seconds
# from the start of their preparation to its end): they appear in the phase they were moved in
T["mlx_prepared"] = dict(kernels.mlx_jit.STATS)
T["kernel_cache"] = dict(kernels.cuda_kernel.STATS)  # custom-kernel variants compiled here vs found stored
# load()'s part spent testing kernels against the MLX path (the rest: GGUF read, upload, MLX's own JIT)
T["self_test_seconds"] = dict(kernels.verdicts.RUN_SECONDS)
# what each phase compiled (on a fresh machine, where start-up's seconds go: ~2-6 s a module)
T["compiled_modules"] = JIT
print(json.dumps(T, indent=1), flush=True)
