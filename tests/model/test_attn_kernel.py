"""The fused attention kernels (`model/kernels/attn.py`) against the MLX operations they replace:
on random layers (every token count 1..16, GQA, partial rope, positions with and without a filled
cache) and through whole models (greedy decode and a draft-mtp run with rollbacks, kernel on and
off). CUDA only: elsewhere the kernels are never selected and these tests skip."""
from __future__ import annotations

import pytest

import mlx.core as mx
from mtp_engine.model.step import Pass

from mtp_engine.model import kernels

GPU = kernels.cuda()
gpu_only = pytest.mark.gpu  # the fused attention kernels run on a CUDA GPU only (conftest skips elsewhere)


def test_supports_rejects_shapes_the_kernels_cannot_hold():
    assert kernels.attn.supports(16, 4, 256, 64, 1, 1)
    assert kernels.attn.supports(4, 2, 64, 16, 1, 16)
    assert kernels.attn.supports(16, 4, 256, 64, 8, 4)          # a batched decode or verify step
    assert not kernels.attn.supports(16, 4, 256, 64, kernels.attn.MAX_BATCH + 1, 1)
    assert not kernels.attn.supports(16, 4, 256, 64, 1, 17)     # more tokens than a verify
    assert not kernels.attn.supports(16, 4, 512, 64, 1, 1)      # a head wider than a block
    assert not kernels.attn.supports(16, 4, 80, 64, 1, 1)       # not whole warps
    assert not kernels.attn.supports(16, 3, 256, 64, 1, 1)      # not whole GQA groups
    assert kernels.attn.supports(16, 4, 256, 64, 1, 1, mx.float16)   # 16-bit caches (EngineOptions.kv_dtype)
    assert kernels.attn.supports(16, 4, 256, 64, 1, 1, mx.bfloat16)
    assert not kernels.attn.supports(16, 4, 256, 64, 1, 1, mx.float64)


def _inputs(nh, nkv, d, s, pos, seed=0):
    ks = mx.random.split(mx.random.key(seed), 5)
    y = mx.random.normal((s, (2 * nh + 2 * nkv) * d), key=ks[0])
    qn = 1.0 + 0.1 * mx.random.normal((d,), key=ks[1])
    kn = 1.0 + 0.1 * mx.random.normal((d,), key=ks[2])
    keys = mx.random.normal((1, nkv, pos + s + 7, d), key=ks[3])
    values = mx.random.normal((1, nkv, pos + s + 7, d), key=ks[4])
    return y, qn, kn, keys, values


def _numpy_attention(y, qn, kn, keys, values, pos, nh, nkv, d, nrot, eps=1e-6, base=10000.0):
    """The layer in float64 NumPy, written from the model's definition (per-head RMSNorm, NEOX rope
    on the first nrot dims, GQA, causal softmax, sigmoid gate): (out [S, nh*d], new keys, new values)."""
    import numpy as np
    Y, QN, KN = (np.array(a, dtype=np.float64) for a in (y, qn, kn))
    K0, V0 = np.array(keys, dtype=np.float64)[0], np.array(values, dtype=np.float64)[0]
    s = Y.shape[0]
    rms = lambda a, w: a / np.sqrt((a * a).mean(-1, keepdims=True) + eps) * w  # noqa: E731

    def rope(a, p):
        half = nrot // 2
        inv = base ** (-np.arange(half) * 2.0 / nrot)
        c, sn = np.cos(p * inv), np.sin(p * inv)
        r = a.copy()
        r[:half] = a[:half] * c - a[half:nrot] * sn
        r[half:nrot] = a[:half] * sn + a[half:nrot] * c
        return r

    e1 = 2 * nh * d
    K = np.concatenate([K0[:, :pos], np.zeros((nkv, s, d))], axis=1)
    V = np.concatenate([V0[:, :pos], np.zeros((nkv, s, d))], axis=1)
    for t in range(s):
        for j in range(nkv):
            K[j, pos + t] = rope(rms(Y[t, e1 + j * d:e1 + (j + 1) * d], KN), pos + t)
            V[j, pos + t] = Y[t, e1 + nkv * d + j * d:e1 + nkv * d + (j + 1) * d]
    out = np.zeros((s, nh * d))
    for t in range(s):
        for h in range(nh):
            q = rope(rms(Y[t, h * 2 * d:h * 2 * d + d], QN), pos + t) * d ** -0.5
            g = Y[t, h * 2 * d + d:(h + 1) * 2 * d]
            j = h // (nh // nkv)
            sc = K[j, :pos + t + 1] @ q
            p = np.exp(sc - sc.max())
            out[t, h * d:(h + 1) * d] = (p / p.sum()) @ V[j, :pos + t + 1] / (1 + np.exp(-g))
    return out, K[:, pos:], V[:, pos:]


