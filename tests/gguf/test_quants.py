"""Tests for mtp_engine.gguf.quants: GGUF block formats repacked into MLX affine quantization.

The reference is ``gguf.quants.dequantize``. Every lossless type must match it bit for bit after
``mx.dequantize``; Q6_K in "q8" mode must stay within half an 8-bit step of it. Run with
``pytest -s`` to see the measured Q6_K requantization error.
"""
from __future__ import annotations


import gguf
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import fixtures_dir
from mtp_engine.errors import MTPEngineError
from mtp_engine.gguf import quants
from mtp_engine.gguf.quants import QuantizedWeight, repack, repack_float

QT = gguf.GGMLQuantizationType
FIXTURES = fixtures_dir() / "llamacpp"

EXACT_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q5_K]
EXPECTED_BITS = {QT.Q8_0: 8, QT.Q4_0: 4, QT.Q4_1: 4, QT.Q5_0: 5, QT.Q5_1: 5, QT.Q4_K: 4, QT.Q5_K: 5}
# Byte offsets of the f16 fields (d, and m / dmin where present) inside one block.
F16_OFFSETS = {
    QT.Q8_0: (0,),
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}
# f16 extremes: largest finite, smallest subnormal (~6e-8), a mid subnormal, the smallest
# normal, both zeros, negatives and ordinary values.
EXTREME_F16 = np.array(
    [65504.0, -65504.0, 6e-8, -6e-8, 1e-5, 2.0**-14, 0.0, -0.0, -1.5, 1.0, 0.0123, -3.0e-3],
    dtype=np.float16,
)
# Half an 8-bit step of a group's range is at most 2*max|w|/510 = max|w|/255.
Q8_REL_BOUND = 1.0 / 255.0


# ------------------------------------------------------------------------------------------
# helpers


def make_raw(qtype, rows: int, cols: int, rng: np.random.Generator, f16=None) -> np.ndarray:
    """Random block bytes ``[rows, bytes_per_row]`` with finite f16 scale fields.

    ``f16``: values for the f16 fields, cycled over all fields of all blocks; by default
    normal(0, 0.05) values, the magnitude of real weight scales.
    """
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // bs
    blocks = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    offs = F16_OFFSETS[qtype]
    if f16 is None:
        f16 = (rng.standard_normal(n_blocks * len(offs)) * 0.05).astype(np.float16)
    f16 = np.resize(np.asarray(f16, dtype=np.float16), n_blocks * len(offs))
    f16_bytes = f16.view(np.uint8).reshape(n_blocks, len(offs), 2)
    for i, off in enumerate(offs):
        blocks[:, off : off + 2] = f16_bytes[:, i]
    return blocks.reshape(rows, cols // bs * ts)


def reference(raw: np.ndarray, qtype) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype)


def mlx_dequant(qw: QuantizedWeight) -> np.ndarray:
    out = mx.dequantize(
        mx.array(qw.weight),
        mx.array(qw.scales),
        mx.array(qw.biases),
        group_size=qw.group_size,
        bits=qw.bits,
    )
    return np.array(out)


