"""A CUDA kernel for quantized products of a few rows (decode, draft, verify), via
`mx.fast.cuda_kernel`, with MLX's `quantized_matmul` as the fallback everywhere else.

Why: MLX's CUDA quantized matrix-vector kernels read 4-bit group-32 weights at about 400 GB/s on an
H200 (3 TB/s measured copy bandwidth), and for 2..7 rows take a per-row path whose cost grows
with the rows, so verifying k drafts costs almost k plain steps. Here one warp computes R output
features for all M <= 8 input rows at once: each weight word is read from memory once per step
whatever M is, so a verify costs about what a plain step does until arithmetic catches up.

Layout (MLX affine quantization): W [N, K*bits/32] uint32, values packed low bits first; scales and
biases [N, K/group] float32; w = q * scale + bias. Lane l of a warp takes chunks l, l+32, ... of its
rows in 16-byte chunks (4 words: one 4-bit group); x[m, a word's columns] is loaded once and reused
for the warp's R rows.
"""
from __future__ import annotations

import warnings

import mlx.core as mx

MAX_ROWS = 8
ROWS_PER_WARP = 8  # output features per warp (bench_gpu.py measures 2, 4 and 8 through `rows_per_warp=`)
# row counts the kernel is compiled for; others are padded up to the next (each variant is an
# NVRTC compile of ~1 s at first use, so there are few of them)
ROW_VARIANTS = (1, 2, 4, 8)

_SOURCE = """
    // shapes are runtime values: one compiled kernel per (rows, bits, group), not per matrix shape
    const int K = x_shape[1];
    const int N = wq_shape[0];
    constexpr int VPW = 32 / BITS;          // values per uint32 word
    const int KW = K / VPW;                 // words per weight row
    const int KC = KW / 4;                  // 16-byte chunks per weight row
    const int G = K / GROUP;                // groups per row
    constexpr int WPG = GROUP / VPW;        // words per group (a chunk never straddles two)
    constexpr unsigned MASK = (1u << BITS) - 1u;
    const int gwarp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    const int n0 = gwarp * R;
    if (n0 >= N) return;
    const uint4* w4 = reinterpret_cast<const uint4*>(wq);
    float acc[R][M];
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int m = 0; m < M; ++m) acc[r][m] = 0.0f;
    }
    #pragma unroll 2
    for (int c = lane; c < KC; c += 32) {
        // issue every row's 16-byte load first: more bytes in flight per lane
        uint4 words[R];
        float sc[R], bi[R];
        const int g = (4 * c) / WPG;
        #pragma unroll
        for (int r = 0; r < R; ++r) {
            const size_t n = (size_t)(n0 + r);
            words[r] = w4[n * KC + c];
            sc[r] = scales[n * G + g];
            bi[r] = biases[n * G + g];
        }
        #pragma unroll
        for (int j = 0; j < 4; ++j) {
            // unpack each row's word once, then stream the input rows past it: unpacking per
            // input row made integer-to-float conversions, not memory, the bound for M > 1
            float wv[R][VPW];
            #pragma unroll
            for (int r = 0; r < R; ++r) {
                const unsigned q = j == 0 ? words[r].x : j == 1 ? words[r].y : j == 2 ? words[r].z : words[r].w;
                #pragma unroll
                for (int v = 0; v < VPW; ++v) wv[r][v] = (float)((q >> (BITS * v)) & MASK);
            }
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                const float4* xp = reinterpret_cast<const float4*>(x + (size_t)m * K + (size_t)(4 * c + j) * VPW);
                float xv[VPW];
                float xs = 0.0f;
                #pragma unroll
                for (int i = 0; i < VPW / 4; ++i) {
                    const float4 a = xp[i];
                    xv[4 * i] = a.x; xv[4 * i + 1] = a.y; xv[4 * i + 2] = a.z; xv[4 * i + 3] = a.w;
                    xs += a.x + a.y + a.z + a.w;
                }
                #pragma unroll
                for (int r = 0; r < R; ++r) {
                    float d = 0.0f;
                    #pragma unroll
                    for (int v = 0; v < VPW; ++v) d = fmaf(xv[v], wv[r][v], d);
                    acc[r][m] += sc[r] * d + bi[r] * xs;
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < R; ++r) {
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            float v = acc[r][m];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
            if (lane == ((r * M + m) & 31)) out[(size_t)m * N + n0 + r] = v;
        }
    }
"""

_MMA_HEADER = r"""
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
"""

