"""Each row's sampling rule in a round over B rows (`round.draft_round`, `round.plain_round`), all on
the device: a greedy row takes the argmax; a sampling row draws from its own distribution
(temperature, top-k, top-p, min-p: `sampling.distribution_rows`) with its own key
(`sampling.DeviceDraws`, from its seeded generator), its drafts drawn from the head's distribution
under the same settings and kept by the rejection sampler (`round.accept_sampling_device`), so each
row is lossless on its own whatever the others do. Each row's logits are penalised first by its
own history (`Sampler.penalize`: the tokens its host read, its unread round's, the drafts before
the row). A row whose token needs the host (a grammar: `Sampler.on_device` is false) is a greedy
row here and its caller samples it.
"""
from __future__ import annotations

import mlx.core as mx

from typing import Callable

from ..generation.round import greedy
from ..generation.sampling import DeviceDraws, SamplerConfig, distribution_rows
from .round import accept_greedy_device, accept_sampling_device


class RowSampling:
    """The rows' rules for one round: `cfgs[b]`, drawn with `draws[b]` (None: a greedy row);
    `drafting[b]`: whether row b's drafts count (None: every row's); `penalize[b]` (None: none for
    the row) its `Sampler.penalize`. A sampling row that does not draft takes a plain step's draw
    (one key, its first verify row): the draws it makes are the ones it makes alone."""

    def __init__(self, cfgs: list[SamplerConfig], draws: list[DeviceDraws | None],
                 drafting: list[bool] | None = None, penalize: list[Callable | None] | None = None):
        self.cfgs = cfgs
        self.penalize = penalize if penalize is not None and any(penalize) else None
        self.draws = [d if not c.greedy else None for c, d in zip(cfgs, draws)]
        self.sampled = [d is not None for d in self.draws]
        drafting = drafting if drafting is not None else [True] * len(cfgs)
        self._drafts = [s and d for s, d in zip(self.sampled, drafting)]  # sampling rows that draft
        self._steps = [s and not d for s, d in zip(self.sampled, drafting)]  # sampling rows that step

    @property
    def greedy(self) -> bool:
        """Whether every row takes its argmax (the round draws nothing)."""
        return not any(self.sampled)

    def _keys(self, rows: list[bool]) -> mx.array:
        """[B, 2]: a fresh key for each of `rows` (another row's is a constant, its draw unused)."""
        unused = mx.random.key(0)
        return mx.stack([d.next() if r else unused for d, r in zip(self.draws, rows)])

    @staticmethod
    def _mix(rows: list[bool], value: mx.array, other: mx.array) -> mx.array:
        """Each row's value: `value` for `rows`, `other` for the rest ([B, ...])."""
        if all(rows):
            return value
        if not any(rows):
            return other
        return mx.where(mx.array(rows).reshape(-1, *([1] * (value.ndim - 1))), value, other)

    def _draw(self, p: mx.array, rows: list[bool]) -> mx.array:
        """[B] int32: row b's token drawn from p[b] [V] with its own key, for `rows` (the others'
        draws unused)."""
        keys, logp = self._keys(rows), mx.log(p)
        return mx.stack([mx.random.categorical(logp[b], key=keys[b]) for b in range(p.shape[0])]).astype(mx.int32)

    def _penalised(self, logits: mx.array, extra=None) -> mx.array:
        """Each row's logits penalised by its own history; `extra(b)`: (row b's device tokens after
        its history, offset) as `Sampler.penalize` takes them."""
        if self.penalize is None:
            return logits
        return mx.stack([p(logits[b], *(extra(b) if extra else ())) if p is not None else logits[b]
                         for b, p in enumerate(self.penalize)])

    def pick(self, logits: mx.array) -> mx.array:
        """A plain round's tokens [B] int32 from logits [B, V]."""
        logits = self._penalised(logits)
        argmax = greedy(logits)
        if self.greedy:
            return argmax
        return self._mix(self.sampled, self._draw(distribution_rows(logits, self.cfgs), self.sampled), argmax)

    def draft_pick(self, logits: mx.array, drafts: list[mx.array]) -> tuple[mx.array, mx.array | None, mx.array]:
        """A draft step's tokens [B] int32 from the head's logits [B, V] after the round's `drafts`
        so far ([B] each), the distributions they were drawn from [B, V] (None: no row draws), and
        the logits as penalised."""
        logits = self._penalised(logits, (lambda b: (mx.stack([d[b] for d in drafts]), len(drafts))) if drafts else None)
        argmax = greedy(logits)
        if not any(self._drafts):
            return argmax, None, logits
        q = distribution_rows(logits, self.cfgs)
        return self._mix(self._drafts, self._draw(q, self._drafts), argmax), q, logits

    def score(self, drafts: mx.array, logits: mx.array) -> mx.array:
        """What each row's rule compares, from the verify's logits [B, k+1, V]: a sampling row's
        distributions, a greedy row's logits (penalised, row i after drafts 1..i)."""
        logits = self._penalised(logits, lambda b: (drafts[b],))
        if self.greedy:
            return logits
        return self._mix(self.sampled, distribution_rows(logits, self.cfgs), logits)

    def accept(self, drafts: mx.array, scored: mx.array, q: mx.array | None,
               live: mx.array) -> tuple[mx.array, mx.array]:
        """(n accepted [B], emitted [B, k+1]): the greedy prefix match for greedy rows, the
        rejection sampler for sampling rows that draft, a plain step's draw for those that do not."""
        n, emitted = accept_greedy_device(drafts, scored, live) if not all(self.sampled) else (None, None)
        if any(self._drafts):
            n_s, e_s = accept_sampling_device(drafts, scored, q, live, self._keys(self._drafts))
            n, emitted = (n_s, e_s) if n is None else (self._mix(self._drafts, n_s, n),
                                                       self._mix(self._drafts, e_s, emitted))
        if any(self._steps):
            token = self._draw(scored[:, 0], self._steps)
            n_p = mx.zeros(token.shape, mx.int32)
            e_p = mx.broadcast_to(token[:, None], (token.shape[0], drafts.shape[1] + 1))
            n, emitted = (n_p, e_p) if n is None else (self._mix(self._steps, n_p, n),
                                                       self._mix(self._steps, e_p, emitted))
        return n, emitted
