"""Joining prompts read together: fresh prompts of 2 tokens to a chunk, padded to their
group's longest and read in one forward (`batching.joint_read`), each row computing what
its prompt computes alone (`Qwen35Model.read_arithmetic`, `BatchCache.begin_rows`). The references
are the same requests run alone by `generate`."""
from __future__ import annotations

import threading

import pytest

from mtp_engine import EngineOptions, PromptCache, batch_generate, generate
from mtp_engine.batching import joint_read
from mtp_engine.model.delta_rule import chunking

from tests.batching.admission import admit_together
from tests.conftest import MOE_Q4, SHIPPED, TINY_Q4, TINY_Q8, need

JOINT = EngineOptions(joint_read=True)  # (the CPU's default is off: `EngineOptions`)
# 20-70 tokens each: the chunked delta rule, one or two chunks, one prefill chunk
PROMPTS = ["def parse_args(argv):\n    \"\"\"Parse the command line of the tool and return the options.\"\"\"\n",
           "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n",
           "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Run the tool.\"\"\"\n    for a in argv:\n",
           "for i in range(10):\n    print(i * i)\n# now the same for a list of words\nwords = ["]
# 3-13 tokens: the delta rule token by token (the CUDA kernel on a GPU), each row to its own length
SHORT = ["def add(a, b):\n", "import numpy as np\n", "x = [1, 2, 3]\nprint(",
         "class Node:\n    def __init__(self, value):\n", "while True:"]


def _groups(monkeypatch) -> list[list[int]]:
    """The prompts' token counts of each group read together."""
    seen: list[list[int]] = []
    read = joint_read.read_group

    def spy(model, group, width, joined):
        seen.append([len(s.reader.next_ids()) for s in group])
        return read(model, group, width, joined)

    monkeypatch.setattr(joint_read, "read_group", spy)
    return seen


@pytest.mark.parametrize("path", [SHIPPED, TINY_Q4, TINY_Q8], ids=["trained", "tiny-q4", "tiny-q8"])
def test_prompts_read_together_answer_as_each_alone(models, monkeypatch, path):
    """Four prompts of 20-70 tokens through four slots: those whose delta rule has one chunking
    are read in one forward, each padded to the longest; every answer is its answer alone."""
    m = models(need(path), options=JOINT)
    want = [generate(p, m, max_tokens=10, ignore_eos=True).token_ids for p in PROMPTS]
    admit_together(monkeypatch, len(PROMPTS))
    seen = _groups(monkeypatch)
    got = batch_generate(PROMPTS, m, max_tokens=10, ignore_eos=True, parallel=4)
    assert [g.token_ids for g in got] == want
    assert seen and max(len(g) for g in seen) >= 2, seen
    for g in seen:  # a group's rows take their own chunking at the group's length
        assert all(chunking(n) == chunking(max(g)) for n in g) and all(n > 16 for n in g), seen
    sizes = [len(m.tokenizer.encode(p)) for p in PROMPTS]
    together = {n for g in seen for n in g}
    # every prompt that shares its chunking with another was read beside it
    assert together == {n for n in sizes if sum(chunking(x) == chunking(n) for x in sizes) > 1}, (seen, sizes)


@pytest.mark.parametrize("path", [SHIPPED, TINY_Q4], ids=["trained", "tiny-q4"])
def test_short_prompts_read_together_answer_as_each_alone(models, monkeypatch, path):
    """Five prompts of 3-13 tokens (the delta rule's token steps, each row stopping at its own
    length) through five slots: read in one forward, each answer its answer alone (without
    the masking of the padded tokens the tiny model's answers differ); where the fused CUDA kernel
    steps them alone, each read alone."""
    m = models(need(path), options=JOINT)
    want = [generate(p, m, max_tokens=10, ignore_eos=True).token_ids for p in SHORT]
    admit_together(monkeypatch, len(SHORT))
    seen = _groups(monkeypatch)
    got = batch_generate(SHORT, m, max_tokens=10, ignore_eos=True, parallel=len(SHORT))
    assert [g.token_ids for g in got] == want
    steps = sorted(n for n in (len(m.tokenizer.encode(p)) for p in SHORT) if n <= 16)  # (the tiny
    # models' tokenizer makes some of them longer)
    assert len(steps) >= 3
    if m.model.read_arithmetic(max(steps), max(steps))[0] == "kernel":
        # a GPU's fused delta-net kernel steps them alone and has no per-row length: each reads alone
        assert not [g for g in seen if max(g) <= 16], seen
        return
    assert any(len(g) >= 2 and max(g) <= 16 for g in seen), seen
    if m.model.read_arithmetic(max(steps), len(steps) * max(steps), apart=True) == \
            m.model.read_arithmetic(min(steps), min(steps)):
        assert sorted(n for g in seen for n in g if n <= 16) == steps, seen  # one arithmetic: all together


