"""GGUF quantized blocks -> MLX affine codes, scales and biases (and MLX's packed code layout).

Each decoder takes uint8 blocks ``[n, type_size]`` of one GGUF type and returns the block's
weights as MLX affine fields over 32-weight groups: codes (uint8 ``[n, block_size]``), scales and
biases (float32 ``[n, block_size // 32]``); see :mod:`mtp_engine.gguf.quants` for why each mapping
is exact. This is a repacking, not a dequantization: `gguf.quants.dequantize` gives floats, which
MLX would have to quantize again (and round differently). Q6_K, whose 16-weight groups MLX cannot
express, is dequantized (:func:`dequant_q6_k`, equal to `gguf.quants.dequantize`) and requantized
to 8 bits (:func:`requant_u8`).
"""
from __future__ import annotations

from math import gcd

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
GROUP_SIZE = 32  # MLX requires one of 32/64/128; every lossless mapping has 32-weight groups


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


def pack(q: np.ndarray, bits: int) -> np.ndarray:
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


DECODERS = {
    QT.Q8_0: _dec_q8_0,
    QT.Q4_0: _dec_q4_0,
    QT.Q4_1: _dec_q4_1,
    QT.Q5_0: _dec_q5_0,
    QT.Q5_1: _dec_q5_1,
    QT.Q4_K: _dec_q4_k,
    QT.Q5_K: _dec_q5_k,
}


def dequant_q6_k(b: np.ndarray) -> np.ndarray:
    """Q6_K blocks [n, 210] -> float32 [n, 256], bit-identical to `gguf.quants.dequantize`
    (tests/gguf/test_quants.py checks it). Not that function itself: on the row chunks `repack` works
    in it measured 2.2-2.6x slower (1024..16384 blocks per call: 55-66 ms vs 21-27 ms per 8M
    weights), which on a 9B Q4_K_M (output.weight alone is 1G Q6_K weights) is seconds of load."""
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


def requant_u8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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
