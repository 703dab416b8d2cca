"""The custom CUDA kernels, each a pure-MLX path's accelerator behind one registry.

`qmv` (few-row quantized products on the CUDA cores, handing 2..32 rows to `mma` on the tensor
cores), `gdn` (the gated-delta-net mixer), `attn` (full attention around the KV cache), `norm`
(residual add + RMSNorm); `cuda_kernel` compiles and keeps their variants across processes (NVRTC
in `nvrtc` worker processes, sources compacted by `source`), `warmup` lists what a model will
launch, `verdicts` keeps self-test passes, and `registry` decides what may run; `mlx_jit` compiles
MLX's own modules a first run needs in worker processes while the model loads.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

from . import mlx_jit
from .cuda_kernel import cuda
from .registry import Registry

REGISTRY = Registry()  # this process's verdicts


def available(name: str, shape: Any = None) -> bool:
    """`Registry.available` on this process's registry."""
    return REGISTRY.available(name, shape)


def check(shapes: dict[str, Any], cache_dir: Path, linears: Iterable[object] = (),
          norm_width: int | None = None) -> dict[str, bool]:
    """`Registry.check` on this process's registry."""
    return REGISTRY.check(shapes, cache_dir, linears, norm_width)

__all__ = ["REGISTRY", "Registry", "available", "check", "cuda", "mlx_jit"]
