"""The process group, the collectives the sharded model issues (counted), and turning a dead or
stuck peer into an engine error within a bounded time.

A peer that exits closes its sockets: MLX's ring backend then fails the pending collective with a
RuntimeError, which `guard` turns into `MTPEngineError`. A peer that stops answering (stopped,
swapping, a cut link) leaves the collective blocked inside MLX, where no Python exception can
reach it; the watchdog thread then ends the process after `timeout` seconds without progress,
with a message naming the rank, instead of hanging forever.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator, TypeVar

import mlx.core as mx

from ..errors import MTPEngineError

DEFAULT_TIMEOUT = 60.0
EXIT_PEER_LOST = 75  # EX_TEMPFAIL: the run may succeed once every rank is up
MODES = ("tp", "pp")

T = TypeVar("T")


class Watchdog:
    """Ends the process when an armed section makes no progress for `timeout` seconds."""

    def __init__(self, timeout: float, rank: int):
        self.timeout, self.rank = float(timeout), rank
        self._last = time.monotonic()
        self._armed = 0
        self._what = ""
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        self._last = time.monotonic()

    @contextmanager
    def armed(self, what: str):
        with self._lock:
            self._armed += 1
            self._what = what
            self.beat()
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="mtp-distributed-watchdog", daemon=True)
                self._thread.start()
        try:
            yield self
        finally:
            with self._lock:
                self._armed -= 1

    def _watch(self) -> None:
        while True:
            time.sleep(min(0.2, self.timeout / 4))
            if self._armed and time.monotonic() - self._last > self.timeout:
                sys.stderr.write(f"mtp-engine: error: rank {self.rank}: no progress in {self._what} for "
                                 f"{self.timeout:g} s: a peer process died or stopped answering "
                                 f"(distributed_timeout={self.timeout:g}); exiting\n")
                sys.stderr.flush()
                os._exit(EXIT_PEER_LOST)


class Comm:
    """One process group and the collectives the sharded model issues, counted per kind (the
    counts and bytes are what `scripts/bench/bench_distributed.py` reports; counted when the graph is
    built, so per forward with uncompiled steps)."""

    def __init__(self, group, mode: str, timeout: float = DEFAULT_TIMEOUT):
        self.group, self.mode = group, mode
        self.rank, self.size = int(group.rank()), int(group.size())
        self.watchdog = Watchdog(timeout, self.rank)
        self.counts: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    @property
    def timeout(self) -> float:
        return self.watchdog.timeout

    def _count(self, kind: str, x: mx.array) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + int(x.nbytes)

    def reset_counts(self) -> None:
        self.counts.clear()
        self.bytes.clear()

    def all_sum(self, x: mx.array) -> mx.array:
        if self.size == 1:
            return x
        self._count("all_sum", x)
        return mx.distributed.all_sum(x, group=self.group)

    def all_gather(self, x: mx.array) -> mx.array:
        if self.size == 1:
            return x
        self._count("all_gather", x)
        return mx.distributed.all_gather(x, group=self.group)

    def send(self, x: mx.array, dst: int) -> mx.array:
        self._count("send", x)
        return mx.distributed.send(x, dst, group=self.group)

    def recv_like(self, x: mx.array, src: int) -> mx.array:
        return mx.distributed.recv_like(x, src, group=self.group)

    def broadcast_int(self, value: int, root: int = 0) -> int:
        """`value` as rank `root` has it, on every rank (an all-sum of int32 zeros elsewhere)."""
        if self.size == 1:
            return int(value)
        x = mx.array([int(value) if self.rank == root else 0], dtype=mx.int32)
        return int(mx.distributed.all_sum(x, group=self.group).item())

    def barrier(self, what: str) -> None:
        with self.watchdog.armed(what):
            self.broadcast_int(0)

    def guard(self, chunks: Iterator[T], what: str = "generation") -> Iterator[T]:
        """Iterates `chunks` with the watchdog armed while the next chunk is computed (not while
        the caller holds one: a slow consumer is not a dead peer), and a peer's failure raised as
        `MTPEngineError`."""
        it = iter(chunks)
        while True:
            with self.watchdog.armed(what):
                try:
                    chunk = next(it)
                except StopIteration:
                    return
                except RuntimeError as e:
                    raise peer_error(self.rank, e) from None
            yield chunk


def peer_error(rank: int, e: BaseException) -> MTPEngineError:
    return MTPEngineError(f"distributed run failed on rank {rank}: {e} (a peer process died or lost its "
                          "connection)", field="distributed")


def init_group(backend: str = "any", timeout: float = DEFAULT_TIMEOUT):
    """The global group of the processes `mlx.launch` started (ring: $MLX_RANK and $MLX_HOSTFILE;
    nccl, mpi, jaccl: their own variables). A process started alone is a group of one. Joining
    waits for every peer, for at most `timeout` seconds."""
    dog = Watchdog(timeout, int(os.environ.get("MLX_RANK", "0") or 0))
    with dog.armed("joining the process group"):
        try:
            if backend == "any" and not any(k in os.environ for k in ("MLX_HOSTFILE", "MLX_RANK", "OMPI_COMM_WORLD_RANK",
                                                                     "MLX_WORLD_SIZE", "MLX_IBV_DEVICES")):
                return mx.distributed.init(strict=False)
            return mx.distributed.init(strict=True, backend=backend)
        except RuntimeError as e:
            raise MTPEngineError(f"could not join the process group ({backend} backend): {e}; start the "
                                 "processes with `mlx.launch`", field="distributed") from None


def check_mode(mode) -> str:
    if mode not in MODES:
        raise MTPEngineError(f"expected one of {list(MODES)}, found {mode!r}", field="distributed")
    return mode


def check_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise MTPEngineError(f"expected a number of seconds > 0, found {timeout!r}", field="distributed_timeout")
    return float(timeout)
