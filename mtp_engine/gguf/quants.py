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
  magnitude. Measured (tests/gguf/test_quants.py::test_q6k_q8_error_bound) on Q6_K-quantized
  Gaussian and t3 weights, on llama.cpp's Q6_K ``output.weight`` of the fixture model and on
  random bytes: the worst case reaches that 0.392 % bound every time (weight groups are
  roughly symmetric, so max - min ~ 2 max|w|), the RMS is 0.16-0.21 % of the group max, and
  the added error is ~4x smaller than Q6_K's own rounding error (RMS 9.1e-5 vs 3.7e-4 on
  N(0, 0.02) weights). Memory: 1.125 bytes/weight versus 0.82 for Q6_K.
* ``q6k_mode="f32"``: the exact float32 dequantized matrix (4 bytes/weight).

The per-type block decoders are in :mod:`mtp_engine.gguf.blocks`. All work is vectorised NumPy over row chunks, so peak extra memory is a few chunk-sized
buffers on top of the raw bytes and the output, whatever the matrix size.
"""
from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np

from mtp_engine.errors import MTPEngineError
from mtp_engine.gguf.blocks import DECODERS, GROUP_SIZE, QT, dequant_q6_k, pack, requant_u8

_pack = pack  # the name tests and scripts used before the block decoders had their own module

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


def loaded_bits(qtype: QT | int) -> int | None:
    """The bits a tensor of `qtype` is loaded at (None: a float type, or one not loaded quantized)."""
    try:
        return _QUANT_BITS.get(QT(int(qtype)))
    except ValueError:
        return None


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


def _blocks(raw: np.ndarray, qtype: QT, rows: int, cols: int, name: str | None) -> tuple[np.ndarray, int]:
    """A quantized tensor's bytes as [rows, bytes per row] (whole blocks per row, the byte count
    the shape needs) and its block's bytes."""
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
    return data.reshape(rows, row_bytes), type_size


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
    data, type_size = _blocks(raw, qtype, rows, cols, name)
    if qtype == QT.Q6_K and q6k_mode == "f32":
        return _q6_k_float(data, type_size, rows, cols, name)
    return _requantized(data, qtype, type_size, rows, cols, name)


def _q6_k_float(data: np.ndarray, type_size: int, rows: int, cols: int, name: str | None) -> np.ndarray:
    """Q6_K blocks exactly, as float32 [rows, cols]."""
    out = np.empty((rows, cols), dtype=np.float32)
    for r0, r1 in _row_chunks(rows, cols):
        blocks = data[r0:r1].reshape(-1, type_size)
        out[r0:r1] = dequant_q6_k(blocks).reshape(r1 - r0, cols)
        _check_finite(out[r0:r1], QT.Q6_K, "value", name)
    return out


def _requantized(data: np.ndarray, qtype: QT, type_size: int, rows: int, cols: int,
                 name: str | None) -> QuantizedWeight:
    """Quantized blocks as MLX's affine form in groups of 32 (Q6_K through 8 bits)."""
    bits = _QUANT_BITS[qtype]
    n_groups = cols // GROUP_SIZE
    weight = np.empty((rows, cols * bits // 32), dtype=np.uint32)
    scales = np.empty((rows, n_groups), dtype=np.float32)
    biases = np.empty((rows, n_groups), dtype=np.float32)
    for r0, r1 in _row_chunks(rows, cols):
        n = r1 - r0
        blocks = data[r0:r1].reshape(-1, type_size)
        if qtype == QT.Q6_K:
            q, s, b = requant_u8(dequant_q6_k(blocks).reshape(n, cols))
        else:
            q, s, b = DECODERS[qtype](blocks)
        _check_finite(s, qtype, "scale", name)
        _check_finite(b, qtype, "bias", name)
        weight[r0:r1] = pack(q.reshape(n, cols), bits)
        scales[r0:r1] = s.reshape(n, n_groups)
        biases[r0:r1] = b.reshape(n, n_groups)
    return QuantizedWeight(weight, scales, biases, bits, GROUP_SIZE, (rows, cols))
