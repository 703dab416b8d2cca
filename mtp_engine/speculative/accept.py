"""Acceptance rules of a verify pass: greedy prefix matching and lossless speculative sampling.

Both take host arrays (one transfer per round) and return (number of drafts accepted, the token
emitted after them: the target's correction or its bonus token).
"""
from __future__ import annotations

import numpy as np

from ..generation.sampling import Sampler


def accept_greedy(drafts: np.ndarray, target_argmax: np.ndarray) -> tuple[int, int]:
    """drafts [k], target_argmax [k+1] (row i predicts the token after input i). Accepts the longest
    prefix where the target's argmax equals the draft; emits the target's argmax after it."""
    k = len(drafts)
    n = 0
    while n < k and int(drafts[n]) == int(target_argmax[n]):
        n += 1
    return n, int(target_argmax[n])


def accept_sampling(drafts: np.ndarray, p: np.ndarray, q: np.ndarray, sampler: Sampler) -> tuple[int, int]:
    """Standard speculative sampling (Leviathan et al., Chen et al.): drafts [k] were drawn from q [k, V];
    p [k+1, V] is the target's distribution at each verify row. Draft i is kept with probability
    min(1, p_i(d)/q_i(d)); on the first rejection the token is drawn from normalise(max(0, p_i - q_i));
    if all are kept, the bonus token is drawn from p_k. The emitted sequence is distributed exactly
    as plain sampling from p."""
    k = len(drafts)
    for i in range(k):
        d = int(drafts[i])
        pi, qi = float(p[i, d]), float(q[i, d])
        if qi > 0 and sampler.uniform() * qi < pi:
            continue
        residual = np.maximum(p[i].astype(np.float64) - q[i].astype(np.float64), 0.0)
        if residual.sum() <= 0:  # p == q to rounding: the residual is empty, p itself is the answer
            residual = p[i].astype(np.float64)
        return i, sampler.categorical(residual)
    return k, sampler.categorical(p[k].astype(np.float64))
