"""The model's own MTP head as a drafter (llama.cpp's draft-mtp).

  draft     the head as a chain: step 1 reads (last token, trunk hidden of the previous position);
            step i > 1 reads (draft i-1, the head's own shared_head_norm output). The catch-up
            rows owed from earlier rounds run in the same forward as step 1.
  rollback  the head's KV rows written by steps 2..k are dropped (their inputs were its own
            guesses); step 1's row is exact and stays.
  accept    the accepted rows (token, trunk hidden from the verify pass) are owed to the head and
            computed lazily, fused into the next round's first draft step.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import mlx.core as mx
import numpy as np

from ..constraint import masked
from ..errors import MTPEngineError
from ..generation.decode import kv_capacity
from ..generation.sampling import distribution
from ..model.kv_cache import KVCache
from ..model.step import Pass
from .drafter import Draft, DraftContext, Drafter
from .round import no_stage


class HeadPrefix(NamedTuple):
    """The head's state after a prompt, for a prompt cache: its cache (rows below `rows` are never
    rewritten), and the trunk hidden state its next row reads."""

    cache: KVCache
    rows: int
    h_last: mx.array

    def fork(self) -> "HeadPrefix":
        """The same state on a cache of its own (a generation may go on from it while the one that
        kept it still writes its cache)."""
        return HeadPrefix(self.cache.view(self.rows), self.rows, self.h_last)

    def nbytes(self) -> int:
        return self.cache.nbytes()


class HeadBlock(NamedTuple):
    """The rows the head runs before its next draft, on the device (resident rounds): owed
    catch-up rows, then the last emitted token's row at index valid-1. After a drafting round it is
    the round's emitted tokens ([k+1], valid = accepted + 1, a device count) with the verify's
    hidden states, so its shape is fixed by k alone."""

    tokens: mx.array  # [w] int32
    hidden: mx.array  # [1, w, H]
    valid: int | mx.array


class MTPDrafter(Drafter):
    """Drafts with the model's MTP head; owns the head's KV cache and the rows it is owed."""

    name = "draft-mtp"
    prefill_chunk: int | None = None  # prompt rows per head forward; None: the model's options'
    # owed rows kept across plain rounds (see _trim_owed): with the last token's row a block is at
    # most 8 rows, what the few-row product kernels take
    catch_up_window = 7
    # widths a block of host-counted rows is padded to (`block_width`): a plain stretch of any
    # length then reuses the head's compiled shapes (each new width was a compile: seconds at 9B)
    BLOCK_WIDTHS = (1, 2, 4, 8)

    def __init__(self, ctx: DraftContext):
        super().__init__(ctx)
        model = ctx.model
        if model.mtp is None:
            raise MTPEngineError("draft-mtp needs a model with an MTP head (nextn_predict_layers >= 1); "
                                 "this model has none", field="spec")
        self.model = model
        self.cache = model.mtp.make_cache()
        self.last_token: int | None = None
        self.h_last: mx.array | None = None  # trunk hidden [1, 1, H] of the position before last_token
        self.owed_tokens: list[int] = []  # catch-up rows the head has not seen yet
        self.owed_hidden: list[mx.array] = []
        self.catch_up_dropped = 0  # owed rows skipped after long plain stretches (see _trim_owed)
        self.steps = 0  # head forwards run by the last draft (rows written), until accept
        self._block: HeadBlock | None = None  # device-resident rounds' rows to run (to_device), see `block`
        self._skip = 0  # leading rows of a host-counted `_block` dropped from the catch-up window
        self._plain_rows: list[tuple[mx.array, mx.array]] = []  # plain rounds' rows, joined on demand
        # drafts are sampled on the device; its key derives from the sampler's seeded generator
        self._rng = mx.random.key(int(ctx.sampler.rng.integers(0, 2**63)))

    def begin(self, prompt: list[int], hidden: mx.array) -> None:
        """The head sees prompt row t as (token t, trunk hidden t-1), zeros before the first."""
        self._rows(prompt, hidden, 0, mx.zeros((1, 1, self.model.cfg.hidden_size)))

    def prefix_state(self) -> "HeadPrefix":
        # the trunk hidden state is copied: a slice would keep the whole prompt's hidden states
        return HeadPrefix(self.cache, self.cache.offset, mx.array(np.array(self.h_last)))

    def begin_from(self, prompt: list[int], hidden: mx.array, start: int, state: "HeadPrefix") -> None:
        cache, rows, h_last = state
        if rows != start:
            raise MTPEngineError(f"prompt cache: the head kept {rows} rows for a {start}-token prefix",
                                 field="prompt_cache")
        self.cache = cache
        self.cache.truncate(rows)
        self._rows(prompt, hidden, start, h_last)

    def _rows(self, prompt: list[int], hidden: mx.array, start: int, h_before: mx.array) -> None:
        """Rows start..len-2 of the prompt through the head; `hidden` holds the trunk's rows
        start..len-2 and `h_before` the one before them."""
        head = prompt[start:-1]
        self.last_token = prompt[-1]
        self.h_last = hidden[:, -1:] if head else h_before
        h_prev = mx.concatenate([h_before, hidden[:, :-1]], axis=1)
        chunk = self.prefill_chunk or self.model.options.prefill_chunk
        for s in range(0, len(head), chunk):
            e = slice(s, s + chunk)
            m = self.model.mtp(self.model.embed_tokens(mx.array([head[e]])), h_prev[:, e], self.cache, Pass.PREFILL)
            mx.eval(m, *self.cache.state())

    def draft(self, k: int, p_min: float = 0.0) -> Draft:
        mtp, model, prof, sampler = self.model.mtp, self.model, self.ctx.prof, self.ctx.sampler
        owed = len(self.owed_tokens)
        if self.owed_tokens and prof.mode == "precise":
            # attribute catch-up honestly: run the owed rows as their own forward (same math)
            with prof.stage("catch_up") as out:
                out.append(mtp(model.embed_tokens(mx.array([self.owed_tokens])),
                               mx.concatenate(self.owed_hidden, axis=1), self.cache))
                out.extend(self.cache.state())
            self.owed_tokens, self.owed_hidden = [], []
        tok = mx.array([self.owed_tokens + [self.last_token]])
        h_prev = mx.concatenate(self.owed_hidden + [self.h_last], axis=1)
        self.owed_tokens, self.owed_hidden = [], []
        drafts: list[mx.array] = []
        qs: list[mx.array] = []
        grammar, host = sampler.grammar, []  # constrained: each step masked by the drafts before it
        self.steps = 0
        for _ in range(k):
            self.steps += 1
            with prof.stage("draft") as out:
                h_mtp = mtp(model.embed_tokens(tok), h_prev, self.cache)[:, -1:]
                # the drafter sees the penalties its chain would meet (history + earlier drafts)
                logits = sampler.penalize(model.draft_logits(h_mtp[0, 0]),
                                          mx.stack(drafts).reshape(-1) if drafts else None, len(drafts))
                allowed = grammar.allowed_after(host) if grammar is not None else None
                if grammar is not None and allowed is None:  # the text ended (an end-of-sequence draft)
                    break
                if allowed is not None:
                    logits = masked(logits, allowed)
                d = self._pick(logits, qs)
                out.append(d)
            if p_min > 0.0:
                with prof.stage("sync"):
                    top = mx.topk(logits, min(10, logits.shape[-1]))
                    p_top = mx.max(mx.softmax(top)).item()  # llama.cpp: top-10 softmax at temperature 1
                if p_top < p_min:
                    if qs:
                        qs.pop()
                    break
            drafts.append(d)
            if grammar is not None:
                host.append(int(d.item()))
            tok, h_prev = d.reshape(1, 1), h_mtp
        cap = kv_capacity(self.cache)
        shapes = [("mtp", owed + 1, cap)] + ([("mtp", 1, cap)] if self.steps > 1 else [])
        if not drafts:
            return Draft([], None, shapes)
        return Draft(mx.stack(drafts), mx.stack(qs) if qs else None, shapes)

    def _pick(self, logits: mx.array, qs: list) -> mx.array:
        """The draft token on the device: argmax, or a draw from the sampler's distribution (kept
        in `qs`: lossless acceptance needs it)."""
        cfg = self.ctx.sampler.cfg
        if cfg.greedy:
            return mx.argmax(logits, axis=-1)
        qi = distribution(logits, cfg)
        self._rng, sub = mx.random.split(self._rng)
        qs.append(qi)
        return mx.random.categorical(mx.log(qi), key=sub)

    def rollback(self, n: int) -> None:
        if self.steps > 1:
            self.cache.truncate(self.cache.offset - (self.steps - 1))

    def accept(self, accepted: list[int], token: int, hidden: mx.array) -> None:
        """Owes the head (d_i, trunk hidden before d_i) for the accepted drafts, and the last token's
        row when no draft step ran (a plain round); they join the next round's first draft forward."""
        n = len(accepted)
        if self.steps == 0:
            self.owed_tokens.append(self.last_token)
            self.owed_hidden.append(self.h_last)
            self._trim_owed()
        self.owed_tokens.extend(accepted)
        if n:
            self.owed_hidden.append(hidden[:, :n])
        self.h_last = hidden[:, n:n + 1]
        self.last_token = token
        self.steps = 0

    def _trim_owed(self) -> None:
        """Keeps only the newest `catch_up_window` owed rows. Every plain round owes the head one
        row, and where a product of M rows costs M single rows (MLX's CPU backend) catching up a
        long plain stretch costs c steps per plain token: measured on the 2-core CPU, n-max auto
        fell to 0.86x plain from its probes' catch-ups alone. Older rows are dropped: the head's own
        attention then lacks them (its positions close the gap), which can only lower acceptance of
        the next drafts, never change the output (verify decides)."""
        drop = len(self.owed_tokens) - self.catch_up_window
        if drop <= 0:
            return
        self.owed_tokens = self.owed_tokens[drop:]
        self.catch_up_dropped += drop
        # drop whole entries (no concatenation: a lazy concat per plain round would chain forever)
        while drop:
            rows = int(self.owed_hidden[0].shape[1])
            if rows <= drop:
                self.owed_hidden.pop(0)
                drop -= rows
            else:
                self.owed_hidden[0] = self.owed_hidden[0][:, drop:]
                drop = 0

    # ---- device-resident rounds (speculative/resident.py): no host reads --------------------------
    def to_device(self) -> None:
        """After `begin`: the owed rows and the last token become a `HeadBlock`."""
        self.cache.to_device()
        tokens = self.owed_tokens + [self.last_token]
        self._block = HeadBlock(mx.array(tokens, dtype=mx.int32),
                                mx.concatenate(self.owed_hidden + [self.h_last], axis=1), len(tokens))
        self._skip, self._plain_rows = 0, []
        self.owed_tokens, self.owed_hidden = [], []

    @property
    def block(self) -> HeadBlock | None:
        """The rows the head runs before its next draft: owed catch-up rows, then the last
        token's. Plain rounds only append their rows to a list (`accept_plain`); they are joined
        here, when a draft (or a reader) needs them: a join per plain round was MLX operations
        (slices, concatenations) in every draft-less round of a plain stretch."""
        if self._plain_rows:
            b, rows = self._block, self._plain_rows
            tokens = [b.tokens[self._skip:]] if b is not None and b.valid > self._skip else []
            hidden = [b.hidden[:, self._skip:]] if tokens else []
            tokens += [t.astype(mx.int32).reshape(1) for t, _ in rows]
            hidden += [h for _, h in rows]
            valid = len(rows) + ((b.valid - self._skip) if b is not None else 0)
            self._block = HeadBlock(mx.concatenate(tokens) if len(tokens) > 1 else tokens[0],
                                    mx.concatenate(hidden, axis=1) if len(hidden) > 1 else hidden[0], valid)
            self._skip, self._plain_rows = 0, []
        return self._block

    def pending_arrays(self) -> list[mx.array]:
        """What a queued round leaves for the head that must be evaluated with it: a drafting
        round's block (a plain round's row is an output of its own forward)."""
        if self._plain_rows or self._block is None:
            return []
        return [self._block.tokens, self._block.hidden]

    def block_width(self) -> int:
        """Rows the head runs for the current block: a drafting round's k+1, or the host-counted
        rows padded up to one of `BLOCK_WIDTHS`."""
        w = int(self.block.tokens.shape[0])
        if not isinstance(self.block.valid, int):
            return w
        return next((x for x in self.BLOCK_WIDTHS if x >= w), w)

    reads_history = False  # its drafts come from device values: rounds may be queued ahead of the read

    def round_read(self, tokens: list[int]) -> None:
        """The host read a round that emitted `tokens`: the head already took them on the device."""

    def round_shapes(self, k: int) -> list:
        """The head's forward shapes in a device round of k drafts (the block, then the chained
        steps): a shape's first use is a trace and compiles, not a sample of a round's cost."""
        cap = kv_capacity(self.cache)
        return [("mtp", self.block_width(), cap)] + ([("mtp", 1, cap)] if k > 1 else [])

    def trunk_committed(self, rows: int) -> None:
        """The trunk holds `rows` committed tokens (the host's count, a round late): the head holds
        at most one row past them (its last token's), whatever rounds are queued."""
        self.cache.bound = min(self.cache.bound, rows + 1)

    def _run_block(self) -> mx.array:
        """The block through the head (its valid rows stay, the cache's device offset moves past
        them; padding rows are written past them, masked and rewritten like stale rows); the last
        valid row's output [1, 1, H]."""
        b, cache = self.block, self.cache
        base, bound, w = cache.offset, cache.bound, self.block_width()
        tokens, hidden = b.tokens, b.hidden
        if w > tokens.shape[0]:
            tokens = mx.pad(tokens, [(0, w - tokens.shape[0])])
            hidden = mx.pad(hidden, [(0, 0), (0, w - hidden.shape[1]), (0, 0)])
        h = self.model.mtp(self.model.embed_tokens(tokens[None]), hidden, cache, Pass.ROUND_STEP)
        cache.offset, cache.bound = base + b.valid, bound + w  # rows past valid are stale, masked, rewritten
        if isinstance(b.valid, int):
            return h[:, b.valid - 1:b.valid]
        return mx.take(h, (b.valid - 1).reshape(1), axis=1)

    def draft_resident(self, k: int, p_min: float = 0.0) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """k drafts as device values, as a round's one row: (tokens [1, k] int32, their
        distributions [1, k, V] when sampling, whether each passed p-min [1, k] when p-min is set).
        Every step runs; p-min only says which drafts count (the round keeps the shape k gives it).
        A precise profile times the head's block (its owed rows and the last token's) as catch-up
        and each step as a draft, each evaluated at its end, as the host round attributes them."""
        prof = self.ctx.prof
        if prof.mode == "precise":
            with prof.stage("catch_up") as out:
                h = self._run_block()
                out.append(h)
            tokens, qs, confident = self._chain(h, k, p_min, prof.stage)
        else:
            with prof.stage("draft") as out:
                tokens, qs, confident = self._chain(self._run_block(), k, p_min)
                out.append(tokens)
        self.steps = k
        return tokens, qs, confident

    def _chain(self, h: mx.array, k: int, p_min: float,
               stage: Callable = no_stage) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """The k chained head steps from the block's last output `h` (`stage` per step)."""
        model, sampler, cache = self.model, self.ctx.sampler, self.cache
        kept, bound = cache.offset, cache.bound
        drafts, qs, confident = [], [], []
        for i in range(k):
            with stage("draft") as out:
                logits = sampler.penalize(model.draft_logits(h[0, 0]), mx.stack(drafts) if drafts else None,
                                          len(drafts))
                d = self._pick(logits, qs)
                if p_min > 0.0:  # llama.cpp: top-10 softmax at temperature 1
                    confident.append(mx.max(mx.softmax(mx.topk(logits, min(10, logits.shape[-1])))) >= p_min)
                drafts.append(d.astype(mx.int32))
                if i + 1 < k:
                    h = model.mtp(model.embed_tokens(d.reshape(1, 1)), h, cache, Pass.ROUND_STEP)
                out.extend([drafts[-1], h])
        cache.offset, cache.bound = kept, bound  # rows of steps 2..k were the head's own guesses
        return (mx.stack(drafts)[None], mx.stack(qs)[None] if qs else None,
                mx.stack(confident)[None] if confident else None)

    def commit(self, emitted: mx.array, n: mx.array, hidden: mx.array) -> None:
        """A drafting round emitted `emitted[0, :n+1]` (the round's one row: accepted drafts, then
        the trunk's token): they, with the verify's hidden states, are the head's next block."""
        self._block = HeadBlock(emitted[0], hidden, (n + 1).reshape(()))
        self._skip, self._plain_rows = 0, []
        self.steps = 0

    def accept_plain(self, token: mx.array, hidden: mx.array) -> None:
        """A plain round emitted `token` (device [1]) from trunk state `hidden` [1, 1, H]. A block
        left by a drafting round (device count) is run now, once; host-counted rows are kept
        (the newest `catch_up_window`) and run with the next draft."""
        b = self._block
        if b is not None and not self._plain_rows and not isinstance(b.valid, int):
            self._run_block()
            self._block, self._skip, self._plain_rows = None, 0, [(token, hidden)]
            return
        self._plain_rows.append((token, hidden))
        kept = (b.valid - self._skip) if b is not None else 0
        over = kept + len(self._plain_rows) - (self.catch_up_window + 1)  # owed rows beyond the window
        if over > 0:
            self.catch_up_dropped += over
            from_block = min(over, kept)
            self._skip += from_block
            del self._plain_rows[:over - from_block]

    def owed_rows(self) -> int:
        """Catch-up rows the head is owed (host-counted; a drafting round's block counts its width)."""
        b = self._block
        if b is None and not self._plain_rows:
            return len(self.owed_tokens)
        if self._plain_rows or isinstance(b.valid, int):
            return (b.valid - self._skip if b is not None else 0) + len(self._plain_rows) - 1
        return int(b.tokens.shape[0]) - 1

    def stats(self) -> dict:
        return {"catch_up_rows_dropped": self.catch_up_dropped}
