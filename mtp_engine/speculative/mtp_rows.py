"""The MTP head drafting for the rows of a batch: `round.draft_round`'s drafter over B sequences.

The stages are `MTPDrafter`'s, over rows (llama.cpp drafts for all slots in
one call the same way):
  block     what the head runs before its next draft, per row: after a drafting round the row's
            emitted tokens [k+1] with the verify's hidden states, `valid` = accepted + 1 of them (a
            device count); after a plain round the row's one token; a joining row's last prompt
            token. Rows run it together, padded to one width (the padding is written past each
            row's length: masked, and rewritten);
  draft     step 1 reads each row's last valid block row; steps 2..k read the drafts before them
            and the head's own output; their rows are guesses, dropped (the lengths return);
  commit    a drafting round's emitted rows become the next block; a plain round's row joins the
            block after the rows that count, and the block runs when it would outgrow the widest
            of `WIDTHS` or at the next draft (a stretch of plain rounds, n-max auto's k = 0, runs the
            head once per 8 of them, as a sequence alone's owed rows do, instead of every round).
Every count stays on the device: the host learns a round's accepted lengths one round late.
"""
from __future__ import annotations

from typing import Callable

import mlx.core as mx

from ..model.batch_cache import BatchCache
from ..model.cache import TrunkCache
from ..model.kv_cache import KVCache
from ..model.qwen35 import Qwen35Model
from .mtp_drafter import draft_chain
from ..generation.round import greedy, no_stage


def greedy_rows(logits: mx.array, drafts: list[mx.array]) -> tuple[mx.array, None, mx.array]:
    """Every row's draft its argmax (a batch of greedy rows without penalties)."""
    return greedy(logits), None, logits


WIDTHS = (1, 2, 4, 8)  # block widths a plain stretch pads to: the head's compiled shapes stay few


