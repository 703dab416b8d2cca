"""A 16-bit attention cache (`EngineOptions.kv_dtype`, half the cache's memory). On any device: the caches take the type, drafting stays
lossless over it (greedy draft-mtp equals plain under the same cache), the model's answers move
only by the rounding, and the memory check counts 2 bytes an element."""
from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from tests.conftest import SHIPPED, TINY_Q4, need
from mtp_engine import EngineOptions, generate, load
from mtp_engine.model.kv_cache import KVCache
from mtp_engine.model.memory import estimate


@pytest.fixture(scope="module")
def tiny16():
    return load(need(TINY_Q4), options=EngineOptions(kv_dtype="float16"))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_caches_take_the_type(dtype):
    m = load(need(TINY_Q4), options=EngineOptions(kv_dtype=dtype)).model
    want = getattr(mx, dtype)
    cache = m.make_cache()
    m.forward(mx.array([[5, 6, 7]]), cache)
    kv = [c for c in cache.layers if isinstance(c, KVCache)]
    assert kv and all(c.keys.dtype == want and c.values.dtype == want for c in kv)
    assert m.mtp.make_cache().dtype == want


def test_draft_mtp_equals_plain_over_a_16_bit_cache(tiny16):
    plain = generate("def f(x):", model=tiny16, max_tokens=40, spec="none")
    for n_max in (1, 3):
        spec = generate("def f(x):", model=tiny16, max_tokens=40, spec="draft-mtp", n_max=n_max)
        assert spec.token_ids == plain.token_ids, n_max
        assert spec.stats["drafted"] > 0


def test_a_16_bit_cache_moves_logits_by_its_rounding(tiny16):
    m32 = load(need(TINY_Q4), options=EngineOptions(kv_dtype="float32")).model
    ids = mx.array([[(13 * i + 7) % 200 + 10 for i in range(120)]])
    got = []
    for m in (m32, tiny16.model):
        cache = m.make_cache()
        h = m.forward(ids, cache)
        h = m.forward(mx.array([[42]]), cache)  # one decode step reading the whole cache
        got.append(np.array(m.logits(h[0, -1])))
    diff = np.abs(got[0] - got[1]).max()
    assert 0 < diff < 0.05 * np.abs(got[0]).max(), diff


def test_memory_estimate_counts_the_cache_type():
    f = need(SHIPPED)
    a = estimate(f, context=4096)
    b = estimate(f, context=4096, kv_bytes=2)
    assert b["kv_cache"] * 2 == a["kv_cache"] and a["total"] - b["total"] == b["kv_cache"]
