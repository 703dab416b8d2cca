"""Caches that a speculative round can roll back without re-running the model: the gated-delta-net
layers' (`RecurrentCache`) and a trunk's (`TrunkCache`: its layers' caches and its length). The
attention layers' are in `kv_cache.py`.

Gated-delta-net caches keep, after a captured forward, the conv input window and the recurrent
state after every position, so rollback is choosing the state after the last accepted token (an
index the next forward reads, like vLLM's per-position state slots). Device-resident rounds
(speculative/decoder.py) keep a device count of tokens (`rollback_lazy`), so the next round can
be queued before the host knows how many drafts were accepted.
"""
from __future__ import annotations

import mlx.core as mx

from .kv_cache import KVCache, shift_offsets


class RecurrentCache:
    """Conv window [B, kernel-1, channels] and recurrent state [B, Vh, Kd, Vd] of one gated-delta-net
    layer.

    A forward with `capture=True` over S tokens keeps every state the pass went through (vLLM's
    per-position state slots): `window` [B, K-1+S, C] (the conv state before the pass, then the
    pass's conv inputs) and `states` [B, S+1, Vh, Kd, Vd] (before the pass, then after each token),
    with `kept` the number of the pass's tokens the cache holds (S until a rollback). Rollback only
    moves `kept`, a host int or a device count per row, so it runs no kernel; the next forward
    starts from state `kept` (the fused kernel reads it in place, the MLX path gathers it inside
    its compiled graph), and `conv`/`state` build it when something else asks.

    `capture_width` W (set by a speculative run, `capture_at_width`): a captured pass
    of S <= W tokens leaves W + 1 state slots and a K-1+W-row window, of which the first S + 1
    and K-1+S count. The next forward's inputs then have one shape whatever the last round's draft
    length was, so a compiled step is traced once per width it runs, not once per pair of
    successive draft lengths (each pair was a new trace in the middle of an auto run)."""

    def __init__(self, kernel: int, channels: int, value_heads: int, key_dim: int, value_dim: int,
                 dtype=mx.float32):
        self._reset(kernel, mx.zeros((1, kernel - 1, channels), dtype),
                    mx.zeros((1, value_heads, key_dim, value_dim), dtype))

    @classmethod
    def holding(cls, kernel: int, conv: mx.array, state: mx.array) -> "RecurrentCache":
        """A cache whose conv window and state are these arrays (not copied)."""
        c = cls.__new__(cls)
        c._reset(kernel, conv, state)
        return c

    def _reset(self, kernel: int, conv: mx.array, state: mx.array) -> None:
        self._conv, self._state = conv, state
        self.kernel = kernel
        self.capturing = False
        self.window: mx.array | None = None  # after a captured pass (see the class docstring)
        self.states: mx.array | None = None
        self.kept: int | mx.array = 0
        self._open = False  # a captured pass not yet rolled back
        self._tokens = 0  # tokens of the last captured pass
        self.capture_width: int | None = None
        self.valid: mx.array | None = None  # [B]: rows of a pass that count their first valid[b] tokens (`gdn.mix`)

    @property
    def conv(self) -> mx.array:
        self._settle()
        return self._conv

    @property
    def state(self) -> mx.array:
        self._settle()
        return self._state

    def set(self, conv: mx.array | None, state: mx.array | None) -> None:
        """Replaces the conv window and state (a captured pass's per-position form is dropped)."""
        self.window = self.states = None
        self._conv, self._state, self._open = conv, state, False

    def _settle(self) -> None:
        """From the per-position form to the plain one (picks state `kept`)."""
        if self.window is None:
            return
        self._conv, self._state = pick_state(self.window, self.states, self.kept, self.kernel)
        self.window = self.states = None
        self._open = False

    def sources(self) -> tuple[mx.array, mx.array, mx.array | None]:
        """What a forward starts from: (conv, state, None), or after a device rollback (window,
        states, kept [B]), for the forward to pick state `kept` itself."""
        if self.window is not None and isinstance(self.kept, mx.array):
            return self.window, self.states, self.kept
        return self.conv, self.state, None

    def update(self, conv: mx.array, state: mx.array, tokens: int | None = None) -> None:
        """A forward's result: the new conv window and state, or, when capturing, the pass's
        window and per-position states (see the class docstring) over its `tokens` (default: all
        the slots hold)."""
        if self.capturing:
            self.window, self.states, self._open = conv, state, True
            self.kept = self._tokens = int(state.shape[1]) - 1 if tokens is None else int(tokens)
            self._conv = self._state = None
        else:
            self.set(conv, state)
        self.capturing = False

    def begin_capture(self) -> None:
        # not settled: the captured forward itself starts from slot `kept` (a verify after a
        # rolled-back verify, the usual round, must not gather the states outside its graph)
        self.capturing = True

    def rollback(self, n_keep: int) -> None:
        """Keeps the first `n_keep` tokens of the last captured forward."""
        s = self._captured_tokens()
        if not 0 <= n_keep <= s:
            raise ValueError(f"cannot keep {n_keep} of {s} captured tokens")
        self.kept = int(n_keep)
        self._settle()

    def roll_back_lazy(self, keep: mx.array) -> None:
        """`rollback` with a device count per row, keep [B] int32 (in 0..S, unchecked)."""
        self._captured_tokens()
        self.kept, self._open = keep, False

    def _captured_tokens(self) -> int:
        if not self._open:
            raise RuntimeError("rollback without a captured forward")
        return self._tokens

    def release(self) -> None:
        """Forgets that a captured pass could still be rolled back (it keeps all its tokens)."""
        self.capturing = self._open = False

    def arrays(self) -> list[mx.array]:
        """The arrays that hold the layer's state, in whichever form (for `mx.eval`)."""
        if self.window is not None:
            return [self.window, self.states] + ([self.kept] if isinstance(self.kept, mx.array) else [])
        return [self._conv, self._state]

    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.arrays()))


