"""Small element-wise helpers fused on a GPU and left as they are on the CPU.

Why: on a GPU each MLX operation is a kernel launch, so a helper of a dozen element-wise operations
(the gated-delta-net's input preparation, SwiGLU, the output gate) is worth `mx.compile`'s fusion.
On MLX's CPU backend a compiled helper is C++ that MLX writes and builds with the system compiler
at its first use on a machine: the shipped model's helpers were 16 such builds, a fresh machine's
first `generate` took 32 s instead of 4 s, for a decode 0.4% faster afterwards (27.2 against
27.1 tok/s, docs/benchmarks.md). So `fused(fn)` runs the compiled form where the operations run
on a GPU (the default device, or the stream a caller chose with `mx.stream`) and `fn` itself on
the CPU. Compiled steps (`step.py`) are separate: they compile whole forwards where the model's
options ask for it.
"""
from __future__ import annotations

import functools
from typing import Callable

import mlx.core as mx


def on_gpu() -> bool:
    """Whether operations issued now run on a GPU (the default stream's device)."""
    return mx.default_device().type == mx.DeviceType.gpu


def fused(fn: Callable, static_argnums: tuple[int, ...] = ()) -> Callable:
    """`fn` compiled (`mx.compile`) where operations run on a GPU, `fn` itself on the CPU;
    `static_argnums`: arguments that are Python values (one graph per value)."""
    compiled = mx.compile(fn) if not static_argnums else _compile_static(fn, static_argnums)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return compiled(*args, **kwargs) if on_gpu() else fn(*args, **kwargs)

    return call


def _compile_static(fn: Callable, static_argnums: tuple[int, ...]) -> Callable:
    """mx.compile of `fn` with the arguments at `static_argnums` bound as constants: one compiled
    function per combination of their values."""
    graphs: dict = {}

    def call(*args):
        key = tuple(args[i] for i in static_argnums)
        if key not in graphs:
            def bound(*arrays, _key=key):
                it, full = iter(arrays), []
                for i in range(len(arrays) + len(_key)):
                    full.append(_key[static_argnums.index(i)] if i in static_argnums else next(it))
                return fn(*full)
            graphs[key] = mx.compile(bound)
        return graphs[key](*(a for i, a in enumerate(args) if i not in static_argnums))

    return call
