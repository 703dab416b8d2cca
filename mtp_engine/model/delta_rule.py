"""The gated delta rule, per value head, in its two forms.

Recurrence (one token t; state S [Kd, Vd]; g_t = log decay <= 0; beta_t in (0, 1)):
    S' = exp(g_t) S;   u_t = beta_t (v_t - S'^T k_t);   S_t = S' + k_t u_t^T;   o_t = S_t^T q_t

`delta_rule_step` runs it for one token (decode). `delta_rule_chunked` runs S > 1 tokens without a
per-token loop: with G_t the cumulative log decay inside a chunk and D[t, j] = exp(G_t - G_j) for
j <= t (0 above the diagonal), the delta vectors of a chunk solve a unit lower-triangular system

    (I + A) U = diag(beta) (V - diag(exp G) K S0),   A[t, j] = beta_t D[t, j] (k_t . k_j), j < t

(the WY / UT form), after which outputs and the end state are matrix products:

    O = diag(exp G) Q S0 + (D * Q K^T) U,   S_end = exp(G_last) S0 + (K * exp(G_last - G))^T U.

Chunks are chained sequentially, so a prompt of P tokens costs P / chunk dependent steps instead
of P. From a pass's delta vectors U (with K and g) any intermediate state follows with one product,
`state_after(S0, K, U, g, n)` (a check of U; rollback instead keeps every state of a verify's few
tokens, `cache.RecurrentCache`, which costs no kernel when the round ends).
"""
from __future__ import annotations

import mlx.core as mx

from .fused import fused

CHUNK = 64  # tokens per chunk (a power of two: `_unit_lower_inverse`)


def delta_rule_step_ops(state, q, k, v, g, beta):
    """One token. state [b, h, kd, vd]; q, k [b, h, kd]; v [b, h, vd]; g, beta [b, h].
    Returns (new state, output [b, h, vd], delta vector u [b, h, vd]). As separate MLX operations;
    `delta_rule_step` is the same fused into one compiled graph."""
    state = state * mx.exp(g)[:, :, None, None]
    kt = k[:, :, :, None]
    u = (v - (state * kt).sum(-2)) * beta[:, :, None]
    state = state + kt * u[:, :, None, :]
    return state, (state * q[:, :, :, None]).sum(-2), u