def test_reference_is_the_layer_computation_on_any_device():
    """The MLX-operations reference (what GatedAttention computes) against the float64 NumPy one,
    so that neither a wrong reference nor a wrong kernel can pass unnoticed."""
    import numpy as np
    nh, nkv, d, nrot, s, pos = 4, 2, 32, 8, 3, 5
    y, qn, kn, keys, values = _inputs(nh, nkv, d, s, pos)
    out, k_new, v_new = kernels.attn.reference(y, qn, kn, keys, values, pos, nh, nkv, d, nrot, 1e-6, 10000.0)
    want = _numpy_attention(y, qn, kn, keys, values, pos, nh, nkv, d, nrot)
    # 1e-3: on a GPU MLX's attention products run at reduced (TF32-class) precision
    np.testing.assert_allclose(np.array(out), want[0], atol=1e-3)
    np.testing.assert_allclose(np.array(k_new)[0], want[1], atol=1e-3)
    np.testing.assert_allclose(np.array(v_new)[0], want[2], atol=1e-6)


@gpu_only
@pytest.mark.parametrize("shape", [(16, 4, 256, 64), (4, 2, 64, 16), (8, 8, 128, 128), (2, 1, 32, 32)])
@pytest.mark.parametrize("pos", [0, 1, 37, 300])
def test_kernels_equal_float64_attention_for_every_token_count(shape, pos):
    import numpy as np
    nh, nkv, d, nrot = shape
    # every token count on the small shapes; the float64 reference is slow at the 9B head shape
    counts = range(1, kernels.attn.MAX_TOKENS + 1) if nh * d <= 1024 else (1, 2, 3, 4, 8, 16)
    for s in counts:
        y, qn, kn, keys, values = _inputs(nh, nkv, d, s, pos, seed=s + pos)
        p = mx.array([pos], dtype=mx.int32)
        k_new, v_new = kernels.attn.new_kv(y, kn, p, nh, nkv, d, nrot, 1e-6, 10000.0)
        keys = mx.slice_update(keys, k_new, p, axes=(2,))
        values = mx.slice_update(values, v_new, p, axes=(2,))
        out = kernels.attn.attend(y, qn, keys, values, p, nh, nkv, d, nrot, 1e-6, 10000.0)
        want = _numpy_attention(y, qn, kn, keys, values, pos, nh, nkv, d, nrot)
        for name, got, ref in (("out", out, want[0]), ("keys", k_new[0], want[1]), ("values", v_new[0], want[2])):
            err = float(np.abs(np.array(got) - ref).max())
            assert err < 2e-4, (shape, pos, s, name, err)


CACHE_TYPES = [mx.float32, mx.float16, mx.bfloat16]


@gpu_only
@pytest.mark.parametrize("dtype", CACHE_TYPES, ids=str)
@pytest.mark.parametrize("pos", [0, 37])
def test_kernels_near_the_mlx_layer(pos, dtype):
    # the self-test's comparison: MLX's own operations (reduced-precision products on a GPU)
    for s in (1, 2, 5, 16):
        assert kernels.attn.max_error(16, 4, 256, 64, s, pos, seed=s, dtype=dtype) < 2e-3