_MMA_SOURCE = r"""
    // Tensor-core few-row product: out[m, n] = sum_k x[m, k] * (q[n, k] * s[n, g] + b[n, g]).
    // One warp tile = 16 output features x 8 input rows (m16n8k16, weights as A, x^T as B); a block's
    // NW warps split K and add in shared memory in a fixed order (deterministic).
    // Fragment layout: lane = 4 * gi + t holds A rows gi and gi + 8 and B column gi (input row gi).
    // Which physical k a fragment slot stands for is ours to choose (A and B only must agree): lane t
    // takes the GROUP/4 consecutive values at t*GROUP/4 of each group, so a group is whole in one
    // mma chain and its scale applies after. Weights enter as bf16 128 + q (q OR-ed into the
    // mantissa of 128.0, then 128 taken off in bf16: exact, and no int-to-float conversions).
    // 8-bit values go in as two nibbles (low, and high against 16 x).
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = wq_shape[0];
    constexpr int VPW = 32 / BITS;           // values per uint32 word
    constexpr int XT = GROUP / 4;            // values per lane per group
    constexpr int WT = XT / VPW;             // words per lane per group
    constexpr int WG = GROUP / VPW;          // words per group
    const int KW = K / VPW;
    const int G = K / GROUP;
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int gi = lane >> 2, t = lane & 3;
    const int nb = blockIdx.x * (16 * TM);
    const bool xrow = gi < M;
    const float* xr = x + (size_t)(xrow ? gi : 0) * K + t * XT;
    float acc[TM][4];
    #pragma unroll
    for (int i = 0; i < TM; ++i) { acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f; }
    for (int j0 = warp * U; j0 < G; j0 += NW * U) {
        // all U groups' loads first: bytes in flight per lane are what bounds this loop
        unsigned w[U][TM][2][WT];
        float sc[U][TM][2], bi[U][TM][2];
        float xa[U][XT];
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = min(j0 + u, G - 1);  // past the end: reloads the last group, not summed
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                #pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const size_t n = (size_t)(nb + 16 * i + gi + 8 * h);
                    const unsigned* wp = wq + n * KW + (size_t)j * WG + t * WT;
                    #pragma unroll
                    for (int v = 0; v < WT; ++v) w[u][i][h][v] = wp[v];
                    sc[u][i][h] = scales[n * G + j];
                    bi[u][i][h] = biases[n * G + j];
                }
            }
            if (xrow) {
                const float4* xp = reinterpret_cast<const float4*>(xr + (size_t)j * GROUP);
                #pragma unroll
                for (int v = 0; v < XT / 4; ++v) {
                    const float4 a = xp[v];
                    xa[u][4 * v] = a.x; xa[u][4 * v + 1] = a.y; xa[u][4 * v + 2] = a.z; xa[u][4 * v + 3] = a.w;
                }
            } else {
                #pragma unroll
                for (int v = 0; v < XT; ++v) xa[u][v] = 0.0f;
            }
        }
        #pragma unroll
        for (int u = 0; u < U; ++u) {
            if (j0 + u >= G) break;
            const float* xv = xa[u];
            float xs = 0.0f;
            #pragma unroll
            for (int v = 0; v < XT; ++v) xs += xv[v];
            xs += __shfl_xor_sync(0xffffffffu, xs, 1);
            xs += __shfl_xor_sync(0xffffffffu, xs, 2);
            // this lane's C columns are input rows 2t and 2t + 1
            const float xs0 = __shfl_sync(0xffffffffu, xs, 8 * t);
            const float xs1 = __shfl_sync(0xffffffffu, xs, 8 * t + 4);
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                #pragma unroll
                for (int v = 0; v < WT; ++v) {
                    const unsigned r0 = w[u][i][0][v], r1 = w[u][i][1][v];
                    const float* xw = xv + v * VPW;
                    if (BITS == 4) {
                        // (w >> 4p) & 0x000F000F: nibbles p and p + 4 of the word as one bf16x2
                        #pragma unroll
                        for (int s = 0; s < 2; ++s) {
                            const int p = 2 * s;
                            mtp_mma_x(c, mtp_q((r0 >> (4 * p)) & 0x000F000Fu),
                                      mtp_q((r1 >> (4 * p)) & 0x000F000Fu),
                                      mtp_q((r0 >> (4 * p + 4)) & 0x000F000Fu),
                                      mtp_q((r1 >> (4 * p + 4)) & 0x000F000Fu),
                                      xw[p], xw[p + 4], xw[p + 1], xw[p + 5]);
                        }
                    } else {
                        // bytes 0, 2 then 1, 3; low nibbles against x, high nibbles against 16 x
                        #pragma unroll
                        for (int hn = 0; hn < 2; ++hn) {
                            const int sh = 4 * hn;
                            const float f = hn ? 16.0f : 1.0f;
                            mtp_mma_x(c, mtp_q((r0 >> sh) & 0x000F000Fu),
                                      mtp_q((r1 >> sh) & 0x000F000Fu),
                                      mtp_q((r0 >> (sh + 8)) & 0x000F000Fu),
                                      mtp_q((r1 >> (sh + 8)) & 0x000F000Fu),
                                      f * xw[0], f * xw[2], f * xw[1], f * xw[3]);
                        }
                    }
                }
                const float k0 = bi[u][i][0], k1 = bi[u][i][1];
                acc[i][0] += sc[u][i][0] * c[0] + k0 * xs0;
                acc[i][1] += sc[u][i][0] * c[1] + k0 * xs1;
                acc[i][2] += sc[u][i][1] * c[2] + k1 * xs0;
                acc[i][3] += sc[u][i][1] * c[3] + k1 * xs1;
            }
        }
    }
    __shared__ float red[NW > 1 ? NW - 1 : 1][TM * 4][32];
    if (NW > 1) {
        if (warp > 0) {
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) red[warp - 1][4 * i + e][lane] = acc[i][e];
            }
        }
        __syncthreads();
        if (warp > 0) return;
        for (int ww = 0; ww < NW - 1; ++ww) {
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][e] += red[ww][4 * i + e][lane];
            }
        }
    }
    #pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int n = nb + 16 * i + gi;
        const int m0 = 2 * t, m1 = 2 * t + 1;
        if (m0 < M) { out[(size_t)m0 * N + n] = acc[i][0]; out[(size_t)m0 * N + n + 8] = acc[i][2]; }
        if (m1 < M) { out[(size_t)m1 * N + n] = acc[i][1]; out[(size_t)m1 * N + n + 8] = acc[i][3]; }
    }
"""