def pick_state(window: mx.array, states: mx.array, kept: int | mx.array, kernel: int) -> tuple[mx.array, mx.array]:
    """The conv window and state after the first `kept` tokens of a captured pass (window [B, K-1+S,
    C], states [B, S+1, Vh, Kd, Vd]; kept a host int or a device count per row [B])."""
    width = kernel - 1
    if not isinstance(kept, mx.array):
        return window[:, kept:kept + width], states[:, kept]
    b = window.shape[0]
    rows = (kept.reshape(b, 1) + mx.arange(width)[None, :])[:, :, None]
    conv = mx.take_along_axis(window, mx.broadcast_to(rows, (b, width, window.shape[2])), axis=1)
    state = mx.take_along_axis(states, kept.reshape(b, 1, 1, 1, 1), axis=1)[:, 0]
    return conv, state


def capture_at_width(layers: list, width: int | None) -> None:
    """The recurrent layers among `layers` (a trunk's or a batch's) capture passes of up to `width`
    tokens into buffers of that width (`RecurrentCache` says why); None: of their own length."""
    for c in layers:
        if isinstance(c, RecurrentCache):
            c.capture_width = width


def roll_back_recurrent(layers: list[RecurrentCache], keep: mx.array) -> None:
    """After a captured pass, each layer's row b keeps its first keep[b] tokens (keep: [B] int32 on
    the device): no kernel runs, the next forward starts from those states."""
    for c in layers:
        c.roll_back_lazy(keep)


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
        shared by the layers), recurrent layers start their next forward from state n_keep (no
        kernel runs); `offset` (the host's) is left to the caller, who learns n_keep later."""
        recurrent = [c for c in self.layers if isinstance(c, RecurrentCache)]
        if not all(c._open for c in recurrent):
            raise RuntimeError("rollback without a captured forward")
        self.kv_to_device()
        shift_offsets(self.layers, mx.reshape(n_keep, ()) - self._captured)
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
                layers.append(RecurrentCache.holding(c.kernel, *s))
        fork = TrunkCache(layers)
        fork.offset = snap[-1]
        return fork

    def restore(self, snap: list) -> None:
        """Returns to a `snapshot()`; the re-decoding rollback llama.cpp falls back to."""
        for c, s in zip(self.layers, snap[:-1]):
            if isinstance(c, KVCache):
                c.truncate(s)
            else:
                c.set(*s)
                c.release()
        self.offset = snap[-1]
        self._captured = 0

    def arrays(self) -> list[mx.array]:
        """Every live array (for mx.eval after a step)."""
        out = []
        for c in self.layers:
            out += c.arrays()
        return out

    def nbytes(self) -> int:
        return sum(c.nbytes() for c in self.layers)