def check_layout(qw: QuantizedWeight, rows: int, cols: int, bits: int) -> None:
    assert isinstance(qw, QuantizedWeight)
    assert qw.bits == bits and qw.group_size == 32 and qw.shape == (rows, cols)
    assert qw.weight.dtype == np.uint32 and qw.weight.shape == (rows, cols * bits // 32)
    assert qw.scales.dtype == np.float32 and qw.scales.shape == (rows, cols // 32)
    assert qw.biases.dtype == np.float32 and qw.biases.shape == (rows, cols // 32)


def q8_error(ref: np.ndarray, approx: np.ndarray) -> tuple[float, float]:
    """(max abs error, max error relative to the 32-group's max |ref|)."""
    err = np.abs(approx.astype(np.float64) - ref).reshape(ref.shape[0], -1, 32)
    gmax = np.abs(ref).reshape(ref.shape[0], -1, 32).max(axis=2, keepdims=True)
    rel = np.divide(err, gmax, out=np.zeros_like(err), where=gmax > 0)
    # A group whose values are all zero must come back exactly zero.
    assert np.all(err[np.broadcast_to(gmax == 0, err.shape)] == 0)
    return float(err.max()), float(rel.max())


def assert_q8_within_half_step(ref: np.ndarray, qw: QuantizedWeight) -> tuple[float, float]:
    approx = mlx_dequant(qw)
    g = ref.reshape(ref.shape[0], -1, 32)
    half_step = (g.max(axis=2) - g.min(axis=2)).astype(np.float64) / 510.0
    # Allow a few float32 roundings of the group's magnitude on top of the half step.
    slack = 4 * np.finfo(np.float32).eps * np.abs(g).max(axis=2)
    err = np.abs(approx.astype(np.float64) - ref).reshape(g.shape).max(axis=2)
    assert np.all(err <= half_step + slack), float((err - half_step - slack).max())
    max_abs, max_rel = q8_error(ref, approx)
    assert max_rel <= Q8_REL_BOUND + 4 * np.finfo(np.float32).eps
    return max_abs, max_rel


# ------------------------------------------------------------------------------------------
# bit packing


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_pack_matches_mlx_layout(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2**bits, size=(3, 256), dtype=np.uint8)
    packed = quants._pack(codes, bits)
    assert packed.dtype == np.uint32 and packed.shape == (3, 256 * bits // 32)
    ones = mx.ones((3, 256 // 32), dtype=mx.float32)
    zeros = mx.zeros((3, 256 // 32), dtype=mx.float32)
    out = np.array(mx.dequantize(mx.array(packed), ones, zeros, group_size=32, bits=bits))
    np.testing.assert_array_equal(out, codes.astype(np.float32))


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
def test_pack_matches_mx_quantize(bits):
    # The words mx.quantize itself produces decode to codes that _pack re-encodes identically.
    w = mx.array(np.random.default_rng(0).standard_normal((4, 128)).astype(np.float32))
    wq, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    deq = np.array(mx.dequantize(wq, scales, biases, group_size=32, bits=bits))
    s = np.repeat(np.array(scales), 32, axis=1)
    b = np.repeat(np.array(biases), 32, axis=1)
    codes = np.rint((deq - b) / s).astype(np.uint8)
    np.testing.assert_array_equal(quants._pack(codes, bits), np.array(wq))


# ------------------------------------------------------------------------------------------
# lossless types: bit-exact against gguf.quants.dequantize


@pytest.mark.parametrize("qtype", EXACT_TYPES, ids=lambda t: t.name)
def test_random_blocks_exact(qtype):
    rng = np.random.default_rng(int(qtype))
    rows, cols = 16, 512
    raw = make_raw(qtype, rows, cols, rng)
    qw = repack(raw, qtype, (rows, cols))
    check_layout(qw, rows, cols, EXPECTED_BITS[qtype])
    ref = reference(raw, qtype)
    assert ref.dtype == np.float32
    np.testing.assert_array_equal(mlx_dequant(qw), ref)
    # Flat bytes give the same result as the 2-D [rows, bytes_per_row] view.
    qw_flat = repack(raw.reshape(-1), qtype, (rows, cols))
    np.testing.assert_array_equal(qw_flat.weight, qw.weight)
    np.testing.assert_array_equal(qw_flat.scales, qw.scales)
    np.testing.assert_array_equal(qw_flat.biases, qw.biases)


@pytest.mark.parametrize("qtype", EXACT_TYPES, ids=lambda t: t.name)
def test_extreme_scales_exact(qtype):
    rng = np.random.default_rng(100 + int(qtype))
    bs, _ = gguf.GGML_QUANT_SIZES[qtype]
    n_f = len(F16_OFFSETS[qtype])
    # Every (d, m/dmin) pair of extremes appears in some block.
    if n_f == 1:
        f16 = EXTREME_F16
    else:
        a, b = np.meshgrid(EXTREME_F16, EXTREME_F16, indexing="ij")
        f16 = np.stack([a.ravel(), b.ravel()], axis=1).ravel()
    n_blocks = len(f16) // n_f
    cols = 4 * bs
    rows = -(-n_blocks // 4)
    raw = make_raw(qtype, rows, cols, rng, f16=f16)
    ref = reference(raw, qtype)
    assert np.isfinite(ref).all()
    qw = repack(raw, qtype, (rows, cols))
    np.testing.assert_array_equal(mlx_dequant(qw), ref)
    # Signed zeros in the scales must not flip any sign of a non-zero value.
    assert np.array_equal(np.signbit(mlx_dequant(qw)[ref != 0]), np.signbit(ref[ref != 0]))


@pytest.mark.parametrize("qtype", EXACT_TYPES, ids=lambda t: t.name)
def test_all_codes_exact(qtype):
    # Blocks of all-0x00 and all-0xFF quant bytes hit the smallest and largest codes
    # (including the fifth bit) that random bytes only reach statistically.
    rng = np.random.default_rng(7)
    rows, cols = 2, 256
    raw = make_raw(qtype, rows, cols, rng, f16=np.float16(0.75))
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    blocks = raw.reshape(-1, ts)
    keep = np.zeros(ts, dtype=bool)
    for off in F16_OFFSETS[qtype]:
        keep[off : off + 2] = True
    if qtype in (QT.Q4_K, QT.Q5_K):
        keep[4:16] = True  # keep random 6-bit scales/mins
    blocks[0::2, ~keep] = 0x00
    blocks[1::2, ~keep] = 0xFF
    ref = reference(raw, qtype)
    np.testing.assert_array_equal(mlx_dequant(repack(raw, qtype, (rows, cols))), ref)


@pytest.mark.parametrize("qtype", EXACT_TYPES + [QT.Q6_K], ids=lambda t: t.name)
def test_quantized_matmul(qtype):
    rng = np.random.default_rng(200 + int(qtype))
    rows, cols = 48, 512
    raw = make_raw(qtype, rows, cols, rng)
    qw = repack(raw, qtype, (rows, cols))
    deq = mlx_dequant(qw)
    if qtype != QT.Q6_K:
        np.testing.assert_array_equal(deq, reference(raw, qtype))
    x = rng.standard_normal((5, cols)).astype(np.float32)
    y = mx.quantized_matmul(
        mx.array(x),
        mx.array(qw.weight),
        mx.array(qw.scales),
        mx.array(qw.biases),
        transpose=True,
        group_size=qw.group_size,
        bits=qw.bits,
    )
    want = x.astype(np.float64) @ deq.astype(np.float64).T
    scale = np.abs(x).astype(np.float64) @ np.abs(deq).astype(np.float64).T
    assert np.all(np.abs(np.array(y) - want) <= 1e-5 * scale + 1e-30)


def test_chunk_boundaries(monkeypatch):
    # Tiny chunks force many row chunks and a ragged last one.
    monkeypatch.setattr(quants, "_CHUNK_ELEMS", 3 * 256)
    rng = np.random.default_rng(5)
    rows, cols = 11, 256
    for qtype in (QT.Q4_K, QT.Q5_0, QT.Q6_K):
        raw = make_raw(qtype, rows, cols, rng)
        ref = reference(raw, qtype)
        if qtype == QT.Q6_K:
            np.testing.assert_array_equal(repack(raw, qtype, (rows, cols), q6k_mode="f32"), ref)
            assert_q8_within_half_step(ref, repack(raw, qtype, (rows, cols)))
        else:
            np.testing.assert_array_equal(mlx_dequant(repack(raw, qtype, (rows, cols))), ref)


def test_comparison_detects_a_flipped_bit():
    # Guards against a vacuous comparison: corrupting one packed bit must be noticed.
    rng = np.random.default_rng(9)
    raw = make_raw(QT.Q5_K, 4, 256, rng, f16=np.float16(1.0))
    qw = repack(raw, QT.Q5_K, (4, 256))
    ref = reference(raw, QT.Q5_K)
    np.testing.assert_array_equal(mlx_dequant(qw), ref)
    qw.weight[2, 7] ^= np.uint32(1 << 13)
    assert not np.array_equal(mlx_dequant(qw), ref)


# ------------------------------------------------------------------------------------------
# hypothesis: arbitrary bytes, arbitrary finite f16 scales


@st.composite
def raw_tensor(draw, qtype):
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    rows = draw(st.integers(1, 3))
    per_row = draw(st.integers(1, 2 if bs == 256 else 4))
    n_blocks = rows * per_row
    body = draw(st.binary(min_size=n_blocks * ts, max_size=n_blocks * ts))
    blocks = np.frombuffer(body, dtype=np.uint8).copy().reshape(n_blocks, ts)
    offs = F16_OFFSETS[qtype]
    # Finite f16 bit patterns drawn directly (exponent field below 0x1F), which covers
    # subnormals and both zeros without the rejection sampling st.floats(width=16) needs.
    finite_f16 = st.builds(
        lambda mag, neg: mag | (neg << 15), st.integers(0, 0x7BFF), st.integers(0, 1)
    )
    n_f16 = n_blocks * len(offs)
    vals = draw(st.lists(finite_f16, min_size=n_f16, max_size=n_f16))
    f16 = np.array(vals, dtype=np.uint16).view(np.uint8).reshape(n_blocks, len(offs), 2)
    for i, off in enumerate(offs):
        blocks[:, off : off + 2] = f16[:, i]
    return blocks.reshape(rows, -1), (rows, per_row * bs)


HYP = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[
        HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large
    ],
)


@pytest.mark.parametrize("qtype", EXACT_TYPES, ids=lambda t: t.name)
def test_property_exact(qtype):
    @HYP
    @given(raw_tensor(qtype))
    def check(case):
        raw, shape = case
        np.testing.assert_array_equal(mlx_dequant(repack(raw, qtype, shape)), reference(raw, qtype))

    check()


@HYP
@given(raw_tensor(QT.Q6_K))
def test_property_q6k(case):
    raw, shape = case
    ref = reference(raw, QT.Q6_K)
    exact = repack(raw, QT.Q6_K, shape, q6k_mode="f32")
    assert exact.dtype == np.float32 and exact.shape == shape
    np.testing.assert_array_equal(exact, ref)
    qw = repack(raw, QT.Q6_K, shape, q6k_mode="q8")
    check_layout(qw, *shape, bits=8)
    assert_q8_within_half_step(ref, qw)


# ------------------------------------------------------------------------------------------
# Q6_K


def quantize_q6k_like_llamacpp(w: np.ndarray) -> np.ndarray:
    """A simple Q6_K quantizer (llama.cpp's layout and rounding scheme, without its
    iterative scale search) for realistic blocks from float weights ``[rows, cols]``."""
    rows, cols = w.shape
    x = w.reshape(-1, 16, 16).astype(np.float32)
    n = x.shape[0]
    amax_idx = np.abs(x).argmax(axis=2)
    gscale = np.take_along_axis(x, amax_idx[..., None], axis=2)[..., 0] / -32.0
    big = np.take_along_axis(gscale, np.abs(gscale).argmax(axis=1)[:, None], axis=1)
    d = (big / -128.0).astype(np.float16)
    d32 = d.astype(np.float32)
    inv_d = np.divide(1.0, d32, out=np.zeros_like(d32), where=d32 != 0)
    sc = np.clip(np.rint(gscale * inv_d), -128, 127).astype(np.int8)
    ds = d32 * sc.astype(np.float32)
    inv = np.divide(1.0, ds, out=np.zeros_like(ds), where=ds != 0)
    q = (np.clip(np.rint(x * inv[..., None]), -32, 31) + 32).astype(np.uint8).reshape(n, 256)
    # Inverse of the Q6_K bit layout (see gguf.quants.Q6_K.dequantize_blocks).
    q = q.reshape(n, 2, 4, 32)  # half, quarter, lane
    lo = q & 0x0F
    hi = q >> 4
    ql = np.concatenate(
        [lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2
    )
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    blocks = np.concatenate(
        [ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d.reshape(n, 1).view(np.uint8)],
        axis=1,
    )
    return blocks.reshape(rows, -1)


def test_q6k_test_quantizer_is_sane():
    w = np.random.default_rng(3).standard_normal((8, 512)).astype(np.float32) * 0.02
    deq = reference(quantize_q6k_like_llamacpp(w), QT.Q6_K)
    assert np.abs(deq - w).max() < 0.02 * 0.1  # 6-bit: a few % of the largest weight


def test_q6k_f32_mode_exact_with_extreme_scales():
    rng = np.random.default_rng(11)
    rows, cols = 4, 768
    raw = make_raw(QT.Q6_K, rows, cols, rng, f16=EXTREME_F16)
    ref = reference(raw, QT.Q6_K)
    assert np.isfinite(ref).all()
    out = repack(raw, QT.Q6_K, (rows, cols), q6k_mode="f32")
    assert out.dtype == np.float32 and out.shape == (rows, cols)
    np.testing.assert_array_equal(out, ref)
    assert_q8_within_half_step(ref, repack(raw, QT.Q6_K, (rows, cols)))


def test_q6k_constant_groups_are_exact():
    # All scales zero -> all weights zero; the requantizer must not divide by zero.
    raw = make_raw(QT.Q6_K, 2, 256, np.random.default_rng(1), f16=np.float16(0.0))
    qw = repack(raw, QT.Q6_K, (2, 256))
    assert np.all(qw.scales == 0)
    np.testing.assert_array_equal(mlx_dequant(qw), np.zeros((2, 256), np.float32))


def test_q6k_q8_error_bound():
    """Measures the q8-mode error on realistic and on adversarial blocks (print with -s).

    Measured: the max error is 1/255 = 0.392 % of the 32-group's max |w| in every case (a
    symmetric group spans ~2 max|w|, and some weight lands mid-step); RMS ~0.16-0.21 %. That
    is ~4x below the Q6_K quantization error itself.
    """
    rng = np.random.default_rng(12)
    cases = {}
    w = rng.standard_normal((64, 1024)).astype(np.float32) * 0.02
    cases["gaussian weights, Q6_K-quantized"] = quantize_q6k_like_llamacpp(w)
    heavy = rng.standard_t(df=3, size=(64, 1024)).astype(np.float32) * 0.02
    cases["heavy-tailed (t3) weights, Q6_K-quantized"] = quantize_q6k_like_llamacpp(heavy)
    cases["random bytes (adversarial)"] = make_raw(QT.Q6_K, 64, 1024, rng)
    q6_fixture = FIXTURES / "qwen35-mtp-tiny-Q6_K.gguf"
    if q6_fixture.exists():
        t = next(t for t in gguf.GGUFReader(q6_fixture).tensors if t.name == "output.weight")
        cases["llama.cpp Q6_K output.weight"] = np.asarray(t.data)
    for label, raw in cases.items():
        rows = raw.shape[0]
        cols = raw.size // rows // 210 * 256
        ref = reference(raw, QT.Q6_K)
        qw = repack(raw, QT.Q6_K, (rows, cols))
        max_abs, max_rel = assert_q8_within_half_step(ref, qw)
        approx = mlx_dequant(qw)
        gmax = np.abs(ref).reshape(rows, -1, 32).max(axis=2, keepdims=True)
        err = np.abs(approx - ref).reshape(rows, -1, 32)
        rms_rel = float(np.sqrt(np.mean((err / np.where(gmax > 0, gmax, 1)) ** 2)))
        print(
            f"\nQ6_K q8 [{label}]: max abs {max_abs:.3e} (max |w| {np.abs(ref).max():.3e}), "
            f"max rel to group max|w| {max_rel:.5f}, RMS rel {rms_rel:.5f}"
        )
        assert rms_rel < 0.0025
    # The requantization adds far less error than Q6_K's own 6-bit rounding.
    ref = reference(cases["gaussian weights, Q6_K-quantized"], QT.Q6_K)
    q8 = mlx_dequant(repack(cases["gaussian weights, Q6_K-quantized"], QT.Q6_K, w.shape))
    rms_q6 = float(np.sqrt(np.mean((ref.astype(np.float64) - w) ** 2)))
    rms_q8 = float(np.sqrt(np.mean((q8.astype(np.float64) - ref) ** 2)))
    print(f"RMS error: Q6_K vs float {rms_q6:.3e}, q8 requant vs Q6_K {rms_q8:.3e}")
    assert rms_q8 < 0.35 * rms_q6


# ------------------------------------------------------------------------------------------
# fixture files made by llama.cpp


FIXTURE_FILES = {
    "qwen35-mtp-tiny-Q4_K_M.gguf": {"Q4_K", "Q6_K"},
    "qwen35-mtp-tiny-Q5_K_M.gguf": {"Q5_K", "Q6_K"},
    "qwen35-mtp-tiny-Q4_0.gguf": {"Q4_0", "Q6_K"},
    "qwen35-mtp-tiny-Q8_0.gguf": {"Q8_0"},
}


@pytest.mark.parametrize("fname", sorted(FIXTURE_FILES))
def test_fixture_tensors(fname):
    path = FIXTURES / fname
    if not path.exists():
        pytest.skip(f"fixture {path} not present")
    reader = gguf.GGUFReader(path)
    seen = set()
    for t in reader.tensors:
        qtype = t.tensor_type
        if qtype == QT.F32:
            continue
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        assert len(shape) == 2, (t.name, shape)
        ref = reference(t.data, qtype).reshape(shape)
        if qtype == QT.Q6_K:
            exact = repack(t.data, qtype, shape, q6k_mode="f32")
            np.testing.assert_array_equal(exact, ref, err_msg=t.name)
            qw = repack(t.data, qtype, shape)
            check_layout(qw, *shape, bits=8)
            assert_q8_within_half_step(ref, qw)
        else:
            qw = repack(t.data, qtype, shape)
            check_layout(qw, *shape, bits=EXPECTED_BITS[qtype])
            np.testing.assert_array_equal(mlx_dequant(qw), ref, err_msg=t.name)
        seen.add(qtype.name)
    assert seen == FIXTURE_FILES[fname]


def test_fixture_f16_and_f32_tensors():
    path = FIXTURES / "qwen35-mtp-tiny-f16.gguf"
    if not path.exists():
        pytest.skip(f"fixture {path} not present")
    n = 0
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type != QT.F16:
            continue
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        out = repack(t.data, t.tensor_type, shape)
        assert out.dtype == np.float32 and out.shape == shape
        np.testing.assert_array_equal(out, np.asarray(t.data, dtype=np.float32).reshape(shape))
        n += 1
    assert n > 0


# ------------------------------------------------------------------------------------------
# float tensors


def test_repack_float_f32_and_f16():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((6, 40)).astype(np.float32)
    for data in (w, w.view(np.uint8)):
        out = repack_float(data, QT.F32, (6, 40))
        assert out.dtype == np.float32
        np.testing.assert_array_equal(out, w)
    h = w.astype(np.float16)
    for data in (h, h.view(np.uint8), h.reshape(-1)):
        np.testing.assert_array_equal(repack_float(data, QT.F16, (6, 40)), h.astype(np.float32))


def test_repack_float_bf16():
    rng = np.random.default_rng(6)
    bits = rng.integers(0, 2**16, size=(5, 24), dtype=np.uint16)
    bits[(bits & 0x7F80) == 0x7F80] = 0x3F80  # no NaN/inf patterns, so array_equal is meaningful
    want = (bits.astype(np.uint32) << 16).view(np.float32)
    assert np.array_equal(want, gguf.quants.dequantize(bits.view(np.uint8), QT.BF16))
    for data in (bits, bits.view(np.uint8), bits.view(np.uint8).reshape(-1)):
        out = repack_float(data, QT.BF16, (5, 24))
        assert out.dtype == np.float32 and out.shape == (5, 24)
        np.testing.assert_array_equal(out, want)
    # repack() routes float types here too.
    np.testing.assert_array_equal(repack(bits.view(np.uint8), QT.BF16, (5, 24)), want)


# ------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("qtype", [QT.Q2_K, QT.Q3_K, QT.IQ4_XS, QT.IQ2_XXS, QT.TQ1_0, QT.Q8_1])
def test_unsupported_type(qtype):
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.zeros(2 * ts, dtype=np.uint8)
    with pytest.raises(MTPEngineError) as ei:
        repack(raw, qtype, (1, 2 * bs), name="blk.0.ffn_up.weight")
    msg = str(ei.value)
    assert qtype.name in msg and "Q4_K" in msg and "Q6_K" in msg and "Q8_0" in msg
    assert ei.value.field == "blk.0.ffn_up.weight"


def test_unknown_type_number():
    with pytest.raises(MTPEngineError, match="unknown GGML tensor type"):
        repack(np.zeros(34, np.uint8), 9999, (1, 32))


def test_cols_not_multiple_of_block():
    with pytest.raises(MTPEngineError, match=r"multiple of the block size 256, found 128"):
        repack(np.zeros(72, np.uint8), QT.Q4_K, (1, 128))
    with pytest.raises(MTPEngineError, match=r"multiple of the block size 32, found 48"):
        repack(np.zeros(27, np.uint8), QT.Q8_0, (1, 48))


@pytest.mark.parametrize("qtype", EXACT_TYPES + [QT.Q6_K], ids=lambda t: t.name)
def test_byte_count_mismatch(qtype):
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 2 * bs
    expected = rows * 2 * ts
    for found in (expected - 1, expected + ts, 0):
        with pytest.raises(MTPEngineError) as ei:
            repack(np.zeros(found, np.uint8), qtype, (rows, cols))
        assert f"expected {expected} bytes, found {found}" in str(ei.value)


def test_bad_arguments():
    raw = make_raw(QT.Q6_K, 1, 256, np.random.default_rng(0))
    with pytest.raises(MTPEngineError, match="q6k_mode"):
        repack(raw, QT.Q6_K, (1, 256), q6k_mode="bf16")
    with pytest.raises(MTPEngineError, match="2-D shape"):
        repack(raw, QT.Q6_K, (256,))
    with pytest.raises(MTPEngineError, match="positive"):
        repack(raw, QT.Q6_K, (0, 256))
    with pytest.raises(MTPEngineError, match="expected one of F32, F16, BF16, found Q4_K"):
        repack_float(np.zeros(144, np.uint8), QT.Q4_K, (1, 256))
    with pytest.raises(MTPEngineError, match="expected 64 bytes, found 60"):
        repack_float(np.zeros(15, np.float32), QT.F32, (4, 4))
    with pytest.raises(MTPEngineError, match="expected dtype uint8 or float16, found float64"):
        repack_float(np.zeros(16, np.float64), QT.F16, (4, 4))
