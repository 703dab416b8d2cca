"""A gated-delta-net layer's mixing (conv, gates, delta rule, gated RMSNorm) in pure MLX: the
portable path (CPU, Metal) and the reference that `kernels.gdn`'s fused CUDA kernel is tested
against. Inputs are the layer's input products; the output goes into the layer's out product."""
from __future__ import annotations

import functools
from typing import NamedTuple

import mlx.core as mx

from .delta_rule import delta_rule_chunked, delta_rule_step, delta_rule_step_ops
from .fused import fused

# up to this many tokens the delta rule runs token by token (inside a compiled step), beyond it chunked
SEQUENTIAL_MAX = 16


class Dims(NamedTuple):
    kh: int  # key heads
    kd: int  # key head dim
    vh: int  # value heads
    vd: int  # value head dim
    kernel: int  # conv kernel width
    eps: float


class Mixed(NamedTuple):
    """What one pass leaves: the gated-normed output and the new caches; with `capture`, the
    pass's whole conv window and the state before it and after each token (what rollback picks
    from, `cache.RecurrentCache`)."""

    y: mx.array  # [b, s, vh * vd]
    state: mx.array  # [b, vh, kd, vd]; captured: [b, s + 1, vh, kd, vd]
    conv: mx.array  # [b, kernel - 1, channels]; captured: [b, kernel - 1 + s, channels]


def mix(d: Dims, qkv_x: mx.array, z_x: mx.array, alpha_x: mx.array, beta_x: mx.array, conv0: mx.array,
        state0: mx.array, conv_w: mx.array, dt_bias: mx.array, a: mx.array, norm: mx.array,
        capture: bool = False, fused_steps: bool = True, width: int | None = None,
        valid: mx.array | None = None) -> Mixed:
    """qkv_x [b, s, C], z_x [b, s, vh*vd], alpha_x/beta_x [b, s, vh], conv0 [b, K-1, C], state0 [b, vh, kd, vd].
    `fused_steps=False` runs the token steps as separate operations: the CUDA kernel's self-test
    does, since on a GPU each fused step graph is a JIT compile (seconds, on a first run) that
    decoding with the kernel never uses again. `width` (captured passes): the captured buffers
    hold that many tokens (>= s; the slots past s are zeros), `cache.RecurrentCache` says why.
    `valid` [b] int32: row b's tokens are its first valid[b] (prompts of several lengths read in
    one pass): the tokens past them have decay 1 and write strength 0, as the chunked form's own
    padding, so each row's outputs and state are those of its tokens alone, and its conv window
    ends at its last token (not in a captured pass)."""
    b, s = qkv_x.shape[0], qkv_x.shape[1]
    window = mx.concatenate([conv0, qkv_x], axis=1)  # [b, K-1+s, C]
    prep = _prepare(d.kh, d.kd, d.vh, d.vd, d.kernel, d.eps)
    q, k, v, g, beta = prep(window, conv_w, alpha_x, beta_x, dt_bias, a)
    if valid is not None:
        if capture:
            raise ValueError("rows of their own lengths are not read in a captured pass")
        real = mx.arange(s)[None, :, None] < valid[:, None, None]
        g, beta = mx.where(real, g, 0.0), mx.where(real, beta, 0.0)
    if s <= SEQUENTIAL_MAX or capture:
        # decode, draft and verify: a few fused step kernels per token beat the chunked form's
        # dozens of small kernels (on the H200 the chunked form made V(2) 2.5 instead of ~1.2)
        state, outs, states = state0, [], [state0]
        step = delta_rule_step if fused_steps else delta_rule_step_ops
        for t in range(s):
            state, o_t, _ = step(state, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
            outs.append(o_t)
            states.append(state)
        o = mx.stack(outs, axis=1)
    else:
        o, state, _ = delta_rule_chunked(q, k, v, g, beta, state0)
    y = _output(o, z_x.reshape(b, s, d.vh, d.vd), norm, d.eps).reshape(b, s, d.vh * d.vd)
    if capture:
        pad = (width or s) - s
        if pad < 0:
            raise ValueError(f"a captured pass of {s} tokens does not fit width {width}")
        if pad:
            states += [mx.zeros_like(state0)] * pad
            window = mx.concatenate([window, mx.zeros((b, pad, window.shape[2]), window.dtype)], axis=1)
        return Mixed(y, mx.stack(states, axis=1), window)
    if valid is not None:  # each row's last kernel-1 inputs: window rows valid .. valid + kernel - 2
        at = valid[:, None] + mx.arange(d.kernel - 1)[None, :]
        return Mixed(y, state, mx.take_along_axis(window, at[..., None], axis=1))
    return Mixed(y, state, window[:, s:])


@functools.lru_cache(maxsize=None)
def _prepare(kh: int, kd: int, vh: int, vd: int, kernel: int, eps: float):
    """Compiled (fused) conv, SiLU, q/k L2 norm, head tiling, decay and write strength for one
    layer shape: dozens of small ops that would each cost a dispatch per token."""

    def prepare(window, conv_w, alpha_x, beta_x, dt_bias, a):
        b, s = window.shape[0], window.shape[1] - (kernel - 1)
        conv = window[:, 0:s] * conv_w[:, 0]
        for j in range(1, kernel):
            conv = conv + window[:, j:j + s] * conv_w[:, j]
        conv = conv * mx.sigmoid(conv)
        q = conv[..., : kh * kd].reshape(b, s, kh, kd)
        k = conv[..., kh * kd: 2 * kh * kd].reshape(b, s, kh, kd)
        v = conv[..., 2 * kh * kd:].reshape(b, s, vh, vd)
        # llama.cpp's l2_norm: x / max(||x||, eps)
        q = q / mx.maximum(mx.sqrt((q * q).sum(-1, keepdims=True)), eps) * (kd ** -0.5)
        k = k / mx.maximum(mx.sqrt((k * k).sum(-1, keepdims=True)), eps)
        if vh != kh:  # tiled order: value head h reads key head h % kh
            q = mx.tile(q, (1, 1, vh // kh, 1))
            k = mx.tile(k, (1, 1, vh // kh, 1))
        g = mx.logaddexp(alpha_x + dt_bias, 0.0) * a  # log decay, [b, s, vh]
        return q, k, v, g, mx.sigmoid(beta_x)

    return fused(prepare)


@fused
def _output(o, z, norm, eps):
    return mx.fast.rms_norm(o, norm, eps) * (z * mx.sigmoid(z))
