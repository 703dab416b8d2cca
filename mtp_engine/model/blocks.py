"""Qwen3.5's blocks: the dense FFN, gated full attention, the gated delta net, a decoder layer and
the loop over layers, shared by the trunk (`qwen35`) and the MTP head (`mtp_head`). Each block's
portable path is pure MLX; the fused CUDA kernels (`kernels.attn`, `kernels.gdn`) are accelerators
behind it, chosen from the model's options."""
from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from . import gdn
from .kernels import attn as attn_kernel
from .kernels import gdn as gdn_kernel
from .cache import RecurrentCache, pick_state
from .config import Qwen35Config
from .fused import fused
from .kv_cache import KVCache
from .layers import Linear, concat_outputs, rms_norm, stored
from .kernels.norm import add_rms_norm

# x [..., H] -> [..., H]; a block's FFN only ever sees the post-attention-normed hidden state
FFN = Callable[[mx.array], mx.array]


class MLP(nn.Module):
    """The SwiGLU FFN: down(silu(gate x) * up x)."""

    record = None  # an FFN's routing hook (`compilable_ffn`): a dense one has no routing

    gate, up, down, gate_up = stored(4)

    def __init__(self, gate: Linear | None, up: Linear | None, down: Linear, gate_up: Linear | None = None):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down
        self.gate_up = gate_up  # gate and up as one product, when `fuse` could join them

    def __call__(self, x: mx.array) -> mx.array:
        if self.gate_up is not None:
            gu = self.gate_up(x)
            f = gu.shape[-1] // 2
            return self.down(_swiglu(gu[..., :f], gu[..., f:]))
        return self.down(_swiglu(self.gate(x), self.up(x)))

    def fuse(self) -> "MLP":
        """Joins gate and up into one product when they are stored alike (at load)."""
        if self.gate is not None and (joined := concat_outputs([self.gate, self.up])) is not None:
            self.gate_up, self.gate, self.up = joined, None, None
        return self


