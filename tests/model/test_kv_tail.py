"""KV caches with a tail (`model/kv_cache.py`, `KVCache.rebase`): a compiled step writes its new keys
into a small tail buffer instead of the whole-context one (which a pipelined GPU step would copy
whole). Against the uncompiled model (one buffer): decode and draft-mtp with a tail small enough
to move many times, rollbacks before the tail, and every path that reads the cache outside a step."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tests.conftest import MOE_Q4, TINY_F32
from mtp_engine import generate
from mtp_engine.model import qwen35
from mtp_engine.model.kv_cache import KVCache


@pytest.fixture
def small_tail(monkeypatch):
    """Tails of 12 positions, and a count of the moves (positions into the main buffer)."""
    make = qwen35.Qwen35Model.make_cache

    def small(self):
        cache = make(self)
        for c in cache.layers:
            if isinstance(c, KVCache) and c.tail:
                c.tail = 12
        return cache

    monkeypatch.setattr(qwen35.Qwen35Model, "make_cache", small)
    moves = {"rebase": 0, "settle": 0}
    rebase, settle = KVCache.rebase, KVCache.settle

    def counted_rebase(self, floor, n_tokens):
        before = self.base
        ok = rebase(self, floor, n_tokens)
        moves["rebase"] += ok and before is not None and self.base != before
        return ok

    def counted_settle(self):
        moves["settle"] += self.base is not None
        settle(self)

    monkeypatch.setattr(KVCache, "rebase", counted_rebase)
    monkeypatch.setattr(KVCache, "settle", counted_settle)
    return moves


def test_the_tail_is_an_option(models):
    model = models(TINY_F32, exact=True).model
    before = model.options
    try:
        model.use(before.updated(compile_steps=True))
        assert {c.tail for c in model.make_cache().layers if isinstance(c, KVCache)} == {256}
        model.use(before.updated(compile_steps=True, kv_tail=0))  # EngineOptions.kv_tail: none
        assert not any(c.tail for c in model.make_cache().layers if isinstance(c, KVCache))
        model.use(before.updated(compile_steps=False))  # uncompiled forwards write one buffer
        assert not any(c.tail for c in model.make_cache().layers if isinstance(c, KVCache))
    finally:
        model.use(before)


def _decode(model, compiled: bool, ids: list[int], n: int):
    before = model.compile_steps
    model.compile_steps = compiled
    try:
        cache = model.make_cache()
        h = model.forward(mx.array([ids]), cache)
        out, hiddens = [], []
        for _ in range(n):
            tok = int(mx.argmax(model.logits(h[0, -1])).item())
            out.append(tok)
            h = model.forward(mx.array([[tok]]), cache)
            hiddens.append(np.array(h[0, -1]))
        tails = [c for c in cache.layers if isinstance(c, KVCache) and c.tail]
        return out, np.stack(hiddens), tails
    finally:
        model.compile_steps = before


@pytest.mark.parametrize("path", [TINY_F32, MOE_Q4], ids=["dense", "moe"])
def test_decode_through_a_moving_tail_equals_one_buffer(path, models, small_tail):
    model = models(path, exact=True).model
    ids = [3, 17, 101, 7, 42, 9, 11]
    ref, h_ref, none = _decode(model, False, ids, 50)
    got, h_got, tails = _decode(model, True, ids, 50)
    assert not none and tails and all(c.tail == 12 for c in tails)
    assert small_tail["rebase"] >= 3 * len(tails)  # 50 positions through a 12-position tail
    assert got == ref
    np.testing.assert_allclose(h_got, h_ref, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("n_max", [1, 3, 8])
def test_draft_mtp_through_a_moving_tail_equals_plain(n_max, models, small_tail):
    """Verifies roll back inside the tail (device offsets, queued rounds); rounds whose rows do not
    fit the tail settle it and write the main buffer (n-max 8: 9 rows and a queued round)."""
    mdl = models(TINY_F32, exact=True)
    before = mdl.model.compile_steps
    mdl.model.compile_steps = False
    try:
        plain = generate("def f(x):", model=mdl, max_tokens=60, spec="none", ignore_eos=True).token_ids
    finally:
        mdl.model.compile_steps = True
    try:
        spec = generate("def f(x):", model=mdl, max_tokens=60, spec="draft-mtp", n_max=n_max,
                        ignore_eos=True).token_ids
    finally:
        mdl.model.compile_steps = before
    assert spec == plain
    if n_max < 8:
        assert small_tail["rebase"] > 0


def test_rebase_and_settle_keep_every_position():
    """The cache's positions, wherever they sit, read back the same: a tail taken from the main
    buffer, moved on, rolled back before its start (settled), read by `state`."""
    c = KVCache(2, 4, step=8, tail=6)
    k = mx.arange(2 * 20 * 4, dtype=mx.float32).reshape(1, 2, 20, 4)
    c.update(k, -k)
    assert c.rebase(floor=17, n_tokens=2) and c.base == 17
    np.testing.assert_array_equal(np.array(c.tail_keys[:, :, :3]), np.array(k[:, :, 17:20]))
    assert c.rebase(floor=19, n_tokens=3) and c.base == 17  # 20 + 3 positions fit 17 .. 23
    assert c.rebase(floor=19, n_tokens=4) and c.base == 19  # 24 do not: 17, 18 go to the main buffer
    np.testing.assert_array_equal(np.array(c.tail_keys[:, :, :1]), np.array(k[:, :, 19:20]))
    assert not c.rebase(floor=19, n_tokens=6) and c.base is None  # 26 - 19 > 6: settled, one buffer
    keys, values = c.state()
    np.testing.assert_array_equal(np.array(keys), np.array(k))
    np.testing.assert_array_equal(np.array(values), np.array(-k))
    assert c.rebase(floor=18, n_tokens=1) and c.base == 18
    c.truncate(10)  # a rollback before the tail (a prompt cache's restore): one buffer again
    assert c.base is None and c.offset == 10
    np.testing.assert_array_equal(np.array(c.state()[0]), np.array(k[:, :, :10]))


def test_a_step_reads_tail_and_buffer_as_one():
    """The graph view's attention inputs (the MLX path) against the same positions in one buffer."""
    from mtp_engine.model import step
    big = mx.random.normal((1, 2, 16, 4))
    tail = mx.random.normal((1, 2, 6, 4))
    view = step._TailKVView(big, big, tail, tail, mx.array(12), mx.array(10))
    new = mx.random.normal((1, 2, 2, 4))
    keys, _, mask = view.update(new, new)
    whole = mx.concatenate([big[:, :, :10], tail[:, :, :2], new], axis=2)  # positions 0 .. 13
    k, m = np.array(keys), np.array(mask)
    seen = [k[0][:, m[q]] for q in range(2)]
    np.testing.assert_array_equal(seen[0], np.array(whole[0, :, :13]))
    np.testing.assert_array_equal(seen[1], np.array(whole[0, :, :14]))


