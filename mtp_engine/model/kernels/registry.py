"""One registry for the custom CUDA kernel families (few-row products, the gated-delta-net
mixer, attention, add+RMSNorm): which may run in this process, at which shape.

Why one place: a family runs only after its self-test matched the MLX operations it replaces at the
model's own shape (a compile error or a mismatch warns once and the engine keeps the MLX path);
a test that passed for the same source, shape, device and MLX version in an earlier process is
not run again (`verdicts`); and before the first test runs, every variant the tests and the
model's products will launch is compiled at once (`warmup`). The kernel modules themselves only
compute and test; none keeps a verdict.
"""
from __future__ import annotations

import logging
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import mlx.core as mx

from . import attn, cuda_kernel, gdn, norm, qmv, verdicts, warmup

log = logging.getLogger("mtp_engine.kernels")


def _attn_test(shape: Any) -> bool:
    # shape: (n_head, n_head_kv, head_dim, n_rot, KV cache dtype name), or None for the test shape
    return attn.self_test(shape[:4], getattr(mx, shape[4])) if shape else attn.self_test()


# family -> (what it is, said in a warning; its CUDA text; its self-test at a shape)
FAMILIES: dict[str, tuple[str, Callable[[], str], Callable[[Any], bool]]] = {
    "qmv": ("custom quantized kernel", qmv.source, lambda shape: qmv.self_test()),
    "gdn": ("fused gated-delta-net kernel", gdn.source, lambda shape: gdn.self_test(shape)),
    "attn": ("fused attention kernels", attn.source, _attn_test),
    "norm": ("fused add+RMSNorm kernel", norm.source, lambda shape: norm.self_test()),
}


class Registry:
    """The self-test verdicts of this process, per family and shape."""

    def __init__(self, known: dict[tuple[str, Any], bool] | None = None) -> None:
        """`known`: verdicts given ahead, {(family, shape): passed} (a test standing in for a GPU)."""
        self._verdicts: dict[tuple[str, Any], bool] = dict(known or {})

    def available(self, name: str, shape: Any = None) -> bool:
        """Whether family `name` may run in this process at `shape` (None: its own test shape): on
        a CUDA GPU, once its self-test passed there. The test runs once per process and shape; a
        failure warns and answers False from then on, so the engine falls back instead of failing."""
        key = (name, shape)
        if key not in self._verdicts:
            if not cuda_kernel.cuda():
                return False
            self._verdicts[key] = self._run(name, shape)
        return self._verdicts[key]

    def verdict(self, name: str, shape: Any = None) -> bool | None:
        """This process's verdict on `name` at `shape`; None before its test ran."""
        return self._verdicts.get((name, shape))

    def check(self, shapes: dict[str, Any], cache_dir: Path, linears: Iterable[object] = (),
              norm_width: int | None = None) -> dict[str, bool]:
        """Which of the families in `shapes` (name -> the model's shape for its self-test) may run.
        On a CUDA GPU, first every variant their pending tests, the few-row products of `linears`
        and the add+RMSNorm over `norm_width` features launch is compiled at once; then each
        family is tested unless this process or an earlier one on this device passed the same test
        (`verdicts`, in `cache_dir`)."""
        if not cuda_kernel.cuda():
            return {name: self.available(name, shape) for name, shape in shapes.items()}
        # each family's verdict key and stored pass, once: the compile-ahead list and the checks share them
        keys = {name: self._key(name, shape) for name, shape in shapes.items()}
        stored = {name: verdicts.passed(cache_dir, k) for name, k in keys.items()}
        pending = [self._test(name, shape) for name, shape in shapes.items()
                   if (name, shape) not in self._verdicts and not stored[name]]
        warmup.compile_ahead(pending, linears if "qmv" in shapes else [], norm_width if "norm" in shapes else None)
        return {name: self._checked(name, shape, cache_dir, keys[name], stored[name]) for name, shape in shapes.items()}

    def forget(self) -> None:
        """Drops every verdict of this process (what a new process would start from)."""
        self._verdicts.clear()

    @staticmethod
    def _test(name: str, shape: Any) -> Callable[[], bool]:
        return lambda: FAMILIES[name][2](shape)

    @staticmethod
    def _key(name: str, shape: Any) -> str:
        return verdicts.key(name, FAMILIES[name][1](), shape)

    def _run(self, name: str, shape: Any) -> bool:
        try:
            return bool(self._test(name, shape)())
        except Exception as e:  # NVRTC missing or a toolchain that rejects the source
            warnings.warn(f"mtp-engine: {FAMILIES[name][0]} unavailable ({e}); using MLX's")
            return False

    def _checked(self, name: str, shape: Any, cache_dir: Path, k: str, stored: bool) -> bool:
        """`available`, taking the pass an earlier process kept for this exact test (`stored`, under
        key `k`); a new pass is kept for the next process."""
        if (name, shape) in self._verdicts:
            return self.available(name, shape)
        if stored:
            self._verdicts[(name, shape)] = True
            return True
        log.info("first run of the %s CUDA kernel here (this device, MLX version and model shape): testing it "
                 "against the MLX path (its code was compiled ahead); the verdict is kept in %s", name, cache_dir)
        t0 = time.perf_counter()
        ok = self.available(name, shape)
        verdicts.RUN_SECONDS[name] = time.perf_counter() - t0
        log.info("%s kernel %s in %.1f s", name, "passed" if ok else "failed its test (the MLX path runs instead)",
                 verdicts.RUN_SECONDS[name])
        if ok:
            verdicts.remember(cache_dir, k)
        return ok