class GatedAttention(nn.Module):
    """Full attention with per-head q/k RMSNorm, partial NEOX rope, GQA and a sigmoid output gate."""

    q, k, v, o, qkv, q_norm, k_norm = stored(7)

    def __init__(self, q: Linear | None, k: Linear | None, v: Linear | None, o: Linear, q_norm: mx.array,
                 k_norm: mx.array, cfg: Qwen35Config, qkv: Linear | None = None, fused_kernel: bool = False):
        super().__init__()
        self.q, self.k, self.v, self.o = q, k, v, o  # q per head: head_dim query rows, then head_dim gate rows
        self.q_norm, self.k_norm = q_norm, k_norm
        self.cfg = cfg
        self.qkv = qkv  # q, k and v as one product, when `fuse` could join them
        self.fused_kernel = fused_kernel  # the fused CUDA attention (attn_kernel), from the model's options

    def fuse(self) -> "GatedAttention":
        """Joins the q, k and v products into one when they are stored alike (at load)."""
        if self.q is not None and (joined := concat_outputs([self.q, self.k, self.v])) is not None:
            self.qkv, self.q, self.k, self.v = joined, None, None, None
        return self

    def _inputs(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        if self.qkv is None:
            return self.q(x), self.k(x), self.v(x)
        c = self.cfg
        y = self.qkv(x)
        e1 = 2 * c.n_head * c.head_dim
        e2 = e1 + c.n_head_kv * c.head_dim
        return y[..., :e1], y[..., e1:e2], y[..., e2:]

    def __call__(self, x: mx.array, cache: KVCache) -> mx.array:
        c = self.cfg
        b, s, _ = x.shape
        if self.fused_kernel and attn_kernel.supports(c.n_head, c.n_head_kv, c.head_dim, c.n_rot, b, s, cache.dtype):
            return self._fused(x, cache)
        d = c.head_dim
        q_x, k_x, v_x = self._inputs(x)
        qg = q_x.reshape(b, s, c.n_head, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(b, s, c.n_head * d)
        k = k_x.reshape(b, s, c.n_head_kv, d)
        v = v_x.reshape(b, s, c.n_head_kv, d)
        q = rms_norm(q, self.q_norm, c.eps).transpose(0, 2, 1, 3)
        k = rms_norm(k, self.k_norm, c.eps).transpose(0, 2, 1, 3)
        v = v.transpose(0, 2, 1, 3)
        pos = cache.offset
        q = mx.fast.rope(q, c.n_rot, traditional=False, base=c.rope_base, scale=1.0, offset=pos)
        k = mx.fast.rope(k, c.n_rot, traditional=False, base=c.rope_base, scale=1.0, offset=pos)
        keys, values, mask = cache.update(k, v)
        if keys.dtype != q.dtype:  # a 16-bit cache (EngineOptions.kv_dtype): attention in float32
            keys, values = keys.astype(q.dtype), values.astype(q.dtype)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=d ** -0.5, mask=mask)
        out = out.transpose(0, 2, 1, 3).reshape(b, s, c.n_head * d)
        return self.o(_sigmoid_gate(out, gate))

    def _fused(self, x: mx.array, cache: KVCache) -> mx.array:
        """The same layer as two CUDA kernels around the cache append (`attn_kernel`); x [B, S, H],
        each row at its own position in a batch's cache."""
        c = self.cfg
        # q (with its gate), k and v side by side: the joined product, or the three products put
        # together where they are stored differently (a Q4_K_M file keeps v in Q6_K), so those models
        # take these kernels too
        y = self.qkv(x) if self.qkv is not None else mx.concatenate([self.q(x), self.k(x), self.v(x)], axis=-1)
        # a Python int, an array inside a compiled step, or a batch's lengths [B]
        start = cache.offset
        # (prompts read together from one length: that length for every row)
        pos = (start.reshape(-1) if isinstance(start, mx.array) else mx.full((x.shape[0],), start)).astype(mx.int32)
        dims = (c.n_head, c.n_head_kv, c.head_dim, c.n_rot, c.eps, c.rope_base)
        k, v = attn_kernel.new_kv(y, self.k_norm, pos, *dims, dtype=cache.dtype)
        cache.update(k, v)
        # the whole buffers: the kernel reads positions < pos + S itself (a slice would be copied)
        keys, values, tail = cache.attention_buffers()
        return self.o(attn_kernel.attend(y, self.q_norm, keys, values, pos, *dims, tail=tail))


class GatedDeltaNet(nn.Module):
    """Linear-attention mixer: causal depthwise conv, then the gated delta rule per value head."""

    qkv, z, alpha, beta, out, in_proj = stored(6)
    conv_w, a, dt_bias, norm = stored(4)

    def __init__(self, qkv: Linear | None, z: Linear | None, alpha: Linear | None, beta: Linear | None,
                 conv_w: mx.array, a: mx.array, dt_bias: mx.array, norm: mx.array, out: Linear, cfg: Qwen35Config,
                 in_proj: Linear | None = None, fused_kernel: bool = False):
        super().__init__()
        self.qkv, self.z, self.alpha, self.beta, self.out = qkv, z, alpha, beta, out
        self.conv_w = conv_w  # [channels, kernel]
        self.a = a  # -exp(A_log), [Vh]
        self.dt_bias = dt_bias  # [Vh]
        self.norm = norm  # [Vd], plain multiplier
        self.cfg = cfg
        self.in_proj = in_proj  # qkv, z, alpha, beta as one product, when `fuse` could join them
        self.fused_kernel = fused_kernel  # the fused CUDA layer (gdn_kernel), from the model's options

    def fuse(self) -> "GatedDeltaNet":
        """Joins the four input products into one when they are stored alike (at load)."""
        parts = [self.qkv, self.z, self.alpha, self.beta]
        if self.qkv is not None and (joined := concat_outputs(parts)) is not None:
            self.in_proj, self.qkv, self.z, self.alpha, self.beta = joined, None, None, None, None
        return self

    def _inputs(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        if self.in_proj is None:
            return self.qkv(x), self.z(x), self.alpha(x), self.beta(x)
        c = self.cfg
        y = self.in_proj(x)
        e1 = c.conv_channels
        e2 = e1 + c.ssm_inner
        e3 = e2 + c.ssm_value_heads
        return y[..., :e1], y[..., e1:e2], y[..., e2:e3], y[..., e3:]

    def kernel_fits(self, rows: int, tokens: int) -> bool:
        """Whether a forward of `rows` rows of `tokens` runs the fused CUDA kernel (rows of their own
        lengths, a joint read's, never do: it has no per-row length)."""
        c = self.cfg
        return self.fused_kernel and gdn_kernel.supports(c.ssm_key_heads, c.ssm_key_dim, c.ssm_value_heads,
                                                         c.ssm_value_dim, rows, tokens)

    def __call__(self, x: mx.array, cache: RecurrentCache) -> mx.array:
        c = self.cfg
        b, s, _ = x.shape
        d = gdn.Dims(c.ssm_key_heads, c.ssm_key_dim, c.ssm_value_heads, c.ssm_value_dim, c.conv_kernel, c.eps)
        qkv_x, z_x, alpha_x, beta_x = self._inputs(x)
        conv0, state0, kept = cache.sources()
        capture = cache.capturing
        width = max(s, cache.capture_width or s) if capture else None  # fixed-width captures (RecurrentCache)
        if cache.valid is None and self.kernel_fits(b, s):
            r = gdn.Mixed(*gdn_kernel.gated_delta(qkv_x, z_x, alpha_x, beta_x, conv0, self.conv_w, self.dt_bias,
                                                  self.a, self.norm, state0, d.kh, d.kd, d.vh, d.vd, d.eps,
                                                  kept=kept, capture=capture, width=width))
        else:
            if kept is not None:
                conv0, state0 = pick_state(conv0, state0, kept, d.kernel)
            r = gdn.mix(d, qkv_x, z_x, alpha_x, beta_x, conv0, state0, self.conv_w, self.dt_bias, self.a, self.norm,
                        capture=capture, width=width, valid=cache.valid)
        cache.update(r.conv, r.state, tokens=s)
        return self.out(r.y)


@fused
def _swiglu(g, u):
    return g * mx.sigmoid(g) * u


@fused
def _sigmoid_gate(x, gate):
    return x * mx.sigmoid(gate)


# MLX's modules of the helpers above, compiled ahead at load (`kernels.mlx_jit`): tiny inputs, the
# real dtypes (a module's name depends on the graph and dtypes, not on sizes)
def jit_swiglu() -> mx.array:
    return mx.compile(_swiglu.__wrapped__)(mx.zeros((1, 1, 8)), mx.zeros((1, 1, 8)))


def jit_sigmoid_gate() -> mx.array:
    return mx.compile(_sigmoid_gate.__wrapped__)(mx.zeros((1, 1, 8)), mx.zeros((1, 1, 8)))


JIT_RECIPES = [(0, f"{__name__}:jit_swiglu"), (2, f"{__name__}:jit_sigmoid_gate")]  # (phase, recipe)


class DecoderLayer(nn.Module):
    """A mixer (attention or delta net) and an FFN, each after an RMSNorm, each added to the stream."""

    attn_norm, mixer, post_norm, mlp = stored(4)

    def __init__(self, attn_norm: mx.array, mixer: GatedAttention | GatedDeltaNet, post_norm: mx.array, mlp: FFN,
                 eps: float):
        super().__init__()
        self.attn_norm, self.mixer, self.post_norm, self.mlp, self.eps = attn_norm, mixer, post_norm, mlp, eps

    def __call__(self, x: mx.array, cache) -> mx.array:
        h = x + self.mixer(rms_norm(x, self.attn_norm, self.eps), cache)
        return h + self.mlp(rms_norm(h, self.post_norm, self.eps))


def run_layers(layers: list[DecoderLayer], x: mx.array, caches: list, final_norm: mx.array,
               eps: float, fused_norm: bool = False) -> tuple[mx.array, mx.array]:
    """The layers over x, returning (rms_norm(out, final_norm), out). Each residual add is joined
    with the norm that reads its sum (the next sub-block's, or the final one): one kernel on a GPU
    with `fused_norm`."""
    xn = rms_norm(x, layers[0].attn_norm, eps)
    for i, (layer, c) in enumerate(zip(layers, caches)):
        h, hn = add_rms_norm(x, layer.mixer(xn, c), layer.post_norm, eps, fused_norm)
        nxt = layers[i + 1].attn_norm if i + 1 < len(layers) else final_norm
        x, xn = add_rms_norm(h, layer.mlp(hn), nxt, eps, fused_norm)
    return xn, x



def compilable_ffn(mlp) -> bool:
    # a test recording MoE routing wants every forward's values, which a trace cannot hand out
    return getattr(mlp, "record", None) is None

