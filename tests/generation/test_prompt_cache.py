"""The prompt cache: a generation whose prompt starts with the previous one's prefills only the
rest and gives exactly what a generation without the cache gives (plain and draft-mtp: the same
tokens and, for draft-mtp, the same acceptance, so the MTP head's state was carried over too);
anything else is a miss that prefills in full and is kept instead."""
from __future__ import annotations

import pytest

from mtp_engine import MTPEngineError, PromptCache, stream_generate
from mtp_engine import generate
from tests.conftest import MOE_Q4, need

PROMPT = "To be or not to be, that is the question. " * 12
SPECS = [dict(spec="none"), dict(spec="draft-mtp", n_max=3)]


def _next_turn(m, first) -> list[int]:
    return first.prompt_token_ids + first.token_ids + m.tokenizer.encode(" Whether tis nobler in the mind")


@pytest.mark.parametrize("kw", SPECS, ids=["plain", "draft-mtp"])
def test_next_prompt_reuses_the_kept_state(tiny_any, kw):
    pc = PromptCache()
    a = generate(PROMPT, model=tiny_any, max_tokens=12, prompt_cache=pc, **kw)
    assert a.stats["cached_prompt_tokens"] == 0 and pc.tokens == len(a.prompt_token_ids) - 1
    ids = _next_turn(tiny_any, a)
    b = generate(ids, model=tiny_any, max_tokens=40, prompt_cache=pc, **kw)
    ref = generate(ids, model=tiny_any, max_tokens=40, **kw)
    assert b.stats["cached_prompt_tokens"] == len(a.prompt_token_ids) - 1
    assert b.token_ids == ref.token_ids
    if kw["spec"] == "draft-mtp":
        assert b.stats["accepted"] == ref.stats["accepted"] and b.stats["drafted"] == ref.stats["drafted"]
    # the same prompt again: all but its last token come from the cache
    c = generate(ids, model=tiny_any, max_tokens=40, prompt_cache=pc, **kw)
    assert c.stats["cached_prompt_tokens"] == len(ids) - 1 and c.token_ids == ref.token_ids
    assert pc.hits == 2


@pytest.mark.parametrize("kw", SPECS, ids=["plain", "draft-mtp"])
def test_a_prompt_that_diverges_is_a_miss_and_is_kept_instead(tiny_any, kw):
    pc = PromptCache()
    a = generate(PROMPT, model=tiny_any, max_tokens=4, prompt_cache=pc, **kw)
    other = "Something else entirely, " + PROMPT
    b = generate(other, model=tiny_any, max_tokens=20, prompt_cache=pc, **kw)
    assert b.stats["cached_prompt_tokens"] == 0 and b.token_ids == generate(other, model=tiny_any, max_tokens=20,
                                                                             **kw).token_ids
    # a prompt that shares only part of the kept tokens cannot rewind the recurrent state: a miss
    part = a.prompt_token_ids[:10] + [7, 8, 9]
    assert generate(part, model=tiny_any, max_tokens=2, prompt_cache=pc, **kw).stats["cached_prompt_tokens"] == 0
    assert pc.tokens == len(part) - 1


def test_plain_reuses_a_draft_mtp_state_but_not_the_reverse(tiny_any):
    pc = PromptCache()
    a = generate(PROMPT, model=tiny_any, max_tokens=4, spec="draft-mtp", n_max=2, prompt_cache=pc)
    ids = _next_turn(tiny_any, a)
    assert generate(ids, model=tiny_any, max_tokens=4, prompt_cache=pc).stats["cached_prompt_tokens"] > 0
    # the plain generation kept no MTP head state: draft-mtp prefills in full (and is right)
    ids2 = ids + [11]
    b = generate(ids2, model=tiny_any, max_tokens=12, spec="draft-mtp", n_max=2, prompt_cache=pc)
    assert b.stats["cached_prompt_tokens"] == 0
    assert b.token_ids == generate(ids2, model=tiny_any, max_tokens=12).token_ids


