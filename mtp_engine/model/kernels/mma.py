"""A tensor-core kernel for quantized products of 2..32 rows (verify, draft blocks, a batch's
steps and verifies, short prompts), via `mx.fast.cuda_kernel`: the cost of a product stays about
that of reading its weights once, whatever the rows (qmv.py's CUDA-core kernel does 8 rows for
4.8x the price of one).

Why tensor cores: with M input rows a CUDA-core kernel does M multiply-adds per weight and loads
x once per row per weight word; at 8 rows that, not memory, is the bound. An m16n8k16 mma does
16 x 8 x 16 multiply-adds in one instruction, with 8 input rows as its n = 8 columns; up to 4 such
column tiles share each weight fragment. A column's sums never mix with another's, so a row's
result is the same bits whichever rows share its product (a batch's row equals the row alone).
Numerics: weights are exact bf16 integers, x enters as bf16 hi + lo (about 17 significant bits),
sums are float32: ~1e-6 relative to a float32 product (scripts/bench/qmv_rows.py checks it on a GPU
against MLX's). One row stays on the CUDA-core kernel, the fastest for plain decoding.

Layout (MLX affine quantization): W [N, K*bits/32] uint32, values packed low bits first; scales and
biases [N, K/group] float32; w = q * scale + bias.
"""
from __future__ import annotations

import mlx.core as mx

from .cuda_kernel import CudaKernel
from .source import compact

MAX_ROWS = 32  # 4 column tiles of 8 rows
# Block shape, chosen in the model (`qmv_rows.py --in-model`): a forward's products depend on each
# other, so one block per SM must keep enough loads in flight alone. 8 warps x 1 tile x 3 stages:
# 4-row 9B forward 6.83 ms against 7.23 for 4 x 2 x 3 (which timed best on independent products).
TILES = 1      # 16-feature tiles per warp
WARPS = 8      # warps of a block, splitting K
STAGES = 3     # copies in flight per warp (shared memory: STAGES * WARPS * TILES * 1792 bytes <= 48 KB)
SPLIT = 2      # bf16 parts of x: 2 (~17 bits) or 3 (float32's 24)

HEADER = r"""
// x as bf16 rounded to nearest (finite inputs); the hi + lo split below keeps ~17 bits of x
__device__ __forceinline__ unsigned mtp_rn(float a) {
    const unsigned u = __float_as_uint(a);
    return (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
}
__device__ __forceinline__ unsigned mtp_pack_hi(float a, float b) { return (mtp_rn(a) >> 16) | mtp_rn(b); }
__device__ __forceinline__ float mtp_hi(float a) { return __uint_as_float(mtp_rn(a)); }
// bf16x2 128 + q (q OR-ed into the mantissa of 128.0) minus 128: the exact integer q, with no
// int-to-float conversion
__device__ __forceinline__ unsigned mtp_q(unsigned m) {
    unsigned d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(m | 0x43004300u), "r"(0x3F803F80u), "r"(0xC300C300u));
    return d;
}
__device__ __forceinline__ void mtp_mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                        unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// A (weights) times B = (x_a, x_b) pairs, with x split into bf16 hi + lo so the sum keeps ~16 bits
__device__ __forceinline__ void mtp_mma_x(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                          float x0, float x1, float x2, float x3) {
    mtp_mma(c, a0, a1, a2, a3, mtp_pack_hi(x0, x1), mtp_pack_hi(x2, x3));
    mtp_mma(c, a0, a1, a2, a3, mtp_pack_hi(x0 - mtp_hi(x0), x1 - mtp_hi(x1)),
            mtp_pack_hi(x2 - mtp_hi(x2), x3 - mtp_hi(x3)));
}

// the same with x in three bf16 parts (hi + mid + lo: all 24 bits of a float32 mantissa): every
// product is exact and only the float32 sums round, as on the CUDA cores
__device__ __forceinline__ void mtp_mma_x3(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                           float x0, float x1, float x2, float x3) {
    const float r0 = x0 - mtp_hi(x0), r1 = x1 - mtp_hi(x1), r2 = x2 - mtp_hi(x2), r3 = x3 - mtp_hi(x3);
    mtp_mma(c, a0, a1, a2, a3, mtp_pack_hi(x0, x1), mtp_pack_hi(x2, x3));
    mtp_mma(c, a0, a1, a2, a3, mtp_pack_hi(r0, r1), mtp_pack_hi(r2, r3));
    mtp_mma(c, a0, a1, a2, a3, mtp_pack_hi(r0 - mtp_hi(r0), r1 - mtp_hi(r1)),
            mtp_pack_hi(r2 - mtp_hi(r2), r3 - mtp_hi(r3)));
}

template <int S>
__device__ __forceinline__ void mtp_mma_xs(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                           float x0, float x1, float x2, float x3) {
    if (S == 3) mtp_mma_x3(c, a0, a1, a2, a3, x0, x1, x2, x3);
    else mtp_mma_x(c, a0, a1, a2, a3, x0, x1, x2, x3);
}

__device__ __forceinline__ void mtp_cp16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src));
}
template <int SZ>
__device__ __forceinline__ void mtp_cp(unsigned dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" :: "r"(dst), "l"(src), "n"(SZ));
}
__device__ __forceinline__ void mtp_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void mtp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N)); }
__device__ __forceinline__ void mtp_ldsm4(unsigned* d, unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "r"(addr));
}
"""

