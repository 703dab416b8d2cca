"""Output files written whole or not at all: to a temporary name beside the target, renamed over
it when complete, so an interrupted or failed run (a full disk, a crash, Ctrl-C) never leaves a
truncated report where a good one was, and a reader never sees half a file."""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO, Iterator


def staging_path(path: str | os.PathLike) -> Path:
    """Where `path` (a file or a folder) is built before it is renamed into place: a hidden name
    beside it (same file system, so the rename is atomic), unique to this process."""
    path = Path(os.path.abspath(path))
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    """`open(path, mode)` whose content appears at `path` only when the block ends without error."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes whole files: mode 'w' or 'wb', not {mode!r}")
    tmp = staging_path(path)
    try:
        with open(tmp, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def write_text(path: str | os.PathLike, text: str) -> None:
    """`Path.write_text`, whole or not at all."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write(text)