@gpu_only
@pytest.mark.parametrize("dtype", CACHE_TYPES, ids=str)
@pytest.mark.parametrize("s", [1, 4, 16])
def test_batched_kernels_equal_the_mlx_layer_row_by_row(s, dtype):
    # 4 sequences in one launch, each at its own position, each compared with the layer run alone
    for shape in ((16, 4, 256, 64), (4, 2, 64, 16)):
        assert kernels.attn.max_error(*shape, s, [0, 37, 5, 300], seed=s, dtype=dtype) < 2e-3, shape


def test_a_16_bit_cache_reference_reads_rounded_keys():
    """The reference with a 16-bit cache attends over the new keys and values as the cache holds
    them (rounded), as the layer reads them back: its output moves by about that rounding, and its
    new keys are the float32 ones rounded."""
    import numpy as np
    nh, nkv, d, nrot, s, pos = 4, 2, 32, 8, 3, 5
    y, qn, kn, keys, values = _inputs(nh, nkv, d, s, pos)
    out32, k32, v32 = kernels.attn.reference(y, qn, kn, keys, values, pos, nh, nkv, d, nrot, 1e-6, 10000.0)
    out16, k16, v16 = kernels.attn.reference(y, qn, kn, keys.astype(mx.float16), values.astype(mx.float16), pos,
                                            nh, nkv, d, nrot, 1e-6, 10000.0)
    assert k16.dtype == mx.float16 and v16.dtype == mx.float16
    np.testing.assert_array_equal(np.array(k16.astype(mx.float32)), np.array(k32.astype(mx.float16).astype(mx.float32)))
    err = float(mx.abs(out16 - out32).max())
    assert 0 < err < 1e-2