def test_a_view_takes_the_tail_without_changing_the_cache():
    """A prompt cache's fork of a cache that another thread may still be decoding into."""
    c = KVCache(2, 4, step=8, tail=6)
    k = mx.arange(2 * 20 * 4, dtype=mx.float32).reshape(1, 2, 20, 4)
    c.update(k, -k)
    assert c.rebase(floor=16, n_tokens=1)
    tail_before = c.tail_keys
    v = c.view(19)
    assert c.base == 16 and c.tail_keys is tail_before
    np.testing.assert_array_equal(np.array(v.state()[0]), np.array(k[:, :, :19]))
    np.testing.assert_array_equal(np.array(c.view(12).state()[1]), np.array(-k[:, :, :12]))


def _batch_of(rows: list[int], tail: int):
    """A BatchCache (with tails of `tail` positions) over two attention layers whose row b holds
    positions 0 .. rows[b] of known keys (row b, position t: b * 1000 + t), and those keys."""
    from mtp_engine.model.batch_cache import BatchCache
    from mtp_engine.model.cache import TrunkCache

    class Cfg:
        n_head_kv, head_dim = 2, 4

    class Net:
        cfg = Cfg()

    batch, want = BatchCache(Net(), tail=tail), []
    for b, n in enumerate(rows):
        k = (mx.arange(n, dtype=mx.float32)[None, None, :, None] + 1000 * b) * mx.ones((1, 2, n, 4))
        layers = [KVCache(2, 4, step=8), KVCache(2, 4, step=8)]
        for c in layers:
            c.update(k, -k)
        trunk = TrunkCache(layers)
        trunk.offset = n
        batch.add(trunk)
        want.append(np.array(k[0]))
    return batch, want


