"""One CUDA kernel for a whole gated-delta-net layer's mixing over 1..16 tokens (decode, draft,
verify), via `mx.fast.cuda_kernel`; `qwen35.GatedDeltaNet` keeps the pure-MLX path as the portable
path (CPU, Metal) and as the reference this kernel is tested against.

Why: in the MLX path one layer is a chain of ~20 small kernels per token (conv, SiLU, two L2 norms,
tiling, gates, the delta-rule step, the gated RMSNorm, slicing and concatenation), ~186 us per
layer on the H200 at 9B shape, and a verify of S tokens runs the recurrence token by token, so it
costs ~S times that. Here one thread block per value head does it all in one launch:

1. causal conv (window = conv state + the S new rows) + SiLU for the head's q, k (its key head,
   tiled order: value head h reads key head h % KH) and v channels, for all S tokens, into shared
   memory; decay g = softplus(alpha + dt_bias) * a and write strength beta = sigmoid(beta_x);
2. q/k L2 norms (llama.cpp's x / max(||x||, eps); q also scaled by KD^-1/2);
3. the recurrence over the S tokens with the head's [KD, VD] state in registers: value column j
   is independent of the others (u_j = beta (v_j - S'[:, j] . k), S[:, j] += k u_j, o_j =
   S[:, j] . q), so P lanes of one warp share a column (KD / P state rows each) and reduce with
   shuffles; the state is read and written once per launch;
4. the gated RMSNorm of the output (rms over VD, times the norm weight, times SiLU(z)).

It also writes what rollback needs (per token keys, delta vectors and log decays: `state_after`
rebuilds any earlier state from them with one product) and the new conv state.
"""
from __future__ import annotations

import mlx.core as mx

MAX_TOKENS = 16
PARTS = 4  # lanes per value column

