"""Attention KV caches: preallocated buffers with a write offset, so rollback is moving the offset.

Device-resident rounds (speculative/decoder.py) keep the lengths on the device: a KV cache's
`offset` is then an MLX scalar the host has not read, `bound` a host upper bound of it (what
capacity is reserved for). Compiled steps write into a tail (`KVCache`'s docstring says why).
"""
from __future__ import annotations

import mlx.core as mx


class KVCache:
    """Keys/values [1, n_kv, capacity, head_dim], valid up to `offset`. Capacity grows in large
    steps (at least `step` positions, doubling up to +`max_growth`), so a compiled step, whose graph
    is specialised to the capacity, is retraced rarely.

    With a tail (`tail` > 0 positions, for compiled steps): MLX writes an array in place only when
    nothing else holds it, and while a decode step is in flight on the GPU it holds the buffers it
    reads, so a pipelined step that wrote its new keys into the whole-context buffer copied that
    buffer (measured on an H100: ~2x the cache allocated per step, +2.7 ms a step at 32k). A step
    writes into the tail instead, `tail` positions [1, n_kv, tail, head_dim] holding positions
    `base` .. `base` + tail; the main buffer holds 0 .. `base` and is written only when the tail
    fills (`rebase`: once per ~tail steps) or another path needs one buffer (`settle`). `base` never
    passes a position a rollback may return to: it moves only to a `floor` the caller vouches for."""

    max_growth = 8192

    def __init__(self, n_kv: int, head_dim: int, step: int = 256, dtype=mx.float32, tail: int = 0):
        self.n_kv, self.head_dim, self.step, self.dtype = n_kv, head_dim, step, dtype
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset: int | mx.array = 0  # an MLX scalar during device-resident rounds
        self.bound: int | None = None  # then: a host upper bound of the offset
        self.tail = tail
        self.tail_keys: mx.array | None = None
        self.tail_values: mx.array | None = None
        self.base: int | None = None  # positions >= base are in the tail; None: all in the main buffer

    @property
    def limit(self) -> int:
        """The offset when the host knows it, else its upper bound."""
        return self.offset if self.bound is None else self.bound

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[2])

    def reserve(self, needed: int) -> None:
        """Makes room for `needed` positions."""
        cap = self.capacity
        if needed <= cap:
            return
        new_cap = max(needed, cap + min(cap, self.max_growth))
        new_cap = ((new_cap + self.step - 1) // self.step) * self.step
        shape = (1, self.n_kv, new_cap, self.head_dim)
        k = mx.zeros(shape, self.dtype)
        v = mx.zeros(shape, self.dtype)
        # a device offset is unknown here: the whole old buffer is copied (stale rows stay masked)
        n = cap if self.bound is not None else min(self.offset, cap)  # with a tail, the buffer may end before the offset
        if self.keys is not None and n:
            k[:, :, :n] = self.keys[:, :, :n]
            v[:, :, :n] = self.values[:, :, :n]
        self.keys, self.values = k, v

    def rebase(self, floor: int, n_tokens: int) -> bool:
        """Before a step of `n_tokens` that writes into the tail: makes room for them, moving the
        tail's start to at most `floor` (no rollback returns below it). False when they cannot fit
        (the tail is settled into the main buffer; the step writes there)."""
        if not self.tail:
            return False
        end = self.limit + n_tokens
        if self.base is not None and end <= self.base + self.tail:
            return True
        if self.base is not None and floor < self.base:
            floor = self.base
        if end - floor > self.tail or floor > self.limit:
            self.settle()
            return False
        self.reserve(max(floor, 1))
        if self.base is None:  # positions floor .. limit move from the main buffer into a new tail
            shape = (1, self.n_kv, self.tail, self.head_dim)
            tk, tv = mx.zeros(shape, self.dtype), mx.zeros(shape, self.dtype)
            if self.limit > floor:
                tk[:, :, :self.limit - floor] = self.keys[:, :, floor:self.limit]
                tv[:, :, :self.limit - floor] = self.values[:, :, floor:self.limit]
        else:  # positions base .. floor move into the main buffer, the rest to the tail's start
            n = floor - self.base
            self.keys[:, :, self.base:floor] = self.tail_keys[:, :, :n]
            self.values[:, :, self.base:floor] = self.tail_values[:, :, :n]
            pad = mx.zeros((1, self.n_kv, n, self.head_dim), self.dtype)
            tk = mx.concatenate([self.tail_keys[:, :, n:], pad], axis=2)
            tv = mx.concatenate([self.tail_values[:, :, n:], pad], axis=2)
        self.tail_keys, self.tail_values, self.base = tk, tv, floor
        return True

    def settle(self) -> None:
        """The tail's positions into the main buffer (which then holds everything)."""
        if self.base is None:
            return
        n = min(self.tail, self.limit - self.base)
        if n > 0:
            self.reserve(self.base + n)
            self.keys[:, :, self.base:self.base + n] = self.tail_keys[:, :, :n]
            self.values[:, :, self.base:self.base + n] = self.tail_values[:, :, :n]
        self.tail_keys = self.tail_values = self.base = None

    def update(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, str | None]:
        """Appends k, v [1, n_kv, S, D] at `offset`; returns all valid keys and values and the
        attention mask the new queries need."""
        self.settle()
        s = int(k.shape[2])
        end = self.offset + s
        self.reserve(end)
        self.keys[:, :, self.offset:end] = k.astype(self.dtype)
        self.values[:, :, self.offset:end] = v.astype(self.dtype)
        self.offset = end
        return self.keys[:, :, :end], self.values[:, :, :end], "causal" if s > 1 else None

    def attention_buffers(self):
        """(keys, values, tail) a fused attention reads; outside a compiled step the tail is
        settled, so None."""
        return self.keys, self.values, None

    def view(self, offset: int) -> "KVCache":
        """A new cache holding this one's first `offset` positions without a copy of the data: new
        array objects over the same buffers. Not the same objects: `update` writes with
        `keys[...] = k`, which changes the array object in place, so a shared object would take the
        other cache's writes. Over a shared buffer MLX copies on the first write instead (a buffer
        another array holds is never written in place). This cache is not changed (its owner may be
        decoding in another thread): positions in its tail are copied into the view's buffer."""
        c = KVCache(self.n_kv, self.head_dim, self.step, self.dtype, self.tail)
        c.offset = int(offset)
        if self.keys is not None:
            c.keys, c.values = mx.array(self.keys), mx.array(self.values)
            if self.base is not None and offset > self.base:
                c.reserve(offset)
                n = offset - self.base
                c.keys[:, :, self.base:offset] = self.tail_keys[:, :, :n]
                c.values[:, :, self.base:offset] = self.tail_values[:, :, :n]
        c.offset = int(offset)
        return c

    def to_device(self) -> None:
        """Device-resident rounds follow: the offset may become an unread MLX scalar."""
        if self.bound is None:
            self.bound = int(self.offset)

    def to_host(self, offset: int) -> None:
        """Back to a host offset (`offset`: the device one, read)."""
        self.offset, self.bound = int(offset), None

    def truncate(self, length: int) -> None:
        """Forgets everything after the first `length` positions."""
        if self.base is not None and length < self.base:  # back before the tail: one buffer again
            self.settle()
        if self.bound is not None:  # a device offset: checked against its bound, then the host's again
            if not 0 <= length <= self.bound:
                raise ValueError(f"cannot truncate a cache of at most {self.bound} positions to {length}")
            self.offset, self.bound = length, None
            return
        if not 0 <= length <= self.offset:
            raise ValueError(f"cannot truncate a cache of {self.offset} positions to {length}")
        self.offset = length

    def state(self) -> tuple[mx.array, mx.array]:
        n = int(self.offset.item()) if isinstance(self.offset, mx.array) else self.offset  # a host read
        self.settle()
        return self.keys[:, :, :n], self.values[:, :, :n]

    def arrays(self) -> list[mx.array]:
        """The buffers that hold the cache (for `mx.eval`)."""
        return [a for a in (self.keys, self.values, self.tail_keys, self.tail_values) if a is not None]

    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays()))


def shift_offsets(caches, delta: int | mx.array) -> None:
    """Moves every KV cache's offset by `delta` (an int, or a device scalar). Layers whose offsets
    are equal keep one shared value, so a device offset costs one operation per move, not one per
    layer (and a later move, or `step._offsets`, sees a single array)."""
    moved: dict = {}
    for c in caches:
        if isinstance(c, KVCache):
            key = id(c.offset) if isinstance(c.offset, mx.array) else ("host", c.offset)
            if key not in moved:
                moved[key] = c.offset + delta
            c.offset = moved[key]
