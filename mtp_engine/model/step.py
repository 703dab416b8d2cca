"""Compiled forward passes over a few tokens (decode, draft, verify, catch-up).

An uncompiled step is hundreds of small MLX operations, each a dispatch (about 19 us on the H200,
6 us on the CPU backend) for arithmetic that takes less. Here a whole trunk (or MTP head) forward
of S tokens is one `mx.compile`d graph with constant shapes:

- attention caches are fixed-capacity buffers written at a dynamic offset (`mx.slice_update` with
  the offset as an array input, so a new position is not a new graph) and attention reads the whole
  buffer under a mask; capacity grows in large steps (`KVCache.reserve`), one retrace per growth;
- recurrent states go in as inputs and come out as outputs that replace them;
- no host synchronisation inside: the caller evaluates when it needs a value.

One graph is traced per (S, capture, cache capacities); prompts longer than `MAX_TOKENS` run
uncompiled, where dispatch cost is amortised over many rows. `run_batch` is the same for a batch of
sequences (`batch_cache.BatchCache`), each row at its own length: one graph per (B, S, capture,
capacity).
"""
from __future__ import annotations

from enum import Enum
from typing import Callable, Sequence

import mlx.core as mx

from .batch_cache import BatchCache, BatchKVCache
from .cache import RecurrentCache
from .kv_cache import KVCache, shift_offsets

MAX_TOKENS = 16


class Pass(Enum):
    """What a forward of the trunk or the MTP head is for, which decides how it runs.

    STEP: a decode step, a draft, a catch-up: one compiled graph when it fits (`MAX_TOKENS`).
    PREFILL: a prompt's rows, a shape that may not recur: compiled only when its graph is traced
    already (`traced`), so a new prompt length costs no trace.
    VERIFY: a step whose caches keep what a rollback needs to keep only its first n tokens.
    ROUND_STEP, ROUND_VERIFY: the same inside a device-resident round (`speculative.round`): KV
    offsets may be device values and the host's token count is left to the round."""

    STEP = "step"
    PREFILL = "prefill"
    VERIFY = "verify"
    ROUND_STEP = "round_step"
    ROUND_VERIFY = "round_verify"

    @property
    def capture(self) -> bool:
        return self in (Pass.VERIFY, Pass.ROUND_VERIFY)

    @property
    def resident(self) -> bool:
        return self in (Pass.ROUND_STEP, Pass.ROUND_VERIFY)


class StepGraphs:
    """The forwards one network (the trunk, or the MTP head) has traced, by shape key: compiled
    graphs, their uncompiled forms (device-resident rounds without compiled steps), and the step
    shapes its decoders have run (a first use is a trace and JIT compiles, not a sample of a
    round's cost). Graphs traced under other options are dropped with the object (`Qwen35Model.use`)."""

    def __init__(self):
        self.compiled: dict = {}
        self.uncompiled: dict = {}
        self.seen: set = set()


