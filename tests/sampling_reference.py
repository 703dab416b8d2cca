"""Independent float64 NumPy statements of llama.cpp's sampling: the repetition penalties and the
filter chain (top-k, top-p, min-p, temperature). Test oracles: they share no code with
`mtp_engine.generation` (the sampler and the penalties are checked against them)."""
from __future__ import annotations

import numpy as np


def reference_penalties(logits: np.ndarray, history: list[int], cfg) -> np.ndarray:
    """llama.cpp's llama_sampler_penalties_apply, in float64 over one row (`cfg`: a
    `PenaltyConfig`)."""
    n = len(history) if cfg.repeat_last_n < 0 else cfg.repeat_last_n
    window = history[-n:] if n else []
    out = logits.astype(np.float64).copy()
    for t in set(window):
        c = window.count(t)
        if out[t] <= 0:
            out[t] *= cfg.repeat_penalty
        else:
            out[t] /= cfg.repeat_penalty
        out[t] -= c * cfg.frequency_penalty + cfg.presence_penalty
    return out


def reference_distribution(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                           min_p: float = 0.0) -> np.ndarray:
    """llama.cpp's default chain, in float64: top-k on the logits; then, on the softmax of what is
    left, top-p (the most likely tokens until their mass reaches top_p, the crossing one included,
    and every token as likely as the last one kept) and min-p (tokens at least min_p times the most
    likely one); then the temperature on the surviving logits."""
    x = np.asarray(logits, dtype=np.float64)
    keep = np.ones(x.shape, dtype=bool)
    if 0 < top_k < x.size:
        kth = np.sort(x)[-top_k]
        keep &= x >= kth
    p = np.where(keep, np.exp(x - x[keep].max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        mass, last = 0.0, None
        for i in order:
            if mass >= top_p:
                break
            mass += p[i]
            last = p[i]
        keep &= p >= last
    if min_p > 0.0:
        keep &= p >= min_p * p.max()
    z = np.where(keep, x / temperature, -np.inf)
    out = np.exp(z - z.max())
    return out / out.sum()