class MTPRowsDrafter:
    """Drafts with the model's MTP head for B rows at once; owns the head's `BatchCache` (rows in
    the batch's order) and each row's block."""

    name = "draft-mtp"

    def __init__(self, model: Qwen35Model, stage: Callable = no_stage):
        """`stage(name)`: the batch's profiler stage (`catch_up`: the block, `draft`: the chain)."""
        self.model = model
        self.stage = stage
        self.cache = BatchCache(model)
        self.tokens: mx.array | None = None  # [B, w] int32
        self.hidden: mx.array | None = None  # [B, w, H]
        self.valid: mx.array | None = None  # [B] int32: each row's rows of the block that count
        self._most = 0  # the host's bound of `valid` (a drafting round's counts are device values)

    def __len__(self) -> int:
        return len(self.cache)

    # ---- rows joining and leaving ---------------------------------------------------------------
    def join(self, heads: list[KVCache], tokens: list[int], hidden: mx.array) -> None:
        """Sequences join with their head caches `heads` (after their prompts but the last token);
        their blocks are each last prompt token `tokens` with the trunk hidden state before it,
        `hidden` [J, 1, H]."""
        for head in heads:
            trunk = TrunkCache([head])
            trunk.offset = head.offset
            self.cache.add(trunk)
        tok = mx.array(tokens, mx.int32)[:, None]
        valid = mx.ones((len(tokens),), mx.int32)
        if self.tokens is None:
            self.tokens, self.hidden, self.valid, self._most = tok, hidden, valid, 1
            return
        w = int(self.tokens.shape[1])
        self.tokens = mx.concatenate([self.tokens, mx.pad(tok, [(0, 0), (0, w - 1)])])
        self.hidden = mx.concatenate([self.hidden, mx.pad(hidden, [(0, 0), (0, w - 1), (0, 0)])])
        self.valid = mx.concatenate([self.valid, valid])

    def keep(self, rows: list[int]) -> None:
        """Keeps only `rows` (in that order)."""
        self.cache.keep(rows)
        if not rows or self.tokens is None:
            self.tokens = self.hidden = self.valid = None
            return
        idx = mx.array(rows, mx.int32)
        self.tokens, self.hidden, self.valid = self.tokens[idx], self.hidden[idx], self.valid[idx]

    def bound(self, trunk_bounds: list[int]) -> None:
        """The host's bounds of the trunk's lengths: the head holds at most one row past each."""
        self.cache.bound_lengths([b + 1 for b in trunk_bounds])

    # ---- the stages ------------------------------------------------------------------------------
    def _run_block(self) -> mx.array:
        """Every row's block through the head; its valid rows stay. Returns each row's last valid
        row's output [B, 1, H]."""
        m, cache = self.model, self.cache
        before = cache.lengths
        h = m.mtp.forward_batch(m.embed_tokens(self.tokens), self.hidden, cache)
        cache.lengths = before + self.valid  # the host bound grew by the width: rows past valid are stale
        # (a row whose block is empty, after a round it sat out, reads a stale row: it does not draft)
        return mx.take_along_axis(h, mx.maximum(self.valid - 1, 0)[:, None, None], axis=1)

    def draft(self, k: int, p_min: "float | mx.array" = 0.0,
              pick: Callable = greedy_rows) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """k drafts per row as device values: (tokens [B, k] int32, the distributions they were
        drawn from [B, k, V] (None: every row greedy), whether each passed p-min [B, k] when p-min
        is set: one for every row, or each row's [B]). `pick(logits [B, V], drafts so far) ->
        (tokens [B], distributions or None, the logits as the rule scored them)`: each row's rule
        (`RowSampling.draft_pick`; p-min reads its scored logits, as a sequence alone's does)."""
        m, cache = self.model, self.cache
        with self.stage("catch_up") as out:
            h = self._run_block()
            out.append(h)
        kept, kept_host = cache.lengths, list(cache.host_lengths)
        with self.stage("draft") as out:
            drafts = draft_chain(m, h, k, p_min, lambda logits, before: (*pick(logits, before), None),
                                 lambda d, h: m.mtp.forward_batch(m.embed_tokens(d[:, None]), h, cache))
            out.append(drafts[0])
        cache.lengths, cache.host_lengths = kept, kept_host  # rows of steps 2..k were the head's guesses
        self.tokens = self.hidden = self.valid = None  # run: the round's commit sets the next block
        return drafts

    def commit(self, emitted: mx.array, n: mx.array, hidden: mx.array, hold: mx.array | None = None) -> None:
        """A drafting round emitted `emitted[b, :n[b]+1]` per row (accepted drafts, then the
        trunk's token): they, with the verify's hidden states [B, k+1, H], are the next block
        (rows `hold` [B] sat the round out: theirs is empty, as the trunk kept nothing)."""
        self.tokens, self.hidden, self.valid = emitted, hidden, n + 1 if hold is None else mx.where(hold, 0, n + 1)
        self._most = int(emitted.shape[1])

    def accept_plain(self, token: mx.array, hidden: mx.array, hold: mx.array | None = None) -> None:
        """A plain round emitted `token` [B] from trunk states `hidden` [B, 1, H]: the token's row
        joins each row's block right after the rows that count (not for rows `hold` [B], which
        sat the round out); a block that would outgrow the widest width runs first and the
        token's row starts the next one."""
        need = self._most + 1
        grow = mx.ones(token.shape, mx.int32) if hold is None else (~hold).astype(mx.int32)
        if self.tokens is None or need > WIDTHS[-1]:
            if self.tokens is not None:
                self._run_block()
            self.tokens, self.hidden, self.valid, self._most = token[:, None], hidden, grow, 1
            return
        w = int(self.tokens.shape[1])
        if need > w:
            wider = next(x for x in WIDTHS if x >= need)
            self.tokens = mx.pad(self.tokens, [(0, 0), (0, wider - w)])
            self.hidden = mx.pad(self.hidden, [(0, 0), (0, wider - w), (0, 0)])
        at = mx.arange(self.tokens.shape[1])[None, :] == self.valid[:, None]  # [B, W]: each row's next
        self.tokens = mx.where(at, token[:, None], self.tokens)
        self.hidden = mx.where(at[..., None], hidden.astype(self.hidden.dtype), self.hidden)
        self.valid = self.valid + grow
        self._most = need

    def arrays(self) -> list[mx.array]:
        """What a queued round leaves for the head (evaluated with it)."""
        block = [a for a in (self.tokens, self.hidden, self.valid) if a is not None]
        return self.cache.arrays() + block
