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
