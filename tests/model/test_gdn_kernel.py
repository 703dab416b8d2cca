"""The fused gated-delta-net CUDA kernel (model/kernels/gdn.py) against the pure-MLX mixer
(model/gdn.py), which the reference tests check against llama.cpp and a float64 NumPy forward.

On a machine without a CUDA GPU only the shape rules run (the kernel cannot); on one with a GPU
every output is compared for 1..16 tokens, for the 9B layer shape and the fixtures' shapes, and
whole models with and without the kernel are compared through captured passes rolled back at
every position."""
from __future__ import annotations

import mlx.core as mx
from mtp_engine.model.step import Pass
import numpy as np
import pytest

from tests.conftest import FIXTURES, TINY
from mtp_engine.model import gdn
from mtp_engine.model import kernels
from mtp_engine.model.cache import RecurrentCache

TOL = 2e-4  # float32, sums of up to 128 products of O(1) values in another order
GPU = kernels.cuda()
needs_gpu = pytest.mark.gpu  # the fused GDN kernel runs only on a CUDA GPU (conftest skips elsewhere)

SHAPES = [gdn.Dims(2, 64, 4, 64, 4, 1e-6),  # tiny fixtures
          gdn.Dims(4, 64, 8, 64, 4, 1e-6),  # the shipped model
          gdn.Dims(16, 128, 32, 128, 4, 1e-6)]  # Qwen3.5-9B


def test_supported_shapes():
    for d in SHAPES:
        assert kernels.gdn.supports(d.kh, d.kd, d.vh, d.vd, 1, 1)
        assert kernels.gdn.supports(d.kh, d.kd, d.vh, d.vd, 1, 16)
        assert not kernels.gdn.supports(d.kh, d.kd, d.vh, d.vd, 1, 17)  # prefill: chunked MLX path
        assert kernels.gdn.supports(d.kh, d.kd, d.vh, d.vd, 8, 4)  # a batched decode or verify step
        assert not kernels.gdn.supports(d.kh, d.kd, d.vh, d.vd, kernels.gdn.MAX_BATCH + 1, 1)
    assert not kernels.gdn.supports(2, 66, 4, 64, 1, 1)  # key dim not split evenly over 4 lanes
    assert not kernels.gdn.supports(2, 64, 4, 4, 1, 1)  # a block that is not whole warps


@needs_gpu
@pytest.mark.parametrize("d", SHAPES, ids=lambda d: f"kd{d.kd}vh{d.vh}")
@pytest.mark.parametrize("s", list(range(1, 17)))
def test_kernel_equals_mlx_mixer(d, s):
    assert kernels.gdn.max_error(d, s, seed=s) < TOL


@needs_gpu
@pytest.mark.parametrize("d", SHAPES, ids=lambda d: f"kd{d.kd}vh{d.vh}")
@pytest.mark.parametrize("s,capture,earlier", [(1, False, 0), (4, True, 0), (1, False, 3), (5, True, 5)])
def test_batched_kernel_equals_mlx_mixer_row_by_row(d, s, capture, earlier):
    # 8 sequences in one launch, each from its own slot of an earlier captured pass when `earlier`:
    # every row's outputs are the MLX mixer's (which runs the batch as one array)
    assert kernels.gdn.max_error(d, s, seed=11 * s + earlier, capture=capture, earlier=earlier, batch=8) < TOL


@needs_gpu
@pytest.mark.parametrize("d", SHAPES, ids=lambda d: f"kd{d.kd}vh{d.vh}")
@pytest.mark.parametrize("s,width,earlier,batch", [(1, 5, 0, 1), (3, 5, 0, 1), (5, 5, 0, 1), (2, 9, 4, 3), (4, 16, 0, 8)])
def test_kernel_captures_into_fixed_width_buffers(d, s, width, earlier, batch):
    # a verify of s tokens into buffers `width` wide (cache.RecurrentCache.capture_width): the
    # first s + 1 slots and K-1+s window rows are the MLX mixer's, from a slot of an earlier pass too
    assert kernels.gdn.max_error(d, s, seed=3 * s + width, capture=True, earlier=earlier, batch=batch,
                                width=width) < TOL


