"""Each row's sampling rule in a round over B rows (`round.draft_round`, `round.plain_round`), all on
the device: a greedy row takes the argmax; a sampling row draws from its own distribution
(temperature, top-k, top-p, min-p: `sampling.distribution_rows`) with its own key
(`sampling.DeviceDraws`, from its seeded generator), its drafts drawn from the head's distribution
under the same settings and kept by the rejection sampler (`round.accept_sampling_device`), so each
row is lossless on its own whatever the others do. A row whose token needs the host (penalties, a
grammar, logprobs: `Sampler.on_device` is false) is a greedy row here and its caller samples it.
"""
from __future__ import annotations

import mlx.core as mx

from ..generation.sampling import DeviceDraws, SamplerConfig, distribution_rows
from .round import accept_greedy_device, accept_sampling_device, greedy


class RowSampling:
    """The rows' rules for one round: `cfgs[b]`, drawn with `draws[b]` (None: a greedy row)."""

    def __init__(self, cfgs: list[SamplerConfig], draws: list[DeviceDraws | None]):
        self.cfgs = cfgs
        self.draws = [d if not c.greedy else None for c, d in zip(cfgs, draws)]
        self.sampled = [d is not None for d in self.draws]
        mixed = any(self.sampled) and not all(self.sampled)
        self._mask = mx.array(self.sampled) if mixed else None  # [B]: the sampling rows of a mixed batch

    @property
    def greedy(self) -> bool:
        """Whether every row takes its argmax (the round draws nothing)."""
        return not any(self.sampled)

    def _keys(self) -> mx.array:
        """[B, 2]: a fresh key per sampling row (a greedy row's is a constant, its draw unused)."""
        unused = mx.random.key(0)
        return mx.stack([d.next() if d is not None else unused for d in self.draws])

    def _mix(self, drawn: mx.array, argmax: mx.array) -> mx.array:
        """Each row's value: the sampling rows' `drawn`, the greedy rows' `argmax` ([B, ...])."""
        if self._mask is None:
            return drawn
        return mx.where(self._mask.reshape(-1, *([1] * (drawn.ndim - 1))), drawn, argmax)

    def _draw(self, p: mx.array) -> mx.array:
        """[B] int32: row b's token drawn from p[b] [V] with its own key."""
        keys, logp = self._keys(), mx.log(p)
        return mx.stack([mx.random.categorical(logp[b], key=keys[b]) for b in range(p.shape[0])]).astype(mx.int32)

    def pick(self, logits: mx.array) -> mx.array:
        """A plain round's tokens [B] int32 from logits [B, V]."""
        argmax = greedy(logits)
        if self.greedy:
            return argmax
        return self._mix(self._draw(distribution_rows(logits, self.cfgs)), argmax)

    def draft_pick(self, logits: mx.array) -> tuple[mx.array, mx.array | None]:
        """A draft step's tokens [B] int32 from the head's logits [B, V], and the distributions they
        were drawn from [B, V] (None: every row greedy)."""
        argmax = greedy(logits)
        if self.greedy:
            return argmax, None
        q = distribution_rows(logits, self.cfgs)
        return self._mix(self._draw(q), argmax), q

    def score(self, drafts: mx.array, logits: mx.array) -> mx.array:
        """What each row's rule compares, from the verify's logits [B, k+1, V]: a sampling row's
        distributions, a greedy row's logits."""
        if self.greedy:
            return logits
        return self._mix(distribution_rows(logits, self.cfgs), logits)

    def accept(self, drafts: mx.array, scored: mx.array, q: mx.array | None,
               live: mx.array) -> tuple[mx.array, mx.array]:
        """(n accepted [B], emitted [B, k+1]): the greedy prefix match for greedy rows, the
        rejection sampler for sampling rows."""
        if self.greedy:
            return accept_greedy_device(drafts, scored, live)
        n, emitted = accept_sampling_device(drafts, scored, q, live, self._keys())
        if self._mask is None:
            return n, emitted
        n_greedy, emitted_greedy = accept_greedy_device(drafts, scored, live)
        return self._mix(n, n_greedy), self._mix(emitted, emitted_greedy)