SOURCE = r"""
    // out[m, n] = sum_k x[m, k] * (q[n, k] * s[n, g] + b[n, g]) on the tensor cores. A warp tile is
    // 16 output features x 8 input rows (m16n8k16: weights as A, x^T as B); a warp owns TM feature
    // tiles times NT column tiles (input rows 8j..8j+7) and a block's NW warps split K, adding in
    // shared memory in a fixed order (deterministic).
    // Fragments: lane = 4 * gi + t holds A rows gi and gi + 8 and B column gi (input row 8j + gi). Which
    // physical k a fragment slot stands for is ours to choose (A and B only must agree): lane t
    // takes word t of each 16-byte piece of a group, so a group is whole in one mma chain and its
    // scale applies after. Weights enter as exact bf16 integers (mtp_q); 8-bit values as two
    // nibbles, the high one against 16 x.
    // The weights stream through shared memory: each lane copies whole 16-byte pieces (cp.async,
    // ST stages in flight, no registers held) and ldmatrix hands every lane the word of each piece
    // its fragment needs. A stage is a chunk of 64 bytes (4 pieces) of each of the warp's 16 * TM
    // rows, with those rows' scales and biases; warps split the chunks of K.
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = wq_shape[0];
    constexpr int VPW = 32 / BITS;
    constexpr int CV = 16 * VPW;             // values per chunk (64 bytes) of a row
    constexpr int WT = GROUP / 4 / VPW;      // words per lane per group = 16-byte pieces per group
    constexpr int GPC = 4 / WT;              // groups per chunk
    const int KW = K / VPW;
    const int G = K / GROUP;
    const int NCH = K / CV;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int gi = lane >> 2, t = lane & 3;
    const int nb = blockIdx.x * (16 * TM);
    __shared__ __align__(16) unsigned ws[ST][NW][TM][16][20];      // rows padded to 80 bytes: no bank conflicts
    __shared__ __align__(16) float sbs[ST][NW][TM][2][16][4];
    // this lane's copies: weight rows gi and gi + 8, piece t; scale (lane < 16) or bias row lane & 15
    const unsigned* wsrc = wq + (size_t)(nb + gi) * KW + 4 * t;
    const float* ssrc = (lane < 16 ? scales : biases) + (size_t)(nb + (lane & 15)) * G;
    auto issue = [&](int stage, int c) {
        #pragma unroll
        for (int i = 0; i < TM; ++i) {
            const size_t roff = (size_t)(16 * i) * KW + (size_t)c * 16;
            mtp_cp16((unsigned)__cvta_generic_to_shared(&ws[stage][warp][i][gi][4 * t]), wsrc + roff);
            mtp_cp16((unsigned)__cvta_generic_to_shared(&ws[stage][warp][i][gi + 8][4 * t]), wsrc + roff + (size_t)8 * KW);
            mtp_cp<4 * GPC>((unsigned)__cvta_generic_to_shared(&sbs[stage][warp][i][lane >> 4][lane & 15][0]),
                            ssrc + (size_t)(16 * i) * G + (size_t)c * GPC);
        }
    };
    float acc[TM][NT][4];
    #pragma unroll
    for (int i = 0; i < TM; ++i) {
        #pragma unroll
        for (int j = 0; j < NT; ++j) { acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f; }
    }
    int next = warp;
    #pragma unroll
    for (int s = 0; s < ST - 1; ++s) {
        if (next < NCH) issue(s, next);
        mtp_commit();
        next += NW;
    }
    int stage = 0;
    for (int c = warp; c < NCH; c += NW) {
        if (next < NCH) issue((stage + ST - 1) % ST, next);
        mtp_commit();
        next += NW;
        mtp_wait<ST - 1>();
        __syncwarp();
        // fragments: wr[i][h][p] = word t of piece p of row gi + 8h (ldmatrix: lanes 8m..8m+7 name
        // the 8 rows of matrix m; matrices = (rows 0-7, piece 2q), (8-15, 2q), (0-7, 2q+1), (8-15, 2q+1))
        unsigned wr[TM][2][4];
        #pragma unroll
        for (int i = 0; i < TM; ++i) {
            #pragma unroll
            for (int q = 0; q < 2; ++q) {
                const int mi = lane >> 3;
                unsigned d[4];
                mtp_ldsm4(d, (unsigned)__cvta_generic_to_shared(&ws[stage][warp][i][(lane & 7) + 8 * (mi & 1)][4 * (2 * q + (mi >> 1))]));
                wr[i][0][2 * q] = d[0]; wr[i][1][2 * q] = d[1]; wr[i][0][2 * q + 1] = d[2]; wr[i][1][2 * q + 1] = d[3];
            }
        }
        #pragma unroll
        for (int gl = 0; gl < GPC; ++gl) {
            const int jg = c * GPC + gl;
            // lane t's v-th word of the group is word 4v + t (piece v); column tile j's lane gi
            // holds input row 8j + gi: its x values, loaded once per piece for the warp's TM tiles
            float c4[TM][NT][4];
            float xs[NT];
            #pragma unroll
            for (int j = 0; j < NT; ++j) {
                xs[j] = 0.0f;
                #pragma unroll
                for (int i = 0; i < TM; ++i) { c4[i][j][0] = c4[i][j][1] = c4[i][j][2] = c4[i][j][3] = 0.0f; }
            }
            #pragma unroll
            for (int v = 0; v < WT; ++v) {
                float xw[NT][VPW];
                #pragma unroll
                for (int j = 0; j < NT; ++j) {
                    const int row = 8 * j + gi;
                    if (row < M) {
                        const float4* xp = reinterpret_cast<const float4*>(x + (size_t)row * K + (size_t)jg * GROUP + (4 * v + t) * VPW);
                        #pragma unroll
                        for (int e = 0; e < VPW / 4; ++e) {
                            const float4 a = xp[e];
                            xw[j][4 * e] = a.x; xw[j][4 * e + 1] = a.y; xw[j][4 * e + 2] = a.z; xw[j][4 * e + 3] = a.w;
                        }
                    } else {
                        #pragma unroll
                        for (int e = 0; e < VPW; ++e) xw[j][e] = 0.0f;
                    }
                    #pragma unroll
                    for (int e = 0; e < VPW; ++e) xs[j] += xw[j][e];
                }
                #pragma unroll
                for (int i = 0; i < TM; ++i) {
                    const unsigned r0 = wr[i][0][gl * WT + v], r1 = wr[i][1][gl * WT + v];
                    #pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        if (BITS == 4) {
                            #pragma unroll
                            for (int s = 0; s < 2; ++s) {
                                const int p = 2 * s;
                                mtp_mma_xs<SPLIT>(c4[i][j], mtp_q((r0 >> (4 * p)) & 0x000F000Fu),
                                                  mtp_q((r1 >> (4 * p)) & 0x000F000Fu),
                                                  mtp_q((r0 >> (4 * p + 4)) & 0x000F000Fu),
                                                  mtp_q((r1 >> (4 * p + 4)) & 0x000F000Fu),
                                                  xw[j][p], xw[j][p + 4], xw[j][p + 1], xw[j][p + 5]);
                            }
                        } else {
                            #pragma unroll
                            for (int hn = 0; hn < 2; ++hn) {
                                const int sh = 4 * hn;
                                const float f = hn ? 16.0f : 1.0f;
                                mtp_mma_xs<SPLIT>(c4[i][j], mtp_q((r0 >> sh) & 0x000F000Fu),
                                                  mtp_q((r1 >> sh) & 0x000F000Fu),
                                                  mtp_q((r0 >> (sh + 8)) & 0x000F000Fu),
                                                  mtp_q((r1 >> (sh + 8)) & 0x000F000Fu),
                                                  f * xw[j][0], f * xw[j][2], f * xw[j][1], f * xw[j][3]);
                            }
                        }
                    }
                }
            }
            // the bias term needs each input row's sum over the group: lanes 4gi..4gi+3 hold row
            // 8j + gi's parts; C's columns 2t and 2t + 1 are lanes 8t and 8t + 4's rows
            float xs0[NT], xs1[NT];
            #pragma unroll
            for (int j = 0; j < NT; ++j) {
                xs[j] += __shfl_xor_sync(0xffffffffu, xs[j], 1);
                xs[j] += __shfl_xor_sync(0xffffffffu, xs[j], 2);
                xs0[j] = __shfl_sync(0xffffffffu, xs[j], 8 * t);
                xs1[j] = __shfl_sync(0xffffffffu, xs[j], 8 * t + 4);
            }
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                const float s0 = sbs[stage][warp][i][0][gi][gl], s1 = sbs[stage][warp][i][0][gi + 8][gl];
                const float b0 = sbs[stage][warp][i][1][gi][gl], b1 = sbs[stage][warp][i][1][gi + 8][gl];
                #pragma unroll
                for (int j = 0; j < NT; ++j) {
                    acc[i][j][0] += s0 * c4[i][j][0] + b0 * xs0[j];
                    acc[i][j][1] += s0 * c4[i][j][1] + b0 * xs1[j];
                    acc[i][j][2] += s1 * c4[i][j][2] + b1 * xs0[j];
                    acc[i][j][3] += s1 * c4[i][j][3] + b1 * xs1[j];
                }
            }
        }
        __syncwarp();  // the next turn's copies overwrite the stage ST - 1 turns on, this one included
        stage = stage + 1 == ST ? 0 : stage + 1;
    }
    mtp_wait<0>();
    if (NW > 1) {
        // warps 1.. hand their sums to warp 0 through the weights' shared memory, free once every
        // warp has read its last stage (a fixed order of addition: deterministic)
        float* red = reinterpret_cast<float*>(&ws[0][0][0][0][0]);
        constexpr int PER = TM * NT * 4;
        __syncthreads();
        if (warp > 0) {
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                #pragma unroll
                for (int j = 0; j < NT; ++j) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) red[((warp - 1) * PER + (i * NT + j) * 4 + e) * 32 + lane] = acc[i][j][e];
                }
            }
        }
        __syncthreads();
        if (warp > 0) return;
        for (int ww = 0; ww < NW - 1; ++ww) {
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                #pragma unroll
                for (int j = 0; j < NT; ++j) {
                    #pragma unroll
                    for (int e = 0; e < 4; ++e) acc[i][j][e] += red[(ww * PER + (i * NT + j) * 4 + e) * 32 + lane];
                }
            }
        }
    }
    #pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int n = nb + 16 * i + gi;
        #pragma unroll
        for (int j = 0; j < NT; ++j) {
            const int m0 = 8 * j + 2 * t, m1 = m0 + 1;
            if (m0 < M) { out[(size_t)m0 * N + n] = acc[i][j][0]; out[(size_t)m0 * N + n + 8] = acc[i][j][2]; }
            if (m1 < M) { out[(size_t)m1 * N + n] = acc[i][j][1]; out[(size_t)m1 * N + n + 8] = acc[i][j][3]; }
        }
    }
"""

