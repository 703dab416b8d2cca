"""The custom few-row quantized products on a CUDA GPU: the CUDA-core kernel
(one row) and the tensor-core kernel (2..32 rows) against a float64 product of the dequantized
weights, through the `Linear` the model uses, for 1..33 rows, 4- and 8-bit, groups
32/64/128, shapes that do and do not fill a block. Skipped where MLX has no CUDA device."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mtp_engine.model import kernels
from mtp_engine.model.layers import Linear

pytestmark = pytest.mark.gpu

CASES = [(4, 32, 512, 1024), (4, 64, 272, 512), (4, 128, 256, 1024), (8, 32, 96, 512), (8, 64, 512, 256)]


@pytest.mark.parametrize("bits,group,n,k", CASES)
def test_products_match_mlx_for_1_to_33_rows(bits, group, n, k):
    assert kernels.available("qmv")
    w = mx.random.normal((n, k), key=mx.random.key(bits * group + n)) * k ** -0.5
    q, s, b = mx.quantize(w, group_size=group, bits=bits)
    lin = Linear(q, s, b, bits, group, custom_kernel=True)
    # the reference in float64 on the host: MLX's CUDA product of 33 rows at group 128 fails to
    # launch (cuGraphAddKernelNode: invalid argument, MLX 0.32.4)
    dense = np.array(mx.dequantize(q, s, b, group_size=group, bits=bits)).astype(np.float64)
    for rows in range(1, 34):  # one to four column tiles of the tensor-core kernel, and a padded slab past them
        x = mx.random.normal((rows, k), key=mx.random.key(rows)) * 2.0
        ref = np.array(x).astype(np.float64) @ dense.T
        got = np.array(lin(x))
        scale = np.abs(ref).max()
        assert np.abs(got - ref).max() <= 3e-5 * scale + 1e-6, (rows, np.abs(got - ref).max() / scale)


def test_products_of_many_rows_run_in_slabs_of_one_arithmetic():
    """A batch's products (B rows, or B x (k+1) in a verify) of up to SLAB_ROWS rows take the
    custom kernel in slabs of its most rows (MLX's product of 12-16 float32 rows cost ~14 ms a row
    at the 9B shape): equal to MLX's product, and every row of a multi-row product is the same
    bits whichever rows share it (a last slab of one row is padded, never the one-row kernel)."""
    from mtp_engine.model.layers import SLAB_ROWS

    w = mx.random.normal((512, 1024), key=mx.random.key(3)) * 1024 ** -0.5
    q, s, b = mx.quantize(w, group_size=32, bits=4)
    lin = Linear(q, s, b, 4, 32, custom_kernel=True)
    x = mx.random.normal((SLAB_ROWS, 1, 1024), key=mx.random.key(4)) * 2.0  # B sequences of one token
    pair = np.array(lin(x[:2]))
    for rows in (9, 16, 17, 33, SLAB_ROWS):
        ref = np.array(mx.quantized_matmul(x[:rows], q, s, b, transpose=True, group_size=32, bits=4))
        got = np.array(lin(x[:rows]))
        assert got.shape == ref.shape and np.abs(got - ref).max() <= 3e-5 * np.abs(ref).max() + 1e-6, rows
        assert np.array_equal(got[:2], pair), rows
        last = np.array(lin(x[rows - 2:rows]))
        assert np.array_equal(got[rows - 2:], last), rows
        # every row alone on the tensor-core kernel gives its bits in any slab (columns of an mma
        # never mix); the one-row decode step's CUDA-core kernel sums in another order
        one = np.array(kernels.mma.quantized_rows(x[rows - 1, 0][None], q, s, b, 4, 32))
        assert np.array_equal(got[rows - 1, 0], one[0]), rows


def test_a_prompts_products_take_float32_precision_on_the_tensor_cores():
    """A sequence's products of more tokens than one slab (a short prompt) split x into three bf16
    parts: as precise as MLX's float32 product they replaced (a step's two parts: ~17 bits)."""
    from mtp_engine.model.layers import SLAB_ROWS

    w = mx.random.normal((512, 1024), key=mx.random.key(3)) * 1024 ** -0.5
    q, s, b = mx.quantize(w, group_size=32, bits=4)
    lin = Linear(q, s, b, 4, 32, custom_kernel=True)
    x = mx.random.normal((1, SLAB_ROWS, 1024), key=mx.random.key(4)) * 2.0
    ref = np.array(mx.quantized_matmul(x, q, s, b, transpose=True, group_size=32, bits=4), np.float64)
    three = np.abs(np.array(lin(x), np.float64) - ref).max() / np.abs(ref).max()
    two = np.abs(np.array(lin(x[:, :8]), np.float64) - ref[:, :8]).max() / np.abs(ref).max()
    assert three <= 3e-6, three
    assert three < two, (three, two)


def test_tensor_core_block_shapes_agree():
    """Every block shape scripts/bench/qmv_rows.py times computes the same product (split-K sums are
    added in a fixed order: run twice, bit-identical)."""
    w = mx.random.normal((1024, 2048), key=mx.random.key(9)) * 0.02
    q, s, b = mx.quantize(w, group_size=32, bits=4)
    x = mx.random.normal((5, 2048), key=mx.random.key(10))
    ref = np.array(mx.quantized_matmul(x, q, s, b, transpose=True, group_size=32, bits=4))
    for warps, tiles, stages in ((4, 2, 3), (4, 1, 4), (2, 4, 3), (8, 1, 3)):
        a = np.array(kernels.mma.quantized_rows(x, q, s, b, 4, 32, warps, tiles, stages))
        assert np.array_equal(a, np.array(kernels.mma.quantized_rows(x, q, s, b, 4, 32, warps, tiles, stages)))
        np.testing.assert_allclose(a, ref, atol=3e-5 * np.abs(ref).max())
