"""One CUDA kernel for a whole gated-delta-net layer's mixing over 1..16 tokens (decode, draft,
verify), via `mx.fast.cuda_kernel`; `blocks.GatedDeltaNet` keeps the pure-MLX path as the portable
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

It also writes the new conv state and, in a captured pass (a verify), the state before and after
each token and the whole conv window: rollback then only chooses a slot, which the next launch
reads in place (`kept`), so a rolled-back round costs no kernel of its own.
"""
from __future__ import annotations

import mlx.core as mx

from .cuda_kernel import CudaKernel
from .source import compact

MAX_TOKENS = 16
MAX_BATCH = 256  # sequences of a batched step: one block row each (grid y)
PARTS = 4  # lanes per value column

_SOURCE = """
    const int h = blockIdx.x;
    const int b = blockIdx.y;  // the sequence (row) of a batch; every operand is offset to it
    const int tid = threadIdx.x;
    constexpr int NT = VD * P;
    constexpr int RP = KD / P;
    constexpr int C = 2 * KH * KD + VH * VD;
    const int S = qkv_shape[1];
    const int kh = h % KH;
    const long rq = qkv_strides[1], rz = z_strides[1], ra = alpha_strides[1], rb = beta_strides[1];
    const long rc = conv0_strides[1];
    const float eps = params[0];
    const bool CAPTURE = params[1] != 0.0f;  // a runtime flag: one NVRTC compile serves both
    const int W = CAPTURE ? (int)params[2] : 0;  // captured buffers' tokens (>= S; slots past S unwritten)
    const int at = kept[b];  // the starting state's slot: kept tokens of a rolled-back captured pass
    const float* xq = qkv + b * qkv_strides[0];
    const float* xz = z + b * z_strides[0];
    const float* xa = alpha + b * alpha_strides[0];
    const float* xb = beta + b * beta_strides[0];
    const float* c0 = conv0 + b * conv0_strides[0];
    const int conv_rows = CAPTURE ? S + KC - 1 : KC - 1;  // written
    float* yb = y + (size_t)b * S * VH * VD;
    float* sb_out = state_out + (size_t)b * (CAPTURE ? W + 1 : 1) * VH * KD * VD;
    float* cb_out = conv_out + (size_t)b * (CAPTURE ? W + KC - 1 : KC - 1) * C;
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
            const float x = r < KC - 1 ? c0[(r + at) * rc + ch] : xq[(r - (KC - 1)) * rq + ch];
            acc += x * conv_w[ch * KC + j];
        }
        *dst = acc / (1.0f + expf(-acc));
    }
    if (tid < S) {
        const float x = xa[tid * ra + h] + dt_bias[h];
        const float sp = fmaxf(x, 0.0f) + log1pf(expf(-fabsf(x)));
        sg[tid] = sp * a[h];
        sb[tid] = 1.0f / (1.0f + expf(-xb[tid * rb + h]));
    }
    // the new conv state, window rows S .. S+KC-2 (captured: the whole window, rows 0 .. S+KC-2);
    // each channel written by exactly one block
    {
        const int nv = VD, nqk = (h < KH) ? 2 * KD : 0;
        const int rows = conv_rows, first = CAPTURE ? 0 : S;
        for (int w = tid; w < rows * (nv + nqk); w += NT) {
            const int r = w / (nv + nqk), c = w - r * (nv + nqk);
            const int ch = c < nv ? 2 * KH * KD + h * VD + c
                                  : (c - nv < KD ? h * KD + (c - nv) : KH * KD + h * KD + (c - nv - KD));
            const int src = first + r;
            cb_out[r * C + ch] = src < KC - 1 ? c0[(src + at) * rc + ch] : xq[(src - (KC - 1)) * rq + ch];
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

    // 3. the recurrence: lane p of column j holds state rows p, p+P, ...
    const int j = tid / P, p = tid - (tid / P) * P;
    float st[RP];
    const float* s0 = state0 + b * state0_strides[0] + ((size_t)at * VH + h) * KD * VD;
    #pragma unroll
    for (int r = 0; r < RP; ++r) st[r] = s0[(size_t)(p + r * P) * VD + j];
    // captured: slot t holds the state after t tokens (slot 0 the starting one)
    constexpr size_t SLOT = (size_t)VH * KD * VD;
    if (CAPTURE) {
        #pragma unroll
        for (int r = 0; r < RP; ++r) sb_out[(size_t)h * KD * VD + (size_t)(p + r * P) * VD + j] = st[r];
    }
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
        if (p == 0) so[t * VD + j] = o;
        if (CAPTURE || t == S - 1) {
            float* s1 = sb_out + (CAPTURE ? (t + 1) * SLOT : 0) + (size_t)h * KD * VD;
            #pragma unroll
            for (int r = 0; r < RP; ++r) s1[(size_t)(p + r * P) * VD + j] = st[r];
        }
    }
    __syncthreads();

    // 4. gated RMSNorm, one warp per token
    for (int t = warp; t < S; t += NW) {
        float ss = 0.0f;
        for (int i = lane; i < VD; i += 32) ss += so[t * VD + i] * so[t * VD + i];
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
        const float inv = rsqrtf(ss / (float)VD + eps);
        for (int i = lane; i < VD; i += 32) {
            const float zz = xz[t * rz + h * VD + i];
            yb[(size_t)t * VH * VD + h * VD + i] = so[t * VD + i] * inv * norm[i] * (zz / (1.0f + expf(-zz)));
        }
    }
"""

