"""ggml's reference K-quant quantizers (Q4_K, Q5_K, Q6_K without an importance matrix, as
`llama-quantize` runs them), in NumPy float32, operation for operation.

Why: the tiny model's Q4_0/Q5_K_M/Q6_K files (llama.cpp's own outputs, with references computed on
them) are rebuilt from the vendored f32 model instead of being vendored (tests/fixture_rebuild.py).
A rebuilt file counts only if its sha256 equals the one llama.cpp's reference records, so this port
has to be bit-exact, not merely close: every sum runs in C's order in float32 (no pairwise
`np.sum`), `nearest_int` is ggml's magic-number rounding, and a step that wins updates the running
minimum exactly as the C loop does. Q8_0 and Q4_0 come from `gguf.quants` (gguf-py's are bit-exact).
Everything is vectorised over blocks; loops run over the 16 or 32 positions of a block.
"""
from __future__ import annotations

import numpy as np

F = np.float32
_MAGIC = F(12582912.0)  # 1.5 * 2**23: adding it leaves the rounded integer in the low mantissa bits
_EPS = F(1e-15)         # ggml's GROUP_MAX_EPS


def nearest_int(v) -> np.ndarray:
    v = np.asarray(v, dtype=F)
    return ((v + _MAGIC).view(np.int32) & 0x007FFFFF) - 0x00400000


def _fp16(v) -> np.ndarray:
    return np.asarray(v, dtype=F).astype(np.float16)


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric levels with ggml's rmse_type 1 (weights x^2) search over 18 scales.
    x [R, n] -> (scale [R], levels [R, n] in 0..2*nmax-1)."""
    R, n = x.shape
    amax = np.zeros(R, F)
    mx = np.zeros(R, F)
    for i in range(n):
        a = np.abs(x[:, i])
        bigger = a > amax
        amax = np.where(bigger, a, amax)
        mx = np.where(bigger, x[:, i], mx)
    zero = amax < _EPS
    mx = np.where(zero, F(1), mx)
    w = x * x

    def fit(iscale):
        slx = np.zeros(R, F)
        sl2 = np.zeros(R, F)
        levels = []
        for i in range(n):
            lvl = np.clip(nearest_int(iscale * x[:, i]), -nmax, nmax - 1)
            lf = lvl.astype(F)
            slx = slx + (w[:, i] * x[:, i]) * lf
            sl2 = sl2 + (w[:, i] * lf) * lf
            levels.append(lvl)
        return slx, sl2, np.stack(levels, 1)

    sumlx, suml2, L = fit(F(-nmax) / mx)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F(0)).astype(F)
    best = (scale * sumlx).astype(F)
    for step in range(-9, 10):
        if step == 0:
            continue
        slx, sl2, cand = fit(-(F(nmax) + F(0.1) * F(step)) / mx)
        take = (sl2 > 0) & (slx * slx > best * sl2)
        with np.errstate(divide="ignore", invalid="ignore"):
            s = (slx / sl2).astype(F)
        L = np.where(take[:, None], cand, L)
        scale = np.where(take, s, scale)
        best = np.where(take, s * slx, best).astype(F)
    return np.where(zero, F(0), scale).astype(F), np.where(zero[:, None], 0, L + nmax)


def make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float,
                     nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric levels (scale and minimum) by ggml's weighted least-squares search.
    x, w [R, n] -> (scale [R], -min [R], levels [R, n] in 0..nmax)."""
    R, n = x.shape
    lo = x[:, 0].copy()
    hi = x[:, 0].copy()
    sum_w = w[:, 0].copy()
    sum_x = sum_w * x[:, 0]
    for i in range(1, n):
        lo = np.where(x[:, i] < lo, x[:, i], lo)
        hi = np.where(x[:, i] > hi, x[:, i], hi)
        sum_w = sum_w + w[:, i]
        sum_x = sum_x + w[:, i] * x[:, i]
    lo = np.where(lo > 0, F(0), lo)
    flat = hi == lo

    def span():
        return np.where(flat, F(1), hi - lo)

    iscale = F(nmax) / span()
    scale = F(1) / iscale
    best = np.zeros(R, F)
    levels = []
    for i in range(n):
        lvl = np.clip(nearest_int(iscale * (x[:, i] - lo)), 0, nmax)
        diff = scale * lvl.astype(F) + lo - x[:, i]
        best = best + w[:, i] * (diff * diff)
        levels.append(lvl)
    L = np.stack(levels, 1)
    for step in range(nstep + 1):
        # the C loop updates `min` when a step wins; later steps use the new range
        isc = (F(rmin) + F(rdelta) * F(step) + F(nmax)) / span()
        sl = np.zeros(R, F)
        sl2 = np.zeros(R, F)
        sxl = np.zeros(R, F)
        cand = []
        for i in range(n):
            lvl = np.clip(nearest_int(isc * (x[:, i] - lo)), 0, nmax)
            lf = lvl.astype(F)
            sl = sl + w[:, i] * lf
            sl2 = sl2 + (w[:, i] * lf) * lf
            sxl = sxl + (w[:, i] * lf) * x[:, i]
            cand.append(lvl)
        cand = np.stack(cand, 1)
        D = sum_w * sl2 - sl * sl
        with np.errstate(divide="ignore", invalid="ignore"):
            this_scale = ((sum_w * sxl - sum_x * sl) / D).astype(F)
            this_min = ((sl2 * sum_x - sl * sxl) / D).astype(F)
            positive = this_min > 0
            this_scale = np.where(positive, (sxl / sl2).astype(F), this_scale)
            this_min = np.where(positive, F(0), this_min)
        err = np.zeros(R, F)
        for i in range(n):
            diff = this_scale * cand[:, i].astype(F) + this_min - x[:, i]
            err = err + w[:, i] * (diff * diff)
        take = (D > 0) & (err < best)
        L = np.where(take[:, None], cand, L)
        best = np.where(take, err, best)
        scale = np.where(take, this_scale, scale)
        lo = np.where(take, this_min, lo)
    return np.where(flat, F(0), scale).astype(F), (-lo).astype(F), np.where(flat[:, None], 0, L)


