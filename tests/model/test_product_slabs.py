"""How `Linear` hands products to the custom few-row kernel, checked on any device: the kernel is
stood in for by MLX's own product (the CUDA kernels' arithmetic is `test_qmv_kernels.py`'s, on a
GPU), so what is tested here is the cutting into slabs, the padding and the reassembly."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtp_engine.model import kernels
from mtp_engine.model.layers import SLAB_ROWS, STEP_TOKENS, Linear


class _Calls(list):
    splits: list[int]


@pytest.fixture
def calls(monkeypatch):
    seen = _Calls()
    splits: list[int] = []

    def stand_in(x, w, s, b, bits, group, split=2):
        seen.append(int(x.shape[0]))
        splits.append(split)
        return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=group, bits=bits)

    monkeypatch.setattr(kernels.qmv, "quantized_rows", stand_in)
    monkeypatch.setattr(kernels.qmv, "supports", lambda w, s, bits, group, rows: 1 <= rows <= kernels.qmv.MAX_ROWS)
    seen.splits = splits
    return seen


@pytest.mark.parametrize("shape", [(1, 64), (2, 64), (8, 64), (9, 64), (16, 64), (17, 64), (20, 64), (33, 64),
                                   (SLAB_ROWS, 64),
                                   (3, 1, 64), (16, 1, 64), (4, 5, 64), (16, 5, 64), (2, SLAB_ROWS, 64)])
def test_products_of_many_rows_are_cut_into_slabs_and_put_back(calls, shape):
    """Up to SLAB_ROWS tokens per sequence (whatever the batch's rows): slabs of at most
    `qmv.SLAB` rows (two column tiles), never a slab of one row in a product of several, the rows back in order and
    shape."""
    w = mx.random.normal((48, 64), key=mx.random.key(1))
    q, s, b = mx.quantize(w, group_size=32, bits=4)
    lin = Linear(q, s, b, 4, 32, custom_kernel=True)
    x = mx.random.normal(shape, key=mx.random.key(2))
    got = lin(x)
    ref = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=32, bits=4)
    assert got.shape == ref.shape
    np.testing.assert_allclose(np.array(got), np.array(ref), rtol=1e-5, atol=1e-5)
    rows = int(np.prod(shape[:-1]))
    assert calls and all(c <= kernels.qmv.SLAB for c in calls)
    assert rows == 1 or all(c >= 2 for c in calls), calls
    assert sum(calls) - rows in (0, 1)  # at most one padding row
    # a sequence's tokens past one slab (a prompt) take x in float32's precision on the tensor cores
    assert set(calls.splits) == ({3} if shape[-2] > STEP_TOKENS else {2}), calls.splits


def test_long_sequences_leave_the_kernel(calls):
    """More than SLAB_ROWS tokens per sequence (a prompt's chunk) take MLX's product (or the
    dequantized one), alone or beside other prompts alike."""
    w = mx.random.normal((48, 64), key=mx.random.key(1))
    q, s, b = mx.quantize(w, group_size=32, bits=4)
    lin = Linear(q, s, b, 4, 32, custom_kernel=True)
    lin(mx.random.normal((1, SLAB_ROWS + 1, 64)))
    lin(mx.random.normal((3, SLAB_ROWS + 1, 64)))
    assert calls == []


@pytest.mark.parametrize("rows,group,dense", [(33, 128, True), (300, 128, True), (32, 128, False), (33, 64, False)])
def test_a_cuda_product_mlx_cannot_launch_takes_the_dequantized_one(monkeypatch, rows, group, dense):
    """On CUDA, MLX's quantized product of more than 32 rows at group 128 fails to launch (MLX
    0.32.4): outside the custom kernel's reach such a product runs on the dequantized weights,
    equal to the quantized product; other groups and row counts keep MLX's product."""
    from mtp_engine.model.layers import CUDA_G128_MAX_ROWS

    assert CUDA_G128_MAX_ROWS == 32
    w = mx.random.normal((64, 256), key=mx.random.key(1))
    q, s, b = mx.quantize(w, group_size=group, bits=4)
    x = mx.random.normal((rows, 256), key=mx.random.key(2))
    # the reference in float64 on the host: MLX's own product is what cannot launch here
    wd = np.array(mx.dequantize(q, s, b, group_size=group, bits=4), dtype=np.float64)
    ref = np.array(x, dtype=np.float64) @ wd.T
    monkeypatch.setattr(kernels, "cuda", lambda: True)
    real, used = mx.quantized_matmul, []
    monkeypatch.setattr(mx, "quantized_matmul", lambda *a, **k: used.append(1) or real(*a, **k))
    got = Linear(q, s, b, 4, group)(x)
    assert bool(used) != dense
    assert np.allclose(np.array(got), ref, rtol=1e-4, atol=1e-4)