class _KVView:
    """A KV cache inside a trace: buffers and offset are graph values, not Python state."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array, reach: int | None = None):
        self.keys, self.values, self.offset = keys, values, offset
        self.reach = reach  # uncompiled: a host bound of offset + S; attention reads no further

    @property
    def dtype(self):
        return self.keys.dtype

    def update(self, k: mx.array, v: mx.array):
        start = mx.reshape(self.offset, (1,))
        self.keys = mx.slice_update(self.keys, k.astype(self.keys.dtype), start, axes=(2,))
        self.values = mx.slice_update(self.values, v.astype(self.values.dtype), start, axes=(2,))
        s, cap = k.shape[2], self.keys.shape[2]
        # an uncompiled step may take a new shape every call: attention reads up to the host's bound
        # instead of the whole buffer (on the CPU backend the full read cost 2-4% of a plain step at
        # a 256-position capacity); positions past it are masked either way
        r = cap if self.reach is None else min(self.reach, cap)
        # query i (position offset + i) sees cache positions <= offset + i; the rest is stale or empty
        mask = mx.arange(r)[None, :] <= (self.offset + mx.arange(s))[:, None]
        if r < cap:
            return self.keys[:, :, :r], self.values[:, :, :r], mask
        return self.keys, self.values, mask

    def attention_buffers(self):
        """(keys, values, tail) a fused attention reads: tail (keys, values, base [1]) or None."""
        return self.keys, self.values, None


class _TailKVView(_KVView):
    """A KV cache with a tail (`KVCache.rebase`) inside a trace: the new keys go into the tail at
    offset - base; the main buffers are read, never written (a pipelined step's write there would
    copy them whole)."""

    def __init__(self, big_keys, big_values, keys, values, offset, base, reach=None):
        super().__init__(keys, values, offset, reach)
        self.big_keys, self.big_values, self.base = big_keys, big_values, base

    def update(self, k: mx.array, v: mx.array):
        start = mx.reshape(self.offset - self.base, (1,))
        self.keys = mx.slice_update(self.keys, k.astype(self.keys.dtype), start, axes=(2,))
        self.values = mx.slice_update(self.values, v.astype(self.values.dtype), start, axes=(2,))
        # the MLX path: both buffers end to end, the main one's positions past `base` masked
        s, cap, tail = k.shape[2], self.big_keys.shape[2], self.keys.shape[2]
        i = mx.arange(cap + tail)
        pos = mx.where(i < cap, i, self.base + i - cap)
        q_pos = self.offset + mx.arange(s)
        mask = (pos[None, :] <= q_pos[:, None]) & ((i < self.base) | (i >= cap))[None, :]
        return (mx.concatenate([self.big_keys, self.keys], axis=2),
                mx.concatenate([self.big_values, self.values], axis=2), mask)

    def attention_buffers(self):
        return self.big_keys, self.big_values, (self.keys, self.values, mx.reshape(self.base, (1,)))


class _BatchKVView(_KVView):
    """A batch's KV cache inside a trace: row b writes at its own length `lengths[b]`, and its
    queries see the whole buffer under a per-row mask (no slice to the longest row, whose length
    would be a new graph every step)."""

    def update(self, k: mx.array, v: mx.array):
        s, cap = k.shape[2], self.keys.shape[2]
        pos = self.offset[:, None, None, None] + mx.arange(s)[None, None, :, None]
        idx = mx.broadcast_to(pos, k.shape).astype(mx.int32)
        self.keys = mx.put_along_axis(self.keys, idx, k.astype(self.keys.dtype), axis=2)
        self.values = mx.put_along_axis(self.values, idx, v.astype(self.values.dtype), axis=2)
        q_pos = self.offset[:, None] + mx.arange(s)[None, :]  # [B, S]
        mask = mx.arange(cap)[None, None, :] <= q_pos[:, :, None]
        return self.keys, self.values, mask[:, None]


class _BatchTailKVView(_BatchKVView):
    """A batch's KV cache with tails inside a trace: row b's new keys go into its tail at
    lengths[b] - base[b]; the main buffers are read, never written."""

    def __init__(self, big_keys, big_values, keys, values, lengths, base):
        super().__init__(keys, values, lengths)
        self.big_keys, self.big_values, self.base = big_keys, big_values, base

    def update(self, k: mx.array, v: mx.array):
        s, cap, tail = k.shape[2], self.big_keys.shape[2], self.keys.shape[2]
        pos = (self.offset - self.base)[:, None, None, None] + mx.arange(s)[None, None, :, None]
        idx = mx.broadcast_to(pos, k.shape).astype(mx.int32)
        self.keys = mx.put_along_axis(self.keys, idx, k.astype(self.keys.dtype), axis=2)
        self.values = mx.put_along_axis(self.values, idx, v.astype(self.values.dtype), axis=2)
        # the MLX path: both buffers end to end, each row's main positions from its base on masked
        i = mx.arange(cap + tail)[None, :]
        base = self.base[:, None]
        pos = mx.where(i < cap, i, base + i - cap)  # [B, L]
        q_pos = self.offset[:, None] + mx.arange(s)[None, :]  # [B, S]
        mask = (pos[:, None, :] <= q_pos[:, :, None]) & ((i < base) | (i >= cap))[:, None, :]
        return (mx.concatenate([self.big_keys, self.keys], axis=2),
                mx.concatenate([self.big_values, self.values], axis=2), mask[:, None])

    def attention_buffers(self):
        return self.big_keys, self.big_values, (self.keys, self.values, self.base)


class _RecurrentView:
    """A gated-delta-net cache inside a trace: what the forward starts from (`sources`, as
    `RecurrentCache.sources` gave it) and what it leaves (`update`)."""

    valid = None  # a traced step's rows count all their tokens (`gdn.mix`)

    def __init__(self, conv: mx.array, state: mx.array, kept: mx.array | None, capturing: bool,
                 capture_width: int | None = None):
        self.conv, self.state, self.kept, self.capturing = conv, state, kept, capturing
        self.capture_width = capture_width

    def sources(self) -> tuple[mx.array, mx.array, mx.array | None]:
        return self.conv, self.state, self.kept

    def update(self, conv: mx.array, state: mx.array, tokens: int | None = None) -> None:
        self.conv, self.state, self.kept = conv, state, None


def _layout(caches) -> tuple[tuple[str, ...], list[mx.array]]:
    """The caches' parts in a graph's key and their input arrays: attention (`kv`: keys, values;
    `kvt` with a tail: keys, values, tail keys, tail values), a recurrent layer in its plain form
    (`rec`: conv, state) or picking its state from a rolled-back pass (`pick`: window, states,
    kept)."""
    kinds, arrays = [], []
    for c in caches:
        if isinstance(c, (KVCache, BatchKVCache)) and c.base is not None:
            kinds.append("kvt")
            arrays += [c.keys, c.values, c.tail_keys, c.tail_values]
        elif isinstance(c, (KVCache, BatchKVCache)):
            kinds.append("kv")
            arrays += [c.keys, c.values]
        else:
            conv, state, kept = c.sources()
            kinds.append("rec" if kept is None else "pick")
            arrays += [conv, state] + ([] if kept is None else [kept])
    return tuple(kinds), arrays


def _key(caches, n_tokens: int, capture: bool) -> tuple[tuple, list[mx.array]]:
    """A graph's key in its owner's table, and the caches' input arrays."""
    kinds, arrays = _layout(caches)
    width = next((c.capture_width for c in caches if isinstance(c, RecurrentCache)), None) if capture else None
    return (n_tokens, kinds, capture, width), arrays


