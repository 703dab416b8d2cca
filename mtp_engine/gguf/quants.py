"""Repack llama.cpp GGUF quantized blocks into MLX affine-quantized matrices.

MLX's affine quantization stores, per group of ``group_size`` consecutive weights of a row,
one float scale and one float bias, and an unsigned ``bits``-wide code ``q`` per weight; the
weight is ``scale * q + bias``. The codes of a row form one little-endian bit stream (weight 0
in the lowest bits of the first byte), stored as uint32 words, so 5- and 6-bit codes straddle
word boundaries.

Most GGUF block formats are already affine with 32-weight groups, so they map onto MLX
*losslessly*:

=========  ====  ===========================  ===============
GGUF type  bits  scale                        bias
=========  ====  ===========================  ===============
Q8_0       8     d                            -128 * d  (q = int8 + 128)
Q4_0       4     d                            -8 * d
Q4_1       4     d                            m
Q5_0       5     d                            -16 * d
Q5_1       5     d                            m
Q4_K       4     d * sc[j] (sub-block j)      -(dmin * m[j])
Q5_K       5     d * sc[j]                    -(dmin * m[j])
=========  ====  ===========================  ===============

For every one of these, ``mx.dequantize`` of the repacked weight equals
``gguf.quants.dequantize`` of the raw bytes bit for bit in float32: every product involved
(f16 ``d`` has an 11-bit significand, ``sc``/``m`` 6 bits, ``q`` at most 8 bits, so at most
22 significant bits) is exact in float32, so the only rounding anywhere is the final addition,
which both sides do once on identical operands (an FMA would round the same way, since its
product is exact).

Q6_K uses 16-weight groups with a signed 8-bit sub-scale each, which no MLX group size (32, 64,
128) can express. Two representations are offered:

* ``q6k_mode="q8"`` (default): the exactly dequantized values are requantized to 8-bit affine
  with 32-weight groups (bias = group minimum, scale = (max - min) / 255, round to nearest).
  The error per weight is at most half a step, i.e. ``(max - min) / 510`` plus float32
  rounding, so at most ``2 * max|w| / 510 = 1/255 = 0.392 %`` of the group's largest
  magnitude. Measured (tests/test_quants.py::test_q6k_q8_error_bound) on Q6_K-quantized
  Gaussian and t3 weights, on llama.cpp's Q6_K ``output.weight`` of the fixture model and on
  random bytes: the worst case reaches that 0.392 % bound every time (weight groups are
  roughly symmetric, so max - min ~ 2 max|w|), the RMS is 0.16-0.21 % of the group max, and
  the added error is ~4x smaller than Q6_K's own rounding error (RMS 9.1e-5 vs 3.7e-4 on
  N(0, 0.02) weights). Memory: 1.125 bytes/weight versus 0.82 for Q6_K.
* ``q6k_mode="f32"``: the exact float32 dequantized matrix (4 bytes/weight).

All work is vectorised NumPy over row chunks, so peak extra memory is a few chunk-sized
buffers on top of the raw bytes and the output, whatever the matrix size.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd

import gguf
import numpy as np

from mtp_engine.errors import MTPEngineError

QT = gguf.GGMLQuantizationType

# MLX requires one of 32/64/128; every lossless mapping above has 32-weight groups.
GROUP_SIZE = 32

# Row chunks of ~256K weights keep each float32 temporary near 1 MiB, cache-sized: measured
# 2-3x faster than 2M-weight chunks, and per-chunk Python overhead stays negligible.
_CHUNK_ELEMS = 1 << 18

_FLOAT_TYPES = (QT.F32, QT.F16, QT.BF16)
_QUANT_BITS: dict[QT, int] = {
    QT.Q8_0: 8,
    QT.Q4_0: 4,
    QT.Q4_1: 4,
    QT.Q5_0: 5,
    QT.Q5_1: 5,
    QT.Q4_K: 4,
    QT.Q5_K: 5,
    QT.Q6_K: 8,  # in "q8" mode
}
Q6K_MODES = ("q8", "f32")

SUPPORTED_TYPES: tuple[str, ...] = tuple(t.name for t in (*_FLOAT_TYPES, *_QUANT_BITS))


@dataclass
class QuantizedWeight:
    """A matrix in MLX affine-quantized form, ready for ``mx.quantized_matmul``.

    ``dequant[r, c] = scales[r, c // group_size] * q[r, c] + biases[r, c // group_size]``
    where ``q[r, c]`` is the ``bits``-wide field at bit offset ``c * bits`` of row ``r``'s
    little-endian bit stream in ``weight``.
    """

    weight: np.ndarray  # uint32 packed, shape [rows, cols*bits//32]
    scales: np.ndarray  # float32 [rows, cols//group_size]
    biases: np.ndarray  # float32 [rows, cols//group_size]
    bits: int
    group_size: int
    shape: tuple[int, int]  # (rows, cols) of the logical float matrix


# --------------------------------------------------------------------------------------------
# helpers


def _err(message: str, name: str | None) -> MTPEngineError:
    return MTPEngineError(message, field=name)


def _coerce_qtype(qtype: QT | int, name: str | None) -> QT:
    try:
        return QT(qtype)
    except ValueError:
        raise _err(
            f"unknown GGML tensor type {qtype!r}; supported types: {', '.join(SUPPORTED_TYPES)}",
            name,
        ) from None


def _check_shape(shape: tuple[int, int], name: str | None) -> tuple[int, int]:
    try:
        rows, cols = (int(s) for s in shape)
    except (TypeError, ValueError):
        raise _err(f"expected a 2-D shape (rows, cols), found {shape!r}", name) from None
    if rows <= 0 or cols <= 0:
        raise _err(f"expected a positive 2-D shape (rows, cols), found {shape!r}", name)
    return rows, cols


def _raw_bytes(raw: np.ndarray) -> np.ndarray:
    """Flat uint8 view of ``raw`` (no copy when it is already contiguous)."""
    raw = np.asarray(raw)
    return np.ascontiguousarray(raw).reshape(-1).view(np.uint8)


def _f16(col: np.ndarray) -> np.ndarray:
    """Bytes ``[n, 2]`` -> float32 ``[n, 1]``, the f16->f32 conversion the reference uses."""
    return np.ascontiguousarray(col).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, n_half: int) -> np.ndarray:
    """Split packed nibbles ``[n, k*n_half]`` (low nibbles of a run of ``n_half`` bytes first,
    then their high nibbles) into codes ``[n, 2*k*n_half]``, the GGUF element order."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, n_half)
    out = np.empty((n, qs.shape[1], 2, n_half), dtype=np.uint8)
    np.bitwise_and(qs[:, :, 0], 0x0F, out=out[:, :, 0])
    np.right_shift(qs[:, :, 0], 4, out=out[:, :, 1])
    return out.reshape(n, -1)


def _bits_le(b: np.ndarray) -> np.ndarray:
    """Bytes ``[n, k]`` -> bits ``[n, k, 8]`` (bit i of each byte at index i)."""
    return np.unpackbits(b[..., None], axis=-1, bitorder="little")


def _pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack codes ``q`` (uint8 ``[n, cols]``, each < 2**bits) into MLX's layout:
    one little-endian bit stream per row, as uint32 words ``[n, cols*bits//32]``."""
    n, cols = q.shape
    if bits == 8:
        return np.ascontiguousarray(q).view(np.uint32)
    if bits == 4:
        return (q[:, 0::2] | (q[:, 1::2] << np.uint8(4))).view(np.uint32)
    # The smallest whole number of codes filling whole bytes: for 5 bits 8 codes -> 5 bytes,
    # for 6 bits 4 codes -> 3 bytes. Assembled in a uint64 (<= 40 bits used).
    per_unit = 8 // gcd(bits, 8)
    unit_bytes = per_unit * bits // 8
    acc = q[:, 0::per_unit].astype(np.uint64)
    for i in range(1, per_unit):
        acc |= q[:, i::per_unit].astype(np.uint64) << np.uint64(bits * i)
    # uint64 is little-endian on every platform MLX runs on, so its low bytes come first.
    packed = acc.view(np.uint8).reshape(n, -1, 8)[:, :, :unit_bytes]
    return np.ascontiguousarray(packed).reshape(n, -1).view(np.uint32)


# --------------------------------------------------------------------------------------------
# per-type block decoders: uint8 blocks [n, type_size] -> (codes uint8 [n, block_size],
# scales f32 [n, block_size // 32], biases f32 [n, block_size // 32])


def _dec_q8_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    # int8 v -> v + 128 as uint8 is a flip of the sign bit.
    q = b[:, 2:] ^ np.uint8(0x80)
    return q, d, d * np.float32(-128)


def _dec_q4_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    return _nibbles(b[:, 2:], 16), d, d * np.float32(-8)


def _dec_q4_1(b: np.ndarray):
    d = _f16(b[:, 0:2])
    m = _f16(b[:, 2:4])
    return _nibbles(b[:, 4:], 16), d, m


def _q5_codes(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    # qh is a little-endian uint32 whose bit j is the fifth bit of element j.
    hi = _bits_le(qh).reshape(qh.shape[0], 32)
    return _nibbles(qs, 16) | (hi << np.uint8(4))


def _dec_q5_0(b: np.ndarray):
    d = _f16(b[:, 0:2])
    return _q5_codes(b[:, 2:6], b[:, 6:]), d, d * np.float32(-16)


def _dec_q5_1(b: np.ndarray):
    d = _f16(b[:, 0:2])
    m = _f16(b[:, 2:4])
    return _q5_codes(b[:, 4:8], b[:, 8:]), d, m


def _scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's get_scale_min_k4 for all 8 sub-blocks: 12 bytes -> 6-bit sc[8], m[8]."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], axis=1)
    return sc, mn


def _k_scales(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    d = _f16(b[:, 0:2])
    dmin = _f16(b[:, 2:4])
    sc, mn = _scale_min_k4(b[:, 4:16])
    # Same products as the reference (f32 d times f32 integer), then an exact negation.
    return d * sc.astype(np.float32), -(dmin * mn.astype(np.float32))


def _dec_q4_k(b: np.ndarray):
    scales, biases = _k_scales(b)
    # 4 runs of 32 bytes; low nibbles are sub-block 2j, high nibbles sub-block 2j+1.
    return _nibbles(b[:, 16:144], 32), scales, biases


def _dec_q5_k(b: np.ndarray):
    scales, biases = _k_scales(b)
    n = b.shape[0]
    # Bit j of qh[l] is the fifth bit of element l of sub-block j.
    hi = _bits_le(b[:, 16:48]).transpose(0, 2, 1).reshape(n, 256)
    return _nibbles(b[:, 48:176], 32) | (hi << np.uint8(4)), scales, biases


_DECODERS = {
    QT.Q8_0: _dec_q8_0,
    QT.Q4_0: _dec_q4_0,
    QT.Q4_1: _dec_q4_1,
    QT.Q5_0: _dec_q5_0,
    QT.Q5_1: _dec_q5_1,
    QT.Q4_K: _dec_q4_k,
    QT.Q5_K: _dec_q5_k,
}


def _dequant_q6_k(b: np.ndarray) -> np.ndarray:
    """Q6_K blocks [n, 210] -> float32 [n, 256], bit-identical to gguf.quants."""
    n = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    # Two halves of 128 weights: low nibbles of 64 bytes then their high nibbles; the top two
    # bits come from 32 bytes, at bit offsets 0, 2, 4, 6 for the four 32-weight quarters.
    lo = _nibbles(ql, 64)
    hi = (qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (lo | (hi.reshape(n, 256) << np.uint8(4))).view(np.int8) - np.int8(32)
    # Same products as the reference, (d * sc) * q; repeating the 16 group scales to full
    # width first is ~8x faster than broadcasting over a length-16 inner axis.
    ds = np.repeat(d * sc, 16, axis=1)
    return ds * q.astype(np.float32)


def _requant_u8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Float32 [n, cols] -> 8-bit affine codes [n, cols], scales/biases [n, cols // 32]."""
    n, cols = x.shape
    g = x.reshape(n, cols // GROUP_SIZE, GROUP_SIZE)
    # NumPy reduces a short contiguous inner axis slowly; reducing across 32 contiguous rows
    # of a transposed copy is ~4x faster.
    t = np.ascontiguousarray(g.reshape(-1, GROUP_SIZE).T)
    lo = t.min(axis=0).reshape(g.shape[:2])
    hi = t.max(axis=0).reshape(g.shape[:2])
    scale = (hi - lo) / np.float32(255)
    # A constant group keeps scale 0 (exact); its codes are all 0.
    inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.rint((g - lo[..., None]) * inv[..., None])
    np.clip(q, 0, 255, out=q)
    return q.astype(np.uint8).reshape(n, cols), scale, lo


def _check_finite(a: np.ndarray, qtype: QT, what: str, name: str | None) -> None:
    """Refuses NaN/inf: one such weight or scale turns every logit that reads it into NaN, a
    silently broken model. min/max propagate both and need no temporary the size of ``a``."""
    if a.size == 0 or (np.isfinite(a.min()) and np.isfinite(a.max())):
        return
    flat = a.reshape(-1)
    bad = np.flatnonzero(~np.isfinite(flat))
    raise _err(f"{qtype.name} tensor holds non-finite {what}s ({flat[bad[0]]} at flat index {bad[0]}, "
               f"{bad.size} in all)", name)


def _row_chunks(rows: int, cols: int):
    step = max(1, _CHUNK_ELEMS // cols)
    for r0 in range(0, rows, step):
        yield r0, min(rows, r0 + step)


# --------------------------------------------------------------------------------------------
# public API


def mlx_nbytes(qtype: QT | int, n_elements: int, *, q6k_mode: str = "q8") -> int | None:
    """Bytes that :func:`repack` / :func:`repack_float` output for a tensor of ``n_elements``
    weights of ``qtype`` (float32 for float types and exact Q6_K; otherwise ``bits``-bit codes
    plus a float32 scale and bias per 32 weights); None for types that are not supported.

    Kept beside the repacking so that memory estimates follow any change of representation."""
    try:
        qtype = QT(qtype)
    except ValueError:
        return None
    n = int(n_elements)
    if qtype in _FLOAT_TYPES or (qtype == QT.Q6_K and q6k_mode == "f32"):
        return 4 * n
    bits = _QUANT_BITS.get(qtype)
    if bits is None:
        return None
    return n * bits // 8 + 2 * 4 * (n // GROUP_SIZE)



def repack_float(
    raw: np.ndarray, qtype: QT | int, shape: tuple[int, int], *, name: str | None = None
) -> np.ndarray:
    """Convert an F32/F16/BF16 tensor to a float32 ``[rows, cols]`` array.

    ``raw`` may be the typed array GGUFReader gives (float32 / float16), raw bytes (uint8, as
    GGUFReader gives BF16), or uint16 bit patterns for BF16. ``name`` only labels errors.
    """
    qtype = _coerce_qtype(qtype, name)
    rows, cols = _check_shape(shape, name)
    if qtype not in _FLOAT_TYPES:
        raise _err(f"repack_float: expected one of F32, F16, BF16, found {qtype.name}", name)
    raw = np.asarray(raw)
    want_dtype = {QT.F32: np.float32, QT.F16: np.float16, QT.BF16: np.uint16}[qtype]
    ok_dtypes = {np.dtype(np.uint8), np.dtype(want_dtype)}
    if raw.dtype not in ok_dtypes:
        raise _err(
            f"{qtype.name} data: expected dtype uint8 or {np.dtype(want_dtype).name}, "
            f"found {raw.dtype}",
            name,
        )
    flat = np.ascontiguousarray(raw).reshape(-1).view(want_dtype)
    if flat.size != rows * cols:
        itemsize = np.dtype(want_dtype).itemsize
        raise _err(
            f"{qtype.name} tensor of shape {(rows, cols)}: expected {rows * cols * itemsize} "
            f"bytes, found {raw.nbytes}",
            name,
        )
    flat = flat.reshape(rows, cols)
    if qtype == QT.BF16:
        # bf16 is the upper half of an IEEE float32.
        out = (flat.astype(np.uint32) << np.uint32(16)).view(np.float32)
    else:
        out = flat.astype(np.float32)  # always a fresh array, never a view of a memmap
    _check_finite(out, qtype, "value", name)
    return out


def repack(
    raw: np.ndarray,
    qtype: QT | int,
    shape: tuple[int, int],
    *,
    q6k_mode: str = "q8",
    name: str | None = None,
) -> QuantizedWeight | np.ndarray:
    """Repack a GGUF tensor's raw bytes into MLX form.

    Args:
        raw: the tensor's bytes as uint8, flat or ``[rows, bytes_per_row]`` as GGUFReader
            returns them (float types may also be given typed, see :func:`repack_float`).
        qtype: the GGUF tensor type.
        shape: the NumPy shape ``(rows, cols)``, i.e. GGUF ``ne`` reversed.
        q6k_mode: ``"q8"`` requantizes Q6_K to 8-bit, 32-weight groups (max error ~0.4 % of
            the group's max ``|w|``); ``"f32"`` returns Q6_K exactly as float32.
        name: tensor name, used only in error messages.

    Returns:
        A :class:`QuantizedWeight` (group size 32) for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
        Q5_K and Q6_K in ``"q8"`` mode, whose MLX dequantization equals
        ``gguf.quants.dequantize`` bit for bit (except Q6_K/"q8"); a float32 ``[rows, cols]``
        array for F32, F16, BF16 and Q6_K in ``"f32"`` mode.

    Raises:
        MTPEngineError: unsupported type, unknown ``q6k_mode``, ``cols`` not a multiple of the
            block size, or a byte count that does not match the shape.
    """
    qtype = _coerce_qtype(qtype, name)
    if qtype in _FLOAT_TYPES:
        return repack_float(raw, qtype, shape, name=name)
    if qtype not in _QUANT_BITS:
        raise _err(
            f"unsupported tensor type {qtype.name}; supported types: {', '.join(SUPPORTED_TYPES)}",
            name,
        )
    if q6k_mode not in Q6K_MODES:
        raise _err(f"q6k_mode: expected one of {Q6K_MODES}, found {q6k_mode!r}", name)
    rows, cols = _check_shape(shape, name)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block_size:
        raise _err(
            f"{qtype.name} tensor of shape {(rows, cols)}: expected cols to be a multiple of "
            f"the block size {block_size}, found {cols}",
            name,
        )
    data = _raw_bytes(raw)
    row_bytes = cols // block_size * type_size
    if data.size != rows * row_bytes:
        raise _err(
            f"{qtype.name} tensor of shape {(rows, cols)}: expected {rows * row_bytes} bytes, "
            f"found {data.size}",
            name,
        )
    data = data.reshape(rows, row_bytes)

    if qtype == QT.Q6_K and q6k_mode == "f32":
        out = np.empty((rows, cols), dtype=np.float32)
        for r0, r1 in _row_chunks(rows, cols):
            blocks = data[r0:r1].reshape(-1, type_size)
            out[r0:r1] = _dequant_q6_k(blocks).reshape(r1 - r0, cols)
            _check_finite(out[r0:r1], qtype, "value", name)
        return out

    bits = _QUANT_BITS[qtype]
    n_groups = cols // GROUP_SIZE
    weight = np.empty((rows, cols * bits // 32), dtype=np.uint32)
    scales = np.empty((rows, n_groups), dtype=np.float32)
    biases = np.empty((rows, n_groups), dtype=np.float32)
    for r0, r1 in _row_chunks(rows, cols):
        n = r1 - r0
        blocks = data[r0:r1].reshape(-1, type_size)
        if qtype == QT.Q6_K:
            q, s, b = _requant_u8(_dequant_q6_k(blocks).reshape(n, cols))
        else:
            q, s, b = _DECODERS[qtype](blocks)
        _check_finite(s, qtype, "scale", name)
        _check_finite(b, qtype, "bias", name)
        weight[r0:r1] = _pack(q.reshape(n, cols), bits)
        scales[r0:r1] = s.reshape(n, n_groups)
        biases[r0:r1] = b.reshape(n, n_groups)
    return QuantizedWeight(weight, scales, biases, bits, GROUP_SIZE, (rows, cols))
