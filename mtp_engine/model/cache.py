"""Caches that a speculative round can roll back without re-running the model.

Attention KV caches are preallocated buffers with a write offset, so rollback is moving the offset.
Gated-delta-net caches keep, during a captured forward, the conv input window and the recurrent
state after every position, so rollback picks the state after the last accepted token.

Device-resident rounds (speculative/resident.py) keep the lengths on the device: a KV cache's
`offset` is then an MLX scalar the host has not read, `bound` a host upper bound of it (what
capacity is reserved for), and rollback keeps a device count of tokens (`rollback_lazy`), so the
next round can be queued before the host knows how many drafts were accepted.
"""
from __future__ import annotations

import mlx.core as mx

from .delta_rule import state_after, state_after_masked


class KVCache:
    """Keys/values [1, n_kv, capacity, head_dim], valid up to `offset`. Capacity grows in large
    steps (at least `step` positions, doubling up to +`max_growth`), so a compiled step, whose graph
    is specialised to the capacity, is retraced rarely."""

    max_growth = 8192

    def __init__(self, n_kv: int, head_dim: int, step: int = 256, dtype=mx.float32):
        self.n_kv, self.head_dim, self.step, self.dtype = n_kv, head_dim, step, dtype
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset: int | mx.array = 0  # an MLX scalar during device-resident rounds
        self.bound: int | None = None  # then: a host upper bound of the offset

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
        n = cap if self.bound is not None else self.offset
        if self.keys is not None and n:
            k[:, :, :n] = self.keys[:, :, :n]
            v[:, :, :n] = self.values[:, :, :n]
        self.keys, self.values = k, v

    def update(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, str | None]:
        """Appends k, v [1, n_kv, S, D] at `offset`; returns all valid keys and values and the
        attention mask the new queries need."""
        s = int(k.shape[2])
        end = self.offset + s
        self.reserve(end)
        self.keys[:, :, self.offset:end] = k
        self.values[:, :, self.offset:end] = v
        self.offset = end
        return self.keys[:, :, :end], self.values[:, :, :end], "causal" if s > 1 else None

    def view(self, offset: int) -> "KVCache":
        """A new cache holding this one's first `offset` positions without a copy of the data: new
        array objects over the same buffers. Not the same objects: `update` writes with
        `keys[...] = k`, which changes the array object in place, so a shared object would take the
        other cache's writes. Over a shared buffer MLX copies on the first write instead (a buffer
        another array holds is never written in place)."""
        c = KVCache(self.n_kv, self.head_dim, self.step, self.dtype)
        if self.keys is not None:
            c.keys, c.values = mx.array(self.keys), mx.array(self.values)
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
        return self.keys[:, :, :n], self.values[:, :, :n]

    def nbytes(self) -> int:
        return 0 if self.keys is None else int(self.keys.nbytes + self.values.nbytes)


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


class RecurrentCache:
    """Conv window [1, kernel-1, channels] and recurrent state [1, Vh, Kd, Vd] of one gated-delta-net
    layer. After a forward with `capture=True` over S tokens, `rollback(n)` sets both to the exact
    state after the first n of those tokens, rebuilt from the pass's keys, delta vectors and decays
    (a few KB per token) rather than from S stored states (MBs per token at real size)."""

    def __init__(self, kernel: int, channels: int, value_heads: int, key_dim: int, value_dim: int,
                 dtype=mx.float32):
        self.conv = mx.zeros((1, kernel - 1, channels), dtype)
        self.state = mx.zeros((1, value_heads, key_dim, value_dim), dtype)
        self.kernel = kernel
        self.capturing = False
        self._captured: tuple[mx.array, ...] | None = None  # (conv0, x, state0, k, u, g) of the last pass

    def begin_capture(self) -> None:
        self.capturing = True
        self._captured = None

    def capture(self, conv0: mx.array, x: mx.array, state0: mx.array, k: mx.array, u: mx.array,
                g: mx.array) -> None:
        """Keeps what rollback needs from a pass: the conv state before it and the pass's conv
        inputs x [1, S, C], the recurrent state before it, and per token its keys k [1, S, Vh, Kd],
        delta vectors u [1, S, Vh, Vd] and log decays g [1, S, Vh]."""
        if self.capturing:
            self._captured = (conv0, x, state0, k, u, g)

    def rollback(self, n_keep: int) -> None:
        """Keeps the first `n_keep` tokens of the last captured forward."""
        if self._captured is None:
            raise RuntimeError("rollback without a captured forward")
        conv0, x, state0, k, u, g = self._captured
        s = int(k.shape[1])
        if not 0 <= n_keep <= s:
            raise ValueError(f"cannot keep {n_keep} of {s} captured tokens")
        if n_keep < s:
            # the conv window is built only when a rollback needs it, not on every pass
            window = mx.concatenate([conv0, x], axis=1)
            self.conv = window[:, n_keep:n_keep + self.kernel - 1]
            self.state = state_after(state0, k, u, g, n_keep)
        self.release()

    def release(self) -> None:
        self.capturing = False
        self._captured = None

    def nbytes(self) -> int:
        return int(self.conv.nbytes + self.state.nbytes)


def _rollback_graph(keep, conv, state, conv0, x, state0, k, u, g):
    """Row b keeps the first keep[b] (>= 1, a device count per row) of a captured pass's S tokens:
    the conv window that ends at its last kept token (by index) and the state by a masked
    `state_after`; where a row kept all S, what the pass itself left (as the host rollback keeps
    it)."""
    s, width = k.shape[1], conv.shape[1]
    window = mx.concatenate([conv0, x], axis=1)  # [B, K-1+S, C]
    idx = (keep[:, None] + mx.arange(width)[None, :])[:, :, None]
    conv_n = mx.take_along_axis(window, mx.broadcast_to(idx, (idx.shape[0], width, window.shape[2])), axis=1)
    all_kept = keep >= s
    return (mx.where(all_kept[:, None, None], conv, conv_n),
            mx.where(all_kept[:, None, None, None], state, state_after_masked(state0, k, u, g, keep)))