def test_a_stream_left_early_keeps_a_valid_state(tiny_any):
    pc = PromptCache()
    it = stream_generate(PROMPT, model=tiny_any, max_tokens=50, spec="draft-mtp", n_max=3, prompt_cache=pc)
    first = next(it)
    it.close()  # the caller left after the first chunk: rounds may have been queued past it
    ids = tiny_any.tokenizer.encode(PROMPT) + first.token_ids + [42]
    b = generate(ids, model=tiny_any, max_tokens=20, spec="draft-mtp", n_max=3, prompt_cache=pc)
    assert b.stats["cached_prompt_tokens"] > 0
    assert b.token_ids == generate(ids, model=tiny_any, max_tokens=20).token_ids


def test_another_model_is_a_miss(tiny_f32, tiny_q4):  # two distinct files: the full set only
    pc = PromptCache()
    generate(PROMPT, model=tiny_f32, max_tokens=2, prompt_cache=pc)
    r = generate(PROMPT + " more", model=tiny_q4, max_tokens=2, prompt_cache=pc)
    assert r.stats["cached_prompt_tokens"] == 0


def test_moe_model(models):
    m = models(need(MOE_Q4))
    pc = PromptCache()
    a = generate(PROMPT, model=m, max_tokens=6, spec="draft-mtp", n_max=2, prompt_cache=pc)
    ids = _next_turn(m, a)
    b = generate(ids, model=m, max_tokens=16, spec="draft-mtp", n_max=2, prompt_cache=pc)
    assert b.stats["cached_prompt_tokens"] > 0
    assert b.token_ids == generate(ids, model=m, max_tokens=16, spec="draft-mtp", n_max=2).token_ids


def test_not_a_prompt_cache(tiny_any):
    with pytest.raises(MTPEngineError) as e:
        generate("x", model=tiny_any, max_tokens=1, prompt_cache={})
    assert e.value.field == "prompt_cache"


def test_the_head_continues_exactly_from_a_kept_prefix(tiny_any):
    """The MTP head's rows for a prompt, begun from a kept prefix of it, equal those of a head that
    read the whole prompt at once (its cache and the hidden state its next row reads)."""
    import mlx.core as mx
    import numpy as np

    from mtp_engine.generation.profiler import Profiler
    from mtp_engine.generation.sampling import Sampler, SamplerConfig
    from mtp_engine.speculative.drafter import DraftContext
    from mtp_engine.speculative.mtp_drafter import MTPDrafter

    m = tiny_any
    ids = m.tokenizer.encode(PROMPT)
    post = m.model.forward(mx.array([ids[:-1]]), m.model.make_cache())
    start = 37
    ctx = DraftContext(m.model, Sampler(SamplerConfig()), Profiler())
    whole = MTPDrafter(ctx)
    whole.start(ids, 0, None)
    whole.read(ids[:-1], post)
    earlier = MTPDrafter(ctx)
    earlier.start(ids[:start + 1], 0, None)
    earlier.read(ids[:start], post[:, :start])
    later = MTPDrafter(ctx)
    later.start(ids, start, earlier.prefix_state())
    later.read(ids[start:-1], post[:, start:])
    assert later.cache.offset == whole.cache.offset == len(ids) - 1
    for a, b in zip(later.cache.state(), whole.cache.state()):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.array(later.h_last), np.array(whole.h_last), rtol=1e-6)
    with pytest.raises(MTPEngineError, match="prompt cache"):
        MTPDrafter(ctx).start(ids, start + 1, earlier.prefix_state())


def test_slots_keep_interleaved_conversations(tiny_any):
    """Two conversations taking turns: with two slots each finds its own state, with one each
    evicts the other's; a byte bound keeps only what fits (always the newest)."""
    def turns(pc):
        a = generate(PROMPT, model=tiny_any, max_tokens=3, prompt_cache=pc)
        b = generate("Another conversation. " * 10, model=tiny_any, max_tokens=3, prompt_cache=pc)
        a2 = generate(_next_turn(tiny_any, a), model=tiny_any, max_tokens=3, prompt_cache=pc)
        b2 = generate(_next_turn(tiny_any, b), model=tiny_any, max_tokens=3, prompt_cache=pc)
        return a2.stats["cached_prompt_tokens"], b2.stats["cached_prompt_tokens"]

    two = turns(PromptCache(slots=2))
    assert two[0] > 0 and two[1] > 0
    assert turns(PromptCache(slots=1)) == (0, 0)
    assert turns(PromptCache(slots=2, max_bytes=1)) == (0, 0)
    pc = PromptCache(slots=3)
    generate(PROMPT, model=tiny_any, max_tokens=2, spec="draft-mtp", n_max=2, prompt_cache=pc)
    assert pc.nbytes() > 0 and pc.tokens == len(tiny_any.tokenizer.encode(PROMPT)) - 1
    pc.clear()
    assert pc.nbytes() == 0 and pc.tokens == 0
    with pytest.raises(MTPEngineError):
        PromptCache(slots=0)


