"""Caches of several sequences decoded together, each at its own length.

A batch holds B sequences in one tensor per layer: attention keys/values [B, n_kv, capacity, D]
with a length per row, gated-delta-net conv windows [B, K-1, C] and states [B, Vh, Kd, Vd]. Rows
are never re-padded: a forward's new positions are written at each row's own length (a scatter),
the attention mask lets row b's queries see its first `length[b]` positions plus the new ones, and
rope rotates each row by its own offset. The recurrent layers need nothing per row: their state
is the sequence's whole past.

A sequence joins with the caches of its own prefill (`add`: batch-1 caches appended as a row) and
leaves by row (`keep`), so one joining or leaving costs a copy of the buffers, never a change to
the other rows' positions. (mlx-lm's BatchKVCache pads on the left and shares one offset; hybrid
models then need the padding masked in every recurrent state, which went wrong there once.)

Compiled steps write into a tail, as a sequence's `KVCache` does (its docstring says why: a
pipelined step that wrote the whole-context buffer copied it whole, a batch of one decoded at 0.76x
of alone at 32k positions on an H100): row b's positions base[b] .. base[b] + tail sit in
[B, n_kv, tail, D] buffers, each row with its own `base` (rows sit at different lengths). A base
moves only to a row's `floor`, a length the host has read (no rollback returns below it).
"""
from __future__ import annotations

import mlx.core as mx

from .cache import RecurrentCache, TrunkCache, roll_back_recurrent
from .kv_cache import KVCache