def test_no_prompt_is_read_beside_others_where_its_arithmetic_alone_cannot_be_kept(models, monkeypatch):
    """A mixture of experts (routing gathers the rows per expert) and prompts whose delta rule the
    fused CUDA kernel steps alone (it has no per-row length) are each read alone, as alone."""
    moe = models(need(MOE_Q4), options=JOINT)
    admit_together(monkeypatch, len(PROMPTS))
    seen = _groups(monkeypatch)
    got = batch_generate(PROMPTS, moe, max_tokens=4, ignore_eos=True, parallel=4)
    assert not seen and [g.token_ids for g in got] == [generate(p, moe, max_tokens=4, ignore_eos=True).token_ids
                                                       for p in PROMPTS]
    m = models(SHIPPED, options=JOINT)
    model = type(m.model)
    arithmetic = model.read_arithmetic

    def kernel_steps(self, tokens, rows, apart=False):  # what a GPU with the fused delta-net kernel answers
        rule, paths = arithmetic(self, tokens, rows, apart)
        return ("kernel" if tokens <= 16 and not apart else rule), paths

    monkeypatch.setattr(model, "read_arithmetic", kernel_steps)
    admit_together(monkeypatch, len(SHORT))
    batch_generate(SHORT, m, max_tokens=2, ignore_eos=True, parallel=len(SHORT))
    assert not seen


def test_joint_reads_can_be_turned_off(models, monkeypatch):
    """`EngineOptions(joint_read=False)` (MTP_ENGINE_JOINT_READ=0): each prompt in a forward of its
    own, the same answers."""
    m = models(SHIPPED, options=EngineOptions(joint_read=False))
    admit_together(monkeypatch, len(PROMPTS))
    seen = _groups(monkeypatch)
    got = batch_generate(PROMPTS, m, max_tokens=6, ignore_eos=True, parallel=4)
    assert not seen and [g.token_ids for g in got] == [generate(p, m, max_tokens=6, ignore_eos=True).token_ids
                                                       for p in PROMPTS]


def test_sampled_prompts_read_together_draw_as_alone(models, monkeypatch):
    """Seeded sampled requests read together draw their first tokens, and all after them, as
    alone (each row's sampler reads its own row's logits)."""
    m = models(SHIPPED, options=JOINT)
    kw = dict(max_tokens=8, ignore_eos=True, temperature=0.9, top_p=0.95, seed=3)
    want = [generate(p, m, **kw).token_ids for p in PROMPTS]
    admit_together(monkeypatch, len(PROMPTS))
    seen = _groups(monkeypatch)
    got = batch_generate(PROMPTS, m, parallel=4, **kw)
    assert [g.token_ids for g in got] == want and seen


def test_prompts_read_together_keep_their_prompt_cache_state(models, monkeypatch):
    """With a prompt cache each prompt's state before its last token is kept (the joint read
    stops there, each last token read alone): a next turn through the batch reuses it and answers
    as alone."""
    m = models(SHIPPED, parallel=4, options=JOINT)
    alone = models(SHIPPED)
    admit_together(monkeypatch, len(PROMPTS))
    seen = _groups(monkeypatch)
    caches = [PromptCache() for _ in PROMPTS]
    out: dict[int, tuple] = {}

    def one(i):
        a = generate(PROMPTS[i], m, max_tokens=6, ignore_eos=True, prompt_cache=caches[i])
        out[i] = (a.token_ids, len(a.prompt_token_ids))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen and max(len(g) for g in seen) >= 2, seen
    monkeypatch.undo()  # the next turns arrive one by one
    for i, p in enumerate(PROMPTS):
        turn2 = p + "    return None\n"
        b = generate(turn2, m, max_tokens=6, ignore_eos=True, prompt_cache=caches[i])
        assert b.stats["cached_prompt_tokens"] == out[i][1] - 1
        ref = PromptCache()
        generate(p, alone, max_tokens=6, ignore_eos=True, prompt_cache=ref)
        assert out[i][0] == generate(p, alone, max_tokens=6, ignore_eos=True).token_ids
        assert b.token_ids == generate(turn2, alone, max_tokens=6, ignore_eos=True, prompt_cache=ref).token_ids