@needs_gpu
def test_batched_kernel_rows_are_independent():
    # a row's result does not depend on the other rows: row 2 of a batch equals it run alone
    d = SHAPES[1]
    x = kernels.gdn.random_inputs(d, 3, seed=5, batch=4)
    names = ["qkv_x", "z_x", "alpha_x", "beta_x", "conv0", "conv_w", "dt_bias", "a", "norm", "state0"]
    dims = (d.kh, d.kd, d.vh, d.vd, d.eps)
    per_row = {"qkv_x", "z_x", "alpha_x", "beta_x", "conv0", "state0"}
    whole = kernels.gdn.gated_delta(*[x[n] for n in names], *dims)
    alone = kernels.gdn.gated_delta(*[x[n][2:3] if n in per_row else x[n] for n in names], *dims)
    for w, a in zip(whole, alone):
        assert float(mx.abs(w[2:3] - a).max().item()) == 0.0


@needs_gpu
def test_kernel_on_contiguous_inputs():
    # the unjoined products arrive as separate dense arrays rather than slices of one product
    d = SHAPES[0]
    x = kernels.gdn.random_inputs(d, 3, seed=7, slices=False)
    ref = gdn.mix(d, **x)
    got = kernels.gdn.gated_delta(x["qkv_x"], x["z_x"], x["alpha_x"], x["beta_x"], x["conv0"], x["conv_w"],
                                 x["dt_bias"], x["a"], x["norm"], x["state0"], d.kh, d.kd, d.vh, d.vd, d.eps)
    for r, g in zip(ref, got):
        assert float(mx.abs(r - g).max().item()) < TOL


def _models():
    return [TINY / "qwen35-mtp-tiny-Q4_K_M.gguf", FIXTURES / "llamacpp-moe" / "qwen35moe-mtp-tiny-Q4_K_M.gguf"]


def _pass(model, ids, s, n_keep, fused: bool):
    """Prompt, then a captured pass of s tokens rolled back to n_keep, then one more token:
    returns every recurrent state and the last logits."""
    before = model.options
    model.use(before.updated(kernels="qmv,gdn,norm" if fused else "qmv,norm"))
    try:
        cache = model.make_cache()
        model.forward(mx.array([ids[:8]]), cache)
        model.forward(mx.array([ids[8:8 + s]]), cache, Pass.VERIFY)
        cache.rollback(n_keep)
        h = model.forward(mx.array([[ids[8 + n_keep]]]), cache)
        logits = model.logits(h[0, -1])
        # KVCache has a state() method: only the recurrent layers' arrays are compared
        states = [np.array(c.state) for c in cache.layers if isinstance(c, RecurrentCache)]
        convs = [np.array(c.conv) for c in cache.layers if isinstance(c, RecurrentCache)]
        return np.array(logits), states, convs
    finally:
        model.use(before)


@needs_gpu
@pytest.mark.parametrize("path", _models(), ids=lambda p: p.name)
@pytest.mark.parametrize("s", [1, 2, 3, 4, 5, 8, 16])
def test_model_rollback_every_position(path, s, models):
    m = models(path).model
    ids = [(17 * i + 5) % 200 + 10 for i in range(8 + s + 1)]
    for n_keep in range(s + 1):
        lf, sf, cf = _pass(m, ids, s, n_keep, fused=True)
        lr, sr, cr = _pass(m, ids, s, n_keep, fused=False)
        np.testing.assert_allclose(lf, lr, atol=2e-3, rtol=0, err_msg=f"logits, s={s}, keep {n_keep}")
        for a, b in zip(sf + cf, sr + cr):
            np.testing.assert_allclose(a, b, atol=TOL, rtol=0, err_msg=f"cache, s={s}, keep {n_keep}")


@needs_gpu
@pytest.mark.parametrize("rows,h", [(1, 4096), (5, 4096), (16, 4096), (3, 256), (2, 512)])
def test_add_rms_norm_kernel(rows, h):
    from mtp_engine.model import kernels
    x = mx.random.normal((1, rows, h), key=mx.random.key(rows))
    d = mx.random.normal((1, rows, h), key=mx.random.key(h))
    w = mx.random.normal((h,), key=mx.random.key(9))
    got_h, got_n = kernels.norm.launch(x, d, w, 1e-6)
    assert float(mx.abs(got_h - (x + d)).max().item()) < 1e-5
    assert float(mx.abs(got_n - mx.fast.rms_norm(x + d, w, 1e-6)).max().item()) < 1e-4