@gpu_only
@pytest.mark.parametrize("dtype", CACHE_TYPES, ids=str)
@pytest.mark.parametrize("pos", [1, 255, 4096, 32768])
@pytest.mark.parametrize("s", [1, 4, 9])
def test_long_contexts_split_over_blocks_equal_the_mlx_layer(pos, s, dtype):
    """Flash-decoding: contexts of up to 32k keys, split over many blocks and merged, at the 9B
    head shape, for a decode step, a verify's rows and a batch whose rows sit at different lengths
    (one of them short enough for a single key range)."""
    assert kernels.attn.splits(pos + s + 7) == min(-(-(pos + s + 7) // kernels.attn.KEYS_PER_SPLIT),
                                                   kernels.attn.MAX_SPLITS)
    # float32 rope angles resolve a position of p to about p * 1.2e-7 rad (both the kernel's and
    # MLX's, rounded differently): the new keys and the scores differ by that much at 32k
    tol = 2e-3 + 2e-7 * pos
    assert kernels.attn.max_error(16, 4, 256, 64, s, pos, seed=s, dtype=dtype) < tol, (pos, s)
    if pos >= 4096:
        assert kernels.attn.max_error(16, 4, 256, 64, s, [pos, 3, pos // 2], seed=s + 1, dtype=dtype) < tol, (pos, s)


@gpu_only
@pytest.mark.parametrize("pos", [255, 4096, 32768])
def test_key_ranges_merge_exactly(pos):
    """The split and merge alone, free of rope: zero keys (every score 0, so each query averages
    the values it sees) and values that change with every key range; the output is then each
    value column's mean over 0..pos+s, known exactly. A lost, doubled or misweighted range moves
    it by far more than float32 rounding."""
    import numpy as np
    nh, nkv, d, nrot, s = 16, 4, 256, 64, 3
    cap = pos + s + 7
    e = (2 * nh + 2 * nkv) * d
    y = np.zeros((s, e), np.float32)
    y[:, :2 * nh * d] = np.random.default_rng(pos).normal(size=(s, 2 * nh * d))  # queries and gates
    keys = np.zeros((1, nkv, cap, d), np.float32)
    t = np.arange(cap, dtype=np.float64)
    col = (np.sin(t[:, None] * 0.001 * (1 + np.arange(d))[None, :]) + t[:, None] / cap).astype(np.float32)
    values = np.broadcast_to(col, (1, nkv, cap, d)).copy()
    for i in range(s):  # the new tokens' values: the same pattern at their positions
        y[i, 2 * nh * d + nkv * d:] = np.tile(col[pos + i], nkv)
    p = mx.array([pos], dtype=mx.int32)
    out = np.array(kernels.attn.attend(mx.array(y), mx.ones((d,)), mx.array(keys), mx.array(values), p, nh, nkv, d,
                                      nrot, 1e-6, 1e7))
    for i in range(s):
        mean = col[:pos + i + 1].astype(np.float64).mean(axis=0)
        gate = 1 / (1 + np.exp(-y[i, :2 * nh * d].reshape(nh, 2, d)[:, 1].astype(np.float64)))
        want = (gate * mean[None, :]).reshape(-1)
        assert np.abs(out[i] - want).max() < 1e-4, (pos, i, np.abs(out[i] - want).max())


def test_key_ranges_follow_the_capacity():
    assert kernels.attn.splits(1) == 1 and kernels.attn.splits(kernels.attn.KEYS_PER_SPLIT) == 1
    assert kernels.attn.splits(kernels.attn.KEYS_PER_SPLIT + 1) == 2
    assert kernels.attn.splits(10 ** 7) == kernels.attn.MAX_SPLITS


@gpu_only
@pytest.mark.parametrize("which", [0, 1], ids=["dense", "moe"])
def test_batched_forward_with_kernels_equals_without(which):
    # sequences of different lengths decoding together (batch_cache.BatchCache): hidden states of
    # a 1-token and a 4-token step with the fused attention and GDN kernels and with MLX's path
    import numpy as np
    from tests.conftest import need
    from mtp_engine import load
    from mtp_engine.model.batch_cache import BatchCache
    m = load(need(_models()[which])).model
    before = m.options

    def steps(kernels: str) -> list:
        m.use(before.updated(kernels=kernels))
        try:
            batch = BatchCache(m)
            for n in (5, 12, 30):
                c = m.make_cache()
                m.forward(mx.array([[(7 * i + n) % 200 + 10 for i in range(n)]]), c)
                batch.add(c)
            outs = []
            for width in (1, 4, 1):
                ids = mx.array([[(3 * r + j) % 200 + 10 for j in range(width)] for r in range(3)])
                outs.append(np.array(m.forward_batch(ids, batch)))
            return outs
        finally:
            m.use(before)

    for j, (a, b) in enumerate(zip(steps("custom"), steps("qmv,norm"))):
        np.testing.assert_allclose(a, b, atol=2e-3, rtol=0, err_msg=f"step {j}")


@gpu_only
def test_kernels_are_available_on_a_cuda_gpu():
    kernels.REGISTRY.forget()
    assert kernels.available("attn") is True


def test_kernels_are_not_offered_off_cuda():
    if not GPU:
        assert kernels.available("attn") is False


def _models():
    from tests.conftest import FIXTURES, TINY
    return [TINY / "qwen35-mtp-tiny-Q4_K_M.gguf", FIXTURES / "llamacpp-moe" / "qwen35moe-mtp-tiny-Q4_K_M.gguf"]


def _logits_after(model, ids, chunks, fused: bool, compiled: bool, kv_dtype: str = "float16"):
    """Forwards `ids` in chunks of the given sizes (a prompt, then decode/verify-sized pieces, each
    longer than two rolled back by two positions, as a verify would) and returns every chunk's
    last logits."""
    import numpy as np
    before = model.options
    model.use(before.updated(kernels="custom" if fused else "qmv,gdn,norm", compile_steps=compiled, kv_dtype=kv_dtype))
    try:
        assert all(layer.mixer.fused_kernel == fused for layer in model.layers
                   if hasattr(layer.mixer, "q_norm"))
        cache, out, i = model.make_cache(), [], 0
        for n in chunks:
            h = model.forward(mx.array([ids[i:i + n]]), cache, Pass.VERIFY)
            out.append(np.array(model.logits(h[0, -1])))
            i += n
            if n > 2:
                cache.rollback(n - 2)
                i -= 2
        return out
    finally:
        model.use(before)


@gpu_only
@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("which", [0, 1], ids=["dense", "moe"])
def test_model_with_kernels_equals_model_without(which, compiled, kv_dtype):
    import numpy as np
    from tests.conftest import need
    from mtp_engine import load
    m = load(need(_models()[which])).model
    ids = [(13 * i + 7) % 200 + 10 for i in range(80)]
    chunks = [20, 1, 1, 4, 1, 16, 3, 1, 8, 2, 1]
    got = _logits_after(m, ids, chunks, fused=True, compiled=compiled, kv_dtype=kv_dtype)
    want = _logits_after(m, ids, chunks, fused=False, compiled=compiled, kv_dtype=kv_dtype)
    for j, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_allclose(a, b, atol=2e-3, rtol=0, err_msg=f"chunk {j} ({chunks[j]} tokens)")


@gpu_only
def test_draft_mtp_greedy_equals_plain_with_kernels():
    from tests.conftest import need
    from mtp_engine import generate
    from mtp_engine import load
    mdl = load(need(_models()[0]))
    assert any(getattr(layer.mixer, "fused_kernel", False) and hasattr(layer.mixer, "q_norm")
               for layer in mdl.model.layers)
    plain = generate("def f(x):", model=mdl, max_tokens=40, spec="none")
    for n_max in (1, 3, 6):
        spec = generate("def f(x):", model=mdl, max_tokens=40, spec="draft-mtp", n_max=n_max)
        assert spec.token_ids == plain.token_ids


@gpu_only
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=str)
def test_a_tail_reads_as_the_main_buffer(dtype):
    """A cache whose positions from `base` on sit in a tail (`KVCache.rebase`, what compiled steps
    write): the same output as one buffer holding every position (the main buffer's positions
    past base hold garbage, which must not be read); a query before its tail's start gets NaN."""
    import numpy as np
    nh, nkv, d, nrot, width = 16, 4, 256, 64, 256
    for pos, s, base in ((300, 1, 290), (300, 4, 300), (4096, 9, 3900), (5, 2, 0)):
        cap = pos + s + 7
        y, qn, _, keys, values = _inputs(nh, nkv, d, s, pos, seed=pos + s)
        y = y[None]
        keys, values = keys.astype(dtype), values.astype(dtype)
        p = mx.array([pos], dtype=mx.int32)
        one = kernels.attn.attend(y, qn, keys, values, p, nh, nkv, d, nrot, 1e-6, 10000.0)
        n = pos + s - base
        pad = mx.zeros((1, nkv, width - n, d), dtype)
        tail = (mx.concatenate([keys[:, :, base:pos + s], pad], axis=2),
                mx.concatenate([values[:, :, base:pos + s], pad], axis=2), mx.array([base], dtype=mx.int32))
        junk = mx.arange(cap)[None, None, :, None] >= base
        big_k = mx.where(junk, 1e4, keys).astype(dtype)
        big_v = mx.where(junk, -1e4, values).astype(dtype)
        two = kernels.attn.attend(y, qn, big_k, big_v, p, nh, nkv, d, nrot, 1e-6, 10000.0, tail=tail)
        assert float(mx.abs(one - two).max()) < 1e-4, (pos, s, base)
    late = (tail[0], tail[1], mx.array([pos + 1], dtype=mx.int32))
    bad = kernels.attn.attend(y, qn, keys, values, p, nh, nkv, d, nrot, 1e-6, 10000.0, tail=late)
    assert np.isnan(np.array(bad)).all()


@gpu_only
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=str)
def test_a_batchs_rows_read_their_own_tails(dtype):
    """A batch's cache with tails (`BatchCache.rebase`): row b's positions from base[b] on sit in
    its own tail row; each row's output equals the row read from one buffer (garbage in the main
    buffers past each base is never read), for 1 and 4 tokens per row and rows far apart."""
    nh, nkv, d, nrot, width = 16, 4, 256, 64, 64
    for s in (1, 4):
        rows = [(300, 290), (40, 40), (4096, 4070), (7, 0)]  # (position of the first new token, base)
        cap = max(p for p, _ in rows) + s + 7  # (the longest row's inputs as `_inputs` makes them)
        ys, qs, keys, values = [], None, [], []
        for i, (pos, _) in enumerate(rows):
            y, qn, _, k, v = _inputs(nh, nkv, d, s, pos, seed=pos + s + i)
            k = mx.pad(k, [(0, 0), (0, 0), (0, cap - k.shape[2]), (0, 0)]).astype(dtype)
            v = mx.pad(v, [(0, 0), (0, 0), (0, cap - v.shape[2]), (0, 0)]).astype(dtype)
            ys.append(y)
            qs = qn
            keys.append(k)
            values.append(v)
        y = mx.stack(ys)
        keys, values = mx.concatenate(keys), mx.concatenate(values)
        pos = mx.array([p for p, _ in rows], dtype=mx.int32)
        one = kernels.attn.attend(y, qs, keys, values, pos, nh, nkv, d, nrot, 1e-6, 10000.0)
        tk, tv = [], []
        for b, (p, base) in enumerate(rows):
            n = p + s - base
            pad = mx.zeros((1, nkv, width - n, d), dtype)
            tk.append(mx.concatenate([keys[b:b + 1, :, base:p + s], pad], axis=2))
            tv.append(mx.concatenate([values[b:b + 1, :, base:p + s], pad], axis=2))
        base = mx.array([b0 for _, b0 in rows], dtype=mx.int32)
        junk = mx.arange(cap)[None, None, :, None] >= base[:, None, None, None]
        big_k = mx.where(junk, 1e4, keys).astype(dtype)
        big_v = mx.where(junk, -1e4, values).astype(dtype)
        two = kernels.attn.attend(y, qs, big_k, big_v, pos, nh, nkv, d, nrot, 1e-6, 10000.0,
                                  tail=(mx.concatenate(tk), mx.concatenate(tv), base))
        for b in range(len(rows)):
            assert float(mx.abs(one[b] - two[b]).max()) < 1e-4, (s, rows[b])


def test_layers_with_q_k_v_stored_apart_take_the_fused_kernels_too(monkeypatch):
    """A Q4_K_M file keeps v in Q6_K, so q, k and v cannot be joined into one product at load: the
    fused path then puts the three products side by side, in the joined product's layout [q and
    its gate | k | v], instead of leaving such models (the shipped one, llama.cpp's Q4_K_M files) on
    the MLX path. Routing and layout only, on any device: the kernels are stood in for (their
    arithmetic is the GPU tests' above)."""
    from mtp_engine import load
    from mtp_engine.model.blocks import GatedAttention
    from tests.conftest import SHIPPED, need

    net = load(need(SHIPPED)).model
    att = next(o for o in net.modules() if isinstance(o, GatedAttention))
    assert att.qkv is None and att.v.bits != att.q.bits  # stored apart: what this test is about
    seen = []

    def new_kv(y, k_norm, pos, n_head, n_head_kv, head_dim, *rest, dtype=None):
        seen.append(y)
        b, s, _ = y.shape
        return mx.zeros((b, n_head_kv, s, head_dim)), mx.zeros((b, n_head_kv, s, head_dim))

    def attend(y, q_norm, keys, values, pos, n_head, n_head_kv, head_dim, *rest, tail=None):
        return mx.zeros((*y.shape[:2], n_head * head_dim))

    monkeypatch.setattr(kernels.attn, "new_kv", new_kv)
    monkeypatch.setattr(kernels.attn, "attend", attend)
    monkeypatch.setattr(kernels.attn, "supports", lambda *a, **k: True)
    monkeypatch.setattr(att, "fused_kernel", True)
    x = mx.random.normal((1, 2, net.cfg.hidden_size), key=mx.random.key(0))
    att(x, net.make_cache().layers[net.cfg.recurrent.index(False)])
    assert len(seen) == 1
    q, k, v = att._inputs(x)
    assert mx.array_equal(seen[0], mx.concatenate([q, k, v], axis=-1))
