"""A progress line on stderr while a model loads (`load(..., progress=...)`), for the command line.

A small model loads in well under a second and prints nothing; a large one (a 9B GGUF reads and
repacks gigabytes) shows its blocks as they load, so a silent terminal is not mistaken for a hang.
stdout is never written (it carries `--json` and the generated text).
"""
from __future__ import annotations

import logging
import sys
import time
from typing import Callable, TextIO

QUIET_SECONDS = 1.0  # loads that finish sooner print nothing


def load_progress(label: str, quiet: bool = False, stream: TextIO | None = None,
                  after: float = QUIET_SECONDS, verb: str = "loading", unit: str = "blocks",
                  rate: bool = False) -> Callable[[int, int], None]:
    """A `progress(done, total)` callback that writes "loading LABEL: done/total blocks (p%)" to
    `stream` (default stderr) once the load has taken `after` seconds: rewritten in place on a
    terminal, one line per tenth otherwise (logs). `quiet` turns it off; `verb` and `unit` name
    other long work (``converting``, ``tensors``); `rate` adds units per second (a prompt's prefill)."""
    t0 = time.perf_counter()
    state = {"shown": False, "last_tenth": -1}

    def progress(done: int, total: int) -> None:
        if quiet or total <= 0:
            return
        out = stream if stream is not None else sys.stderr
        elapsed = time.perf_counter() - t0
        if not state["shown"] and elapsed < after:
            return
        state["shown"] = True
        pct = 100 * done // total
        line = f"{verb} {label}: {done}/{total} {unit} ({pct}%), {elapsed:.1f} s"
        if rate and elapsed > 0:
            line += f", {done / elapsed:.0f} {unit}/s"
        if getattr(out, "isatty", lambda: False)():
            out.write("\r" + line + ("\n" if done >= total else ""))
        elif pct // 10 != state["last_tenth"] or done >= total:
            state["last_tenth"] = pct // 10
            out.write(line + "\n")
        out.flush()

    return progress


class _NoticeHandler(logging.StreamHandler):
    """Writes to `target`, or to whatever `sys.stderr` is when a notice comes (an in-process
    caller, e.g. a test capturing output, may have replaced and closed the one there at set-up)."""

    def __init__(self, target: TextIO | None):
        self._target = target
        super().__init__(target)

    @property
    def stream(self) -> TextIO:
        return self._target if self._target is not None else sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler sets it; the target above decides
        pass


def show_kernel_notices(quiet: bool = False, stream: TextIO | None = None) -> None:
    """Shows the engine's notices of slow first-run work (kernels compiled and tested on a GPU,
    `mtp_engine.kernels`) as `mtp-engine: ...` lines on `stream` (default: stderr), replacing an
    earlier call's (so each line shows once); `quiet` (e.g. --json) shows none."""
    logger = logging.getLogger("mtp_engine.kernels")
    for h in [h for h in logger.handlers if isinstance(h, _NoticeHandler)]:
        logger.removeHandler(h)
    if quiet:
        return
    handler = _NoticeHandler(stream)
    handler.setFormatter(logging.Formatter("mtp-engine: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