def _positions(batch, layer) -> list[np.ndarray]:
    """Each row's valid keys read through the tail and the main buffer as the kernel does."""
    out = []
    for b, n in enumerate(batch.host_lengths):
        base = n if batch.base is None else batch.base[b]
        main = np.array(layer.keys[b, :, :min(n, base)])
        tail = np.array(layer.tail_keys[b, :, :max(0, n - base)]) if batch.base is not None else main[:, :0]
        out.append(np.concatenate([main, tail], axis=1))
    return out


def test_a_batch_opens_moves_and_settles_each_rows_tail():
    """Rows at different lengths each get a tail from their own floor; positions read back the
    same through tail and buffer, after a move, and after settling (a row joining or leaving)."""
    batch, want = _batch_of([5, 17, 11], tail=6)
    layer = batch.layers[0]
    batch.bound_lengths([5, 17, 11], floors=[3, 15, 11])
    assert batch.rebase(2) and batch.base == [3, 15, 11]
    assert all(np.array_equal(g, w) for g, w in zip(_positions(batch, layer), want))
    assert batch.rebase(2) and batch.base == [3, 15, 11]  # 7, 19, 13 positions fit 3+6, 15+6, 11+6
    batch.host_lengths = [8, 17, 11]  # row 0 took 3 positions (written into its tail by a step)
    assert batch.rebase(1) and batch.base == [3, 15, 11]
    assert not batch.rebase(2) and batch.base is None  # row 0 would reach 10 > 3 + 6, floor still 3
    batch.bound_lengths([8, 17, 11], floors=[8, 16, 11])
    assert batch.rebase(2) and batch.base == [8, 16, 11]
    np.testing.assert_array_equal(np.array(layer.tail_keys[1, :, :1]), want[1][:, 16:17])
    batch.keep([2, 1])  # a row leaves: the tails settle first, every kept position stays
    assert batch.base is None and batch.floors == [11, 16]
    assert all(np.array_equal(g, w) for g, w in zip(_positions(batch, layer), [want[2], want[1]]))


def test_a_batch_step_reads_each_rows_tail_and_buffer_as_one():
    """The batch graph view's attention inputs (the MLX path), row by row, against the same
    positions in one buffer; the new keys land in each row's tail at its own length."""
    from mtp_engine.model import step
    big = mx.random.normal((2, 2, 16, 4))
    tail = mx.random.normal((2, 2, 6, 4))
    lengths, base = mx.array([12, 7]), mx.array([10, 4])
    view = step._BatchTailKVView(big, big, tail, tail, lengths, base)
    new = mx.random.normal((2, 2, 2, 4))
    keys, _, mask = view.update(new, new)
    k, m = np.array(keys), np.array(mask)
    for b, (n, b0) in enumerate([(12, 10), (7, 4)]):
        whole = np.concatenate([np.array(big[b, :, :b0]), np.array(tail[b, :, :n - b0]), np.array(new[b])], axis=1)
        for q in range(2):
            np.testing.assert_array_equal(k[b][:, m[b, 0, q]], whole[:, :n + q + 1])


@pytest.mark.parametrize("spec", ["none", "draft-mtp"])
def test_batched_decoding_through_moving_tails_equals_alone(models, spec, monkeypatch):
    """Compiled batched steps (the GPU's default; forced here) with tails of 12 positions: rows
    at different lengths each move their tail many times, rows join and leave, verifies roll
    back inside the tails; every answer is its prompt's alone (uncompiled, one buffer)."""
    from mtp_engine import EngineOptions, batch_generate, load
    from mtp_engine.model.batch_cache import BatchCache
    from tests.conftest import TINY_Q4, need

    prompts = ["x", "def fib(n):\n    if n < 2:\n        return n\n", "class A:", "import os\nimport sys\n",
               "for i in range(3):"]
    want = [generate(p, models(need(TINY_Q4)), max_tokens=40, ignore_eos=True).token_ids for p in prompts]
    moves = []
    rebase = BatchCache.rebase

    def counted(self, n_tokens):
        before = self.base
        ok = rebase(self, n_tokens)
        moves.append(ok and before is not None and self.base != before)
        return ok

    monkeypatch.setattr(BatchCache, "rebase", counted)
    m = load(need(TINY_Q4), options=EngineOptions(compile_steps=True, kv_tail=12))
    kw = dict(spec="draft-mtp", n_max=3) if spec == "draft-mtp" else {}
    got = batch_generate(prompts, m, max_tokens=40, ignore_eos=True, parallel=3, **kw)
    assert [g.token_ids for g in got] == want
    assert sum(moves) >= 6, moves  # 40 tokens through 12-position tails, rows moving on their own
