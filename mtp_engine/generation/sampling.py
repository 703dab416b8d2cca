"""Token sampling: greedy, or temperature with top-k / top-p / min-p, as one distribution.

The filters run on the raw logits' softmax and the temperature after them, as in llama.cpp's
default chain (top-k, top-p, min-p, temperature). Speculative sampling builds both the target's
and the draft's distributions with the same `distribution`, which is what makes it lossless.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import mlx.core as mx
import numpy as np

from ..errors import MTPEngineError
from .penalties import PenaltyConfig, PenaltyHistory

MAX_LOGPROBS = 20  # OpenAI's top_logprobs limit


@dataclass(frozen=True)
class SamplerConfig:
    """temperature 0 means greedy (argmax); top_k 0 and top_p 1 and min_p 0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # None or -1: a fresh random seed (llama.cpp's -s -1)
    penalties: PenaltyConfig = PenaltyConfig()  # applied to the logits first (llama.cpp's chain)
    logprobs: int | None = None  # report the chosen token's logprob and this many alternatives

    def __post_init__(self) -> None:
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
            raise MTPEngineError(f"expected a finite number >= 0, found {t!r}", field="temperature")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise MTPEngineError(f"expected an integer >= 0 (0 disables), found {self.top_k!r}", field="top_k")
        p = self.top_p
        if not isinstance(p, (int, float)) or not math.isfinite(p) or not 0 < p <= 1:
            raise MTPEngineError(f"expected a number in (0, 1], found {p!r}", field="top_p")
        m = self.min_p
        if not isinstance(m, (int, float)) or not math.isfinite(m) or not 0 <= m < 1:
            raise MTPEngineError(f"expected a number in [0, 1), found {m!r}", field="min_p")
        sd = self.seed
        if sd is not None and (not isinstance(sd, int) or isinstance(sd, bool) or not -1 <= sd < 2**63):
            raise MTPEngineError(f"expected an integer in 0..2^63-1, or -1 / None for a random seed, found {sd!r}",
                                 field="seed")
        if not isinstance(self.penalties, PenaltyConfig):
            raise MTPEngineError(f"expected a PenaltyConfig, found {type(self.penalties).__name__}", field="penalties")
        lp = self.logprobs
        if lp is not None and (not isinstance(lp, int) or isinstance(lp, bool) or not 0 <= lp <= MAX_LOGPROBS):
            raise MTPEngineError(f"expected an integer in 0..{MAX_LOGPROBS} or None, found {lp!r}", field="logprobs")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def distribution(logits: mx.array, cfg: SamplerConfig) -> mx.array:
    """Sampling probabilities [..., V] for logits [..., V] under `cfg` (temperature > 0)."""
    return _distribution(logits, cfg.temperature, cfg.top_k, cfg.top_p, cfg.min_p)


def distribution_rows(logits: mx.array, cfgs: list[SamplerConfig]) -> mx.array:
    """`distribution` per row of logits [B, ..., V], row b under `cfgs[b]` (a greedy row's is a
    softmax at temperature 1, never drawn from): each row's values are `distribution`'s for it
    alone, with every filter's parameters as per-row arrays."""
    shape = (len(cfgs),) + (1,) * (logits.ndim - 1)

    def per_row(values: list, active: bool):
        return mx.array(values, mx.float32 if isinstance(values[0], float) else mx.int32).reshape(shape) \
            if active else values[0]
    v = logits.shape[-1]
    top_k = [c.top_k if 0 < c.top_k < v else 0 for c in cfgs]
    top_p = [float(c.top_p) if c.top_p < 1.0 else 2.0 for c in cfgs]  # 2: keeps every token
    min_p = [float(c.min_p) for c in cfgs]
    return _distribution(logits, per_row([float(c.temperature) or 1.0 for c in cfgs], True),
                         per_row(top_k, any(top_k)), per_row(top_p, any(p < 1.0 for p in top_p)),
                         per_row(min_p, any(min_p)))