delta_rule_step = fused(delta_rule_step_ops)


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], C a power of two, by blocks: the
    inverses of the diagonal blocks of size b give those of size 2b,

        [[L11, 0], [L21, L22]]^-1 = [[X11, 0], [-X22 L21 X11, X22]],

    so log2(C) levels of batched products instead of C - 1 dependent row steps (a dispatch each on
    a GPU). Exact triangular algebra: stable for any A (the Neumann-series doubling trick is not:
    its partial sums grow like binomials)."""
    c = a.shape[-1]
    lead = a.shape[:-2]
    x = mx.ones((*lead, c, 1, 1), a.dtype)  # the inverses of the 1 x 1 diagonal blocks
    b = 1
    while b < c:
        p = c // (2 * b)
        blocks = a.reshape(*lead, p, 2, b, p, 2, b)[..., :, 1, :, :, 0, :]  # [..., P, b, P', b]
        lower = mx.moveaxis(mx.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # L21 of pair P: [..., P, b, b]
        even, odd = x[..., 0::2, :, :], x[..., 1::2, :, :]
        off = -(odd @ lower @ even)
        top = mx.concatenate([even, mx.zeros_like(even)], axis=-1)
        x = mx.concatenate([top, mx.concatenate([off, odd], axis=-1)], axis=-2)  # [..., P, 2b, 2b]
        b *= 2
    return x.reshape(*lead, c, c)


def chunking(s: int, chunk: int = CHUNK) -> tuple[int, int]:
    """(tokens a chunk, chunks) of `delta_rule_chunked` over s tokens: what its arithmetic depends
    on (rows of one pass padded to the same chunking, their padded tokens masked, compute as alone)."""
    c = min(chunk, 1 << (s - 1).bit_length())
    return c, 1 << (-(-s // c) - 1).bit_length()


def delta_rule_chunked(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                       state: mx.array, chunk: int = CHUNK) -> tuple[mx.array, mx.array, mx.array]:
    """S tokens at once. q, k [b, s, h, kd]; v [b, s, h, vd]; g, beta [b, s, h]; state [b, h, kd, vd].
    Returns (outputs [b, s, h, vd], end state, delta vectors U [b, s, h, vd]).

    The chunks' count is padded to a power of two (padded tokens have decay 1 and write strength
    0: they leave the state unchanged) and the whole computation is one compiled graph per such
    count on a GPU (`fused`). On an H100 the rule was most of a long prefill as 32-token chunks
    with a row-by-row inverse (17.6 ms a layer for 4096 tokens); 64-token chunks and the block
    inverse take 4.7 ms: what is left is the chunk-to-chunk recurrence, a few small products a
    chunk."""
    b, s, h, kd = k.shape
    c, n = chunking(s, chunk)
    pad = n * c - s
    if pad:  # padded tokens have decay 1 and beta 0: they leave the state unchanged
        q, k, v = (mx.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
        g, beta = (mx.pad(x, [(0, 0), (0, pad), (0, 0)]) for x in (g, beta))
    o, state, u = _chunked(q, k, v, g, beta, state, c)
    return o[:, :s], state, u[:, :s]


def _chunked_ops(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
                 c: int) -> tuple[mx.array, mx.array, mx.array]:
    """`delta_rule_chunked` on a length that is a whole number of chunks of c tokens."""
    b, s, h, kd = k.shape
    n = s // c
    # heads first: [b, h, s, d]
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    g, beta = g.transpose(0, 2, 1), beta.transpose(0, 2, 1)
    q, k, v = (x.reshape(b, h, n, c, -1) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)

    cum = mx.cumsum(g, axis=-1)
    idx = mx.arange(c)
    incl = idx[:, None] >= idx[None, :]
    decay = mx.exp(mx.where(incl, cum[..., :, None] - cum[..., None, :], -mx.inf))  # D[t, j]
    strict = idx[:, None] > idx[None, :]
    a = mx.where(strict, beta[..., :, None] * decay * (k @ k.swapaxes(-1, -2)), 0.0)
    t = _unit_lower_inverse(a)
    eg = mx.exp(cum)
    w = t @ (k * (beta * eg)[..., None])  # U = U0 - W S0
    u0 = t @ (v * beta[..., None])
    qk = decay * (q @ k.swapaxes(-1, -2))
    qg = q * eg[..., None]
    k_end = k * mx.exp(cum[..., -1:] - cum)[..., None]
    g_end = mx.exp(cum[..., -1])

    outs, us = [], []
    for i in range(n):
        u = u0[:, :, i] - w[:, :, i] @ state
        outs.append(qg[:, :, i] @ state + qk[:, :, i] @ u)
        state = g_end[:, :, i, None, None] * state + k_end[:, :, i].swapaxes(-1, -2) @ u
        us.append(u)
    o = mx.concatenate(outs, axis=2) if n > 1 else outs[0]
    u = mx.concatenate(us, axis=2) if n > 1 else us[0]
    return o.transpose(0, 2, 1, 3), state, u.transpose(0, 2, 1, 3)


_chunked = fused(_chunked_ops, static_argnums=(6,))


def state_after(state0: mx.array, k: mx.array, u: mx.array, g: mx.array, n: int) -> mx.array:
    """The recurrent state after the first n tokens of a pass that started from state0, from that
    pass's keys k [b, s, h, kd], delta vectors u [b, s, h, vd] and log decays g [b, s, h]."""
    if n == 0:
        return state0
    cum = mx.cumsum(g[:, :n], axis=1)  # [b, n, h]
    to_end = mx.exp(cum[:, -1:] - cum)  # decay from token j to token n-1
    kw = (k[:, :n] * to_end[..., None]).transpose(0, 2, 3, 1)  # [b, h, kd, n]
    return mx.exp(cum[:, -1])[:, :, None, None] * state0 + kw @ u[:, :n].transpose(0, 2, 1, 3)
