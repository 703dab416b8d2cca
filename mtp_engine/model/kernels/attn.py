"""Gated full attention of 1..16 new tokens (decode, draft, verify) as CUDA kernels, via
`mx.fast.cuda_kernel`; `blocks.GatedAttention` keeps the pure-MLX path as the portable path (CPU,
Metal, prefill) and as the reference these kernels are tested against.

Why: as MLX operations an attention layer of a decode step is ~25 kernels (slices, two per-head
RMSNorms, two ropes with their position arithmetic, transposes, the causal mask, two products for
the scores and the values, softmax, the sigmoid gate), each a launch and a graph node for a few KB of
data; on the H200 a step's time is mostly the host's cost per node, not the GPU's. Here:

1. `new_kv`: one block per (kv head, token) takes the joined q/k/v product's row, RMS-normalises the
   key, ropes it (NEOX halves over the first `n_rot` dimensions) and writes the new keys and values
   in the cache's [1, kv heads, S, D] layout; the cache appends them (MLX `slice_update`, in place);
2. `attend` (flash-decoding): one block per (kv head, token, key range) normalises and ropes the
   group's query heads, reads its range of the keys and values once for all of them (8 warps over
   the keys, each with an online softmax per head, merged in shared memory) and writes each head's
   normalised partial row and log-sum-exp; a second launch merges the ranges and multiplies by the
   sigmoid of the head's gate, writing the row the output product reads. The ranges split what each
   query sees (its causal length, a device value) evenly, their number follows the cache's
   capacity, so a long context is spread over the whole GPU at any position.

Rollback is unchanged: the cache still moves its offset.
"""
from __future__ import annotations

import mlx.core as mx

from .cuda_kernel import CudaKernel
from .source import compact

MAX_TOKENS = 16
MAX_BATCH = 256  # sequences of a batched step: one block row each (grid y)
WARPS = 8

# the cache's element type (EngineOptions.kv_dtype) read and written in float32 arithmetic; a lane's
# slice of a row in 16-byte loads where its width allows (8 halves or 4 floats)
_HEADER = """
__device__ __forceinline__ void kv_store(float* p, float x) { *p = x; }
__device__ __forceinline__ void kv_store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void kv_store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }
__device__ __forceinline__ float kv_float(float x) { return x; }
__device__ __forceinline__ float kv_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float kv_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <int N>
__device__ __forceinline__ void kv_row(const float* p, float* o) {
    if (N % 4 == 0) {
        #pragma unroll
        for (int i = 0; i < N; i += 4) {
            const float4 a = *reinterpret_cast<const float4*>(p + i);
            o[i] = a.x; o[i + 1] = a.y; o[i + 2] = a.z; o[i + 3] = a.w;
        }
    } else {
        #pragma unroll
        for (int i = 0; i < N; ++i) o[i] = p[i];
    }
}
template <int N, typename H>
__device__ __forceinline__ void kv_row(const H* p, float* o) {
    if (N % 8 == 0) {
        #pragma unroll
        for (int i = 0; i < N; i += 8) {
            const uint4 u = *reinterpret_cast<const uint4*>(p + i);
            const H* h = reinterpret_cast<const H*>(&u);
            #pragma unroll
            for (int j = 0; j < 8; ++j) o[i + j] = kv_float(h[j]);
        }
    } else {
        #pragma unroll
        for (int i = 0; i < N; ++i) o[i] = kv_float(p[i]);
    }
}
"""