def _distribution(logits: mx.array, temperature, top_k, top_p, min_p) -> mx.array:
    """The filters and the temperature, with each parameter a number or a per-row array (an
    array's rows where a filter is off hold its no-op: top-k 0, top-p 2, min-p 0)."""
    logits = logits.astype(mx.float32)
    neg = mx.array(-math.inf, mx.float32)
    v = logits.shape[-1]
    if isinstance(top_k, mx.array) or (top_k and top_k < v):
        ordered = mx.sort(logits, axis=-1)
        if isinstance(top_k, mx.array):  # a row's k-th largest; k = 0: its smallest, filtering nothing
            kth = mx.take_along_axis(ordered, mx.broadcast_to(mx.where(top_k > 0, v - top_k, 0),
                                                              (*logits.shape[:-1], 1)), axis=-1)
        else:
            kth = ordered[..., -top_k][..., None]
        logits = mx.where(logits < kth, neg, logits)
    filter_p = isinstance(top_p, mx.array) or top_p < 1.0
    if filter_p or isinstance(min_p, mx.array) or min_p > 0.0:
        probs = mx.softmax(logits, axis=-1)
        if filter_p:
            # keep the smallest prefix of the sorted distribution whose mass reaches top_p
            sorted_p = -mx.sort(-probs, axis=-1)
            before = mx.cumsum(sorted_p, axis=-1) - sorted_p
            keep = before < top_p
            cutoff = mx.min(mx.where(keep, sorted_p, mx.array(math.inf)), axis=-1, keepdims=True)
            logits = mx.where(probs < cutoff, neg, logits)
        if isinstance(min_p, mx.array) or min_p > 0.0:
            logits = mx.where(probs < min_p * probs.max(axis=-1, keepdims=True), neg, logits)
    return mx.softmax(logits / temperature, axis=-1)