_MMA2_HEADER = r"""
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

_MMA2_SOURCE = r"""
    // As the kernel above (same fragments, same sums), with the weights streamed through shared
    // memory: each lane copies whole 16-byte pieces (cp.async, ST stages in flight, no registers
    // held), and ldmatrix hands every lane the word of each piece its fragment needs. A stage is a
    // chunk of 64 bytes (4 pieces) of each of the warp's 16 * TM rows, with those rows' scales and
    // biases; warps split the chunks of K.
    const int M = x_shape[0];
    const int K = x_shape[1];
    const int N = wq_shape[0];
    constexpr int VPW = 32 / BITS;
    constexpr int CV = 16 * VPW;             // values per chunk (64 bytes) of a row
    constexpr int WT = GROUP / 4 / VPW;      // words per lane per group = 16-byte pieces per group
    constexpr int GPC = 4 / WT;              // groups per chunk
    constexpr int XT = GROUP / 4;
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
    const bool xrow = gi < M;
    const float* xr = x + (size_t)(xrow ? gi : 0) * K;
    float acc[TM][4];
    #pragma unroll
    for (int i = 0; i < TM; ++i) { acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f; }
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
            // lane t's v-th word of the group is word 4v + t (piece v): its x values
            float xv[XT];
            if (xrow) {
                #pragma unroll
                for (int v = 0; v < WT; ++v) {
                    const float4* xp = reinterpret_cast<const float4*>(xr + (size_t)jg * GROUP + (4 * v + t) * VPW);
                    #pragma unroll
                    for (int e = 0; e < VPW / 4; ++e) {
                        const float4 a = xp[e];
                        xv[v * VPW + 4 * e] = a.x; xv[v * VPW + 4 * e + 1] = a.y;
                        xv[v * VPW + 4 * e + 2] = a.z; xv[v * VPW + 4 * e + 3] = a.w;
                    }
                }
            } else {
                #pragma unroll
                for (int v = 0; v < XT; ++v) xv[v] = 0.0f;
            }
            float xs = 0.0f;
            #pragma unroll
            for (int v = 0; v < XT; ++v) xs += xv[v];
            xs += __shfl_xor_sync(0xffffffffu, xs, 1);
            xs += __shfl_xor_sync(0xffffffffu, xs, 2);
            const float xs0 = __shfl_sync(0xffffffffu, xs, 8 * t);
            const float xs1 = __shfl_sync(0xffffffffu, xs, 8 * t + 4);
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                float c4[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                #pragma unroll
                for (int v = 0; v < WT; ++v) {
                    const unsigned r0 = wr[i][0][gl * WT + v], r1 = wr[i][1][gl * WT + v];
                    const float* xw = xv + v * VPW;
                    if (BITS == 4) {
                        #pragma unroll
                        for (int s = 0; s < 2; ++s) {
                            const int p = 2 * s;
                            mtp_mma_x(c4, mtp_q((r0 >> (4 * p)) & 0x000F000Fu),
                                      mtp_q((r1 >> (4 * p)) & 0x000F000Fu),
                                      mtp_q((r0 >> (4 * p + 4)) & 0x000F000Fu),
                                      mtp_q((r1 >> (4 * p + 4)) & 0x000F000Fu),
                                      xw[p], xw[p + 4], xw[p + 1], xw[p + 5]);
                        }
                    } else {
                        #pragma unroll
                        for (int hn = 0; hn < 2; ++hn) {
                            const int sh = 4 * hn;
                            const float f = hn ? 16.0f : 1.0f;
                            mtp_mma_x(c4, mtp_q((r0 >> sh) & 0x000F000Fu),
                                      mtp_q((r1 >> sh) & 0x000F000Fu),
                                      mtp_q((r0 >> (sh + 8)) & 0x000F000Fu),
                                      mtp_q((r1 >> (sh + 8)) & 0x000F000Fu),
                                      f * xw[0], f * xw[2], f * xw[1], f * xw[3]);
                        }
                    }
                }
                const float s0 = sbs[stage][warp][i][0][gi][gl], s1 = sbs[stage][warp][i][0][gi + 8][gl];
                const float b0 = sbs[stage][warp][i][1][gi][gl], b1 = sbs[stage][warp][i][1][gi + 8][gl];
                acc[i][0] += s0 * c4[0] + b0 * xs0;
                acc[i][1] += s0 * c4[1] + b0 * xs1;
                acc[i][2] += s1 * c4[2] + b1 * xs0;
                acc[i][3] += s1 * c4[3] + b1 * xs1;
            }
        }
        __syncwarp();  // the next turn's copies overwrite the stage ST - 1 turns on, this one included
        stage = stage + 1 == ST ? 0 : stage + 1;
    }
    mtp_wait<0>();
    __shared__ float red[NW > 1 ? NW - 1 : 1][TM * 4][32];
    if (NW > 1) {
        if (warp > 0) {
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) red[warp - 1][4 * i + e][lane] = acc[i][e];
            }
        }
        __syncthreads();
        if (warp > 0) return;
        for (int ww = 0; ww < NW - 1; ++ww) {
            #pragma unroll
            for (int i = 0; i < TM; ++i) {
                #pragma unroll
                for (int e = 0; e < 4; ++e) acc[i][e] += red[ww][4 * i + e][lane];
            }
        }
    }
    #pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int n = nb + 16 * i + gi;
        const int m0 = 2 * t, m1 = 2 * t + 1;
        if (m0 < M) { out[(size_t)m0 * N + n] = acc[i][0]; out[(size_t)m0 * N + n + 8] = acc[i][2]; }
        if (m1 < M) { out[(size_t)m1 * N + n] = acc[i][1]; out[(size_t)m1 * N + n + 8] = acc[i][3]; }
    }
