"""MLX's own CUDA modules a first run needs, compiled ahead in worker processes while a model loads.

Why: MLX's CUDA backend compiles each of its JIT modules (gathers, dynamic-offset writes, every
`mx.compile`d element-wise graph) with NVRTC at its first launch, one at a time in the launching
process, 1.4-5.2 s each on an H100: a fresh machine's first plain generation and first draft-mtp
round waited ~20 s for ten of them. The cache MLX reads them from (`$MLX_PTX_CACHE_DIR`) is keyed by
the module's name, which depends on dtypes and the graph, never on sizes; so a tiny input run
through the same operation in another process compiles the module a 9B model will need.

How: a recipe is a function (`"package.module:function"`, imported in the worker, so recipes live
with the code whose modules they warm: the model's helpers, the speculative round's) that runs
that code on tiny inputs and returns what to evaluate. `prepare` starts a few worker processes
(each with its own staging folder as MLX's cache, at a lower CPU priority than the loading
process) that take the recipes from one queue, those of a prompt's forward first; after each, a
worker moves the new modules into the real cache folder whole (the kernel names before the code,
each a rename: MLX reads a module the moment it needs one, and reading code without names fails)
and leaves a marker so later processes start nothing. Whatever a recipe misses, the main process
compiles at first use as before: a missed recipe costs time, never
correctness. Off a CUDA GPU nothing runs.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import mlx.core as mx

from ...options import mlx_kernel_cache_dir, mlx_prepare_workers, worker_environment
from .cuda_kernel import cuda, mlx_cache_dirs

log = logging.getLogger("mtp_engine.kernels")

MARKERS = ".prepared"  # sub-folder of the cache: one empty file per recipe done (name.key)
STAGING = ".staging"
CLAIM_SECONDS = 120.0
STATS: dict = {"started": 0, "skipped": 0, "done": []}  # this process's: recipes started, found done, ended


# ---- generic recipes: MLX primitives whose module name is their dtypes -----------------------
def gather(dtype: str, index: str) -> mx.array:
    """`gather_<dtype>_<index>_1`: rows of a table by an index array (an embedding lookup, token
    history)."""
    return mx.zeros((4, 8), getattr(mx, dtype))[mx.array([1, 2], getattr(mx, index))]


def gather_axis(dtype: str, index: str) -> mx.array:
    """`gather_axis_<dtype>_<index>`: `take_along_axis` (a row's accepted token, a drafted
    token's probability)."""
    return mx.take_along_axis(mx.zeros((2, 4), getattr(mx, dtype)), mx.array([[1], [2]], getattr(mx, index)), axis=1)


def dynamic_offset() -> mx.array:
    """`compute_dynamic_offset_int32_1`: a write at a device-resident position (the KV caches of
    compiled steps)."""
    return mx.slice_update(mx.zeros((1, 2, 8, 4)), mx.ones((1, 2, 1, 4)), mx.array([3], mx.int32), axes=(2,))


# (phase, recipe): a prompt's forward (0), a plain step (1), a greedy draft-mtp round (2): the
# modules a fresh GPU's first runs compiled one after another in those phases before any were
# prepared (docs/performance.md, start-up); then the rest (3: the sampler's, a batch's)
_M = __name__
GENERIC = [(0, f"{_M}:gather:float32,int32"), (0, f"{_M}:gather:uint32,int32"), (0, f"{_M}:gather:float32,uint32"),
           (1, f"{_M}:dynamic_offset"), (1, f"{_M}:gather:int32,uint32"), (2, f"{_M}:gather_axis:int32,int32"),
           (2, f"{_M}:gather:uint32,uint32"), (2, f"{_M}:gather_axis:float32,int32"), (2, f"{_M}:gather:int32,int32")]


# ---- the worker ------------------------------------------------------------------------------
def resolve(recipe: str) -> Callable[[], object]:
    """`package.module:function` or `package.module:function:arg,arg` (string arguments) -> a call
    of it."""
    mod, _, rest = recipe.partition(":")
    name, _, args = rest.partition(":")
    fn = getattr(importlib.import_module(mod), name, None)
    if not callable(fn):
        raise ValueError(f"no recipe {name!r} in {mod}")
    return lambda: fn(*(args.split(",") if args else ()))


@functools.lru_cache(maxsize=None)
def _source_digest(module: str) -> str:
    """A module's source, hashed once per process (several recipes share a module)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not os.path.isfile(spec.origin):
        return ""
    return hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()


def key(recipe: str) -> str:
    """The marker's key: MLX's version and the source of the recipe's module (a change there may
    change the graphs it warms)."""
    text = f"{mx.__version__}\n{recipe}\n{_source_digest(recipe.partition(':')[0])}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def marker(cache_dir: Path, recipe: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in recipe)[-120:]
    return cache_dir / MARKERS / f"{safe}.{key(recipe)}"


def _claim_path(done: Path) -> Path:
    """Where a process notes that it took the recipe whose marker is `done`."""
    return done.with_name(done.name + ".claim")


def move_modules(staging: Path, cache_dir: Path) -> int:
    """Moves each module MLX wrote under `staging` to the same place under `cache_dir` unless one is
    there: names (`.txt`) before code (`.ptx`), each a rename; returns how many moved."""
    moved = 0
    for ptx in sorted(staging.rglob("*.ptx")):
        target = cache_dir / ptx.relative_to(staging)
        txt = ptx.with_suffix(".txt")
        if target.exists() or not txt.is_file():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(txt, target.with_suffix(".txt"))
        os.replace(ptx, target)
        moved += 1
    return moved


def share_modules(cache_dir: Path, staging: Path) -> int:
    """Links into `staging` each module the cache folder holds and it lacks (names before code), so
    the worker's MLX reads what other workers already compiled instead of compiling it again:
    recipes that run a model share most of their graphs. Returns how many it linked."""
    linked = 0
    for ptx in cache_dir.rglob("*.ptx"):
        rel = ptx.relative_to(cache_dir)
        if rel.parts[0] in (STAGING, MARKERS) or (staging / rel).exists() or not ptx.with_suffix(".txt").is_file():
            continue
        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
        for src in (ptx.with_suffix(".txt"), ptx):
            try:
                os.link(src, staging / rel.with_suffix(src.suffix))
            except FileExistsError:
                pass
            except OSError:
                shutil.copyfile(src, staging / rel.with_suffix(src.suffix))
        linked += 1
    return linked


def work(cache_dir: Path, staging: Path, recipes=None, out=None) -> int:
    """Runs in the worker (MLX's cache pointed at `staging`, a lower CPU priority than the loading
    process, whose own kernels' compiles come first): for each recipe named on a line of `recipes`
    (stdin), links what the cache folder already holds (`share_modules`), evaluates it, moves what
    it compiled into `cache_dir`, marks it done and says so on a line of `out` (stdout): "ok RECIPE
    N" or "failed RECIPE: why"."""
    recipes = sys.stdin if recipes is None else recipes
    out = sys.stdout if out is None else out
    try:
        os.nice(5)
    except (AttributeError, OSError):
        pass
    try:
        for line in recipes:
            recipe = line.strip()
            if not recipe:
                continue
            try:
                share_modules(cache_dir, staging)
                mx.eval(resolve(recipe)())
                moved = move_modules(staging, cache_dir)
                m = marker(cache_dir, recipe)
                m.parent.mkdir(parents=True, exist_ok=True)
                m.touch()
                _claim_path(m).unlink(missing_ok=True)
                print(f"ok {recipe} {moved}", file=out, flush=True)
            except Exception as e:  # the main process compiles what this one could not, at first use
                print(f"failed {recipe}: {type(e).__name__}: {str(e)[:500]}".replace("\n", " "), file=out, flush=True)
        return 0
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _claim(done: Path) -> bool:
    """Whether this process takes the recipe: processes loading at once (a test run's workers, a
    server's ranks) start one worker per recipe between them. A claim older than `CLAIM_SECONDS`
    is a process that died: taken over."""
    claim = _claim_path(done)
    claim.parent.mkdir(parents=True, exist_ok=True)
    try:
        if time.time() - claim.stat().st_mtime > CLAIM_SECONDS:
            claim.unlink(missing_ok=True)
    except FileNotFoundError:
        pass
    try:
        os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


# ---- the caller ------------------------------------------------------------------------------
class Preparation:
    """The worker processes `prepare` started: `workers` of them, each running recipes one after
    another from a shared queue (a process's start, ~2.5 s of Python and CUDA set-up under load, is
    paid once per worker, not per recipe), a thread per worker feeding it."""

    def __init__(self, recipes: list[str], cache_dir: Path, workers: int):
        self.cache_dir = cache_dir
        self.done: list[tuple[str, int, float]] = []  # recipe, 0 (done) or 1 (failed), seconds since the start
        self.started = time.perf_counter()
        self._queue: queue.Queue = queue.Queue()
        for r in recipes:
            self._queue.put(r)
        self._threads = [threading.Thread(target=self._feed, args=(i,), name=f"mtp-mlx-jit-{i}", daemon=True)
                         for i in range(workers)]
        for t in self._threads:
            t.start()

    def _spawn(self, i: int) -> subprocess.Popen:
        staging = self.cache_dir / STAGING / f"{os.getpid()}-{i}"
        staging.mkdir(parents=True, exist_ok=True)
        env = worker_environment(str(Path(__file__).resolve().parents[3]), MLX_PTX_CACHE_DIR=str(staging))
        return subprocess.Popen([sys.executable, "-m", __name__, str(self.cache_dir), str(staging)],
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True, start_new_session=True)

    def _feed(self, i: int) -> None:
        p = None
        try:
            while True:
                try:
                    r = self._queue.get_nowait()
                except queue.Empty:
                    return
                if p is None:
                    p = self._spawn(i)
                p.stdin.write(r + "\n")
                p.stdin.flush()
                said = p.stdout.readline()
                if not said:  # the worker died: what is left goes to the other workers
                    log.debug("MLX module worker %d ended at recipe %s", i, r)
                    return
                ok = said.startswith("ok ")
                if not ok:
                    log.debug("MLX module recipe %s", said.strip())
                entry = (r, 0 if ok else 1, round(time.perf_counter() - self.started, 2))
                self.done.append(entry)
                STATS["done"].append(entry)
        except OSError as e:  # no process to be had: the main process compiles at first use
            log.debug("MLX module worker %d: %s", i, e)
        finally:
            if p is not None:  # its stdin closed, the worker ends; reaped here (a server lives on)
                try:
                    p.stdin.close()
                    p.wait(timeout=60)
                except (OSError, subprocess.TimeoutExpired):
                    pass

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for every recipe to be handed out and answered; True when all were."""
        end = None if timeout is None else time.perf_counter() + timeout
        for t in self._threads:
            t.join(None if end is None else max(end - time.perf_counter(), 0.0))
        return not any(t.is_alive() for t in self._threads)


def prepare(recipes: Iterable[tuple[int, str]], cache_dir: Path | None = None,
            workers: int | None = None) -> Preparation | None:
    """Starts the workers for the `recipes` ((phase, recipe): the phase that needs it first runs
    first) not marked done in `cache_dir` (default: the folder MLX reads, `$MLX_PTX_CACHE_DIR`);
    returns at once. `workers`: how many processes (default `options.mlx_prepare_workers()`, else
    half the cores, 1 to 8; 0: none). None off a CUDA GPU or with nothing to do.

    On a 16-core H100 host, fresh root, import to first plain token + the first draft-mtp round's
    compiles: 17.2 + 12.4 s with no workers, 10.2 + 5.1 with 2, 8.5 + 4.4 with 4, 9.8 + 0.2 with 6
    (load itself 5.5-6.3 s throughout), and 6.5 + 2.3 with 6 in a second run: each module takes a
    worker ~1 s, so more workers finish the first round's modules before it meets them."""
    if not cuda():
        return None
    workers = mlx_prepare_workers() if workers is None else workers
    if workers == 0:
        return None

    cache_dir = Path(cache_dir or mlx_kernel_cache_dir() or mlx_cache_dirs()[0])
    ordered = list(dict.fromkeys(r for _, r in sorted(recipes, key=lambda pr: pr[0])))
    todo = [r for r in ordered if not (m := marker(cache_dir, r)).exists() and _claim(m)]
    STATS["skipped"] += len(ordered) - len(todo)
    if not todo:
        return None
    STATS["started"] += len(todo)
    n = workers or max(1, min(len(todo), (os.cpu_count() or 4) // 2, 8))
    log.info("first run on this GPU and MLX version: compiling %d groups of MLX's own kernels in %d background "
             "processes while the model loads (kept in %s)", len(todo), n, cache_dir)
    return Preparation(todo, cache_dir, n)


if __name__ == "__main__":
    raise SystemExit(work(Path(sys.argv[1]), Path(sys.argv[2])))
