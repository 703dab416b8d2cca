"""Checkpoint conversion: a Hugging Face Qwen3.5 folder to an MLX folder (`to_mlx`) or a GGUF file
(`to_gguf`), and a GGUF file back to a Hugging Face folder (`to_hf`)."""
from __future__ import annotations

import os
from typing import Callable

from ..errors import MTPEngineError
from ..model.hf import QuantSpec
from .to_gguf import write_gguf
from .to_mlx import ConvertReport, convert_to_mlx

__all__ = ["ConvertReport", "convert", "convert_to_mlx", "write_gguf"]


def _check_not_source(src: str | os.PathLike, out: str | os.PathLike) -> None:
    """The output must not be the source, nor a folder the source lies in: writing it would
    overwrite what is still being read (symbolic links resolved)."""
    s, o = os.path.realpath(os.fspath(src)), os.path.realpath(os.fspath(out))
    if s == o or s.startswith(o.rstrip(os.sep) + os.sep):
        raise MTPEngineError(f"the output {os.fspath(out)!r} is {'the source' if s == o else 'a folder the source is in'}: "
                             "writing it would overwrite the source while it is read; choose another output",
                             file=os.fspath(src), field="out")


def convert(src: str | os.PathLike, out: str | os.PathLike, quantize: QuantSpec | str | int | None = 4,
            gguf_type: str | None = None, overwrite: bool = False, scales: str = "float32",
            progress: Callable[[int, int], None] | None = None) -> ConvertReport:
    """An MLX folder (default; see `convert_to_mlx`), or with `gguf_type` (F32, F16, BF16, Q8_0,
    Q4_0, ...) one GGUF file. Refuses an output that is the source or holds it (`--force` once
    overwrote the source while reading it)."""
    _check_not_source(src, out)
    if gguf_type is not None:
        return write_gguf(src, out, gguf_type, overwrite=overwrite, progress=progress)
    return convert_to_mlx(src, out, quantize, scales=scales, overwrite=overwrite, progress=progress)