def traced(graphs: StepGraphs, caches: Sequence[KVCache | RecurrentCache], n_tokens: int,
           capture: bool = False) -> bool:
    """Whether `run` has a compiled graph for this forward already: a forward of a shape that may
    not recur (a prompt's prefill) runs uncompiled unless it has, since a trace costs more than
    dispatching the operations once (70-100 ms of host at the 9B shape, measured)."""
    return _key(caches, n_tokens, capture)[0] in graphs.compiled


def run(graphs: StepGraphs, body: Callable, args: Sequence[mx.array], caches: Sequence[KVCache | RecurrentCache],
        n_tokens: int, capture: bool = False, side: Callable[[], list] | None = None,
        set_side: Callable[[list], None] | None = None, compiled: bool = True,
        floor: int | None = None) -> list[mx.array]:
    """Runs `body(*args, views)` (which returns a list of arrays) as one compiled graph over
    `caches`, then writes the new cache contents back. `graphs` keeps the traced graphs (one per
    shape key). `side()` lists extra per-forward values the body leaves on objects (MoE routing),
    returned through the graph and handed to `set_side`. Returns the body's outputs.
    `compiled=False` runs the same graph uncompiled (device-resident rounds where steps are not
    compiled: the cache offsets are device values only this form takes). `floor`: a position no
    later rollback of these caches returns below (the trunk's committed length); given, KV caches
    with a tail write their new keys there (`KVCache.rebase`)."""
    for c in caches:
        if isinstance(c, KVCache):
            if not (floor is not None and c.rebase(floor, n_tokens)):
                c.settle()
                c.reserve(c.limit + n_tokens)
    key, arrays = _key(caches, n_tokens, capture)
    kinds, width = key[1], key[3]
    fns = graphs.compiled if compiled else graphs.uncompiled
    if key not in fns:
        layout: dict[str, int] = {}  # filled when the graph is traced: how many outputs are the body's
        reach: list = []  # uncompiled: per KV cache, a host bound of its offset after this step
        def view(arrays, offsets, bases, i):
            if len(arrays) == 4:
                return _TailKVView(*arrays, offsets[i], bases[i], reach[i] if reach else None)
            return _KVView(*arrays, offsets[i], reach[i] if reach else None)

        fn = _traced(body, kinds, capture, side, layout, view, width)
        fns[key] = (mx.compile(fn) if compiled else fn, layout, reach)
    fn, layout, reach = fns[key]
    kv = [c for c in caches if isinstance(c, KVCache)]
    if not compiled:
        reach[:] = [c.limit + n_tokens for c in kv]
    offsets = _offsets(kv)
    bases = mx.array([0 if c.base is None else c.base for c in kv] or [0], dtype=mx.int32)
    saved = _release_kv(caches, KVCache)
    try:
        outs = fn(offsets, bases, *args, *arrays)
    except Exception:
        _restore(saved)
        raise
    del arrays, saved
    body_out, rest = outs[:layout["body"]], outs[layout["body"]:]
    shift_offsets(caches, n_tokens)
    rest = _write_back(caches, rest, KVCache, n_tokens, n_tokens)
    if set_side:
        set_side(list(rest))
    return body_out


def _write_back(caches, rest: list, kv_type: type, grown: int = 0, tokens: int | None = None) -> list:
    """Puts a graph's cache outputs back on `caches` (KV buffers; recurrent windows and states,
    per position when captured, over the forward's `tokens`); returns the outputs after them. A KV
    cache's host bound grows by `grown` tokens."""
    for c in caches:
        if isinstance(c, kv_type):
            c.keys, c.values = rest[0], rest[1]
            if getattr(c, "base", None) is not None:
                c.tail_keys, c.tail_values = rest[2], rest[3]
                rest = rest[2:]
            if getattr(c, "bound", None) is not None:
                c.bound += grown
        else:
            c.update(rest[0], rest[1], tokens)
        rest = rest[2:]
    return rest