@mx.compile
def _rollback_layers(keep, *flat):
    """`_rollback_graph` for every gated-delta-net layer (8 arrays each, B rows) at once: the
    layers are stacked on the row axis, so a round's rollback is ~20 graph nodes instead of ~10
    per layer (on MLX's CUDA backend each node costs the host ~8-10 us: 24 layers cost ~2.4 ms)."""
    n, b = len(flat) // 8, keep.shape[0]
    cols = [mx.concatenate(flat[j::8], axis=0) if n > 1 else flat[j] for j in range(8)]
    conv, state = _rollback_graph(mx.tile(keep, n) if n > 1 else keep, *cols)
    out = []
    for i in range(n):
        out += [conv[i * b:(i + 1) * b], state[i * b:(i + 1) * b]]
    return out


def roll_back_recurrent(layers: list[RecurrentCache], keep: mx.array) -> None:
    """After a captured pass, each layer's row b keeps its first keep[b] tokens (keep: [B] int32
    on the device), all layers in one compiled graph; their captures are released."""
    if not layers:
        return
    out = _rollback_layers(keep, *[a for c in layers for a in (c.conv, c.state, *c._captured)])
    for i, c in enumerate(layers):
        c.conv, c.state = out[2 * i], out[2 * i + 1]
        c.release()


class TrunkCache:
    """Per-layer caches of the trunk and the number of tokens they hold."""

    def __init__(self, layers: list[KVCache | RecurrentCache]):
        self.layers = layers
        self.offset = 0
        self._captured = 0

    def begin_capture(self, n_tokens: int) -> None:
        """Before a forward of `n_tokens` whose tokens a later `rollback` may drop."""
        for c in self.layers:
            if isinstance(c, RecurrentCache):
                c.begin_capture()
        self._captured = n_tokens

    def rollback(self, n_keep: int) -> None:
        """After a captured forward of S tokens, keeps its first `n_keep` tokens."""
        drop = self._captured - n_keep
        if drop < 0:
            raise ValueError(f"cannot keep {n_keep} of {self._captured} captured tokens")
        for c in self.layers:
            if isinstance(c, KVCache):
                c.truncate(c.offset - drop)
            else:
                c.rollback(n_keep)
        self.offset -= drop
        self._captured = 0

    def rollback_lazy(self, n_keep: mx.array) -> None:
        """`rollback` with n_keep a device scalar: KV offsets become device values (one array
        shared by the layers), recurrent states are rebuilt on the device; `offset` (the host's)
        is left to the caller, who learns n_keep later."""
        recurrent = [c for c in self.layers if isinstance(c, RecurrentCache)]
        if any(c._captured is None for c in recurrent):
            raise RuntimeError("rollback without a captured forward")
        self.kv_to_device()
        shift_offsets(self.layers, n_keep - self._captured)
        roll_back_recurrent(recurrent, mx.reshape(n_keep, (1,)))
        self._captured = 0

    def kv_to_device(self) -> None:
        for c in self.layers:
            if isinstance(c, KVCache):
                c.to_device()

    def set_bound(self, bound: int) -> None:
        """A host upper bound of every device KV offset (tightened as the host reads lengths)."""
        for c in self.layers:
            if isinstance(c, KVCache) and c.bound is not None:
                c.bound = bound

    def to_host(self) -> None:
        """Device offsets read back (one sync), e.g. at the end of a generation."""
        for c in self.layers:
            if isinstance(c, KVCache) and c.bound is not None:
                c.to_host(int(c.offset.item()) if isinstance(c.offset, mx.array) else c.offset)

    def snapshot(self) -> list:
        """References to the current state (MLX arrays are values: later writes make new arrays,
        except KV buffers, whose valid length is their offset)."""
        return [c.offset if isinstance(c, KVCache) else (c.conv, c.state) for c in self.layers] + [self.offset]

    def fork(self, snap: list) -> "TrunkCache | None":
        """A new cache in the state of `snapshot()` `snap`, sharing buffers with this one (see
        `KVCache.view`): another generation may go on from it while this one is still written.
        None while a forward holds the buffers (mid-step in another thread)."""
        layers: list[KVCache | RecurrentCache] = []
        for c, s in zip(self.layers, snap[:-1]):
            if isinstance(c, KVCache):
                if c.keys is None and s:
                    return None
                layers.append(c.view(s))
            else:
                r = RecurrentCache.__new__(RecurrentCache)
                r.__dict__.update(c.__dict__)
                r.conv, r.state = s
                r.capturing, r._captured = False, None
                layers.append(r)
        fork = TrunkCache(layers)
        fork.offset = snap[-1]
        return fork

    def restore(self, snap: list) -> None:
        """Returns to a `snapshot()`; the re-decoding rollback llama.cpp falls back to."""
        for c, s in zip(self.layers, snap[:-1]):
            if isinstance(c, KVCache):
                c.truncate(s)
            else:
                c.conv, c.state = s
                c.release()
        self.offset = snap[-1]
        self._captured = 0

    def arrays(self) -> list[mx.array]:
        """Every live array (for mx.eval after a step)."""
        out = []
        for c in self.layers:
            if isinstance(c, KVCache):
                if c.keys is not None:
                    out += [c.keys, c.values]
            else:
                out += [c.conv, c.state]
        return out

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)
