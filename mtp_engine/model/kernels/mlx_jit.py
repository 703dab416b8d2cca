"""MLX's own CUDA modules a first run needs, compiled ahead in worker processes while a model loads.

Why: MLX's CUDA backend compiles each of its JIT modules (gathers, dynamic-offset writes, every
`mx.compile`d element-wise graph) with NVRTC at its first launch, one at a time in the launching
process, 1.4-5.2 s each on an H100: a fresh machine's first plain generation and first draft-mtp
round waited ~20 s for ten of them. The cache MLX reads them from (`$MLX_PTX_CACHE_DIR`) is keyed by
the module's name, which depends on dtypes and the graph, never on sizes; so a tiny input run
through the same operation in another process compiles the module a 9B model will need.

How: a recipe is a function (`"package.module:function"`, imported in the worker, so recipes live
with the code whose modules they warm: the model's helpers, the speculative round's) that runs
that code on tiny inputs and returns what to evaluate. `prepare` starts one worker process per
recipe, a few at a time, longest first, each with its own staging folder as MLX's cache; a worker
evaluates its recipe, then moves each new module into the real cache folder whole (the kernel
names before the code, each a rename: MLX reads a module the moment it needs one, and reading code
without names fails) and leaves a marker so later processes start nothing. Whatever a recipe
misses, the main process compiles at first use as before: a missed recipe costs time, never
correctness. Off a CUDA GPU nothing runs.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

import mlx.core as mx

from .cuda_kernel import cuda

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


# (phase, recipe): a prompt's forward (0), a plain step (1), a draft-mtp round (2), the rest (3)
_M = __name__
GENERIC = [(0, f"{_M}:gather:float32,int32"), (0, f"{_M}:gather:uint32,int32"), (0, f"{_M}:gather:float32,uint32"),
           (1, f"{_M}:dynamic_offset"), (1, f"{_M}:gather:int32,uint32"), (2, f"{_M}:gather_axis:int32,int32"),
           (2, f"{_M}:gather:uint32,uint32"), (3, f"{_M}:gather_axis:float32,int32"), (3, f"{_M}:gather:int32,int32")]


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


def key(recipe: str) -> str:
    """The marker's key: MLX's version and the source of the recipe's module (a change there may
    change the graphs it warms)."""
    h = hashlib.sha256(f"{mx.__version__}\n{recipe}\n".encode())
    spec = importlib.util.find_spec(recipe.partition(":")[0])
    if spec is not None and spec.origin and os.path.isfile(spec.origin):
        h.update(Path(spec.origin).read_bytes())
    return h.hexdigest()[:16]


def marker(cache_dir: Path, recipe: str) -> Path:
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in recipe)[-120:]
    return cache_dir / MARKERS / f"{safe}.{key(recipe)}"


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


def work(cache_dir: Path, staging: Path, recipe: str) -> int:
    """Runs in the worker (MLX's cache pointed at `staging`): evaluates `recipe`, moves what it
    compiled into `cache_dir`, marks the recipe done."""
    try:
        mx.eval(resolve(recipe)())
        moved = move_modules(staging, cache_dir)
        m = marker(cache_dir, recipe)
        m.parent.mkdir(parents=True, exist_ok=True)
        m.touch()
        m.with_name(m.name + ".claim").unlink(missing_ok=True)
        print(f"{recipe}: {moved} module(s)", flush=True)
        return 0
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _claim(done: Path) -> bool:
    """Whether this process takes the recipe: processes loading at once (a test run's workers, a
    server's ranks) start one worker per recipe between them. A claim older than `CLAIM_SECONDS`
    is a process that died: taken over."""
    claim = done.with_name(done.name + ".claim")
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
    """The worker processes `prepare` started (a thread keeps `workers` of them running)."""

    def __init__(self, recipes: list[str], cache_dir: Path, workers: int):
        self.recipes, self.cache_dir, self.workers = recipes, cache_dir, workers
        self.done: list[tuple[str, int, float]] = []  # recipe, exit status, seconds
        self.started = time.perf_counter()
        self._spawned = 0
        self._thread = threading.Thread(target=self._run, name="mtp-mlx-jit", daemon=True)
        self._thread.start()

    def _spawn(self, recipe: str) -> subprocess.Popen:
        self._spawned += 1
        staging = self.cache_dir / STAGING / f"{os.getpid()}-{self._spawned}"
        staging.mkdir(parents=True, exist_ok=True)
        # the worker imports this package as this process does, wherever it came from
        root = str(Path(__file__).resolve().parents[3])
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
        env = dict(os.environ, MLX_PTX_CACHE_DIR=str(staging), PYTHONPATH=path)
        return subprocess.Popen([sys.executable, "-m", __name__, str(self.cache_dir), str(staging), recipe],
                                env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)

    def _run(self) -> None:
        todo, running = list(self.recipes), {}
        while todo or running:
            while todo and len(running) < self.workers:
                r = todo.pop(0)
                try:
                    running[r] = (self._spawn(r), time.perf_counter())
                except OSError as e:  # no process to be had: the main process compiles it at first use
                    log.debug("MLX module recipe %s not started: %s", r, e)
                    self.done.append((r, -1, 0.0))
            time.sleep(0.02)
            for r, (p, t0) in list(running.items()):
                if p.poll() is not None:
                    err = p.stderr.read().decode(errors="replace") if p.stderr else ""
                    p.stderr and p.stderr.close()
                    if p.returncode:
                        log.debug("MLX module recipe %s failed: %s", r, err[-2000:])
                    self.done.append((r, p.returncode, time.perf_counter() - t0))
                    STATS["done"].append((r, p.returncode, round(time.perf_counter() - self.started, 2)))
                    del running[r]

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for every worker; True when all ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


def prepare(recipes: Iterable[tuple[int, str]], cache_dir: Path | None = None,
            workers: int | None = None) -> Preparation | None:
    """Starts the workers for the `recipes` ((phase, recipe): the phase that needs it first runs
    first) not marked done in `cache_dir` (default: the folder MLX reads, `$MLX_PTX_CACHE_DIR`);
    returns at once. None off a CUDA GPU or with nothing to do."""
    if not cuda():
        return None
    from ...options import mlx_kernel_cache_dir
    from .cuda_kernel import mlx_cache_dirs

    cache_dir = Path(cache_dir or mlx_kernel_cache_dir() or mlx_cache_dirs()[0])
    ordered = list(dict.fromkeys(r for _, r in sorted(recipes, key=lambda pr: pr[0])))
    todo = [r for r in ordered if not marker(cache_dir, r).exists() and _claim(marker(cache_dir, r))]
    STATS["skipped"] += len(ordered) - len(todo)
    if not todo:
        return None
    STATS["started"] += len(todo)
    n = workers or max(2, min(len(todo), (os.cpu_count() or 4) // 2, 8))
    log.info("preparing MLX's kernel modules ahead: %d recipes in %d processes", len(todo), n)
    return Preparation(todo, cache_dir, n)


if __name__ == "__main__":
    raise SystemExit(work(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]))
