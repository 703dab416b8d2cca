"""Notebook d's experiment: rollback by re-decoding instead of by the state captured in verify.

llama.cpp's server falls back to this where it cannot snapshot per position: the verify captures
nothing, the host reads how many drafts were accepted, restores the trunk's pre-verify state and
runs the trunk again over the accepted tokens. A round the host must read before it rolls back
cannot stay on the device, so this variant lives here, beside the notebook that measures it, and
not in the package (whose round is `mtp_engine.speculative.round.draft_round`).
"""
from __future__ import annotations

import mlx.core as mx

from mtp_engine.model.step import Pass
from mtp_engine.generation.decode import Queued
from mtp_engine.speculative.draft_mtp import DraftMTPDecoder
from mtp_engine.generation.round import Round
from mtp_engine.speculative.round import live_drafts


class RedecodeDecoder(DraftMTPDecoder):
    """draft-mtp whose drafting rounds roll back by snapshot and re-decoding (module docstring)."""

    def _ahead(self) -> bool:
        return False  # each round is read on the host before the next is launched

    def _launch(self, k: int) -> Queued:
        if k == 0:
            return super()._launch(0)
        shapes = self._shapes(k)
        self.cache.to_host()  # host offsets: the snapshot is what the rollback restores
        snapshot = self.cache.snapshot()
        drafts, q, confident = self.drafter.draft(k, self.params.p_min)
        live = live_drafts(confident, k, self.params.n_min)
        ids = mx.concatenate([self._last_dev[:, None], drafts], axis=1)
        with self.prof.stage("verify") as out:
            post, pre = self.model.forward_states(ids, self.cache, Pass.ROUND_STEP)  # nothing captured
            logits = self.model.logits(post)
            out.append(logits)
        with self.prof.stage("sample") as out:
            scored = self._score(drafts, logits)
            out.append(scored)
        with self.prof.stage("accept") as out:
            n, emitted = self._accept(drafts, scored, q, live)
            out.extend([n, emitted])
        with self.prof.stage("rollback") as out:
            kept = int(n.item()) + 1
            if kept < k + 1:
                self.cache.restore(snapshot)
                self.model.forward_states(ids[:, :kept], self.cache, Pass.ROUND_STEP)
                out.extend(self.cache.arrays())
            self.drafter.commit(emitted, n, self._fed(post, pre))
        last = emitted[:, kept - 1]
        self._last_dev = last
        finite = mx.all(mx.isfinite(logits), axis=(1, 2))
        return Queued(Round(k, emitted, n, mx.sum(live, axis=1), drafts, finite, logits, last), k + 1, shapes)