_KV_SOURCE = """
    const int S = y_shape[1];
    const int E = y_shape[2];
    const int blk = blockIdx.x;
    const int s = blk / HKV, hk = blk % HKV;
    const int r = blockIdx.y;  // the sequence (row) of a batch, at its own position pos[r]
    const int d = threadIdx.x;
    const float eps = params[0], log2_base = params[1];
    const float* row = y + ((size_t)r * S + s) * E;
    const float kx = row[2 * HQ * D + hk * D + d];
    const float vx = row[2 * HQ * D + HKV * D + hk * D + d];
    __shared__ float part[32];
    __shared__ float kb[D];
    float ss = kx * kx;
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if ((d & 31) == 0) part[d >> 5] = ss;
    __syncthreads();
    float tot = 0.0f;
    #pragma unroll
    for (int w = 0; w < D / 32; ++w) tot += part[w];
    const float kn = kx * rsqrtf(tot / (float)D + eps) * kw[d];
    kb[d] = kn;
    __syncthreads();
    float out = kn;
    if (d < NROT) {
        constexpr int HALF = NROT / 2;
        const int i = d < HALF ? d : d - HALF;
        const float ang = (float)(pos[r] + s) * exp2f(-(float)(2 * i) / (float)NROT * log2_base);
        const float c = cosf(ang), sn = sinf(ang);
        out = d < HALF ? kn * c - kb[d + HALF] * sn : kb[d - HALF] * sn + kn * c;
    }
    const size_t o = (((size_t)r * HKV + hk) * S + s) * D + d;
    kv_store(k_new + o, out);
    kv_store(v_new + o, vx);
"""

_ATTEND_SOURCE = """
    constexpr int NW = WARPS;
    constexpr int DL = D / 32;                  // dimensions per lane
    constexpr int G = HQ / HKV;                 // query heads sharing one kv head
    const int S = y_shape[1];
    const int E = y_shape[2];
    const int CAP = keys_shape[2];
    const int NSPLIT = gridDim.x / (HKV * S);   // key ranges of one (kv head, token), one block each
    const int blk = blockIdx.x;
    const int split = blk % NSPLIT;
    const int s = (blk / NSPLIT) / HKV, hk = (blk / NSPLIT) % HKV;
    const int r = blockIdx.y;  // the sequence (row) of a batch: its own cache rows and position
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float eps = params[0], log2_base = params[1], scale = params[2];
    __shared__ float qs[G][D];
    __shared__ float part[NW];
    __shared__ float red[NW][D];
    __shared__ float sm[NW][G], sl[NW][G];
    // RMSNorm and rope of the group's query heads (each D wide; blockDim >= D)
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        const float* row = y + ((size_t)r * S + s) * E + (size_t)(hk * G + g) * 2 * D;
        const float qx = tid < D ? row[tid] : 0.0f;
        float ss = qx * qx;
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        if (lane == 0) part[warp] = ss;
        __syncthreads();
        float tot = 0.0f;
        #pragma unroll
        for (int w = 0; w < NW; ++w) tot += part[w];
        const float qn = qx * rsqrtf(tot / (float)D + eps) * (tid < D ? qw[tid] : 0.0f);
        if (tid < D) qs[g][tid] = qn;
        __syncthreads();
        float qr = qn;
        if (tid < NROT) {
            constexpr int HALF = NROT / 2;
            const int i = tid < HALF ? tid : tid - HALF;
            const float ang = (float)(pos[r] + s) * exp2f(-(float)(2 * i) / (float)NROT * log2_base);
            const float c = cosf(ang), sn = sinf(ang);
            qr = tid < HALF ? qn * c - qs[g][tid + HALF] * sn : qs[g][tid - HALF] * sn + qn * c;
        }
        __syncthreads();
        if (tid < D) qs[g][tid] = qr * scale;
        __syncthreads();
    }
    float q[G][DL], acc[G][DL], m[G], l[G];
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -__int_as_float(0x7f800000); l[g] = 0.0f;
        #pragma unroll
        for (int i = 0; i < DL; ++i) { q[g][i] = qs[g][lane * DL + i]; acc[g][i] = 0.0f; }
    }
    // causal: the query at position pos + s sees keys 0 .. pos + s; this block's share of them
    const int T = pos[r] + s + 1;
    const int per = (T + NSPLIT - 1) / NSPLIT;
    const int t0 = split * per;
    const int t1 = min(T, t0 + per);
    // positions from B0 on sit in the tail buffers (a cache's tail, else B0 is past every position);
    // a batch's rows each have their own tail and base
    const int B0 = base[base_shape[0] > 1 ? r : 0];
    const int TCAP = tail_k_shape[2];
    const size_t tr = tail_k_shape[0] > 1 ? (size_t)r : 0;
    const auto* kb = keys + ((size_t)r * HKV + hk) * CAP * D + lane * DL;
    const auto* vb = values + ((size_t)r * HKV + hk) * CAP * D + lane * DL;
    const auto* tkb = tail_k + (tr * HKV + hk) * TCAP * D + lane * DL;
    const auto* tvb = tail_v + (tr * HKV + hk) * TCAP * D + lane * DL;
    for (int t = t0 + warp; t < t1; t += NW) {
        float kv[DL], vv[DL];
        if (t < B0) {
            kv_row<DL>(kb + (size_t)t * D, kv);
            kv_row<DL>(vb + (size_t)t * D, vv);
        } else {
            kv_row<DL>(tkb + (size_t)(t - B0) * D, kv);
            kv_row<DL>(tvb + (size_t)(t - B0) * D, vv);
        }
        float dot[G];
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            dot[g] = 0.0f;
            #pragma unroll
            for (int i = 0; i < DL; ++i) dot[g] = fmaf(q[g][i], kv[i], dot[g]);
        }
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            #pragma unroll
            for (int g = 0; g < G; ++g) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], off);
        }
        #pragma unroll
        for (int g = 0; g < G; ++g) {
            const float mn = fmaxf(m[g], dot[g]);
            const float corr = expf(m[g] - mn);
            const float p = expf(dot[g] - mn);
            l[g] = l[g] * corr + p;
            #pragma unroll
            for (int i = 0; i < DL; ++i) acc[g][i] = fmaf(p, vv[i], acc[g][i] * corr);
            m[g] = mn;
        }
    }
    // the warps' partial softmaxes merged per query head: this block's (normalised row, log-sum-exp)
    #pragma unroll
    for (int g = 0; g < G; ++g) {
        if (lane == 0) { sm[warp][g] = m[g]; sl[warp][g] = l[g]; }
        #pragma unroll
        for (int i = 0; i < DL; ++i) red[warp][lane * DL + i] = acc[g][i];
        __syncthreads();
        if (tid < D) {
            float M = -__int_as_float(0x7f800000);
            #pragma unroll
            for (int w = 0; w < NW; ++w) M = fmaxf(M, sm[w][g]);
            float L = 0.0f, O = 0.0f;
            #pragma unroll
            for (int w = 0; w < NW; ++w) {
                const float f = sm[w][g] == -__int_as_float(0x7f800000) ? 0.0f : expf(sm[w][g] - M);
                L += f * sl[w][g];
                O += f * red[w][tid];
            }
            const size_t at = (((size_t)r * S + s) * HQ + hk * G + g) * NSPLIT + split;
            const bool lost = B0 != 0x7fffffff && pos[r] < B0;  // a query before its tail: a broken contract
            part_o[at * D + tid] = lost ? __int_as_float(0x7fffffff) : (L > 0.0f ? O / L : 0.0f);
            if (tid == 0) lse[at] = L > 0.0f ? M + logf(L) : -__int_as_float(0x7f800000);
        }
        __syncthreads();
    }
"""

