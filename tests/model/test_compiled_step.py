"""Compiled forwards (model/step.py) against the uncompiled ones: same tokens, same hidden states,
same speculative rounds, across KV capacity growth, for dense and MoE models."""
from __future__ import annotations

import mlx.core as mx
from mtp_engine.model.step import Pass
import numpy as np
import pytest

from tests.conftest import MOE_Q4, TINY_F32
from mtp_engine.generation.decode import PlainDecoder
from mtp_engine.model.kv_cache import KVCache
from mtp_engine.generation.sampling import Sampler, SamplerConfig
from mtp_engine.speculative.draft_mtp import DraftMTPDecoder, DraftParams

def _paths():
    return [TINY_F32, MOE_Q4]


def _hidden_trace(model, compiled: bool, ids: list[int], n: int, kv_step: int = 256):
    before = model.compile_steps  # a session-wide model: left as found
    model.compile_steps = compiled
    try:
        cache = model.make_cache()
        for c in cache.layers:
            if isinstance(c, KVCache):
                c.step = kv_step
        h = model.forward(mx.array([ids]), cache)
        tok = int(mx.argmax(model.logits(h[0, -1])).item())
        out, hiddens = [tok], []
        for _ in range(n):
            h = model.forward(mx.array([[tok]]), cache)
            hiddens.append(np.array(h[0, -1]))
            tok = int(mx.argmax(model.logits(h[0, -1])).item())
            out.append(tok)
        return out, np.stack(hiddens)
    finally:
        model.compile_steps = before


@pytest.mark.parametrize("which", [0, 1], ids=["dense", "moe"])
def test_compiled_decode_equals_uncompiled_across_capacity_growth(which, models):
    model = models(_paths()[which], exact=True).model
    ids = [3, 17, 101, 7, 42]
    # an 8-position growth step makes the compiled graph meet several capacities in 40 tokens
    ref, h_ref = _hidden_trace(model, False, ids, 40, kv_step=8)
    got, h_got = _hidden_trace(model, True, ids, 40, kv_step=8)
    assert got == ref
    np.testing.assert_allclose(h_got, h_ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("which", [0, 1], ids=["dense", "moe"])
def test_compiled_draft_mtp_equals_plain_greedy(which, models):
    """Verify with capture, rollback to a per-position slot, catch-up fused into drafting: all
    compiled, the greedy output is still plain decoding's."""
    model = models(_paths()[which], exact=True).model
    prompt = [5, 9, 250, 31, 77, 2, 64]
    before = model.compile_steps
    model.compile_steps = False
    plain = PlainDecoder(model, Sampler(SamplerConfig()))
    ref = plain.prefill(prompt)
    while len(ref) < 48:
        ref += plain.step()
    model.compile_steps = True
    try:
        for n_max in (1, 3):
            dec = DraftMTPDecoder(model, Sampler(SamplerConfig()), DraftParams(n_max))
            dec.prefill(prompt)
            got: list[int] = []
            while len(got) < 48:
                got += dec.step()
            assert got[:48] == ref[:48], n_max
            assert 0 < dec.counts.accepted < dec.counts.drafted  # rollback was exercised
    finally:
        model.compile_steps = before


def test_verify_row_padding_gives_the_unpadded_product():
    """On a GPU, 2..7-row quantized products are padded to 8 rows (a faster kernel path there);
    the rows kept must be the unpadded product's."""
    from mtp_engine.model import layers

    w = mx.random.normal((96, 64), key=mx.random.key(1))
    q, s, b = mx.quantize(w, group_size=32, bits=4)
    plain = layers.Linear(q, s, b, 4, 32, row_pad=0)
    padded = layers.Linear(q, s, b, 4, 32, row_pad=8)
    for rows in (1, 2, 5, 7, 8, 11):
        x = mx.random.normal((1, rows, 64), key=mx.random.key(rows))
        ref = np.array(plain(x))
        got = padded(x)
        assert got.shape == (1, rows, 96)
        np.testing.assert_allclose(np.array(got), ref, atol=1e-5)


class _FakeKernel:
    """Stands in for the CUDA kernel on a CPU: checks how it is called, computes MLX's product."""

    def __init__(self):
        self.variants = set()

    def __call__(self, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        from mtp_engine.model import kernels

        x, wq, s, b = inputs
        t = dict(template)
        assert t["M"] in kernels.qmv.ROW_VARIANTS and x.shape[0] == t["M"]
        assert grid[0] == wq.shape[0] // t["R"] * 32 and output_shapes == [(t["M"], wq.shape[0])]
        self.variants.add(t["M"])
        return [mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=t["GROUP"], bits=t["BITS"])]


class _FakeMmaKernel:
    """Stands in for the tensor-core kernel: checks its launch shape, computes MLX's product."""

    def __init__(self):
        self.rows = set()

    def __call__(self, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        x, wq, s, b = inputs
        t = dict(template)
        n = wq.shape[0]
        assert n % (16 * t["TM"]) == 0 and grid[0] == n // (16 * t["TM"]) * threadgroup[0]
        assert threadgroup[0] == 32 * t["NW"] and output_shapes == [(x.shape[0], n)]
        # each warp's shared memory: ST stages of 16 * TM rows x 80 bytes + their scales and biases
        assert t["ST"] * t["NW"] * t["TM"] * 1792 <= 48 * 1024
        # column tiles of 8 rows: as few as hold them (1, 2 or 4 compiled)
        assert t["NT"] in (1, 2, 4) and 8 * t["NT"] >= x.shape[0] and (t["NT"] == 1 or 4 * t["NT"] < x.shape[0])
        self.rows.add(x.shape[0])
        return [mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=t["GROUP"], bits=t["BITS"])]


def test_kernel_wrapper_pads_rows_to_few_variants(monkeypatch):
    from mtp_engine.model import kernels

    fake, fake_mma = _FakeKernel(), _FakeMmaKernel()
    monkeypatch.setattr(kernels.qmv, "_kernel", fake)
    monkeypatch.setattr(kernels.mma, "_kernel", fake_mma)
    w = mx.random.normal((64, 256), key=mx.random.key(5))
    q, s, b = mx.quantize(w, group_size=32, bits=8)
    assert kernels.qmv.supports(q, s, 8, 32, 32) and not kernels.qmv.supports(q, s, 8, 32, 33)
    assert not kernels.qmv.supports(q, s, 3, 32, 1) and not kernels.qmv.supports(q[:62], s[:62], 8, 32, 1)
    assert kernels.qmv.supports(q[:60], s[:60], 8, 32, 8) and not kernels.qmv.supports(q[:60], s[:60], 8, 32, 9)
    for m in range(1, 33):
        x = mx.random.normal((m, 256), key=mx.random.key(m))
        got = kernels.qmv.quantized_rows(x, q, s, b, 8, 32)
        ref = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=32, bits=8)
        assert got.shape == (m, 64)
        # 1e-3 (of values ~16): on a GPU MLX's product takes different kernels for different row counts
        np.testing.assert_allclose(np.array(got), np.array(ref), atol=1e-3)
    # one row on the CUDA cores (plain decoding's fastest), 2..32 on the tensor cores
    assert fake.variants == {1} and fake_mma.rows == set(range(2, 33))
    assert kernels.mma.supports(q[:48], s[:48], 8, 32, 2)  # 48 features: 16-feature tiles
    assert not kernels.mma.supports(q, s, 8, 128, 2) and not kernels.mma.supports(q, s, 4, 32, 33)
    for m in (2, 5):  # the CUDA-core kernel alone still pads to its variants
        got = kernels.qmv.simt_rows(mx.random.normal((m, 256)), q, s, b, 8, 32)
        assert got.shape == (m, 64)
    assert fake.variants == {1, 2, 8}