def logprob_arrays(logits: mx.array, tokens: mx.array, n: int) -> list[mx.array]:
    """`Sampler.token_logprobs` as device values, for logits [..., R, V] and the tokens they
    scored [..., R] (int32): each token's log-probability [..., R] and, for n > 0, the n most
    likely tokens [..., R, n] and their log-probabilities, best first (a round computes them with
    its other values, so the host reads them without waiting for the round queued after it)."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    parts = [mx.take_along_axis(lp, tokens[..., None].astype(mx.int32), axis=-1)[..., 0]]
    if n:
        top = mx.argpartition(-lp, kth=n - 1, axis=-1)[..., :n]  # a full sort of V is wasted work
        vals = mx.take_along_axis(lp, top, axis=-1)
        order = mx.argsort(-vals, axis=-1)
        parts += [mx.take_along_axis(top, order, axis=-1), mx.take_along_axis(vals, order, axis=-1)]
    return parts


def logprob_dicts(parts: list[np.ndarray], tokens: list[int], n: int) -> list[dict]:
    """`logprob_arrays` read on the host (rows [R, ...], R >= len(tokens); their top lists may be
    longer than n: the first n are the n most likely) as the loop reports them, one per token."""
    chosen = parts[0].astype(np.float64)
    return [{"token": int(t), "logprob": float(chosen[r]),
             "top": [(int(parts[1][r, j]), float(parts[2][r, j])) for j in range(n)] if n else []}
            for r, t in enumerate(tokens)]


def check_finite(finite: mx.array | bool) -> None:
    """Refuses to go on from NaN/inf logits: finite but huge weights in a corrupt file overflow,
    and an argmax of NaN would silently produce text. `finite`: a device flag, or one already read."""
    if not bool(finite.item() if isinstance(finite, mx.array) else finite):
        raise MTPEngineError("the model produced non-finite logits (NaN/inf): its weights are corrupt or out of "
                             "range", field="logits")


class Sampler:
    """Draws tokens for one generation; holds its random generator (seeded for reproducibility)."""

    def __init__(self, cfg: SamplerConfig, grammar: Any = None):
        self.cfg = cfg
        self.rng = np.random.default_rng(None if cfg.seed in (None, -1) else cfg.seed)
        self.history = PenaltyHistory(cfg.penalties)
        self.grammar = grammar  # a constraint's GrammarState (constraint.py): logits masked to it
        self._draws: DeviceDraws | None = None
        # the tokens of a round queued ahead that the host has not read (tokens [m], how many count:
        # a device value), while the round after it is built (`reading_ahead`)
        self._unread: tuple[mx.array, mx.array] | None = None

    def begin(self, prompt_ids: list[int]) -> None:
        """Starts the penalty history with the prompt (llama.cpp penalises prompt tokens too)."""
        self.history.tokens = list(prompt_ids)

    def accept(self, tokens: list[int]) -> None:
        """Emitted tokens join the penalty history."""
        if self.cfg.penalties.active:
            self.history.tokens.extend(int(t) for t in tokens)
        if self.grammar is not None:
            self.grammar.accept(tokens)

    def penalize(self, logits: mx.array, extra: mx.array | None = None, offset: int = 0) -> mx.array:
        """Logits with the repetition penalties applied (row r's history: the generation's, the
        unread round's tokens (`reading_ahead`), then extra[:offset + r]); unchanged when no
        penalty is set."""
        return self.history.penalize(logits, extra, offset, self._unread)

    @contextmanager
    def reading_ahead(self, unread: tuple[mx.array, mx.array] | None) -> Iterator[None]:
        """While a round is built ahead of one the host has not read: the penalties' history goes
        on through that round's tokens `unread` (tokens [m], how many count: a device value; None:
        none). The host's own draws after it (`sample`) follow the history it read."""
        self._unread = unread
        try:
            yield
        finally:
            self._unread = None

    def constrain(self, logits: mx.array, drafts: Any = None) -> mx.array:
        """Logits with the tokens a constraint refuses at -inf (row r: after drafts[:r]; `drafts`
        may be a device array, read here); unchanged without a constraint."""
        if self.grammar is None:
            return logits
        host = [int(t) for t in np.array(drafts).reshape(-1)] if drafts is not None and len(drafts) else []
        return self.grammar.apply(logits, host)

    def token_logprobs(self, logits: mx.array, tokens: list[int]) -> list[dict] | None:
        """Per row of logits [R, V] (R = len(tokens)): the log-probability of `tokens[r]` and the
        `cfg.logprobs` most likely alternatives, from the model's raw distribution (before
        penalties, temperature and filters, as vLLM and llama.cpp's server report them).
        None when logprobs were not asked for."""
        n = self.cfg.logprobs
        if n is None or not tokens:
            return None
        rows = logits.reshape(-1, logits.shape[-1])[: len(tokens)]
        parts = logprob_arrays(rows, mx.array(tokens, dtype=mx.int32), n)
        mx.eval(*parts)
        return logprob_dicts([np.array(p) for p in parts], tokens, n)

    @property
    def on_device(self) -> bool:
        """Whether the next token is drawn on the device, with no host decision (a grammar's
        masks follow the tokens the host read): its argmax or a draw with a key (`DeviceDraws`),
        from logits penalised by the history the host read plus the unread round's. Then a
        decode loop may queue the next step from the token still on the device before the host
        reads it (its logprobs, where asked for, computed with it: `logprob_arrays`), and a batch's
        row may draft."""
        return self.grammar is None

    @property
    def draws(self) -> DeviceDraws:
        """The generation's random draws on the device (made at the first, from the seeded
        generator: every path that draws a request's tokens on the device draws the same keys in
        the same order, alone or in a batch)."""
        if self._draws is None:
            self._draws = DeviceDraws(self.rng)
        return self._draws

    def draw(self, logits: mx.array) -> mx.array:
        """The next token on the device (int32) from logits [..., V] as they are (penalised and
        constrained already, where that applies): the argmax, or a draw from `distribution` with
        the next key of `draws`."""
        if self.cfg.greedy:
            return mx.argmax(logits, axis=-1).astype(mx.int32)
        # one draw per row of V, whatever the leading shape: a draw's bits depend on its shape,
        # and a batch draws each of its rows so (`RowSampling`)
        logp = mx.log(distribution(logits, self.cfg)).reshape(-1, logits.shape[-1])
        tokens = [mx.random.categorical(logp[i], key=self.draws.next()) for i in range(logp.shape[0])]
        return mx.stack(tokens).reshape(logits.shape[:-1]).astype(mx.int32)

    def sample(self, logits: mx.array) -> int:
        """One token from logits [V] (penalised first when penalties are set): `draw`'s where the
        token needs no host state (`on_device`), else drawn on the host."""
        finite = mx.all(mx.isfinite(logits))
        logits = self.constrain(self.penalize(logits))
        if self.cfg.greedy or self.on_device:
            tok = self.draw(logits)
            mx.eval(tok, finite)
            check_finite(finite)
            return int(tok.item())
        p = distribution(logits, self.cfg)
        mx.eval(p, finite)
        check_finite(finite)
        return self.categorical(np.array(p, dtype=np.float64))

    def categorical(self, p: np.ndarray) -> int:
        p = np.maximum(p, 0.0)
        c = np.cumsum(p)
        u = self.rng.random() * c[-1]
        return int(min(np.searchsorted(c, u, side="right"), len(p) - 1))


class DeviceDraws:
    """A generation's random draws on the device: one key, from its sampler's seeded generator
    (a seeded request draws the same), split for each use."""

    def __init__(self, rng: np.random.Generator):
        self.key = mx.random.key(int(rng.integers(0, 2**63)))

    def next(self) -> mx.array:
        """A fresh key for one draw."""
        self.key, sub = mx.random.split(self.key)
        return sub