"""

_kernel = None
_tested: bool | None = None
_mma2_kernel = None
_mma_kernel = None


def _cuda() -> bool:
    try:
        return mx.default_device() == mx.gpu and mx.cuda.is_available()
    except AttributeError:  # an MLX without the CUDA backend (e.g. Metal, CPU)
        return False


def cuda() -> bool:
    """Whether MLX runs on a CUDA GPU (the only place the custom kernels run)."""
    return _cuda()


def supports(weight: mx.array, scales: mx.array, bits: int, group_size: int, rows: int) -> bool:
    """Whether the kernel handles this product: 4- or 8-bit, groups of a multiple of 32, rows
    1..8, N a multiple of the rows per warp, rows of whole 16-byte chunks, float32 scales."""
    if bits not in (4, 8) or group_size % 32 or not 1 <= rows <= MAX_ROWS:
        return False
    return (weight.ndim == 2 and weight.shape[0] % 4 == 0 and weight.shape[1] % 4 == 0
            and scales.dtype == mx.float32)


def quantized_rows(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array,
                   bits: int, group_size: int, rows_per_warp: int = ROWS_PER_WARP) -> mx.array:
    """x [M, K] (M <= 8) times W^T: [M, N] float32. `rows_per_warp`: output features per warp."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="mtp_qmv_rows", input_names=["x", "wq", "scales", "biases"],
                                      output_names=["out"], source=_SOURCE)
    m = x.shape[0]
    rows = next(r for r in ROW_VARIANTS if r >= m)
    if rows != m:
        x = mx.pad(x, [(0, rows - m), (0, 0)])
    n = weight.shape[0]
    # 8 rows per warp with 8 input rows would spill registers
    r = rows_per_warp if n % rows_per_warp == 0 and rows_per_warp * rows <= 32 else 4
    out = _kernel(inputs=[x.astype(mx.float32), weight, scales, biases],
                  template=[("M", rows), ("R", r), ("BITS", bits), ("GROUP", group_size)],
                  grid=(n // r * 32, 1, 1), threadgroup=(128, 1, 1),
                  output_shapes=[(rows, n)], output_dtypes=[mx.float32])[0]
    return out[:m] if rows != m else out


def mma_supports(weight: mx.array, scales: mx.array, bits: int, group_size: int, rows: int,
                 tiles: int = 1) -> bool:
    """Whether the tensor-core kernel handles this product: 4- or 8-bit, groups of 32/64/128,
    rows 1..8, N a multiple of 16 * tiles, float32 scales."""
    return (bits in (4, 8) and group_size in (32, 64, 128) and 1 <= rows <= MAX_ROWS and weight.ndim == 2
            and weight.shape[0] % (16 * tiles) == 0 and scales.dtype == mx.float32)


def quantized_rows_mma(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, bits: int,
                       group_size: int, warps: int = 4, tiles: int = 1, unroll: int = 4) -> mx.array:
    """x [M, K] (M <= 8) times W^T on the tensor cores: [M, N] float32. A block is `tiles` tiles of
    16 output features; its `warps` warps split K, `unroll` groups per loop turn."""
    global _mma_kernel
    if _mma_kernel is None:
        _mma_kernel = mx.fast.cuda_kernel(name="mtp_qmv_mma", input_names=["x", "wq", "scales", "biases"],
                                          output_names=["out"], source=_MMA_SOURCE, header=_MMA_HEADER)
    n = weight.shape[0]
    return _mma_kernel(inputs=[x.astype(mx.float32), weight, scales, biases],
                       template=[("BITS", bits), ("GROUP", group_size), ("TM", tiles), ("NW", warps), ("U", unroll)],
                       grid=(n // (16 * tiles) * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
                       output_shapes=[(x.shape[0], n)], output_dtypes=[mx.float32])[0]


def quantized_rows_mma2(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, bits: int,
                        group_size: int, warps: int = 4, tiles: int = 2, stages: int = 3) -> mx.array:
    """As `quantized_rows_mma`, the weights streamed through shared memory (`stages` deep)."""
    global _mma2_kernel
    if _mma2_kernel is None:
        _mma2_kernel = mx.fast.cuda_kernel(name="mtp_qmv_mma2", input_names=["x", "wq", "scales", "biases"],
                                           output_names=["out"], source=_MMA2_SOURCE,
                                           header=_MMA_HEADER + _MMA2_HEADER)
    n = weight.shape[0]
    return _mma2_kernel(inputs=[x.astype(mx.float32), weight, scales, biases],
                        template=[("BITS", bits), ("GROUP", group_size), ("TM", tiles), ("NW", warps), ("ST", stages)],
                        grid=(n // (16 * tiles) * 32 * warps, 1, 1), threadgroup=(32 * warps, 1, 1),
                        output_shapes=[(x.shape[0], n)], output_dtypes=[mx.float32])[0]


def available() -> bool:
    """Whether the kernel can be used in this process: on a CUDA GPU, after it matched MLX's
    product once (outside any compiled graph). A compile error or a mismatch warns and answers
    False from then on, so the engine falls back instead of failing. Whether a model uses it is
    that model's choice (`EngineOptions.kernels`)."""
    global _tested
    if _tested is not None:
        return _tested
    if not _cuda():
        return False
    try:
        w = mx.random.normal((64, 256), key=mx.random.key(3))
        q, s, b = mx.quantize(w, group_size=32, bits=4)
        x = mx.random.normal((3, 256), key=mx.random.key(4))
        ref = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=32, bits=4)
        ok = bool(mx.allclose(quantized_rows(x, q, s, b, 4, 32), ref, atol=1e-3, rtol=1e-3).item())
    except Exception as e:  # NVRTC missing or a toolchain that rejects the source
        warnings.warn(f"mtp-engine: custom quantized kernel unavailable ({e}); using MLX's")
        ok = False
    _tested = ok
    return ok