_SOURCE = """
    const int h = blockIdx.x;
    const int tid = threadIdx.x;
    constexpr int NT = VD * P;
    constexpr int RP = KD / P;
    constexpr int C = 2 * KH * KD + VH * VD;
    const int S = qkv_shape[1];
    const int kh = h % KH;
    const long rq = qkv_strides[1], rz = z_strides[1], ra = alpha_strides[1], rb = beta_strides[1];
    const long rc = conv0_strides[1];
    const float eps = params[0];
    __shared__ float sq[SMAX * KD];
    __shared__ float sk[SMAX * KD];
    __shared__ float sv[SMAX * VD];
    __shared__ float so[SMAX * VD];
    __shared__ float sg[SMAX];
    __shared__ float sb[SMAX];

    // 1. conv + SiLU of this head's q, k, v channels, all tokens
    constexpr int PER_TOK = 2 * KD + VD;
    for (int w = tid; w < S * PER_TOK; w += NT) {
        const int t = w / PER_TOK, c = w - t * PER_TOK;
        int ch;
        float* dst;
        if (c < KD) { ch = kh * KD + c; dst = &sq[t * KD + c]; }
        else if (c < 2 * KD) { ch = KH * KD + kh * KD + (c - KD); dst = &sk[t * KD + c - KD]; }
        else { ch = 2 * KH * KD + h * VD + (c - 2 * KD); dst = &sv[t * VD + c - 2 * KD]; }
        float acc = 0.0f;
        #pragma unroll
        for (int j = 0; j < KC; ++j) {
            const int r = t + j;  // row of the window [conv state (KC-1 rows); new rows]
            const float x = r < KC - 1 ? conv0[r * rc + ch] : qkv[(r - (KC - 1)) * rq + ch];
            acc += x * conv_w[ch * KC + j];
        }
        *dst = acc / (1.0f + expf(-acc));
    }
    if (tid < S) {
        const float x = alpha[tid * ra + h] + dt_bias[h];
        const float sp = fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
        sg[tid] = sp * a[h];
        sb[tid] = 1.0f / (1.0f + expf(-beta[tid * rb + h]));
    }
    // the new conv state: window rows S .. S+KC-2; each channel written by exactly one block
    {
        const int nv = VD, nqk = (h < KH) ? 2 * KD : 0;
        for (int w = tid; w < (KC - 1) * (nv + nqk); w += NT) {
            const int r = w / (nv + nqk), c = w - r * (nv + nqk);
            const int ch = c < nv ? 2 * KH * KD + h * VD + c
                                  : (c - nv < KD ? h * KD + (c - nv) : KH * KD + h * KD + (c - nv - KD));
            const int src = S + r;
            conv_out[r * C + ch] = src < KC - 1 ? conv0[src * rc + ch] : qkv[(src - (KC - 1)) * rq + ch];
        }
    }
    __syncthreads();

    // 2. L2 norms of q and k, one warp per vector
    const int lane = tid & 31, warp = tid >> 5;
    constexpr int NW = NT / 32;
    for (int vec = warp; vec < 2 * S; vec += NW) {
        float* p = vec < S ? &sq[vec * KD] : &sk[(vec - S) * KD];
        float ss = 0.0f;
        for (int i = lane; i < KD; i += 32) ss += p[i] * p[i];
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        float inv = 1.0f / fmaxf(sqrtf(ss), eps);
        if (vec < S) inv *= rsqrtf((float)KD);
        __syncwarp();
        for (int i = lane; i < KD; i += 32) p[i] *= inv;
    }
    __syncthreads();
    for (int w = tid; w < S * KD; w += NT) {
        const int t = w / KD, i = w - t * KD;
        k_out[((size_t)t * VH + h) * KD + i] = sk[w];
    }
    if (tid < S) g_out[tid * VH + h] = sg[tid];

    // 3. the recurrence: lane p of column j holds state rows p, p+P, ...
    const int j = tid / P, p = tid - (tid / P) * P;
    float st[RP];
    const float* s0 = state0 + (size_t)h * KD * VD;
    #pragma unroll
    for (int r = 0; r < RP; ++r) st[r] = s0[(size_t)(p + r * P) * VD + j];
    for (int t = 0; t < S; ++t) {
        const float eg = expf(sg[t]);
        const float* kt = &sk[t * KD];
        const float* qt = &sq[t * KD];
        float kv = 0.0f;
        #pragma unroll
        for (int r = 0; r < RP; ++r) { st[r] *= eg; kv += st[r] * kt[p + r * P]; }
        #pragma unroll
        for (int off = P / 2; off > 0; off >>= 1) kv += __shfl_xor_sync(0xffffffffu, kv, off);
        const float u = sb[t] * (sv[t * VD + j] - kv);
        float o = 0.0f;
        #pragma unroll
        for (int r = 0; r < RP; ++r) { st[r] += kt[p + r * P] * u; o += st[r] * qt[p + r * P]; }
        #pragma unroll
        for (int off = P / 2; off > 0; off >>= 1) o += __shfl_xor_sync(0xffffffffu, o, off);
        if (p == 0) {
            so[t * VD + j] = o;
            u_out[((size_t)t * VH + h) * VD + j] = u;
        }
    }
    float* s1 = state_out + (size_t)h * KD * VD;
    #pragma unroll
    for (int r = 0; r < RP; ++r) s1[(size_t)(p + r * P) * VD + j] = st[r];
    __syncthreads();

    // 4. gated RMSNorm, one warp per token
    for (int t = warp; t < S; t += NW) {
        float ss = 0.0f;
        for (int i = lane; i < VD; i += 32) ss += so[t * VD + i] * so[t * VD + i];
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        const float inv = rsqrtf(ss / (float)VD + eps);
        for (int i = lane; i < VD; i += 32) {
            const float zz = z[t * rz + h * VD + i];
            y[(size_t)t * VH * VD + h * VD + i] = so[t * VD + i] * inv * norm[i] * (zz / (1.0f + expf(-zz)));
        }
    }
"""

_INPUTS = ["qkv", "z", "alpha", "beta", "conv0", "conv_w", "dt_bias", "a", "norm", "state0", "params"]
_OUTPUTS = ["y", "state_out", "conv_out", "k_out", "u_out", "g_out"]
_kernel = None