def _pack_scales_mins(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [B, 8] in K-quants' 12-byte layout."""
    s = np.zeros((ls.shape[0], 12), np.uint8)
    s[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    s[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    s[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return s


def _kx_levels(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Q4_K/Q5_K: x [B, 256] -> d, dmin (float16 [B]), packed scales [B, 12], levels [B, 256]."""
    B = x.shape[0]
    sub = x.reshape(B * 8, 32)
    sq = np.zeros(B * 8, F)
    for i in range(32):
        sq = sq + sub[:, i] * sub[:, i]
    weights = np.sqrt(sq / F(32))[:, None] + np.abs(sub)
    sc, mins, _ = make_qkx2_quants(sub, weights, nmax, rmin, rdelta, nstep)
    sc, mins = sc.reshape(B, 8), mins.reshape(B, 8)
    max_scale = np.zeros(B, F)
    max_min = np.zeros(B, F)
    for j in range(8):
        max_scale = np.where(sc[:, j] > max_scale, sc[:, j], max_scale)
        max_min = np.where(mins[:, j] > max_min, mins[:, j], max_min)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F(63) / max_scale, F(0)).astype(F)
        inv_min = np.where(max_min > 0, F(63) / max_min, F(0)).astype(F)
    ls = np.minimum(63, nearest_int(inv_scale[:, None] * sc).astype(np.uint8))
    lm = np.minimum(63, nearest_int(inv_min[:, None] * mins).astype(np.uint8))
    d, dmin = _fp16(max_scale / F(63)), _fp16(max_min / F(63))
    L = np.zeros((B, 256), np.int32)
    for j in range(8):
        dj = d.astype(F) * ls[:, j].astype(F)
        dm = dmin.astype(F) * lm[:, j].astype(F)
        live = dj != 0
        with np.errstate(divide="ignore", invalid="ignore"):
            lvl = nearest_int((x[:, 32 * j:32 * j + 32] + dm[:, None]) / np.where(live, dj, F(1))[:, None])
        L[:, 32 * j:32 * j + 32] = np.where(live[:, None], np.clip(lvl, 0, nmax), 0)
    return d, dmin, _pack_scales_mins(ls, lm), L


def _as_blocks(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=F)
    if x.size % 256:
        raise ValueError(f"K-quants need a multiple of 256 values, got {x.size}")
    return x.reshape(-1, 256)


def _halves(v: np.ndarray) -> np.ndarray:
    return v.view(np.uint8).reshape(-1, 2)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """x (any shape, rows of 256k values) -> Q4_K blocks [B, 144] (d, dmin, scales, nibbles)."""
    x = _as_blocks(x)
    d, dmin, scales, L = _kx_levels(x, 15, -1.0, 0.1, 20)
    qs = np.concatenate([L[:, 64 * c:64 * c + 32] | (L[:, 64 * c + 32:64 * c + 64] << 4) for c in range(4)], 1)
    return np.concatenate([_halves(d), _halves(dmin), scales, qs.astype(np.uint8)], 1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """x -> Q5_K blocks [B, 176] (d, dmin, scales, high bits, nibbles)."""
    x = _as_blocks(x)
    d, dmin, scales, L = _kx_levels(x, 31, -0.5, 0.1, 15)
    qh = np.zeros((x.shape[0], 32), np.int32)
    ql = []
    for c in range(4):
        lo, hi = L[:, 64 * c:64 * c + 32], L[:, 64 * c + 32:64 * c + 64]
        qh |= ((lo > 15) << (2 * c)) | ((hi > 15) << (2 * c + 1))
        ql.append((lo & 0xF) | ((hi & 0xF) << 4))
    return np.concatenate([_halves(d), _halves(dmin), scales, qh.astype(np.uint8),
                           np.concatenate(ql, 1).astype(np.uint8)], 1)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """x -> Q6_K blocks [B, 210] (low nibbles, high bits, int8 scales, d)."""
    x = _as_blocks(x)
    B = x.shape[0]
    sc, L0 = make_qx_quants(x.reshape(B * 16, 16), 32)
    sc, L0 = sc.reshape(B, 16), L0.reshape(B, 256)
    max_abs = np.zeros(B, F)
    max_scale = np.zeros(B, F)
    for j in range(16):
        a = np.abs(sc[:, j])
        bigger = a > max_abs
        max_abs = np.where(bigger, a, max_abs)
        max_scale = np.where(bigger, sc[:, j], max_scale)
    zero = max_abs < _EPS
    iscale = F(-128) / np.where(zero, F(1), max_scale)
    d = _fp16(F(1) / iscale)
    scales = np.minimum(127, nearest_int(iscale[:, None] * sc)).astype(np.int8)
    L = L0.copy()  # a sub-block whose scale rounds to 0 keeps its first levels, as in C
    for j in range(16):
        dj = d.astype(F) * scales[:, j].astype(F)
        live = dj != 0
        with np.errstate(divide="ignore", invalid="ignore"):
            lvl = nearest_int(x[:, 16 * j:16 * j + 16] / np.where(live, dj, F(1))[:, None])
        L[:, 16 * j:16 * j + 16] = np.where(live[:, None], np.clip(lvl, -32, 31) + 32, L[:, 16 * j:16 * j + 16])
    ql, qh = [], []
    for h in range(2):
        q = [L[:, 128 * h + 32 * k:128 * h + 32 * k + 32] for k in range(4)]
        ql += [(q[0] & 0xF) | ((q[2] & 0xF) << 4), (q[1] & 0xF) | ((q[3] & 0xF) << 4)]
        qh.append((q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6))
    out = np.concatenate([np.concatenate(ql, 1).astype(np.uint8), np.concatenate(qh, 1).astype(np.uint8),
                          scales.view(np.uint8), _halves(d)], 1)
    out[zero] = 0
    return out


def quantize(x: np.ndarray, type_name: str) -> np.ndarray:
    """Bytes of `x` (float32, GGUF row order) as llama-quantize writes `type_name` without an
    importance matrix."""
    if type_name == "F32":
        return np.ascontiguousarray(x, F).view(np.uint8).reshape(-1)
    if type_name == "F16":
        return np.ascontiguousarray(x, F).astype(np.float16).view(np.uint8).reshape(-1)
    ours = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}
    if type_name in ours:
        return ours[type_name](x).reshape(-1)
    from gguf import GGMLQuantizationType
    from gguf import quants as gq
    return gq.quantize(np.ascontiguousarray(x, F), GGMLQuantizationType[type_name]).view(np.uint8).reshape(-1)
