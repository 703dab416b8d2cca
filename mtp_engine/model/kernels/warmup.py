"""The custom CUDA kernels a model will launch, compiled together before the first of them runs.

Why: each kernel variant is one NVRTC compile (~2 s, CPU-bound, one thread) the first time a GPU
and an MLX version meet it. Compiled one by one at their first launches, a fresh H100 paid 23.4 s
for a model's eleven before its first token. Listed ahead instead (the self-tests and
every row count the model's products may take, called under `cuda_kernel.recording`, which
launches nothing), they compile at once on the machine's cores, so a first run pays for its slowest
kernel, and a later process finds them all stored (`cuda_kernel.store`) and compiles nothing.
"""
from __future__ import annotations

import logging
import warnings
from typing import Callable, Iterable

import mlx.core as mx

from . import cuda_kernel, norm, qmv

log = logging.getLogger("mtp_engine.kernels")


def launched_variants(self_tests: Iterable[Callable[[], bool]], linears: Iterable[object],
                      norm_width: int | None = None) -> dict[str, str]:
    """What `self_tests` (each a kernel family's self-test at the model's shape), the few-row
    products of `linears` (quantized `Linear`s, 1..SLAB rows each, as `Linear` sends them: decode,
    draft, verify, a batch's step) and the fused add+RMSNorm over `norm_width` features would compile: module
    function name -> source. Nothing is launched and no verdict is made."""
    with cuda_kernel.recording() as rec, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for run in self_tests:
            try:
                run()  # a recorded kernel returns zeros: what the test concludes is meaningless here
            except Exception as e:  # the real self-test meets it again and says so
                log.debug("self-test not recorded: %s", e)
        seen: set = set()
        for lin in linears:
            if not getattr(lin, "quantized", False):
                continue
            key = (tuple(lin.weight.shape), lin.bits, lin.group_size, lin.scales.dtype)
            if key in seen:
                continue
            seen.add(key)
            for rows in range(1, qmv.SLAB + 1):
                if qmv.supports(lin.weight, lin.scales, lin.bits, lin.group_size, rows):
                    for split in ((2, 3) if rows > 1 else (2,)):  # a step's x, a prompt's (`Linear`)
                        qmv.quantized_rows(mx.zeros((rows, lin.in_features)), lin.weight, lin.scales,
                                           lin.biases, lin.bits, lin.group_size, split=split)
        if norm_width:
            x = mx.zeros((1, norm_width))
            norm.launch(x, x, mx.zeros((norm_width,)), 1e-6)
    return rec.variants


def compile_ahead(self_tests: Iterable[Callable[[], bool]], linears: Iterable[object], norm_width: int | None = None) -> int:
    """Compiles (and stores for later processes) every variant `launched_variants` lists that is not
    stored yet, several at once; returns how many were compiled. Off a CUDA GPU, nothing."""
    if not cuda_kernel.cuda():
        return 0
    variants = launched_variants(self_tests, linears, norm_width)
    n = cuda_kernel.compile_all(variants)
    if n:
        log.info("compiled %d CUDA kernel variants ahead in %.1f s", n, cuda_kernel.STATS["compile_wall"])
    return n