class BatchKVCache:
    """One attention layer's keys and values for the batch; `lengths` is the owner's (one array
    shared by every layer, advanced by `BatchCache.advance` after a forward)."""

    step = 256

    def __init__(self, owner: "BatchCache", n_kv: int, head_dim: int, dtype=mx.float32):
        self.owner, self.n_kv, self.head_dim, self.dtype = owner, n_kv, head_dim, dtype
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.tail_keys: mx.array | None = None  # [B, n_kv, tail, D] while the owner has bases
        self.tail_values: mx.array | None = None

    @property
    def base(self) -> mx.array | None:
        """Each row's first position in the tail [B] (None: no tail, the main buffers hold all)."""
        return self.owner.base_array

    @property
    def offset(self) -> mx.array | int:
        """Each row's length before this forward: rope's per-row offset (prompts read together
        from one length: that length, as a prompt alone gives it)."""
        if self.owner.joint_start is not None:
            return self.owner.joint_start
        return self.owner.lengths

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def reserve(self, needed: int) -> None:
        """Room for `needed` positions in every row (in steps, so growth is rare)."""
        cap = self.capacity
        if self.keys is not None and needed <= cap:
            return
        new_cap = -(-needed // self.step) * self.step
        rows = 1 if self.keys is None else int(self.keys.shape[0])
        shape = (rows, self.n_kv, new_cap, self.head_dim)
        k, v = mx.zeros(shape, self.dtype), mx.zeros(shape, self.dtype)
        if self.keys is not None and cap:
            k[:, :, :cap] = self.keys
            v[:, :, :cap] = self.values
        self.keys, self.values = k, v

    def attention_buffers(self):
        """(keys, values, tail) a fused attention reads: outside a compiled step the tail is
        settled, so None."""
        return self.keys, self.values, None

    def _window(self, base: mx.array, n: int) -> mx.array:
        """Indices of positions base[b] .. base[b] + n of every row, for the buffers' axis 2."""
        rows = int(self.keys.shape[0])
        idx = base[:, None, None, None] + mx.arange(n)[None, None, :, None]
        return mx.broadcast_to(idx, (rows, self.n_kv, n, self.head_dim)).astype(mx.int32)

    def open_tail(self, base: mx.array, tail: int) -> None:
        """Positions base[b] .. base[b] + tail of each row move into tail buffers (the main
        buffers have room for them: `BatchCache.rebase` reserved it)."""
        idx = self._window(base, tail)
        self.tail_keys = mx.take_along_axis(self.keys, idx, axis=2)
        self.tail_values = mx.take_along_axis(self.values, idx, axis=2)

    def settle(self, base: mx.array) -> None:
        """The tail's positions back into the main buffers (past a row's length they are stale,
        masked as any position there is)."""
        idx = self._window(base, int(self.tail_keys.shape[2]))
        self.keys = mx.put_along_axis(self.keys, idx, self.tail_keys, axis=2)
        self.values = mx.put_along_axis(self.values, idx, self.tail_values, axis=2)
        self.tail_keys = self.tail_values = None

    def update(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """Writes k, v [B, n_kv, S, D] at each row's length; returns the keys and values up to the
        longest row's new end and the boolean mask [B, 1, S, L] of what each query may see."""
        self.owner.settle()
        s = int(k.shape[2])
        end = max(self.owner.host_lengths) + s
        self.reserve(end)
        pos = self.owner.lengths[:, None, None, None] + mx.arange(s)[None, None, :, None]
        idx = mx.broadcast_to(pos, k.shape).astype(mx.int32)
        self.keys = mx.put_along_axis(self.keys, idx, k.astype(self.dtype), axis=2)
        self.values = mx.put_along_axis(self.values, idx, v.astype(self.dtype), axis=2)
        if s > 1 and self.owner.joint_start is not None:
            # prompts read together from one length (`BatchCache.begin_rows`): each row's queries
            # see what a sequence alone sees, by the mask it reads with (rows past a prompt's
            # length are stale, rewritten by its next tokens)
            return self.keys[:, :, :end], self.values[:, :, :end], "causal"
        # query j of row b sits at position lengths[b] + j and sees every position up to it
        q_pos = self.owner.lengths[:, None] + mx.arange(s)[None, :]  # [B, S]
        mask = mx.arange(end)[None, None, :] <= q_pos[:, :, None]  # [B, S, L]
        return self.keys[:, :, :end], self.values[:, :, :end], mask[:, None]

    def add(self, row: KVCache) -> None:
        """Appends a batch-1 cache as the last row."""
        row.settle()
        n = int(row.offset)
        cap = max(self.capacity, -(-max(n, 1) // self.step) * self.step)
        if self.keys is not None:
            self.reserve(cap)
        k = mx.zeros((1, self.n_kv, cap, self.head_dim), self.dtype)
        v = mx.zeros_like(k)
        if n:
            k[:, :, :n] = row.keys[:, :, :n].astype(self.dtype)
            v[:, :, :n] = row.values[:, :, :n].astype(self.dtype)
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = mx.concatenate([self.keys, k], axis=0)
            self.values = mx.concatenate([self.values, v], axis=0)

    def keep(self, rows: mx.array) -> None:
        if self.keys is not None:
            self.keys, self.values = self.keys[rows], self.values[rows]

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values, self.tail_keys, self.tail_values) if a is not None]


class BatchRecurrentCache(RecurrentCache):
    """A gated-delta-net layer's conv windows and states, one row per sequence (the layer code is
    the batch-1 cache's: its arrays simply have B rows)."""

    def __init__(self, first: RecurrentCache):
        self._reset(first.kernel, first.conv, first.state)

    def add(self, row: RecurrentCache) -> None:
        self.set(mx.concatenate([self.conv, row.conv], axis=0), mx.concatenate([self.state, row.state], axis=0))

    def keep(self, rows: mx.array) -> None:
        self.set(self.conv[rows], self.state[rows])

class BatchCache:
    """The trunk's caches for a batch of sequences, each with its own length: `lengths` [B] on the
    device (exact), `host_lengths` the host's upper bound of each (exact while no round whose
    accepted length the host has not read is queued: `bound_lengths`)."""

    def __init__(self, model, tail: int = 0) -> None:
        """`tail`: positions of the attention layers' tails for compiled steps (0: none)."""
        self.model = model
        self.layers: list[BatchKVCache | BatchRecurrentCache] = []
        self.host_lengths: list[int] = []
        self.lengths = mx.array([], mx.int32)
        self._captured = 0
        self.tail = tail
        self.floors: list[int] = []  # per row: a length the host has read, no rollback returns below
        self.base: list[int] | None = None  # per row: the first position in the tails (None: no tails)
        self.base_array: mx.array | None = None
        self.valid: list[int] | None = None  # per row: the tokens that count of the next forward (`begin_rows`)

    def __len__(self) -> int:
        return len(self.host_lengths)

    def add(self, trunk: TrunkCache) -> int:
        """Appends a sequence whose batch-1 caches hold its prompt; returns its row."""
        self.settle()
        trunk.to_host()
        self.floors.append(int(trunk.offset))
        self.host_lengths.append(int(trunk.offset))
        self.lengths = mx.concatenate([self.lengths, mx.array([int(trunk.offset)], mx.int32)])
        if not self.layers:
            c = self.model.cfg
            for layer in trunk.layers:
                if isinstance(layer, KVCache):
                    self.layers.append(BatchKVCache(self, c.n_head_kv, c.head_dim, layer.dtype))
                    self.layers[-1].add(layer)
                else:
                    self.layers.append(BatchRecurrentCache(layer))
            return 0
        for mine, row in zip(self.layers, trunk.layers):
            mine.add(row)
        return len(self.host_lengths) - 1

    def keep(self, rows: list[int]) -> None:
        """Keeps only `rows` (in that order): the others' sequences have left."""
        self.settle()
        self.host_lengths = [self.host_lengths[r] for r in rows]
        self.floors = [self.floors[r] for r in rows]
        if not rows:
            self.layers, self.lengths = [], mx.array([], mx.int32)
            return
        idx = mx.array(rows, mx.int32)
        self.lengths = self.lengths[idx]
        for layer in self.layers:
            layer.keep(idx)

    def advance(self, n: int) -> None:
        """Every row took `n` more tokens (after a forward of n tokens per row), or with
        `begin_rows` its own count of them."""
        if self.valid is not None:
            self.host_lengths = [x + v for x, v in zip(self.host_lengths, self.valid)]
            self.lengths = self.lengths + mx.array(self.valid, mx.int32)
            self.valid = None
            for layer in self.layers:
                if isinstance(layer, BatchRecurrentCache):
                    layer.valid = None
            return
        self.host_lengths = [x + n for x in self.host_lengths]
        self.lengths = self.lengths + n

    @property
    def joint_start(self) -> int | None:
        """Prompts read together (`begin_rows`) from one length: that length (None otherwise)."""
        if self.valid is None or len(set(self.host_lengths)) != 1:
            return None
        return self.host_lengths[0]

    def begin_rows(self, valid: list[int]) -> None:
        """Before an uncompiled forward of several tokens per row, row b padded past its
        first valid[b]: prompts of several lengths read in one pass, each row's caches left as its
        own tokens alone leave them (`gdn.mix`'s `valid`; the attention's rows past a prompt's
        length are stale, its length moves by valid[b])."""
        self.valid = list(valid)
        rows = mx.array(self.valid, mx.int32)
        for layer in self.layers:
            if isinstance(layer, BatchRecurrentCache):
                layer.valid = rows

    def row(self, b: int) -> TrunkCache:
        """Row b as a sequence's own caches (slices of the batch's arrays): a prompt read in a batch
        of prompts, handed back to its sequence."""
        self.settle()
        n = self.host_lengths[b]
        trunk = self.model.make_cache()
        for mine, c in zip(self.layers, trunk.layers):
            if isinstance(c, KVCache):
                c.keys, c.values, c.offset = mine.keys[b:b + 1], mine.values[b:b + 1], n
            else:
                c.set(mine.conv[b:b + 1], mine.state[b:b + 1])
        trunk.offset = n
        return trunk

    def bound_lengths(self, bounds: list[int], floors: list[int] | None = None) -> None:
        """The host's bounds of the rows' lengths, tightened from what it has read (the device
        lengths are not touched); `floors`: lengths it has read, which no rollback of a round
        queued since returns below (where the tails may start)."""
        self.host_lengths = [min(x, b) for x, b in zip(self.host_lengths, bounds)]
        if floors is not None:
            self.floors = list(floors)

    def rebase(self, n_tokens: int) -> bool:
        """Before a compiled forward of `n_tokens` per row that writes into the tails: makes room
        for them, moving each row's tail to start at its floor when it must. False when they cannot
        fit (no tails: the forward writes the main buffers)."""
        if not self.tail or not self.layers:
            return False
        ends = [h + n_tokens for h in self.host_lengths]
        if self.base is not None and all(e <= b + self.tail for e, b in zip(ends, self.base)):
            return True
        self.settle()
        base = [min(f, h) for f, h in zip(self.floors, self.host_lengths)]
        if any(e - b > self.tail for e, b in zip(ends, base)):
            return False
        self.base, self.base_array = base, mx.array(base, mx.int32)
        for layer in self.layers:
            if isinstance(layer, BatchKVCache):
                layer.reserve(max(base) + self.tail)
                layer.open_tail(self.base_array, self.tail)
        return True

    def settle(self) -> None:
        """The tails' positions into the main buffers (which then hold everything)."""
        if self.base is None:
            return
        for layer in self.layers:
            if isinstance(layer, BatchKVCache):
                layer.settle(self.base_array)
        self.base = self.base_array = None

    def begin_capture(self, n_tokens: int = 0) -> None:
        """Before a forward of `n_tokens` per row whose tokens a rollback may drop, row by row."""
        self._captured = n_tokens
        for layer in self.layers:
            if isinstance(layer, BatchRecurrentCache):
                layer.begin_capture()

    def rollback_lazy(self, keep: mx.array) -> None:
        """After a captured forward, row b keeps its first keep[b] tokens (keep [B] int32, on the
        device): the device lengths move, the host's stay bounds (`TrunkCache.rollback_lazy` for
        a batch), and recurrent layers start their next forward from the kept states."""
        self.lengths = self.lengths - self._captured + keep
        roll_back_recurrent([c for c in self.layers if isinstance(c, BatchRecurrentCache)], keep)
        self._captured = 0

    def arrays(self) -> list[mx.array]:
        return [a for layer in self.layers for a in layer.arrays()] + [self.lengths]

    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays())