_kernel = None


def supports(weight: mx.array, scales: mx.array, bits: int, group_size: int, rows: int) -> bool:
    """Whether this kernel takes the product: 1..32 rows, 4- or 8-bit, groups of 32/64/128 (8-bit:
    32/64), rows of whole 64-byte chunks, N a multiple of 16, float32 scales."""
    if bits not in (4, 8) or group_size not in (32, 64, 128) or (bits == 8 and group_size == 128):
        return False
    return (1 <= rows <= MAX_ROWS and weight.ndim == 2 and weight.shape[0] % 16 == 0
            and weight.shape[1] % 16 == 0 and scales.dtype == mx.float32)


def quantized_rows(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, bits: int,
                   group_size: int, warps: int = WARPS, tiles: int = TILES, stages: int = STAGES,
                   split: int = SPLIT) -> mx.array:
    """x [M, K] (M <= 32) times W^T: [M, N] float32, in ceil(M / 8) column tiles (1, 2 or 4: each
    a compile). `warps`, `tiles`, `stages`: the block shape (scripts/bench/qmv_rows.py times others);
    `split`: x's bf16 parts (2 or 3). None of them changes a row's bits but `warps` and `split`."""
    global _kernel
    if _kernel is None:
        _kernel = CudaKernel(name="mtp_qmv_mma", input_names=["x", "wq", "scales", "biases"],
                                      output_names=["out"], source=compact(SOURCE), header=HEADER)
    n = weight.shape[0]
    while n % (16 * tiles):
        tiles //= 2
    cols = next(c for c in (1, 2, 4) if 8 * c >= x.shape[0])
    return _kernel(inputs=[x.astype(mx.float32), weight, scales, biases],
                   template=[("BITS", bits), ("GROUP", group_size), ("TM", tiles), ("NW", warps), ("ST", stages),
                             ("SPLIT", split), ("NT", cols)],
                   grid=(n // (16 * tiles) * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
                   output_shapes=[(x.shape[0], n)], output_dtypes=[mx.float32])[0]