def test_threads_sharing_one_cache(tiny_any):
    """Two threads, one cache (two slots), each continuing its own conversation: the answers are
    those of generations without a cache."""
    from concurrent.futures import ThreadPoolExecutor

    pc = PromptCache(slots=2)
    prompts = [PROMPT, "Another conversation altogether. " * 8]

    def converse(p):
        a = generate(p, model=tiny_any, max_tokens=4, prompt_cache=pc)
        ids = _next_turn(tiny_any, a)
        return ids, generate(ids, model=tiny_any, max_tokens=8, prompt_cache=pc).token_ids

    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(converse, prompts))
    for ids, tokens in results:
        assert tokens == generate(ids, model=tiny_any, max_tokens=8).token_ids


@pytest.mark.parametrize("kw", SPECS, ids=["plain", "draft-mtp"])
def test_a_state_taken_while_its_generation_runs_is_not_shared(tiny_any, kw):
    """Generation A keeps its prompt's state and goes on decoding; B, whose prompt starts with it,
    takes the state while A still runs, and the two streams then advance in turn. Each must give
    what it gives alone (the kept caches were once handed over live: B rewound A's caches and both
    wrote into the same buffers)."""
    pc = PromptCache(slots=2)
    tok = tiny_any.tokenizer
    a_ids = tok.encode(PROMPT)
    b_ids = a_ids + tok.encode(" Whether tis nobler in the mind to suffer")
    ref_a = generate(a_ids, model=tiny_any, max_tokens=24, **kw).token_ids
    ref_b = generate(b_ids, model=tiny_any, max_tokens=24, **kw).token_ids
    sa = stream_generate(a_ids, model=tiny_any, max_tokens=24, prompt_cache=pc, **kw)
    got = {"a": [], "b": []}
    got["a"] += next(sa).token_ids  # A prefilled and kept its state; it has not finished
    sb = stream_generate(b_ids, model=tiny_any, max_tokens=24, prompt_cache=pc, **kw)
    streams = {"a": sa, "b": sb}
    while streams:
        for name in list(streams):
            try:
                chunk = next(streams[name])
            except StopIteration:
                del streams[name]
                continue
            got[name] += chunk.token_ids
            if chunk.stats and name == "b":
                assert chunk.stats["cached_prompt_tokens"] == len(a_ids) - 1  # B did reuse A's state
    assert got["a"] == ref_a and got["b"] == ref_b
    # A has ended: its state is handed over as it is now
    c = generate(b_ids, model=tiny_any, max_tokens=24, prompt_cache=pc, **kw)
    assert c.token_ids == ref_b


def test_a_forked_kv_cache_never_sees_the_other_ones_writes():
    """`KVCache.view` (a kept state forked for a second generation while the first goes on): each
    cache's later writes stay its own, whichever writes first (`update` writes in place)."""
    import mlx.core as mx

    from mtp_engine.model.kv_cache import KVCache

    def row(value):
        return mx.full((1, 1, 1, 2), float(value))

    for first in ("original", "fork"):
        a = KVCache(1, 2)
        a.update(mx.ones((1, 1, 3, 2)), mx.ones((1, 1, 3, 2)))
        b = a.view(2)  # the fork keeps 2 positions; a goes on from 3
        writes = [(a, 5), (b, 7)] if first == "original" else [(b, 7), (a, 5)]
        for cache, value in writes:
            cache.update(row(value), row(value))
        assert a.keys[0, 0, :4, 0].tolist() == [1, 1, 1, 5] and a.values[0, 0, :4, 0].tolist() == [1, 1, 1, 5]
        assert b.keys[0, 0, :3, 0].tolist() == [1, 1, 7] and b.values[0, 0, :3, 0].tolist() == [1, 1, 7]
