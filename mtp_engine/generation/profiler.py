"""Stage timing of a generation: where each millisecond of a round goes.

MLX is lazy: work queued in one stage may run in a later one. `precise` mode therefore evaluates
the stage's outputs at every stage boundary (honest attribution, at the cost of extra syncs);
`round` mode only timestamps host-visible boundaries. `off` costs nothing.
"""
from __future__ import annotations

import csv
import json
import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator

import mlx.core as mx

from ..output_files import atomic_open

# `emit`: handing a round's tokens out (detokenization, EOS and stop strings), host work that
# overlaps the next round on a device and is a visible share of a small model's step
STAGES = ("prefill", "decode", "draft", "catch_up", "verify", "sample", "sync", "accept", "rollback", "emit",
          "other")


class Profiler:
    """Accumulates seconds and counts per stage. Use `with prof.stage("draft") as out: out.append(arr)`:
    arrays appended to `out` are evaluated before the stage's clock stops in precise mode."""

    def __init__(self, mode: str = "off"):
        if mode not in ("off", "round", "precise"):
            raise ValueError(f"profiler mode must be off, round or precise, not {mode!r}")
        self.mode = mode
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.wall = 0.0
        self._t0: float | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def start(self) -> None:
        self._t0 = time.perf_counter()

    def stop(self) -> None:
        if self._t0 is not None:
            self.wall += time.perf_counter() - self._t0
            self._t0 = None

    @contextmanager
    def stage(self, name: str) -> Iterator[list]:
        outputs: list = []
        if self.mode == "off":
            yield outputs
            return
        t = time.perf_counter()
        yield outputs
        if self.mode == "precise" and outputs:
            mx.eval(*outputs)
        self.seconds[name] += time.perf_counter() - t
        self.counts[name] += 1

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds
        self.counts[name] += 1

    def report(self) -> dict:
        """Per-stage seconds and share of wall time; `other` is the wall time no stage claimed."""
        total = sum(self.seconds.values())
        stages = {k: {"seconds": v, "count": self.counts[k]} for k, v in self.seconds.items()}
        if self.wall:
            stages["other"] = {"seconds": max(self.wall - total, 0.0), "count": 0}
        return {"mode": self.mode, "wall_seconds": self.wall, "stages": stages}

    def table(self) -> str:
        return format_report(self.report())


def format_report(rep: dict) -> str:
    """A per-stage table (ms, calls, ms per call, share of wall time) of `Profiler.report()`."""
    wall = rep["wall_seconds"] or sum(s["seconds"] for s in rep["stages"].values()) or 1.0
    lines = [f"{'stage':<10} {'ms':>10} {'calls':>7} {'ms/call':>9} {'share':>7}"]
    order = [s for s in STAGES if s in rep["stages"]] + [s for s in rep["stages"] if s not in STAGES]
    for name in order:
        s = rep["stages"][name]
        per = s["seconds"] / s["count"] * 1e3 if s["count"] else 0.0
        lines.append(f"{name:<10} {s['seconds'] * 1e3:>10.1f} {s['count']:>7} {per:>9.3f} {s['seconds'] / wall:>6.1%}")
    lines.append(f"{'total':<10} {wall * 1e3:>10.1f}  ({rep['mode']} mode)")
    return "\n".join(lines)


def write_report(rep: dict, path: str) -> None:
    """Writes `Profiler.report()` as JSON (.json) or CSV (anything else: stage, seconds, count, share)."""
    if str(path).endswith(".json"):
        with atomic_open(path) as f:
            json.dump(rep, f, indent=1)
        return
    wall = rep["wall_seconds"] or 1.0
    with atomic_open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["stage", "seconds", "count", "share_of_wall"])
        for name, s in rep["stages"].items():
            w.writerow([name, f"{s['seconds']:.6f}", s["count"], f"{s['seconds'] / wall:.4f}"])
        w.writerow(["wall", f"{rep['wall_seconds']:.6f}", "", "1.0"])
