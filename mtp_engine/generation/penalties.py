"""Repetition penalties as llama.cpp defines them, over the last `repeat_last_n` tokens of the
history (prompt and generated tokens), applied to the logits before any other sampling step:

    logit(t) *= repeat_penalty  if logit(t) <= 0 and t occurs in the window (/= when > 0)
    logit(t) -= count(t) * frequency_penalty + (count(t) > 0) * presence_penalty

Speculative verification scores k+1 positions in one forward, each with a different history
(the tokens before row i are the history plus drafts 1..i). `penalize` therefore takes the
history on the host plus the round's draft tokens on the device and builds each row's window on
the device: no host sync, and each row penalised exactly as plain decoding would have penalised
that position had the drafts before it been generated. That is what keeps draft-mtp lossless
under penalties.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx

from ..errors import MTPEngineError


@dataclass(frozen=True)
class PenaltyConfig:
    """presence/frequency 0, repeat 1 or repeat_last_n 0 disable (llama.cpp's defaults).
    repeat_last_n -1 means the whole context, as in llama.cpp."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or not -2 <= v <= 2:
                raise MTPEngineError(f"expected a number in [-2, 2], found {v!r}", field=name)
        r = self.repeat_penalty
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not math.isfinite(r) or not 0 < r <= 10:
            raise MTPEngineError(f"expected a number in (0, 10] (1 disables), found {r!r}", field="repeat_penalty")
        n = self.repeat_last_n
        if not isinstance(n, int) or isinstance(n, bool) or n < -1:
            raise MTPEngineError(f"expected an integer >= -1 (0 disables, -1 = whole context), found {n!r}",
                                 field="repeat_last_n")

    @property
    def active(self) -> bool:
        return self.repeat_last_n != 0 and (self.presence_penalty != 0 or self.frequency_penalty != 0
                                            or self.repeat_penalty != 1)


class PenaltyHistory:
    """The tokens a generation has seen so far (prompt, then every emitted token)."""

    def __init__(self, cfg: PenaltyConfig):
        self.cfg = cfg
        self.tokens: list[int] = []

    def window(self) -> list[int]:
        n = self.cfg.repeat_last_n
        return list(self.tokens) if n < 0 else self.tokens[-n:] if n else []

    def penalize(self, logits: mx.array, extra: mx.array | None = None, offset: int = 0,
                 unread: tuple[mx.array, mx.array] | None = None) -> mx.array:
        """Penalised logits. `logits` is [V] or [R, V]; row r's history is the host history, then
        the first `count` of `unread` = (tokens [m], count: a device scalar; a round the host has not
        read yet, queued ahead), then extra[:offset + r] (device tokens: the round's drafts)."""
        if not self.cfg.active:
            return logits
        single = logits.ndim == 1
        rows = logits[None] if single else logits
        rows = rows.astype(mx.float32)
        r_count, vocab = rows.shape
        e = 0 if extra is None else int(extra.shape[0])
        m = 0 if unread is None else int(unread[0].shape[0])
        hist = self.window()
        # no window is longer than all the tokens there may be: -1 (whole context) and huge values agree
        limit = self.cfg.repeat_last_n if self.cfg.repeat_last_n > 0 else len(hist) + m + e
        n = max(1, min(limit, len(hist) + m + e))
        # -1 marks "no token" where the history is shorter than the window
        parts = [mx.array([-1] * (n - min(n, len(hist))) + hist[len(hist) - min(n, len(hist)):], dtype=mx.int32)]
        if m:
            parts.append(unread[0].reshape(-1).astype(mx.int32))
        if e:
            parts.append(extra.reshape(-1).astype(mx.int32))
        short = offset + r_count - 1 - e
        if short > 0:
            parts.append(mx.full((short,), -1, mx.int32))
        seq = mx.concatenate(parts) if len(parts) > 1 else parts[0]
        # row r: the last n tokens of history + unread[:count] + extra[:offset + r], at virtual
        # positions count + offset + r ... + n - 1 of (window, unread[:count], extra); past the
        # window and the counted unread tokens a position skips unread's m - count others
        idx = mx.arange(r_count)[:, None] + offset + mx.arange(n)[None, :]
        if m:
            count = unread[1].astype(mx.int32)
            idx = idx + count
            idx = mx.where(idx < n + count, idx, idx + m - count)
        win = seq[idx]
        valid = win >= 0
        row_ids = mx.broadcast_to(mx.arange(r_count)[:, None], win.shape)
        counts = mx.zeros((r_count, vocab), mx.float32).at[row_ids, mx.maximum(win, 0)].add(
            valid.astype(mx.float32))
        present = counts > 0
        c = self.cfg
        out = rows
        if c.repeat_penalty != 1:
            out = mx.where(present, mx.where(out <= 0, out * c.repeat_penalty, out / c.repeat_penalty), out)
        if c.frequency_penalty or c.presence_penalty:
            out = out - counts * c.frequency_penalty - present.astype(mx.float32) * c.presence_penalty
        return out[0] if single else out
