"""Residual add + RMSNorm as one CUDA kernel (`mx.fast.cuda_kernel`) for forwards of 1..16 rows.

Why: every block of the trunk adds its mixer's and its FFN's output to the residual stream and
normalises the sum for what reads it next; as MLX operations that is an add kernel and an RMSNorm
kernel each time (two launches per norm, 64+ per 9B step) for a few KB of data. One block per row
reads both inputs once and writes the sum and its normalised form. Elsewhere (CPU, Metal, prefill)
`add_rms_norm` is the same two MLX operations.
"""
from __future__ import annotations

import mlx.core as mx

from .cuda_kernel import CudaKernel
from .source import compact

MAX_ROWS = 16

_SOURCE = """
    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    const int H = x_shape[x_ndim - 1];
    const size_t base = (size_t)row * H;
    __shared__ float part[32];
    float ss = 0.0f;
    for (int i = tid; i < H; i += NT) {
        const float v = x[base + i] + d[base + i];
        h[base + i] = v;
        ss += v * v;
    }
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if ((tid & 31) == 0) part[tid >> 5] = ss;
    __syncthreads();
    if (tid < 32) {
        float t = tid < NT / 32 ? part[tid] : 0.0f;
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) t += __shfl_xor_sync(0xffffffffu, t, off);
        if (tid == 0) part[0] = t;
    }
    __syncthreads();
    const float inv = rsqrtf(part[0] / (float)H + eps[0]);
    for (int i = tid; i < H; i += NT) hn[base + i] = h[base + i] * inv * w[i];
"""

_kernel = None


def add_rms_norm(x: mx.array, d: mx.array, w: mx.array, eps: float,
                 fused: bool = False) -> tuple[mx.array, mx.array]:
    """(x + d, rms_norm(x + d) * w) over the last axis; with `fused` (the model's choice, after
    its self-test passed), one kernel where it applies."""
    rows = x.size // x.shape[-1]
    if fused and 1 <= rows <= MAX_ROWS and x.dtype == mx.float32 and d.dtype == mx.float32:
        return launch(x, d, w, eps)
    h = x + d
    return h, mx.fast.rms_norm(h, w, eps)


def launch(x: mx.array, d: mx.array, w: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """The kernel alone: (x + d, rms_norm(x + d) * w) for rows of float32."""
    global _kernel
    if _kernel is None:
        _kernel = CudaKernel(name="mtp_add_rms_norm", input_names=["x", "d", "w", "eps"],
                                      output_names=["h", "hn"], source=compact(_SOURCE))
    rows = x.size // x.shape[-1]
    nt = 1024 if x.shape[-1] >= 4096 else 256
    return tuple(_kernel(inputs=[x, d, w.astype(mx.float32), mx.array([eps], dtype=mx.float32)],
                         template=[("NT", nt)], grid=(rows * nt, 1, 1), threadgroup=(nt, 1, 1),
                         output_shapes=[x.shape, x.shape], output_dtypes=[mx.float32, mx.float32]))


def source() -> str:
    """The kernel's CUDA text (what a self-test verdict is kept under)."""
    return _SOURCE


def self_test() -> bool:
    """Whether the kernel matches the two MLX operations on random rows (inputs and reference on
    the CPU). Raises what a compile raises."""
    with mx.stream(mx.cpu):  # inputs and reference: no GPU JIT compile that decoding never uses
        x = mx.random.normal((3, 4096), key=mx.random.key(1))
        d = mx.random.normal((3, 4096), key=mx.random.key(2))
        w = mx.random.normal((4096,), key=mx.random.key(3))
        ref_h = x + d
        ref_hn = mx.fast.rms_norm(ref_h, w, 1e-6)
        mx.eval(x, d, w, ref_h, ref_hn)
    h, hn = launch(x, d, w, 1e-6)
    mx.eval(h, hn)
    with mx.stream(mx.cpu):
        return bool(mx.allclose(h, ref_h, atol=1e-5).item() and mx.allclose(hn, ref_hn, atol=1e-4).item())