def test_kernel_self_test_falls_back_when_the_kernel_fails(monkeypatch):
    from mtp_engine.model import kernels

    def broken(**kwargs):
        raise RuntimeError("nvrtc: compilation failed")

    monkeypatch.setattr(kernels.cuda_kernel, "cuda", lambda: True)
    monkeypatch.setattr(kernels, "REGISTRY", kernels.Registry())
    monkeypatch.setattr(kernels.qmv, "_kernel", broken)
    with pytest.warns(UserWarning, match="custom quantized kernel unavailable"):
        assert kernels.available("qmv") is False
    assert kernels.available("qmv") is False  # remembered: no second warning, no second try


@pytest.mark.parametrize("compiled", [False, True], ids=["graph", "compiled"])
def test_a_device_rollback_starts_the_next_forward_from_the_kept_slot(compiled, models):
    """After a captured pass of S tokens rolled back with a device count n (no kernel runs: the
    gated-delta-net layers keep every per-position state and the next forward starts from slot
    n), the next forward and every cache equal a fresh cache fed only the kept tokens."""
    model = models(TINY_F32, exact=True).model
    toks = [5, 9, 250, 31, 77, 2, 64, 11, 90, 13, 8]
    prefix, s = 3, 5
    before = model.compile_steps
    model.compile_steps = compiled
    try:
        for n in range(s + 1):
            cache = model.make_cache()
            model.forward(mx.array([toks[:prefix]]), cache)
            cache.kv_to_device()
            model.forward(mx.array([toks[prefix:prefix + s]]), cache, Pass.ROUND_VERIFY)
            cache.rollback_lazy(mx.array(n, dtype=mx.int32))
            cache.offset += n  # resident forwards leave the host's count to the round's read
            rec = [c for c in cache.layers if not isinstance(c, KVCache)]
            assert all(isinstance(c.kept, mx.array) for c in rec)
            nxt = toks[prefix + n:prefix + n + 2]
            # the next verify, captured too (the usual round): it starts from the slot itself, the
            # states are not gathered before it; then rolled back to keep both of its tokens
            cache.begin_capture(len(nxt))
            assert all(c.window is not None and isinstance(c.kept, mx.array) for c in rec)
            h = model.forward(mx.array([nxt]), cache, Pass.ROUND_VERIFY)
            cache.rollback_lazy(mx.array(len(nxt), dtype=mx.int32))
            cache.offset += len(nxt)
            cache.to_host()

            fresh = model.make_cache()
            model.forward(mx.array([toks[:prefix + n]]), fresh)
            h_ref = model.forward(mx.array([nxt]), fresh)
            np.testing.assert_allclose(np.array(h), np.array(h_ref), atol=2e-5, rtol=0, err_msg=f"kept {n}")
            for a, b in zip(cache.layers, fresh.layers):
                if isinstance(a, KVCache):
                    assert int(a.offset) == int(b.offset) == prefix + n + 2
                    continue
                np.testing.assert_allclose(np.array(a.state), np.array(b.state), atol=2e-5, rtol=0)
                np.testing.assert_allclose(np.array(a.conv), np.array(b.conv), atol=2e-5, rtol=0)
    finally:
        model.compile_steps = before