def run_batch(graphs: StepGraphs, body: Callable, args: Sequence[mx.array], batch: BatchCache,
              n_tokens: int) -> list[mx.array]:
    """`run` for a batch: `body(*args, views)` over the batch's layers as one compiled graph, with
    each row's length (`batch.lengths`) an input, so a step of any lengths reuses the graph (one
    per batch size, tokens per row, capture and capacity). Recurrent layers that `begin_capture`d
    keep every per-position state (rollback picks one). The caller advances the lengths."""
    layers = batch.layers
    capture = any(getattr(c, "capturing", False) for c in layers)
    if not batch.rebase(n_tokens):  # no tails: the new keys go into the main buffers
        end = max(batch.host_lengths) + n_tokens
        for c in layers:
            if isinstance(c, BatchKVCache):
                c.reserve(end)
    key, arrays = _key(layers, n_tokens, capture)
    kinds, width = key[1], key[3]
    key = ("batch",) + key
    fns = graphs.compiled
    if key not in fns:
        layout: dict[str, int] = {}
        fn = _traced(body, kinds, capture, None, layout, _batch_kv_view, width)
        fns[key] = (mx.compile(fn), layout)
    fn, layout = fns[key]
    saved = _release_kv(layers, BatchKVCache)
    try:
        outs = fn(batch.lengths, batch.lengths if batch.base_array is None else batch.base_array, *args, *arrays)
    except Exception:
        _restore(saved)
        raise
    del arrays, saved
    _write_back(layers, outs[layout["body"]:], BatchKVCache, tokens=n_tokens)
    return outs[:layout["body"]]


def _batch_kv_view(arrays, lengths: mx.array, bases: mx.array, i: int) -> _KVView:
    """A batch's attention layer inside a trace: its main buffers, and its tails when it has them."""
    return _BatchKVView(*arrays, lengths) if len(arrays) == 2 else _BatchTailKVView(*arrays, lengths, bases)


def _offsets(kv: list[KVCache]) -> mx.array:
    """The KV caches' write offsets as one int32 array (host ints, or device scalars of resident
    rounds: one stack, layers that share a device offset share its element)."""
    if not kv:
        return mx.array([0], dtype=mx.int32)
    if not any(isinstance(c.offset, mx.array) for c in kv):
        return mx.array([c.offset for c in kv], dtype=mx.int32)
    first = kv[0].offset
    if all(c.offset is first for c in kv):  # the trunk's layers advance together: one device value
        return mx.broadcast_to(first.reshape(1), (len(kv),))
    return mx.stack([c.offset.reshape(()) if isinstance(c.offset, mx.array) else mx.array(c.offset, dtype=mx.int32)
                     for c in kv])


def _release_kv(caches, kv_type: type) -> list:
    """Drops the caches' references to their KV buffers, so the graph's write goes in place (a
    buffer another array holds is copied); returns them for `_restore` if the graph fails."""
    saved = []
    for c in caches:
        if isinstance(c, kv_type):
            saved.append((c, c.keys, c.values, getattr(c, "tail_keys", None), getattr(c, "tail_values", None)))
            c.keys = c.values = None
            if saved[-1][3] is not None:
                c.tail_keys = c.tail_values = None
    return saved


def _restore(saved: list) -> None:
    for c, keys, values, tail_keys, tail_values in saved:
        c.keys, c.values = keys, values
        if tail_keys is not None:
            c.tail_keys, c.tail_values = tail_keys, tail_values


def _traced(body: Callable, kinds: tuple[str, ...], capture: bool, side, layout: dict[str, int], kv_view: Callable,
            capture_width: int | None = None):
    width_of = {"kv": 2, "kvt": 4, "rec": 2, "pick": 3}

    def fn(offsets, bases, *flat):
        n_cache = sum(width_of[k] for k in kinds)
        args, arrays = flat[:len(flat) - n_cache], flat[len(flat) - n_cache:]
        views, j, i_kv = [], 0, 0
        for kind in kinds:
            if kind in ("kv", "kvt"):
                views.append(kv_view(arrays[j:j + width_of[kind]], offsets, bases, i_kv))
                i_kv += 1
            else:
                kept = arrays[j + 2] if kind == "pick" else None
                views.append(_RecurrentView(arrays[j], arrays[j + 1], kept, capture, capture_width))
            j += width_of[kind]
        outs = list(body(*args, views))
        layout["body"] = len(outs)
        for v in views:
            if isinstance(v, (_TailKVView, _BatchTailKVView)):
                outs += [v.big_keys, v.big_values, v.keys, v.values]
            elif isinstance(v, _KVView):
                outs += [v.keys, v.values]
            else:
                outs += [v.conv, v.state]
        if side:
            outs += side()
        return outs

    return fn
