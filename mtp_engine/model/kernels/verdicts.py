"""The custom kernels' self-test verdicts, kept across processes.

Why: on a GPU each kernel is checked against the MLX operations once per process before a model
uses it (`registry.Registry.available`). With MLX's PTX cache warm the
compiles are cheap, but the checks still cost ~7 s of a new process's start-up on the H200 (the
reference operations and their first use). A check that passed for the same kernel source, the same
shape, the same device and the same MLX version passes again, so its verdict is stored beside the
engine's other cached measurements and a later process skips it. Only passes are kept: a failure
(a driver or toolchain problem that may be gone next time) is re-checked in every process.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx

FILE = "kernel-selftests.json"
# seconds each self-test took in this process (those run, not those a stored verdict skipped):
# scripts/bench/startup_breakdown.py reports them apart from the rest of load()
RUN_SECONDS: dict[str, float] = {}


def key(name: str, source: str, shape) -> str:
    """What a verdict depends on: the kernel's name and CUDA source, the shape it was checked at,
    the device and the MLX version."""
    try:
        device = str(mx.device_info().get("device_name", ""))
    except Exception:  # an MLX without device_info: the version alone then
        device = ""
    # the compiled code now comes from cuda_kernel's NVRTC call: verdicts on MLX's own compiles
    # (before it) do not vouch for it
    text = json.dumps([name, source, repr(shape), device, mx.__version__, "kernel_cache-1"])
    return hashlib.sha256(text.encode()).hexdigest()


def passed(cache_dir: Path, k: str) -> bool:
    """Whether a check with key `k` passed in an earlier process (False when unknown or unreadable)."""
    try:
        return json.loads((Path(cache_dir) / FILE).read_text()).get(k) is True
    except (OSError, ValueError, AttributeError):
        return False


def remember(cache_dir: Path, k: str) -> None:
    """Records that the check with key `k` passed; a cache folder that cannot be written is skipped
    (the check simply runs again next time)."""
    path = Path(cache_dir) / FILE
    try:
        try:
            verdicts = json.loads(path.read_text())
            if not isinstance(verdicts, dict):
                verdicts = {}
        except (OSError, ValueError):
            verdicts = {}
        verdicts[k] = True
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(verdicts))
        os.replace(tmp, path)  # atomic: processes starting together never read half a file
    except OSError:
        pass