def supports(kh: int, kd: int, vh: int, vd: int, batch: int, tokens: int) -> bool:
    """Shapes the kernel handles: one sequence, 1..16 tokens, KD split evenly over the lanes of a
    column, a block of whole warps of at most 1024 threads, key heads tiling value heads."""
    return (batch == 1 and 1 <= tokens <= MAX_TOKENS and kd % PARTS == 0 and (vd * PARTS) % 32 == 0
            and vd * PARTS <= 1024 and vh % kh == 0 and kd // PARTS <= 64)


def gated_delta(qkv: mx.array, z: mx.array, alpha: mx.array, beta: mx.array, conv0: mx.array,
                conv_w: mx.array, dt_bias: mx.array, a: mx.array, norm: mx.array, state0: mx.array,
                kh: int, kd: int, vh: int, vd: int, eps: float) -> tuple[mx.array, ...]:
    """qkv [1, S, C], z [1, S, VH*VD], alpha/beta [1, S, VH] (column slices of one product are fine:
    rows are addressed by stride), conv0 [1, K-1, C], conv_w [C, K], state0 [1, VH, KD, VD].
    Returns (y [1, S, VH*VD] gated-normed output, state [1, VH, KD, VD], conv state [1, K-1, C],
    k [1, S, VH, KD], u [1, S, VH, VD], g [1, S, VH])."""
    global _kernel
    if _kernel is None:
        # inputs are addressed by their row strides, so slices of the joined product need no copy
        _kernel = mx.fast.cuda_kernel(name="mtp_gdn_fused", input_names=_INPUTS, output_names=_OUTPUTS,
                                      source=_SOURCE, ensure_row_contiguous=False)
    s = int(qkv.shape[1])
    kc = int(conv_w.shape[1])
    c = int(qkv.shape[2])
    f32 = mx.float32
    # parameters must be dense (they are read by flat index); a no-op for weights as loaded
    params = [mx.contiguous(x.astype(f32)) for x in (conv_w, dt_bias, a, norm, state0)]
    acts = [x.astype(f32) for x in (qkv, z, alpha, beta, conv0)]
    outs = _kernel(inputs=[*acts, *params, mx.array([eps], dtype=f32)],
                   template=[("KH", kh), ("KD", kd), ("VH", vh), ("VD", vd), ("KC", kc), ("P", PARTS),
                             ("SMAX", MAX_TOKENS)],
                   grid=(vh * vd * PARTS, 1, 1), threadgroup=(vd * PARTS, 1, 1),
                   output_shapes=[(1, s, vh * vd), (1, vh, kd, vd), (1, kc - 1, c), (1, s, vh, kd), (1, s, vh, vd),
                                  (1, s, vh)],
                   output_dtypes=[f32] * 6)
    return tuple(outs)


_tested: bool | None = None


def available(dims=None) -> bool:
    """Whether the kernel can be used in this process: on a CUDA GPU, after it matched the pure-MLX
    mixer (`gdn.mix`) on random inputs, 1 and 5 tokens, outside any compiled graph. A compile error
    or a mismatch warns and answers False from then on, so the engine falls back to the MLX path
    instead of failing. Whether a model uses it is that model's choice (`EngineOptions.kernels`).

    `dims` (`gdn.Dims`): test at the model's own layer shape. The kernel is compiled per shape
    (NVRTC, ~30 s for a cold 9B-shaped one on the H200), so testing at the shape the model then
    runs shares that compile instead of paying a second one for a test shape."""
    global _tested
    if _tested is not None:
        return _tested
    from . import kernels
    if not kernels.cuda():
        return False
    from . import gdn
    if dims is None or not supports(dims.kh, dims.kd, dims.vh, dims.vd, 1, 1):
        dims = gdn.Dims(2, 64, 4, 64, 4, 1e-6)
    try:
        ok = all(max_error(dims, s, seed=s) < 1e-3 for s in (1, 5))
    except Exception as e:  # NVRTC missing or a toolchain that rejects the source
        import warnings
        warnings.warn(f"mtp-engine: fused gated-delta-net kernel unavailable ({e}); using MLX's")
        ok = False
    _tested = ok
    return ok


def random_inputs(d, s: int, seed: int = 0, slices: bool = True) -> dict[str, mx.array]:
    """Random inputs of a layer of dims `d` (gdn.Dims) over s tokens, as the layer would pass them
    (with `slices`, q/k/v, z, alpha, beta are column slices of one joined product)."""
    ch = 2 * d.kh * d.kd + d.vh * d.vd
    widths = [ch, d.vh * d.vd, d.vh, d.vh]
    key = mx.random.key(seed)
    ks = mx.random.split(key, 8)
    proj = mx.random.normal((1, s, sum(widths)), key=ks[0])
    cuts, o = [], 0
    for w in widths:
        cuts.append(proj[..., o:o + w] if slices else mx.contiguous(proj[..., o:o + w]))
        o += w
    qkv, z, alpha, beta = cuts
    return dict(qkv_x=qkv, z_x=z, alpha_x=alpha, beta_x=beta,
                conv0=mx.random.normal((1, d.kernel - 1, ch), key=ks[1]),
                state0=0.1 * mx.random.normal((1, d.vh, d.kd, d.vd), key=ks[2]),
                conv_w=0.5 * mx.random.normal((ch, d.kernel), key=ks[3]),
                dt_bias=mx.random.normal((d.vh,), key=ks[4]),
                a=-mx.exp(mx.random.normal((d.vh,), key=ks[5])),
                norm=1.0 + 0.1 * mx.random.normal((d.vd,), key=ks[6]))


def max_error(d, s: int, seed: int = 0) -> float:
    """Largest absolute difference between this kernel and `gdn.mix` over every output."""
    from . import gdn
    x = random_inputs(d, s, seed)
    ref = gdn.mix(d, **x)
    got = gated_delta(x["qkv_x"], x["z_x"], x["alpha_x"], x["beta_x"], x["conv0"], x["conv_w"], x["dt_bias"],
                      x["a"], x["norm"], x["state0"], d.kh, d.kd, d.vh, d.vd, d.eps)
    return max(float(mx.abs(r - g).max().item()) for r, g in zip(ref, got))