_MERGE_SOURCE = """
    const int S = y_shape[1];
    const int E = y_shape[2];
    const int NSPLIT = lse_shape[3];
    const int s = blockIdx.x / HQ, h = blockIdx.x % HQ;
    const int r = blockIdx.y;
    const int d = threadIdx.x;
    const size_t at = (((size_t)r * S + s) * HQ + h) * NSPLIT;
    float M = -__int_as_float(0x7f800000);
    for (int j = 0; j < NSPLIT; ++j) M = fmaxf(M, lse[at + j]);
    float W = 0.0f, O = 0.0f;
    for (int j = 0; j < NSPLIT; ++j) {
        const float x = lse[at + j];
        const float w = x == -__int_as_float(0x7f800000) ? 0.0f : expf(x - M);
        W += w;
        O = fmaf(w, part_o[(at + j) * D + d], O);
    }
    const float g = y[((size_t)r * S + s) * E + (size_t)h * 2 * D + D + d];
    o[((size_t)r * S + s) * HQ * D + (size_t)h * D + d] = O / W / (1.0f + expf(-g));
"""

# Keys one block of `attend` reads at most (its share of the context): a long context is spread
# over HKV x S x splits blocks (flash-decoding); one block per (kv head, token) over 32k keys left
# all but 16 of the GPU's SMs idle (a step grew by ~33 ms between 512 and 32k positions).
KEYS_PER_SPLIT = 256
MAX_SPLITS = 256


