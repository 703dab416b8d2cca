"""The model's own MTP head as a drafter (llama.cpp's draft-mtp), in the device round's stages.

  draft    the head as a chain: step 1 reads (last token, trunk hidden of the previous position);
           step i > 1 reads (draft i-1, the head's own shared_head_norm output). The block of rows
           the head is owed (a drafting round's emitted tokens, or plain rounds' rows) runs in the
           same forward as step 1. The KV rows of steps 2..k are dropped (their inputs were its own
           guesses); step 1's row is exact and stays.
  commit   a drafting round's emitted tokens, with the verify's hidden states, are the next block
           (its valid length a device count: nothing is read on the host).
  accept_plain  a plain round's row joins the block (the newest `catch_up_window` are kept).
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
from ..model.qwen35 import Qwen35Model
from ..model.step import Pass
from .drafter import DraftContext, Drafter
from ..generation.round import no_stage


def draft_chain(model, h: mx.array, k: int, p_min: "float | mx.array", pick: Callable, advance: Callable,
                stage: Callable = no_stage) -> tuple[mx.array, mx.array | None, mx.array | None]:
    """The MTP head's k chained draft steps over B rows, from its last output `h` [B, 1, H]: step 1
    reads it, step i > 1 the head's step on draft i-1 (`advance(tokens [B], h) -> h`). `pick(logits
    [B, V], drafts so far) -> (tokens [B] int32, the distributions drawn from [B, V] or None, the
    logits as the rule scored them, whether each draft counts [B] or None)`: each row's rule. A
    draft counts while the scored logits' top-10 softmax (temperature 1) reaches `p_min` (llama.cpp's
    rule; one for every row, or each row's [B]). Returns (drafts [B, k], distributions [B, k, V] or
    None, counting [B, k] or None); `stage` wraps each step (the profiler's)."""
    drafts, qs, confident = [], [], []
    for i in range(k):
        with stage("draft") as out:
            d, q, scored, ok = pick(model.draft_logits(h[:, 0]), drafts)
            if q is not None:
                qs.append(q)
            if isinstance(p_min, mx.array) or p_min > 0.0:
                top = mx.max(mx.softmax(mx.topk(scored, min(10, scored.shape[-1]), axis=-1), axis=-1), axis=-1) >= p_min
                ok = top if ok is None else ok & top
            if ok is not None:
                confident.append(ok)
            drafts.append(d)
            if i + 1 < k:
                h = advance(d, h)
            out.extend([d, h])
    return (mx.stack(drafts, axis=1), mx.stack(qs, axis=1) if qs else None,
            mx.stack(confident, axis=1) if confident else None)


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


class HeadReader:
    """The MTP head reading a prompt beside the trunk (`generation.prompt_read.PromptDrafter`): the
    head sees prompt row t as (token t, the trunk's hidden state at t-1), zeros before the first.
    Holds its cache and `h_last`, the trunk state its next row reads. A sequence alone
    (`MTPDrafter`) and a sequence joining a batch (`batching.mtp`) read their prompts with it."""

    name = "draft-mtp"

    def __init__(self, model: Qwen35Model):
        self.model = model
        self.cache = model.mtp.make_cache()
        self.h_last = mx.zeros((1, 1, model.cfg.hidden_size))

    def start(self, prompt: list[int], start: int, state: HeadPrefix | None) -> None:
        if state is None:
            return
        cache, rows, h_last = state
        if rows != start:
            raise MTPEngineError(f"prompt cache: the head kept {rows} rows for a {start}-token prefix",
                                 field="prompt_cache")
        self.cache, self.h_last = cache, h_last
        self.cache.truncate(rows)

    def read(self, ids: list[int], hidden: mx.array) -> None:
        h_prev = mx.concatenate([self.h_last, hidden[:, :-1]], axis=1) if len(ids) > 1 else self.h_last
        self.model.mtp(self.model.embed_tokens(mx.array([ids])), h_prev, self.cache, Pass.PREFILL)
        self.h_last = hidden[:, -1:]

    def prefix_state(self) -> HeadPrefix:
        # the trunk hidden state is copied: a slice would keep the whole chunk's hidden states
        return HeadPrefix(self.cache, self.cache.offset, mx.array(np.array(self.h_last)))

    def prompt_arrays(self) -> list[mx.array]:
        return [self.h_last, *self.cache.arrays()]


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
    # owed rows kept across plain rounds (`accept_plain`): every plain round owes the head one row,
    # and where a product of M rows costs M single rows (MLX's CPU backend) catching up a long plain
    # stretch cost c steps per plain token (auto fell to 0.86x plain from its probes' catch-ups).
    # Older rows are dropped: the head's attention then lacks them, which can only lower the next
    # drafts' acceptance, never change the output (verify decides). With the last token's row a
    # block is at most 8 rows, what the few-row product kernels take.
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
        self.catch_up_dropped = 0  # owed rows skipped after long plain stretches (`accept_plain`)
        self._block: HeadBlock | None = None  # device-resident rounds' rows to run (to_device), see `block`
        self._skip = 0  # leading rows of a host-counted `_block` dropped from the catch-up window
        self._plain_rows: list[tuple[mx.array, mx.array]] = []  # plain rounds' rows, joined on demand
        self._prompt: HeadReader | None = None  # the head reading the prompt (`start`)

    # ---- the prompt (`generation.prompt_read`): the head reads it beside the trunk ---------------
    def start(self, prompt: list[int], start: int, state: HeadPrefix | None) -> None:
        self._prompt = HeadReader(self.model)
        self._prompt.start(prompt, start, state)
        self.cache, self.h_last, self.last_token = self._prompt.cache, self._prompt.h_last, prompt[-1]

    def read(self, ids: list[int], hidden: mx.array) -> None:
        self._prompt.read(ids, hidden)
        self.h_last = self._prompt.h_last

    def prefix_state(self) -> HeadPrefix:
        return self._prompt.prefix_state()

    def prompt_arrays(self) -> list[mx.array]:
        return self._prompt.prompt_arrays()

    def _pick(self, logits: mx.array, qs: list) -> mx.array:
        """The draft token on the device: argmax, or a draw from the sampler's distribution (kept
        in `qs`: lossless acceptance needs it)."""
        cfg = self.ctx.sampler.cfg
        if cfg.greedy:
            return mx.argmax(logits, axis=-1)
        qi = distribution(logits, cfg)
        qs.append(qi)
        return mx.random.categorical(mx.log(qi), key=self.ctx.sampler.draws.next())

    # ---- the device round's stages (speculative/round.py): no host reads -----------------------------
    def to_device(self) -> None:
        """After the prompt: the last prompt token's row is the first `HeadBlock`. The trunk state it
        reads is copied, and the prompt's reader let go: a slice would hold the prompt's last chunk
        of hidden states for the whole run (64 MB for a 4096-token chunk at 9B)."""
        self.h_last, self._prompt = mx.array(np.array(self.h_last)), None
        self.cache.to_device()
        self._block = HeadBlock(mx.array([self.last_token], dtype=mx.int32), self.h_last, 1)
        self._skip, self._plain_rows = 0, []

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

    def draft(self, k: int, p_min: float = 0.0) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """k drafts as device values, as a round's one row: (tokens [1, k] int32, their
        distributions [1, k, V] when sampling, whether each passed p-min [1, k] when p-min is set).
        Every step runs; p-min only says which drafts count (the round keeps the shape k gives it).
        A precise profile times the head's block (its owed rows and the last token's) as catch-up
        and each step as a draft, each evaluated at its end."""
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
        return tokens, qs, confident

    def _chain(self, h: mx.array, k: int, p_min: float,
               stage: Callable = no_stage) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """The k chained head steps from the block's last output `h` (`draft_chain`, the round's one
        row: each step penalised, masked by a grammar, drawn by the sampler)."""
        model, sampler, cache = self.model, self.ctx.sampler, self.cache
        kept, bound = cache.offset, cache.bound
        # a grammar masks each step by the drafts before it (read on the host: such a round is not
        # queued ahead anyway); after a draft that ends the text the rest do not count
        grammar, host = sampler.grammar, []

        def pick(logits: mx.array, drafts: list[mx.array]):
            nonlocal host
            logits = sampler.penalize(logits[0], mx.concatenate(drafts) if drafts else None, len(drafts))
            allowed = grammar.allowed_after(host) if grammar is not None and host is not None else None
            if allowed is not None:
                logits = masked(logits, allowed)
            qs: list = []
            d = self._pick(logits, qs).astype(mx.int32).reshape(1)
            ok = None
            if grammar is not None:
                ok = mx.array([allowed is not None])
                host = host + [int(d.item())] if allowed is not None else None
            return d, qs[0][None] if qs else None, logits[None], ok

        def advance(d: mx.array, h: mx.array) -> mx.array:
            return model.mtp(model.embed_tokens(d.reshape(1, 1)), h, cache, Pass.ROUND_STEP)

        out = draft_chain(model, h, k, p_min, pick, advance, stage)
        cache.offset, cache.bound = kept, bound  # rows of steps 2..k were the head's own guesses
        return out

    def commit(self, emitted: mx.array, n: mx.array, hidden: mx.array) -> None:
        """A drafting round emitted `emitted[0, :n+1]` (the round's one row: accepted drafts, then
        the trunk's token): they, with the verify's hidden states, are the head's next block."""
        self._block = HeadBlock(emitted[0], hidden, (n + 1).reshape(()))
        self._skip, self._plain_rows = 0, []

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
            return 0
        if self._plain_rows or isinstance(b.valid, int):
            return (b.valid - self._skip if b is not None else 0) + len(self._plain_rows) - 1
        return int(b.tokens.shape[0]) - 1

    def stats(self) -> dict:
        return {"catch_up_rows_dropped": self.catch_up_dropped}
