"""CUDA kernels for quantized products of a few rows (decode, draft, verify), via
`mx.fast.cuda_kernel`, with MLX's `quantized_matmul` as the fallback everywhere else:
`quantized_rows` sends one row to the CUDA-core kernel here (`simt_rows`, the fastest for plain
decoding) and 2..32 rows to the tensor-core kernel (mma.py), which costs about one weight
read whatever the rows.

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

import mlx.core as mx

from . import mma
from .cuda_kernel import CudaKernel
from .source import compact

SIMT_ROWS = 8  # the most rows of the CUDA-core kernel
MAX_ROWS = mma.MAX_ROWS  # the most rows of one product here (the tensor-core kernel's)
# the most rows a caller sends in one launch (`layers.Linear` cuts longer products in slabs): two
# column tiles; 17-32 rows take four, padded, and cost more than two launches of 16 (H100, 9B
# forward of 20 rows 19.9 -> 16.3 ms, 40 rows 26.4 -> 25.3, 80 rows 46.9 -> 44.3 in slabs of 16)
SLAB = 16
ROWS_PER_WARP = 8  # output features per warp (bench_gpu.py measures 2, 4 and 8 through `rows_per_warp=`)
# row counts the kernel is compiled for; others are padded up to the next (each variant is an
# NVRTC compile of ~1 s at first use, so there are few of them)
ROW_VARIANTS = (1, 2, 4, 8)
TENSOR_CORE_ROWS = 2  # the fewest rows a product sends to the tensor-core kernel

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

_kernel = None


def source() -> str:
    """The CUDA text of this module's kernels and the tensor-core one it hands rows to (what a
    self-test verdict is kept under)."""
    return _SOURCE + mma.HEADER + mma.SOURCE


def supports(weight: mx.array, scales: mx.array, bits: int, group_size: int, rows: int) -> bool:
    """Whether `quantized_rows` takes this product: `rows` on the tensor-core kernel
    (`mma.supports`), or on the CUDA cores (4- or 8-bit, groups of a multiple of 32, rows
    1..SIMT_ROWS, N a multiple of the rows per warp, rows of whole 16-byte chunks, float32 scales)."""
    if rows >= TENSOR_CORE_ROWS and mma.supports(weight, scales, bits, group_size, rows):
        return True
    if bits not in (4, 8) or group_size % 32 or not 1 <= rows <= SIMT_ROWS:
        return False
    return (weight.ndim == 2 and weight.shape[0] % 4 == 0 and weight.shape[1] % 4 == 0
            and scales.dtype == mx.float32)


def quantized_rows(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array,
                   bits: int, group_size: int, rows_per_warp: int = ROWS_PER_WARP,
                   split: int = mma.SPLIT) -> mx.array:
    """x [M, K] (M <= MAX_ROWS) times W^T: [M, N] float32, on the tensor cores for 2.. rows where
    `mma.supports` it (`split`: the bf16 parts of x there), else on the CUDA cores
    (`rows_per_warp`: their output features per warp)."""
    if x.shape[0] >= TENSOR_CORE_ROWS and mma.supports(weight, scales, bits, group_size, x.shape[0]):
        return mma.quantized_rows(x, weight, scales, biases, bits, group_size, split=split)
    return simt_rows(x, weight, scales, biases, bits, group_size, rows_per_warp)


def simt_rows(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array,
              bits: int, group_size: int, rows_per_warp: int = ROWS_PER_WARP) -> mx.array:
    """The CUDA-core kernel alone: x [M, K] (M <= SIMT_ROWS) times W^T, [M, N] float32."""
    global _kernel
    if _kernel is None:
        _kernel = CudaKernel(name="mtp_qmv_rows", input_names=["x", "wq", "scales", "biases"],
                                      output_names=["out"], source=compact(_SOURCE))
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


def self_test() -> bool:
    """Whether both kernels match MLX's product on random rows (1: the CUDA-core kernel, 3: the
    tensor-core one), run outside any compiled graph; inputs and reference on the CPU, so the test
    compiles no GPU code that decoding never uses. Raises what a compile raises."""
    ok = True
    for rows in (1, 3):
        with mx.stream(mx.cpu):
            w = mx.random.normal((64, 256), key=mx.random.key(3))
            q, s, b = mx.quantize(w, group_size=32, bits=4)
            x = mx.random.normal((rows, 256), key=mx.random.key(4))
            ref = mx.quantized_matmul(x, q, s, b, transpose=True, group_size=32, bits=4)
            mx.eval(q, s, b, x, ref)
        got = quantized_rows(x, q, s, b, 4, 32)
        mx.eval(got)
        with mx.stream(mx.cpu):
            ok = ok and bool(mx.allclose(got, ref, atol=1e-3, rtol=1e-3).item())
    return ok