def splits(capacity: int) -> int:
    """Key ranges per (kv head, token) for a cache of `capacity` positions: one block reads at most
    about KEYS_PER_SPLIT keys of the valid ones (each block splits what its query sees evenly)."""
    return max(1, min(-(-capacity // KEYS_PER_SPLIT), MAX_SPLITS))


CACHE_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_kv_kernel = None
_attend_kernel = None
_merge_kernel = None


def supports(n_head: int, n_head_kv: int, head_dim: int, n_rot: int, batch: int, tokens: int,
             dtype=mx.float32) -> bool:
    """Head sizes a multiple of 32 up to 256 (a block of 256 threads holds one head), whole GQA
    groups, an even rope width, 1..MAX_BATCH sequences of 1..16 tokens each, a cache of float32,
    float16 or bfloat16."""
    return (1 <= batch <= MAX_BATCH and 1 <= tokens <= MAX_TOKENS and head_dim % 32 == 0 and 32 <= head_dim <= 256
            and n_head % n_head_kv == 0 and n_rot % 2 == 0 and 0 < n_rot <= head_dim and dtype in CACHE_DTYPES)


def _params(eps: float, rope_base: float, scale: float) -> mx.array:
    import math
    return mx.array([eps, math.log2(rope_base), scale], dtype=mx.float32)


def new_kv(y: mx.array, k_norm: mx.array, pos: mx.array, n_head: int, n_head_kv: int, head_dim: int,
           n_rot: int, eps: float, rope_base: float, dtype: mx.Dtype = mx.float32) -> tuple[mx.array, mx.array]:
    """y [S, E] (one sequence) or [B, S, E] the joined q(+gate)/k/v product rows, pos [B] int32
    each sequence's first new position: (keys, values) [B, n_head_kv, S, head_dim] in the cache's
    `dtype`, keys normalised and roped."""
    global _kv_kernel
    if _kv_kernel is None:
        _kv_kernel = CudaKernel(name="mtp_attn_kv", input_names=["y", "kw", "pos", "params"],
                                output_names=["k_new", "v_new"], source=compact(_KV_SOURCE), header=_HEADER)
    y = y[None] if y.ndim == 2 else y
    b, s = int(y.shape[0]), int(y.shape[1])
    shape = (b, n_head_kv, s, head_dim)
    return tuple(_kv_kernel(inputs=[y, k_norm.astype(mx.float32), pos, _params(eps, rope_base, 1.0)],
                            template=[("D", head_dim), ("HQ", n_head), ("HKV", n_head_kv), ("NROT", n_rot)],
                            grid=(n_head_kv * s * head_dim, b, 1), threadgroup=(head_dim, 1, 1),
                            output_shapes=[shape, shape], output_dtypes=[dtype, dtype]))


def attend(y: mx.array, q_norm: mx.array, keys: mx.array, values: mx.array, pos: mx.array, n_head: int,
           n_head_kv: int, head_dim: int, n_rot: int, eps: float, rope_base: float,
           tail: tuple[mx.array, mx.array, mx.array] | None = None) -> mx.array:
    """Queries from y [S, E] (or [B, S, E]) against the cache buffers [B, n_head_kv, capacity,
    head_dim] (row b already holding its new keys at pos[b] .. pos[b] + S - 1), gated:
    [S, n_head * head_dim] (or [B, S, n_head * head_dim]). Two launches: each block attends one
    kv head's query heads (read once for the group) over one range of the keys (`splits`), then
    the ranges' partial softmaxes are merged and gated. `tail`: (tail keys, tail values, base) of
    a cache whose positions from base on sit in the tail (a sequence's [1, n_kv, T, D] and base
    [1], `KVCache.rebase`; a batch's [B, n_kv, T, D] and base [B], `BatchCache.rebase`); a query
    before its base (a contract broken upstream) gets NaN, which the round's check reports."""
    global _attend_kernel, _merge_kernel
    if _attend_kernel is None:
        _attend_kernel = CudaKernel(
            name="mtp_attn_split", input_names=["y", "qw", "keys", "values", "pos", "params", "tail_k", "tail_v",
                                                "base"],
            output_names=["part_o", "lse"], source=compact(_ATTEND_SOURCE), header=_HEADER)
        _merge_kernel = CudaKernel(name="mtp_attn_merge", input_names=["y", "part_o", "lse"], output_names=["o"],
                                   source=compact(_MERGE_SOURCE))
    one = y.ndim == 2
    y = y[None] if one else y
    b, s = int(y.shape[0]), int(y.shape[1])
    if tail is None:  # every position in the main buffers
        tail = (keys, values, mx.array([2 ** 31 - 1], dtype=mx.int32))
    elif int(tail[0].shape[0]) != b or int(tail[2].shape[0]) != b:
        raise ValueError(f"a cache tail of {tail[0].shape[0]} rows and {tail[2].shape[0]} bases for {b} rows")
    n = splits(int(keys.shape[2]) + int(tail[0].shape[2]))
    dims = [("D", head_dim), ("HQ", n_head), ("HKV", n_head_kv)]
    part_o, lse = _attend_kernel(
        inputs=[y, q_norm.astype(mx.float32), keys, values, pos, _params(eps, rope_base, head_dim ** -0.5),
                tail[0], tail[1], tail[2]],
        template=dims + [("NROT", n_rot), ("WARPS", WARPS)],
        grid=(n_head_kv * s * n * 32 * WARPS, b, 1), threadgroup=(32 * WARPS, 1, 1),
        output_shapes=[(b, s, n_head, n, head_dim), (b, s, n_head, n)], output_dtypes=[mx.float32, mx.float32])
    out = _merge_kernel(inputs=[y, part_o, lse], template=dims, grid=(n_head * s * head_dim, b, 1),
                        threadgroup=(head_dim, 1, 1), output_shapes=[(b, s, n_head * head_dim)],
                        output_dtypes=[mx.float32])[0]
    return out[0] if one else out


def reference(y: mx.array, q_norm: mx.array, k_norm: mx.array, keys: mx.array, values: mx.array, pos: int,
              n_head: int, n_head_kv: int, head_dim: int, n_rot: int, eps: float, rope_base: float):
    """The same computation in MLX operations (what `GatedAttention` does), for the tests:
    (gated output [S, n_head * head_dim], new keys, new values). `keys`/`values` hold the cache
    before the new tokens (their first `pos` positions are used); a 16-bit cache holds the new
    keys and values rounded to its type, and attention reads them from there, in float32."""
    cache_dtype = keys.dtype
    s, d = int(y.shape[0]), head_dim
    e1 = 2 * n_head * d
    qg = y[:, :e1].reshape(1, s, n_head, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(s, n_head * d)
    k = y[:, e1:e1 + n_head_kv * d].reshape(1, s, n_head_kv, d)
    v = y[:, e1 + n_head_kv * d:].reshape(1, s, n_head_kv, d).transpose(0, 2, 1, 3)
    q = mx.fast.rms_norm(q, q_norm, eps).transpose(0, 2, 1, 3)
    k = mx.fast.rms_norm(k, k_norm, eps).transpose(0, 2, 1, 3)
    q = mx.fast.rope(q, n_rot, traditional=False, base=rope_base, scale=1.0, offset=pos)
    k = mx.fast.rope(k, n_rot, traditional=False, base=rope_base, scale=1.0, offset=pos)
    k, v = k.astype(cache_dtype), v.astype(cache_dtype)
    all_k = mx.concatenate([keys[:, :, :pos], k], axis=2).astype(mx.float32)
    all_v = mx.concatenate([values[:, :, :pos], v], axis=2).astype(mx.float32)
    out = mx.fast.scaled_dot_product_attention(q, all_k, all_v, scale=d ** -0.5,
                                               mask="causal" if s > 1 else None)
    out = out.transpose(0, 2, 1, 3).reshape(s, n_head * d)
    return out * mx.sigmoid(gate), k, v


def max_error(n_head: int, n_head_kv: int, head_dim: int, n_rot: int, s: int, pos: int | list[int],
              seed: int = 0, dtype: mx.Dtype = mx.float32) -> float:
    """Largest absolute difference between the kernels and `reference` on random inputs (output,
    new keys, new values), with `pos` positions already in a cache of `dtype` and capacity
    pos + s + 7; `pos` a list: a batch of that many sequences in one launch, each at its own
    position, each compared with `reference` run alone (the batch's cache written per row, as
    `BatchKVCache` does). New keys and values of a 16-bit cache may differ from the reference's
    by one rounding of that type (their float32 values differ in the last bits): the part of a
    difference beyond one unit in the last place counts."""
    one = isinstance(pos, int)
    positions = [pos] if one else list(pos)
    b = len(positions)
    eps, base = 1e-6, 10000.0
    # the inputs, the cache writes and the reference on the CPU: on a GPU each of their operations
    # would be a JIT compile on a fresh machine that decoding never uses
    with mx.stream(mx.cpu):
        ks = mx.random.split(mx.random.key(seed), 5)
        e = (2 * n_head + 2 * n_head_kv) * head_dim
        y = mx.random.normal((b, s, e), key=ks[0])
        qn = 1.0 + 0.1 * mx.random.normal((head_dim,), key=ks[1])
        kn = 1.0 + 0.1 * mx.random.normal((head_dim,), key=ks[2])
        cap = max(positions) + s + 7
        keys = mx.random.normal((b, n_head_kv, cap, head_dim), key=ks[3]).astype(dtype)
        values = mx.random.normal((b, n_head_kv, cap, head_dim), key=ks[4]).astype(dtype)
        p = mx.array(positions, dtype=mx.int32)
        y_in = y[0] if one else y  # one sequence: the [S, E] form the layer passes
        refs = [reference(y[r], qn, kn, keys[r:r + 1], values[r:r + 1], at, n_head, n_head_kv, head_dim, n_rot,
                          eps, base) for r, at in enumerate(positions)]
        mx.eval(y_in, qn, kn, keys, values, p, refs)
    k_new, v_new = new_kv(y_in, kn, p, n_head, n_head_kv, head_dim, n_rot, eps, base, dtype=dtype)
    mx.eval(k_new, v_new)
    with mx.stream(mx.cpu):
        idx = mx.broadcast_to(p[:, None, None, None] + mx.arange(s)[None, None, :, None], k_new.shape)
        keys_in, values_in = mx.put_along_axis(keys, idx, k_new, axis=2), mx.put_along_axis(values, idx, v_new, axis=2)
        mx.eval(keys_in, values_in)
    got = attend(y_in, qn, keys_in, values_in, p, n_head, n_head_kv, head_dim, n_rot, eps, base)
    mx.eval(got)
    got = got[None] if one else got
    ulp = {mx.float32: 0.0, mx.float16: 2.0 ** -10, mx.bfloat16: 2.0 ** -7}[dtype]  # relative, at most
    err = 0.0
    with mx.stream(mx.cpu):
        for r, (ref_o, ref_k, ref_v) in enumerate(refs):
            err = max(err, float(mx.abs(ref_o - got[r]).max().item()))
            for a, g in ((ref_k, k_new[r:r + 1]), (ref_v, v_new[r:r + 1])):
                a, g = a.astype(mx.float32), g.astype(mx.float32)
                err = max(err, float(mx.maximum(mx.abs(a - g) - ulp * mx.abs(a), 0).max().item()))
    return err


def source() -> str:
    """The three kernels' CUDA text (what a self-test verdict is kept under)."""
    return _HEADER + _KV_SOURCE + _ATTEND_SOURCE + _MERGE_SOURCE


def self_test(shape: tuple[int, int, int, int] | None = None, dtype: mx.Dtype = mx.float32) -> bool:
    """Whether the kernels match the MLX operations on random inputs (1 and 5 tokens, GQA, partial
    rope; a batch of 3 sequences at different positions; 700 keys over several blocks). Raises
    what a compile raises.

    `shape` (n_head, n_head_kv, head_dim, n_rot) and `dtype` (the KV cache's): test at the
    model's own shape and cache type, whose compiled kernels (one NVRTC compile per shape and
    type) the model then reuses."""
    if shape is None or not supports(*shape, 1, 1):
        shape = (4, 2, 64, 16)
    # 2e-3: MLX's attention products on a GPU run at reduced (TF32-class) precision
    # (2, 700): a cache long enough to split its keys over several blocks
    return all(max_error(*shape, s, pos, seed=s, dtype=dtype) < 2e-3
               for s, pos in ((1, 9), (5, 3), (2, [4, 0, 11]), (2, 700)))