_INPUTS = ["qkv", "z", "alpha", "beta", "conv0", "conv_w", "dt_bias", "a", "norm", "state0", "params", "kept"]
_OUTPUTS = ["y", "state_out", "conv_out"]
_kernel = None
_SLOT0: mx.array | None = None  # `kept` of a plain state


def supports(kh: int, kd: int, vh: int, vd: int, batch: int, tokens: int) -> bool:
    """Shapes the kernel handles: 1..MAX_BATCH sequences of 1..16 tokens each, KD split evenly over
    the lanes of a column, a block of whole warps of at most 1024 threads, key heads tiling value
    heads."""
    return (1 <= batch <= MAX_BATCH and 1 <= tokens <= MAX_TOKENS and kd % PARTS == 0 and (vd * PARTS) % 32 == 0
            and vd * PARTS <= 1024 and vh % kh == 0 and kd // PARTS <= 64)


def gated_delta(qkv: mx.array, z: mx.array, alpha: mx.array, beta: mx.array, conv0: mx.array,
                conv_w: mx.array, dt_bias: mx.array, a: mx.array, norm: mx.array, state0: mx.array,
                kh: int, kd: int, vh: int, vd: int, eps: float, kept: mx.array | None = None,
                capture: bool = False, width: int | None = None) -> tuple[mx.array, ...]:
    """qkv [B, S, C], z [B, S, VH*VD], alpha/beta [B, S, VH] (column slices of one product are fine:
    rows are addressed by stride), conv0 [B, K-1, C], conv_w [C, K], state0 [B, VH, KD, VD]; or,
    with `kept` [B] int32, a captured pass's windows conv0 [B, K-1+S0, C] and states
    [B, S0+1, VH, KD, VD], row b to start from its slot kept[b]. Returns `gdn.Mixed`'s fields: (y
    [B, S, VH*VD] gated-normed output, state [B, VH, KD, VD], conv state [B, K-1, C]); captured,
    the states [B, W+1, VH, KD, VD] and the windows [B, K-1+W, C], W = `width` (default S; the
    slots past S are left unwritten and never read: `cache.RecurrentCache`). The B sequences of a
    batch are independent blocks of one launch (grid y)."""
    global _kernel, _SLOT0
    if _kernel is None:
        # inputs are addressed by their row strides, so slices of the joined product need no copy
        _kernel = CudaKernel(name="mtp_gdn_fused", input_names=_INPUTS, output_names=_OUTPUTS,
                                      source=compact(_SOURCE), ensure_row_contiguous=False)
        _SLOT0 = mx.array([0], mx.int32)
    rows, s = int(qkv.shape[0]), int(qkv.shape[1])
    kc = int(conv_w.shape[1])
    c = int(qkv.shape[2])
    f32 = mx.float32
    # parameters must be dense (they are read by flat index); a no-op for weights as loaded
    params = [mx.contiguous(x.astype(f32)) for x in (conv_w, dt_bias, a, norm, state0)]
    acts = [x.astype(f32) for x in (qkv, z, alpha, beta, conv0)]
    if kept is not None:
        slot = kept.astype(mx.int32)
    else:
        slot = _SLOT0 if rows == 1 else mx.zeros((rows,), mx.int32)
    w = max(s, width or s)
    state_shape = (rows, w + 1, vh, kd, vd) if capture else (rows, vh, kd, vd)
    conv_rows = kc - 1 + (w if capture else 0)
    outs = _kernel(
        inputs=[*acts, *params, mx.array([eps, float(capture), float(w)], dtype=f32), slot],
        template=[("KH", kh), ("KD", kd), ("VH", vh), ("VD", vd), ("KC", kc), ("P", PARTS),
                  ("SMAX", MAX_TOKENS)],
        grid=(vh * vd * PARTS, rows, 1), threadgroup=(vd * PARTS, 1, 1),
        output_shapes=[(rows, s, vh * vd), state_shape, (rows, conv_rows, c)],
        output_dtypes=[f32] * 3)
    return outs[0], outs[1], outs[2]


def source() -> str:
    """The kernel's CUDA text (what a self-test verdict is kept under)."""
    return _SOURCE


def self_test(dims=None) -> bool:
    """Whether the kernel matches the pure-MLX mixer (`gdn.mix`) on random inputs (1 token; 5
    captured; a batch of 3 sequences of 2 tokens, each from its own slot of an earlier captured
    pass; 2 sequences of 3 tokens captured into buffers 5 wide), outside any compiled graph.
    Raises what a compile raises.

    `dims` (`gdn.Dims`): test at the model's own layer shape. The kernel is compiled per shape
    (NVRTC, ~30 s for a cold 9B-shaped one on the H200), so testing at the shape the model then
    runs shares that compile instead of paying a second one for a test shape."""
    from .. import gdn
    if dims is None or not supports(dims.kh, dims.kd, dims.vh, dims.vd, 1, 1):
        dims = gdn.Dims(2, 64, 4, 64, 4, 1e-6)
    return all(max_error(dims, s, seed=s, capture=cap, earlier=e, batch=b, width=w) < 1e-3
               for s, cap, e, b, w in ((1, False, 0, 1, None), (5, True, 0, 1, None), (2, False, 4, 3, None),
                                       (3, True, 0, 2, 5)))


def random_inputs(d, s: int, seed: int = 0, slices: bool = True, earlier: int = 0,
                  batch: int = 1) -> dict[str, mx.array]:
    """Random inputs of a layer of dims `d` (gdn.Dims) over s tokens of `batch` sequences, as the
    layer would pass them (with `slices`, q/k/v, z, alpha, beta are column slices of one joined
    product). With `earlier` > 0 the caches are a captured pass of that many tokens (windows,
    states) and `kept` picks one per sequence (different ones)."""
    ch = 2 * d.kh * d.kd + d.vh * d.vd
    widths = [ch, d.vh * d.vd, d.vh, d.vh]
    key = mx.random.key(seed)
    ks = mx.random.split(key, 8)
    proj = mx.random.normal((batch, s, sum(widths)), key=ks[0])
    cuts, o = [], 0
    for w in widths:
        cuts.append(proj[..., o:o + w] if slices else mx.contiguous(proj[..., o:o + w]))
        o += w
    qkv, z, alpha, beta = cuts
    lead = (earlier + 1,) if earlier else ()
    out = dict(qkv_x=qkv, z_x=z, alpha_x=alpha, beta_x=beta,
               conv0=mx.random.normal((batch, d.kernel - 1 + earlier, ch), key=ks[1]),
               state0=0.1 * mx.random.normal((batch, *lead, d.vh, d.kd, d.vd), key=ks[2]),
               conv_w=0.5 * mx.random.normal((ch, d.kernel), key=ks[3]),
               dt_bias=mx.random.normal((d.vh,), key=ks[4]),
               a=-mx.exp(mx.random.normal((d.vh,), key=ks[5])),
               norm=1.0 + 0.1 * mx.random.normal((d.vd,), key=ks[6]))
    if earlier:
        out["kept"] = mx.array([(seed * 7 + 1 + 3 * r) % (earlier + 1) for r in range(batch)], mx.int32)
    return out


def max_error(d, s: int, seed: int = 0, capture: bool = False, earlier: int = 0, batch: int = 1,
              width: int | None = None) -> float:
    """Largest absolute difference between this kernel and `gdn.mix` over every output (`capture`:
    a captured pass, `width`: into buffers of that many tokens, whose slots past s are not
    compared; `earlier`: starting from a slot of an earlier captured pass of that many tokens;
    `batch`: sequences in one launch)."""
    from .. import gdn
    from ..cache import pick_state
    # the inputs and the reference on the CPU: on a GPU each of their operations would be a JIT
    # compile on a fresh machine (tens of seconds at a 9B shape) that decoding never uses
    with mx.stream(mx.cpu):
        x = random_inputs(d, s, seed, earlier=earlier, batch=batch)
        kept = x.pop("kept", None)
        ref_in = dict(x)
        if kept is not None:
            ref_in["conv0"], ref_in["state0"] = pick_state(x["conv0"], x["state0"], kept, d.kernel)
        ref = gdn.mix(d, **ref_in, capture=capture, fused_steps=False, width=width)
        mx.eval(x, ref)
    got = gated_delta(x["qkv_x"], x["z_x"], x["alpha_x"], x["beta_x"], x["conv0"], x["conv_w"], x["dt_bias"],
                      x["a"], x["norm"], x["state0"], d.kh, d.kd, d.vh, d.vd, d.eps, kept=kept, capture=capture,
                      width=width)
    for r, g in zip(ref, got):
        if r.shape != g.shape:
            raise AssertionError(f"shape {g.shape}, expected {r.shape}")
    mx.eval(got)
    if capture and width:  # the slots past the pass's tokens are never read (nor written by the kernel)
        keep = (slice(None), slice(None, s + 1)), (slice(None), slice(None, d.kernel - 1 + s))
        ref = gdn.Mixed(ref.y, ref.state[keep[0]], ref.conv[keep[1]])
        got = (got[0], got[1][keep[0]], got[2][keep[1]])
    with mx.stream(mx.cpu):
        return max(float(mx.abs(r - g).max().item()) for r, g in zip(ref, got))
