"""One way of reading a prompt (`generation.prompt_read`), alone and in a batch: a drafter's head
reads each chunk beside the trunk (nothing of a long prompt's hidden states is held past its
chunk), and a prompt cache's state is kept again by every generation that took it."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tests.conftest import SHIPPED

PROMPT = "def area(r):\n    return 3.14159 * r * r\n\n\ndef perimeter(r):\n    return 2 * 3.14159 * r\n"


def _head_rows(monkeypatch) -> list[int]:
    """The rows of each chunk the MTP head reads of a prompt, as they are read."""
    from mtp_engine.speculative.mtp_drafter import HeadReader

    rows: list[int] = []
    read = HeadReader.read

    def spy(self, ids, hidden):
        rows.append(hidden.shape[1])
        read(self, ids, hidden)

    monkeypatch.setattr(HeadReader, "read", spy)
    return rows


def test_a_drafting_prompt_is_read_a_chunk_at_a_time_with_the_head_beside_the_trunk(models, monkeypatch):
    from mtp_engine import EngineOptions, generate
    m = models(SHIPPED, options=EngineOptions(prefill_chunk=8))
    n = len(m.tokenizer.encode(PROMPT))
    rows = _head_rows(monkeypatch)
    got = generate(PROMPT, m, max_tokens=8, ignore_eos=True, spec="draft-mtp", n_max=2)
    assert n > 3 * 8 and rows and max(rows) <= 8 and sum(rows) == n - 1, (n, rows)
    assert got.token_ids == generate(PROMPT, m, max_tokens=8, ignore_eos=True).token_ids


@pytest.mark.parametrize("chunk", [64, 512, 4096, 8192])
def test_a_chunk_deep_in_a_long_prompt_shrinks_so_that_its_attention_scores_stay_bounded(chunk):
    from mtp_engine.model.memory import SCORE_POSITIONS, prefill_chunk_at

    limit = chunk * max(chunk, SCORE_POSITIONS)
    sizes = [prefill_chunk_at(chunk, offset) for offset in range(0, 131072, 97)]
    assert sizes[0] == chunk and all(a >= b for a, b in zip(sizes, sizes[1:])), "shrinks as the prompt goes on"
    for offset in range(0, 131072, 97):
        c = prefill_chunk_at(chunk, offset)
        assert 0 < c <= chunk and (c == chunk or c % 64 == 0), (offset, c)
        if chunk * (offset + chunk) <= limit:
            assert c == chunk, (offset, c)  # full-sized while its scores fit
        elif c > 64:
            assert c * (offset + c) <= limit and (c + 64) * (offset + c + 64) > limit, (offset, c)
        # what the memory estimate counts per head for a context of offset + c positions
        positions = offset + c
        assert c * positions <= max(chunk * min(positions, max(chunk, SCORE_POSITIONS)), min(64, chunk) * positions)


@pytest.fixture(scope="module")
def read_whole(models) -> tuple[int, list[int]]:
    """The long prompt's token count and its answer read in one chunk (both parameters' reference)."""
    from mtp_engine import EngineOptions, generate

    whole = models(SHIPPED, options=EngineOptions(prefill_chunk=2048))
    prompt = PROMPT * 5
    return len(whole.tokenizer.encode(prompt)), generate(prompt, whole, max_tokens=8, ignore_eos=True).token_ids


@pytest.mark.parametrize("where", ["alone", "batch"])
def test_a_long_prompt_read_in_shrinking_chunks_decodes_as_when_read_whole(models, monkeypatch, where,
                                                                             read_whole):
    """Bounded scores shrink a long prompt's later chunks (here a bound of 128 positions, so that a
    prompt of a few hundred tokens shows it), alone and joining a batch: trunk and head read every
    token once, and the tokens are those of the same prompt read alone in one chunk."""
    from mtp_engine import EngineOptions, generate
    from mtp_engine.batching import batch_scheduler
    from mtp_engine.model import memory

    prompt = PROMPT * 5
    n, want = read_whole
    monkeypatch.setattr(memory, "SCORE_POSITIONS", 128)
    rows = _head_rows(monkeypatch)
    m = models(SHIPPED, options=EngineOptions(prefill_chunk=128))
    if where == "batch":
        m = replace(m, scheduler=None)
        m = replace(m, scheduler=batch_scheduler(m, 2))
    try:
        got = generate(prompt, m, max_tokens=8, ignore_eos=True, spec="draft-mtp", n_max=2)
        assert n > 180 and sum(rows) == n - 1 and rows[0] == 128 and 64 in rows, (n, rows)
        assert got.token_ids == want
        assert generate(prompt, m, max_tokens=8, ignore_eos=True).token_ids == want
    finally:
        if where == "batch":
            m.scheduler.stop()


@pytest.mark.parametrize("where", ["alone", "batch"])
def test_a_prompt_taken_whole_from_the_cache_is_kept_again(shipped_model, where):
    """The same draft-mtp prompt three times: the second takes the first's kept state (nothing left
    to read but the last token, which its first round reads) and keeps it again for the third
    (taken and not kept again, the third would read the whole prompt)."""
    from mtp_engine import PromptCache, generate
    from mtp_engine.batching import batch_scheduler

    m = shipped_model
    if where == "batch":
        m = replace(m, scheduler=None)
        m = replace(m, scheduler=batch_scheduler(m, 2))
    cache = PromptCache()
    try:
        runs = [generate(PROMPT, m, max_tokens=6, spec="draft-mtp", n_max=2, prompt_cache=cache) for _ in range(3)]
    finally:
        if where == "batch":
            m.scheduler.stop()
    n = len(runs[0].prompt_token_ids)
    assert [r.stats["cached_prompt_tokens"] for r in runs] == [0, n - 1, n - 1]
    assert runs[1].token_ids == runs[2].token_ids == runs[0].token_ids


@pytest.mark.parametrize("where", ["alone", "batch"])
def test_the_device_running_out_of_memory_is_said_as_the_engines_error(models, monkeypatch, where):
    """MLX's allocator failing inside a prompt's reading (a memory estimate that let through what
    did not fit) reaches the caller as an `MTPEngineError` naming memory and what to change, alone
    and in a batch (named as that prompt's); anything else still raises as itself."""
    from mtp_engine import EngineOptions, MTPEngineError, batch_generate, generate
    from mtp_engine.generation.prompt_read import PromptReader

    m = models(SHIPPED, options=EngineOptions(prefill_chunk=8))
    read = PromptReader.read_chunk
    failure = RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory")

    def chunk(self, wait=True):
        if len(self.ids) > 20:
            raise failure
        return read(self, wait)

    monkeypatch.setattr(PromptReader, "read_chunk", chunk)
    with pytest.raises(MTPEngineError, match=r"memory: the device ran out of memory .*MTP_ENGINE_PREFILL_CHUNK") as e:
        if where == "alone":
            generate(PROMPT, m, max_tokens=4)
        else:
            batch_generate(["def f(x):", PROMPT], m, max_tokens=4, parallel=2)
    assert e.value.__cause__ is failure or e.value.__cause__.__cause__ is failure
    if where == "batch":
        assert "prompts[1]" in str(e.value)
    failure = RuntimeError("something else")
    with pytest.raises(RuntimeError, match="something else"):
        generate(PROMPT, m, max_tokens=4)
