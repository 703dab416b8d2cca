"""Continuous batching (mtp_engine.batching): many sequences in one forward per step, each exactly
as it decodes alone. The references are the same requests run one at a time by `generate`."""
from __future__ import annotations

import random
from dataclasses import replace
import threading
import time

import mlx.core as mx
import pytest

from mtp_engine import MTPEngineError, batch_generate, generate, stream_generate
from mtp_engine.model.batch_cache import BatchCache

from tests.batching.admission import admit_together
from tests.conftest import MOE_Q4, SHIPPED, TINY_Q4, need

# mixed lengths: 1 token, a few, a few dozen (two prefill chunks when the chunk is made small)
PROMPTS = ["x", "def fib(n):", "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(",
           "import os\nimport sys\n\n\ndef main(argv):\n    \"\"\"Parse the arguments and run the tool.\"\"\"\n",
           "for i in range(10):"]


def _alone(model, prompts, **kw):
    return [generate(p, model, **kw) for p in prompts]


@pytest.mark.parametrize("path", [SHIPPED, TINY_Q4, MOE_Q4], ids=["trained", "tiny", "moe"])
def test_batch_greedy_equals_each_alone(models, path):
    """Five prompts of mixed lengths through 2 slots (sequences join and leave as others end):
    every token as when the prompt runs alone."""
    m = models(need(path))
    want = _alone(m, PROMPTS, max_tokens=12, ignore_eos=True)
    got = batch_generate(PROMPTS, m, max_tokens=12, ignore_eos=True, parallel=2)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.text for g in got] == [w.text for w in want]
    assert [g.prompt_token_ids for g in got] == [w.prompt_token_ids for w in want]
    assert max(g.stats["batch_size_max"] for g in got) == 2  # they did share steps


@pytest.mark.parametrize("extra", [dict(repeat_penalty=1.3, presence_penalty=0.5), dict(min_p=0.05),
                                   dict(spec="draft-mtp", n_max=2), dict(spec="draft-mtp", n_max=3, top_k=0, logprobs=2)],
                         ids=["penalties-host", "device", "draft-mtp-2", "draft-mtp-3-logprobs"])
def test_batch_sampling_and_penalties_equal_each_alone(shipped_model, extra):
    """Each sequence keeps its own sampler: seeded draws, top-k/p, penalties as alone. Rows drawn
    on the device (no penalties) draw their keys in the order they do alone, so a seeded answer
    is the same in a batch, drafting rounds included (a fixed n-max: the rounds are alone's)."""
    kw = {**dict(max_tokens=10, ignore_eos=True, temperature=0.9, top_k=20, top_p=0.95, seed=7), **extra}
    want = _alone(shipped_model, PROMPTS[:4], **kw)
    got = batch_generate(PROMPTS[:4], shipped_model, parallel=3, **kw)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    if "logprobs" in extra:  # computed on the device with the round, as alone (to the rows' rounding)
        for g, w in zip(got, want):
            assert [(a["token"], [t for t, _ in a["top"]]) for a in g.logprobs] == \
                [(b["token"], [t for t, _ in b["top"]]) for b in w.logprobs] and len(g.logprobs) == 10
            assert [a["logprob"] for a in g.logprobs] == pytest.approx([b["logprob"] for b in w.logprobs], abs=1e-4)
    if extra.get("spec"):  # sampled rows draft in a batch, and their drafts are kept
        assert all(g.stats["drafted"] for g in got) and sum(g.stats["accepted"] for g in got) > 0


def test_each_rows_p_min_and_n_min_decide_its_drafts_as_alone(shipped_model):
    """A request's --spec-draft-p-min / -n-min hold in a batch as alone: per row, on the device;
    the same tokens and the same drafts counted and accepted (rows of different knobs share rounds)."""
    from mtp_engine.batching import batch_scheduler

    knobs = [dict(p_min=0.6), dict(p_min=0.5, n_min=2), dict(), dict(p_min=0.6, temperature=0.8, seed=2,
                                                                     repeat_penalty=1.2)]
    kw = dict(max_tokens=16, ignore_eos=True, spec="draft-mtp", n_max=3)
    want = [generate(p, shipped_model, **kw, **k) for p, k in zip(PROMPTS[1:5], knobs)]
    m = replace(shipped_model, scheduler=None)
    m = replace(m, scheduler=batch_scheduler(m, 4))
    got: dict[int, object] = {}
    _in_threads(lambda i: got.__setitem__(i, generate(PROMPTS[1 + i], m, **kw, **knobs[i])), range(4))
    m.scheduler.stop()
    for i, w in enumerate(want):
        g = got[i]
        assert (g.token_ids, g.stats["drafted"], g.stats["accepted"]) == \
            (w.token_ids, w.stats["drafted"], w.stats["accepted"]), (i, knobs[i])
    assert got[0].stats["drafted"] < 3 * got[0].stats["rounds"]  # p-min dropped some drafts


def test_batch_stops_and_logprobs_per_sequence(shipped_model):
    kw = dict(max_tokens=16, stop=["\n\n", "return"], logprobs=2)
    want = _alone(shipped_model, PROMPTS, **kw)
    got = batch_generate(PROMPTS, shipped_model, parallel=3, **kw)
    for g, w in zip(got, want):
        assert (g.token_ids, g.text, g.finish_reason) == (w.token_ids, w.text, w.finish_reason)
        assert [lp["token"] for lp in g.logprobs] == [lp["token"] for lp in w.logprobs]
        for a, b in zip(g.logprobs, w.logprobs):
            assert a["logprob"] == pytest.approx(b["logprob"], abs=1e-4)


@pytest.mark.parametrize("spec", ["none", "draft-mtp"])
def test_long_prompt_prefills_in_chunks_beside_running_streams(models, spec):
    """Prompts of several chunks (4 tokens a chunk) read a chunk at a time between the running
    streams' steps answer as they do alone, where the same chunks are read at once."""
    from mtp_engine import EngineOptions

    m = models(SHIPPED, options=EngineOptions(prefill_chunk=4))
    want = _alone(m, PROMPTS, max_tokens=6, ignore_eos=True, spec=spec)
    got = batch_generate(PROMPTS, m, max_tokens=6, ignore_eos=True, parallel=4, spec=spec)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]


@pytest.mark.parametrize("spec", ["none", "draft-mtp"])
def test_prompts_longer_than_a_chunk_batch_at_the_real_chunk_size(models, spec):
    """A prompt of more than one real prefill chunk (512 tokens) beside short ones, through
    `batch_generate` and through threads on a `load(parallel=2)` model: every answer as alone
    (the MTP batch used to fail every sequence when no joining prompt finished in a chunk)."""
    from mtp_engine import EngineOptions, load

    # chunks of 512 on every device (the CPU's default; a GPU's 4096 exceeds the tiny model's context)
    opts = EngineOptions(prefill_chunk=512)
    tiny = load(need(TINY_Q4), options=opts)
    long = "".join(f"x{i} = {i} * {i}\n" for i in range(85))
    assert len(tiny.tokenizer.encode(long)) > 2 * tiny.options.prefill_chunk
    prompts = [PROMPTS[1], long, PROMPTS[2]]
    want = _alone(tiny, prompts, max_tokens=6, ignore_eos=True, spec=spec)
    got = batch_generate(prompts, tiny, max_tokens=6, ignore_eos=True, parallel=3, spec=spec)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    par = load(need(TINY_Q4), options=opts, parallel=2)
    out: dict[int, list[int]] = {}
    try:
        _in_threads(lambda i: out.__setitem__(i, generate(prompts[i], par, max_tokens=6, ignore_eos=True,
                                                           spec=spec).token_ids), range(3))
    finally:
        par.scheduler.stop()
    assert [out[i] for i in range(3)] == [w.token_ids for w in want]


def test_batch_refusals_name_the_field(shipped_model):
    with pytest.raises(MTPEngineError) as e:
        batch_generate(["a", "b\ud800"], shipped_model, max_tokens=2)
    assert "prompts[1]" in str(e.value) and e.value.field == "prompt"
    with pytest.raises(MTPEngineError) as e:
        batch_generate(["a"], shipped_model, max_tokens=2, spec="ngram")
    assert e.value.field == "spec"
    with pytest.raises(MTPEngineError) as e:
        batch_generate(["a"], shipped_model, max_tokens=2, profile="round")
    assert e.value.field == "profile"
    for bad in ([], "abc", None):
        with pytest.raises(MTPEngineError) as e:
            batch_generate(bad, shipped_model)
        assert e.value.field == "prompts"
    with pytest.raises(MTPEngineError) as e:
        batch_generate(["a"], shipped_model, parallel=0)
    assert e.value.field == "parallel"


@pytest.mark.parametrize("spec", ["none", "draft-mtp"])
def test_a_prefill_that_fails_ends_only_its_own_sequences(models, monkeypatch, spec):
    """An error inside a prefill chunk (MLX raising, say) fails that prompt with the engine's error
    type, named by `batch_generate` as prompts[i]; the streams already decoding go on to their
    answers."""
    from mtp_engine.batching.scheduler import BatchScheduler

    tiny = models(need(TINY_Q4))
    bad = "zzz bad prompt"
    prefill = BatchScheduler._prefill_chunk  # (an MTP batch's too)

    def failing(self, s):
        if tiny.tokenizer.decode(s.prompt_ids) == bad:
            raise ValueError("[concatenate] No arrays provided for concatenation")
        return prefill(self, s)

    monkeypatch.setattr(BatchScheduler, "_prefill_chunk", failing)
    prompts = [PROMPTS[1], PROMPTS[2], bad]
    with pytest.raises(MTPEngineError) as e:
        batch_generate(prompts, tiny, max_tokens=8, ignore_eos=True, parallel=2, spec=spec)
    assert "prompts[2]" in str(e.value) and "ValueError" in str(e.value)
    want = _alone(tiny, prompts[:2], max_tokens=200, ignore_eos=True, spec=spec)
    par = models(need(TINY_Q4), parallel=3)

    def later(i):
        if i == 2:  # it joins once the others decode
            deadline = time.time() + 30
            while len(par.scheduler._rows) < 2 and time.time() < deadline:
                time.sleep(0.002)
        return dict(max_tokens=200, ignore_eos=True, spec=spec)

    out = _answers_in_threads(par, prompts, later)
    assert [out[0], out[1]] == [w.token_ids for w in want]
    assert isinstance(out[2], MTPEngineError), out[2]


def test_a_sequence_whose_sampler_fails_mid_decode_ends_alone(models, monkeypatch):
    """A row's own sampling failing inside a round (its grammar library or sampler raising,
    say) fails that sequence with the engine's error type; the rows beside it in the same rounds
    decode on to their answers."""
    pytest.importorskip("llguidance")
    from mtp_engine import Constraint
    from mtp_engine.generation.sampling import Sampler

    tiny = models(need(TINY_Q4))
    sample = Sampler.sample
    drawn = {"n": 0}

    def failing(self, logits):
        if self.cfg.seed == 666:
            drawn["n"] += 1
            if drawn["n"] == 3:
                raise ValueError("the grammar library gave up")
        return sample(self, logits)

    monkeypatch.setattr(Sampler, "sample", failing)
    want = _alone(tiny, PROMPTS[:2], max_tokens=24, ignore_eos=True)
    par = models(need(TINY_Q4), parallel=3)
    # a grammar's row: sampled on the host each round (a row drawn on the device never calls `sample`)
    out = _answers_in_threads(par, PROMPTS[:3], lambda i: dict(
        max_tokens=24, **(dict(temperature=0.7, seed=666, constraint=Constraint.regex(r"[a-z ]+")) if i == 2
                          else dict(ignore_eos=True))))
    assert [out[0], out[1]] == [w.token_ids for w in want]
    assert isinstance(out[2], MTPEngineError) and "ValueError" in str(out[2]), out[2]



def test_a_first_token_that_fails_ends_only_its_own_sequence(models, monkeypatch):
    """Prompts that finish their prefill in one step have their first tokens read after all of them
    are queued; one whose first draw fails (its sampler raising) ends alone, with the engine's
    error type, and the others answer as alone."""
    from mtp_engine.generation.sampling import Sampler

    tiny = models(need(TINY_Q4))
    bad = tiny.tokenizer.encode(PROMPTS[3])
    sample = Sampler.sample

    def failing(self, logits):
        if self.history.tokens == bad:
            raise ValueError("the sampler gave up")
        return sample(self, logits)

    monkeypatch.setattr(Sampler, "sample", failing)
    want = _alone(tiny, PROMPTS[:3], max_tokens=12, ignore_eos=True)
    out = _answers_in_threads(models(need(TINY_Q4), parallel=4), PROMPTS[:4],
                              lambda i: dict(max_tokens=12, ignore_eos=True))
    assert [out[i] for i in range(3)] == [w.token_ids for w in want]
    assert isinstance(out[3], MTPEngineError) and "ValueError" in str(out[3]), out[3]

def test_joining_prompts_are_read_back_to_back_each_first_token_read_behind_the_next(models, monkeypatch):
    """Short prompts that join together have their last chunks queued without a wait, each
    prompt's first token read once the next prompt's forward is queued (a wait per prompt left the
    device idle while the host built the next prompt's forward; one wait for all would hold the
    first joiner's token until the last's forward ran); a long prompt's earlier chunks still wait
    (one chunk of memory at a time). Answers as alone."""
    from mtp_engine import EngineOptions
    from mtp_engine.batching.scheduler import QUEUED_TOKENS
    from mtp_engine.generation.prompt_read import PromptReader
    from mtp_engine.generation.sampling import Sampler

    m = models(need(TINY_Q4), options=EngineOptions(prefill_chunk=QUEUED_TOKENS))
    events = []
    read, sample = PromptReader.read_chunk, Sampler.sample

    def reading(self, wait=True):
        events.append(("read", wait))
        return read(self, wait)

    def sampling(self, logits):
        events.append(("sample", None))
        return sample(self, logits)

    monkeypatch.setattr(PromptReader, "read_chunk", reading)
    monkeypatch.setattr(Sampler, "sample", sampling)
    long = PROMPTS[3] * 4  # more than one chunk: its first chunk waits
    assert len(m.tokenizer.encode(long)) > QUEUED_TOKENS
    prompts = PROMPTS[:3] + [long]
    want = _alone(m, prompts, max_tokens=6, ignore_eos=True)
    events.clear()
    # the long prompt joins last, whichever reader thread submits first
    admit_together(monkeypatch, len(prompts), order=lambda s: len(s.prompt_ids) > QUEUED_TOKENS)
    got = batch_generate(prompts, m, max_tokens=6, ignore_eos=True, parallel=4)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    read, drew = ("read", False), ("sample", None)
    assert events[:6] == [read, read, drew, read, drew, drew], events
    assert ("read", True) in events[6:] and events.count(read) == 4, events


# ---- stream_generate from many threads, on a model loaded with parallel= --------------------------

@pytest.fixture(scope="module")
def parallel_model(models):
    return models(SHIPPED, parallel=4)


def test_threads_share_batched_steps_and_overlap(parallel_model, shipped_model):
    """8 threads stream at once: each gets its sequential output, and the streams overlap (every
    first token arrives before the first stream ends), instead of running one after another."""
    prompts = [f"def f{i}(x):\n    return" for i in range(8)]
    want = [r.token_ids for r in _alone(shipped_model, prompts, max_tokens=12, ignore_eos=True)]
    got: dict[int, list[int]] = {}
    first: dict[int, float] = {}
    ended: dict[int, float] = {}
    errors: list[BaseException] = []

    def read(i: int) -> None:
        try:
            toks = []
            for c in stream_generate(prompts[i], parallel_model, max_tokens=12, ignore_eos=True):
                if c.token_ids and i not in first:
                    first[i] = time.perf_counter()
                toks += c.token_ids
            ended[i] = time.perf_counter()
            got[i] = toks
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    _in_threads(read, range(8))
    assert not errors and [got[i] for i in range(8)] == want
    # 4 slots: the first four streams to start all start before any stream ends
    assert sorted(first.values())[3] < min(ended.values())
    s = parallel_model.scheduler
    assert s.running == 0 and s.waiting == 0


def test_random_cancellations_leak_no_slot(models):
    """200 streams (draft-mtp and plain), many closed after a random number of chunks: every slot
    comes back free."""
    rng = random.Random(3)
    tiny = models(TINY_Q4, parallel=4)
    s = tiny.scheduler

    def read(i: int) -> None:
        gen = stream_generate(f"x = {i}", tiny, max_tokens=8, ignore_eos=True, spec="draft-mtp" if i % 2 else None)
        stop_after = rng.randrange(0, 10)
        for n, _ in enumerate(gen):
            if n >= stop_after:
                break
        gen.close()

    for batch in range(10):
        _in_threads(read, range(20 * batch, 20 * batch + 20))
    deadline = time.time() + 10
    while (s.running or s.waiting) and time.time() < deadline:
        time.sleep(0.01)
    assert s.running == 0 and s.waiting == 0
    assert len(s._batch) == 0


def test_requests_the_batch_cannot_take_run_alone(parallel_model, shipped_model):
    """ngram and profiled requests on a batching model still work (alone, not in the batch)."""
    b = generate("def fib(n):", shipped_model, max_tokens=8)
    a = generate("def fib(n):", parallel_model, max_tokens=8, spec="ngram", n_max=2)
    assert a.token_ids == b.token_ids and "batch_size_mean" not in a.stats
    a = generate("def fib(n):", parallel_model, max_tokens=8, profile="round")
    assert a.token_ids == b.token_ids and "profile" in a.stats


# ---- draft-mtp in batches ------------------------------------------------------------------------

def test_greedy_batches_queue_the_next_step_before_reading_this_one(models, monkeypatch):
    """With every row greedy the scheduler queues step t+1 from step t's argmax still on the
    device, then delivers step t; rows that join or leave in between (five prompts of mixed
    lengths through two slots) still get every token as alone. Sampled and penalised rows keep it
    (their tokens are drawn on the device, the penalties' history going on through the unread
    round's tokens); a grammar's row sits out every other round (its masks follow the tokens the
    host read) and the rows beside it stay queued ahead; only a batch of grammar rows is not."""
    from mtp_engine.batching.scheduler import BatchScheduler

    m = models(need(TINY_Q4))
    ahead = []
    launch = BatchScheduler._launch
    monkeypatch.setattr(BatchScheduler, "_launch", lambda self, rows, prev=None: ahead.append(prev is not None)
                        or launch(self, rows, prev))
    want = _alone(m, PROMPTS, max_tokens=12, ignore_eos=True)
    got = batch_generate(PROMPTS, m, max_tokens=12, ignore_eos=True, parallel=2)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert sum(ahead) > len(ahead) // 2, ahead
    ahead.clear()
    batch_generate(PROMPTS[:2], m, max_tokens=6, ignore_eos=True, parallel=2, temperature=0.7, seed=1)
    assert sum(ahead) > len(ahead) // 2, ahead
    ahead.clear()
    kw = dict(max_tokens=6, ignore_eos=True, temperature=0.7, seed=1, repeat_penalty=1.2)
    got = batch_generate(PROMPTS[:2], m, parallel=2, **kw)
    assert sum(ahead) > len(ahead) // 2, ahead
    assert [g.token_ids for g in got] == [w.token_ids for w in _alone(m, PROMPTS[:2], **kw)]
    pytest.importorskip("llguidance")
    from mtp_engine import Constraint
    ahead.clear()
    batch_generate(PROMPTS[:2], m, max_tokens=6, parallel=2, constraint=Constraint.regex(r"[a-z ]+"))
    assert ahead and not any(ahead)
    ahead.clear()
    par = models(need(TINY_Q4), parallel=3)
    c = Constraint.regex(r"[a-z ]+")
    grammar = dict(max_tokens=10, temperature=0.7, seed=5, constraint=c)
    want = [generate(PROMPTS[0], m, **grammar).token_ids] + [w.token_ids for w in
                                                              _alone(m, PROMPTS[1:3], max_tokens=16, ignore_eos=True)]
    out: dict[int, list[int]] = {}

    def one(i):
        kw = grammar if i == 0 else dict(max_tokens=16, ignore_eos=True)
        out[i] = generate(PROMPTS[i], par, **kw).token_ids

    _in_threads(one, range(3))
    assert [out[i] for i in range(3)] == want
    assert sum(ahead) > len(ahead) // 2, ahead


@pytest.mark.parametrize("spec", ["none", "draft-mtp"])
def test_compiled_batched_steps_equal_each_alone(models, spec):
    """Batched forwards of up to 16 tokens per row run as one compiled graph (the GPU's default;
    forced here on the CPU): each row writes at its own length and attends under its own mask,
    and the tokens are still each prompt's alone (run uncompiled: the reference, and no traces of
    single-sequence shapes to pay for). One graph per (rows, tokens per row, capture): rows moving
    on to new lengths trace nothing new."""
    from mtp_engine import EngineOptions, load

    want = _alone(models(need(TINY_Q4)), PROMPTS[:3], max_tokens=14, ignore_eos=True)
    m = load(need(TINY_Q4), options=EngineOptions(compile_steps=True))
    kw = dict(spec="draft-mtp", n_max=2) if spec == "draft-mtp" else {}
    got = batch_generate(PROMPTS[:3], m, max_tokens=14, ignore_eos=True, parallel=3, **kw)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    traced = [k for k in m.model.graphs.compiled if k[0] == "batch"]
    assert traced and len(traced) <= 3 * 4, traced  # B in 1..3, tokens per row 1..3 (+ capture)
    again = batch_generate(PROMPTS[:3], m, max_tokens=20, ignore_eos=True, parallel=3, **kw)
    assert [g.token_ids[:14] for g in again] == [w.token_ids for w in want]
    assert [k for k in m.model.graphs.compiled if k[0] == "batch"] == traced


@pytest.mark.parametrize("path,n_max", [(SHIPPED, 3), (TINY_Q4, "auto"), (TINY_Q4, 1), (MOE_Q4, 2)],
                         ids=["trained-3", "tiny-auto", "tiny-1", "moe"])
def test_draft_mtp_batch_equals_plain_alone(models, path, n_max):
    """The head drafts for every sequence at once, one verify checks them all, each row accepts
    and rolls back alone (attention lengths, recurrent states, the head's rows): every token as
    plain greedy decoding of the prompt alone, with drafts accepted."""
    m = models(need(path))
    want = _alone(m, PROMPTS, max_tokens=14, ignore_eos=True)
    got = batch_generate(PROMPTS, m, max_tokens=14, ignore_eos=True, spec="draft-mtp", n_max=n_max, parallel=3)
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    if path == SHIPPED and n_max != "auto":  # the trained head's drafts are often right
        assert sum(g.stats["accepted"] for g in got) > 0.3 * sum(g.stats["drafted"] for g in got)
        assert all(g.stats["drafted"] == n_max * g.stats["rounds"] for g in got)
        for g in got:  # the statistics a decoder alone reports, from the same counts
            st = g.stats
            assert st["drafting_rounds"] == st["rounds"] and len(st["acceptance_per_position"]) == n_max
            assert st["mean_accepted_length"] == st["accepted"] / st["rounds"]
            assert st["acceptance_per_position"][0] * st["rounds"] >= st["accepted"] / n_max


def test_mtp_batch_mixes_drafting_sampled_and_plain_sequences(shipped_model):
    """One MTP batch: greedy and sampled draft-mtp rows draft (a sampled row by the rejection
    sampler with its own keys), a penalised row takes plain steps in the same forwards, a plain
    row too; each gets what it gets alone."""
    from mtp_engine.api import stream_request
    from mtp_engine.batching import batch_scheduler
    from mtp_engine.request import prepare, request_from_keywords

    kws = [dict(spec="draft-mtp", n_max=3), dict(spec="draft-mtp", n_max=3, temperature=0.8, seed=5),
           dict(spec="draft-mtp", repeat_penalty=1.5), dict(), dict(spec="draft-mtp", n_max=3, stop=["\n\n"])]
    prompts = PROMPTS[:5]
    want = [generate(p, shipped_model, max_tokens=10, ignore_eos=True, **kw) for p, kw in zip(prompts, kws)]
    m = replace(shipped_model, scheduler=None)
    m = replace(m, scheduler=batch_scheduler(m, 5))
    got: dict[int, list[int]] = {}

    def read(i):
        req = request_from_keywords(prompts[i], max_tokens=10, ignore_eos=True, **kws[i])
        got[i] = [t for c in stream_request(prepare(m, req), m) for t in c.token_ids]

    _in_threads(read, range(5))
    assert [got[i] for i in range(5)] == [w.token_ids for w in want]
    m.scheduler.stop()


def test_plain_rows_skip_the_head_and_a_drafting_row_joins_them_later(shipped_model):
    """A batch of plain rows takes the plain scheduler's pipelined steps and runs no head step
    (their head rows are never read); a draft-mtp row that joins after their head rows went stale
    (while a step may still be queued) still drafts from its own, and every row gets what it gets
    alone."""

    from mtp_engine.api import stream_request
    from mtp_engine.batching import batch_scheduler
    from mtp_engine.request import prepare, request_from_keywords

    kws = [dict(spec="none"), dict(spec="none", max_tokens=40), dict(spec="draft-mtp", n_max=3)]
    want = [generate(p, shipped_model, ignore_eos=True, **{"max_tokens": 24, **kw}) for p, kw in zip(PROMPTS, kws)]
    m = replace(shipped_model, scheduler=None)
    m = replace(m, scheduler=batch_scheduler(m, 3))
    head_steps = []
    forward = m.model.mtp.forward_batch
    m.model.mtp.forward_batch = lambda *a, **k: (head_steps.append(1), forward(*a, **k))[1]
    got: dict[int, list[int]] = {}
    started = threading.Event()

    def read(i):
        req = request_from_keywords(PROMPTS[i], ignore_eos=True, **{"max_tokens": 24, **kws[i]})
        got[i] = []
        for c in stream_request(prepare(m, req), m):
            got[i] += c.token_ids
            if i == 1 and len(got[i]) >= 8:
                started.set()

    try:
        plain = [threading.Thread(target=read, args=(i,)) for i in (0, 1)]
        for t in plain:
            t.start()
        assert started.wait(120)
        before = len(head_steps)  # plain rows only so far: at most their prefill chunks ran the head
        assert before <= 2, before  # 8+ batched decode steps without a head step (one each before)
        late = threading.Thread(target=read, args=(2,))
        late.start()
        for t in plain + [late]:
            t.join(120)
        assert [got[i] for i in range(3)] == [w.token_ids for w in want]
        assert len(head_steps) > before  # the drafting row's rounds ran the head
    finally:
        del m.model.mtp.forward_batch
        m.scheduler.stop()


@pytest.mark.parametrize("oracle", [0.0, 1.0])
def test_oracle_batches_accept_what_they_are_told(shipped_model, oracle):
    """The benchmark's oracle scheduler (batching/ablations.py): at acceptance 0 no draft counts and
    every row emits what plain greedy decoding does; at 1 every draft counts."""

    from mtp_engine.batching.ablations import OracleBatchScheduler

    m = replace(shipped_model, scheduler=None)
    m = replace(m, scheduler=OracleBatchScheduler(m, 3, oracle=oracle))
    got: dict[int, object] = {}

    def one(i):  # a model with a scheduler: generate() calls from threads share its batches
        got[i] = generate(PROMPTS[i], m, max_tokens=10, ignore_eos=True, spec="draft-mtp", n_max=3)

    try:
        _in_threads(one, range(3))
    finally:
        m.scheduler.stop()
    got = [got[i] for i in range(3)]
    st = [g.stats for g in got]
    assert max(s["batch_size_max"] for s in st) > 1
    assert all(s["drafted"] > 0 for s in st)
    if oracle == 0.0:
        want = _alone(shipped_model, PROMPTS[:3], max_tokens=10, ignore_eos=True)
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert all(s["accepted"] == 0 for s in st)
    else:
        assert all(s["accepted"] == s["drafted"] and s["acceptance_per_position"] == [1.0, 1.0, 1.0] for s in st)
    with pytest.raises(MTPEngineError, match="acceptance"):
        OracleBatchScheduler(m, 2, oracle=1.5, own_thread=False)


def test_no_row_makes_the_batch_draft_longer_than_its_cap(shipped_model):
    """A sequence asking for n-max 64 beside others: the batch's rounds draft at most the
    scheduler's `max_draft` (the API's load(parallel=N) and the server's batches alike), and every
    answer is still its plain greedy answer alone."""

    from mtp_engine.batching import MTPBatchScheduler

    m = replace(shipped_model, scheduler=None)
    m = replace(m, scheduler=MTPBatchScheduler(m, 3, max_draft=2))
    got: dict[int, object] = {}
    n_maxes = [64, 3, "auto"]

    def one(i):
        got[i] = generate(PROMPTS[i], m, max_tokens=10, ignore_eos=True, spec="draft-mtp", n_max=n_maxes[i])

    try:
        _in_threads(one, range(3))
    finally:
        m.scheduler.stop()
    want = _alone(shipped_model, PROMPTS[:3], max_tokens=10, ignore_eos=True)
    assert [got[i].token_ids for i in range(3)] == [w.token_ids for w in want]
    assert m.scheduler.rounds_by_k and max(m.scheduler.rounds_by_k) <= 2, m.scheduler.rounds_by_k


def test_mtp_batch_reuses_the_prompt_cache_with_the_heads_state(shipped_model):

    from mtp_engine import PromptCache
    from mtp_engine.batching import batch_scheduler

    m = replace(shipped_model, scheduler=None)
    m = replace(m, scheduler=batch_scheduler(m, 2))
    turn1 = "def area(r):\n    return 3.14159 * r * r\n\n"
    turn2 = turn1 + "def perimeter(r):\n"
    cache = PromptCache()
    a1 = generate(turn1, m, max_tokens=8, spec="draft-mtp", n_max=2, prompt_cache=cache)
    a2 = generate(turn2, m, max_tokens=8, spec="draft-mtp", n_max=2, prompt_cache=cache)
    assert a2.stats["cached_prompt_tokens"] == len(a1.prompt_token_ids) - 1 and a2.stats["rounds"] > 0
    b = [generate(t, shipped_model, max_tokens=8) for t in (turn1, turn2)]
    assert (a1.token_ids, a2.token_ids) == (b[0].token_ids, b[1].token_ids)
    m.scheduler.stop()


def test_k0_rounds_are_pipelined_and_keep_the_head_exact_for_later_drafts(shipped_model):
    """auto's k = 0 rounds (its choice for large batches) are the plain batched round, queued one
    ahead like every greedy round, with the head's row for each token in the same work: drafting rounds after a k = 0
    stretch draft from an exact head (their drafts accepted as often as without the stretch) and
    every row gets what it gets alone. A controller that alternates stretches of 0 and 3 stands in for
    auto's measurements."""

    from mtp_engine.api import stream_request
    from mtp_engine.request import prepare, request_from_keywords

    want = _alone(shipped_model, PROMPTS[:3], max_tokens=30, ignore_eos=True)
    from mtp_engine.batching import MTPBatchScheduler
    from mtp_engine.speculative.calibration import default_seed

    m = replace(shipped_model, scheduler=None)
    # a device where drafts may pay (this CPU's prior says none does)
    sched = MTPBatchScheduler(m, 3, prior=default_seed(gpu=True))
    m = replace(m, scheduler=sched)
    choices = iter(([0] * 6 + [3] * 3) * 40)
    sched.controller(3).next_k = lambda context=0: next(choices)
    queued, lengths = [], []
    launch = sched._launch
    sched._launch = lambda rows, prev=None: (queued.append(prev is not None), launch(rows, prev))[1]
    capture = sched._batch.begin_capture

    def drafting_round_starts(n_tokens):  # each row's head and trunk lengths (device values) at a verify
        lengths.append((sched.drafter.cache.lengths.tolist(), sched._batch.lengths.tolist()))
        capture(n_tokens)

    sched._batch.begin_capture = drafting_round_starts
    got: dict[int, list] = {}

    def read(i):
        req = request_from_keywords(PROMPTS[i], max_tokens=30, ignore_eos=True, spec="draft-mtp", n_max="auto")
        got[i] = list(stream_request(prepare(m, req), m))

    try:
        _in_threads(read, range(3))
    finally:
        sched.stop()
    assert [[t for c in got[i] for t in c.token_ids] for i in range(3)] == [w.token_ids for w in want]
    assert sched.rounds_by_k.get(0, 0) >= 6 and sched.rounds_by_k.get(3, 0) >= 3, sched.rounds_by_k
    assert sum(queued) >= 3, queued  # k = 0 steps queued behind the one being read
    # the head keeps a row per trunk position through k = 0 steps: at each drafting round's verify
    # (its guessed rows of draft steps 2..3 dropped) every row's head holds one row past its trunk:
    # the last token's, which the verify is about to add to the trunk
    assert len(lengths) >= 2 and all(h - t == 1 for hs, ts in lengths for h, t in zip(hs, ts)), lengths
    # the trained head after k = 0 stretches: its drafts are often right (an unsynced head's are not)
    stats = [got[i][-1].stats for i in range(3)]
    assert sum(st["accepted"] for st in stats) > 0.3 * sum(st["drafted"] for st in stats), \
        [(st["accepted"], st["drafted"]) for st in stats]


def test_auto_rows_where_no_draft_can_pay_take_plain_rounds_without_the_head(shipped_model):
    """Where the device's prior round costs say even fully accepted drafts cannot pay (MLX's CPU
    backend: a verify row costs what it computes), n-max auto rows in a batch never draft and run
    no head rows, in their rounds or over their prompts: plain batched rounds, the plain answers. A row with a fixed n-max in
    the same batch still drafts (and keeps the head in step for every row)."""

    from mtp_engine.batching import MTPBatchScheduler
    from mtp_engine.speculative.calibration import default_seed

    want = _alone(shipped_model, PROMPTS[:3], max_tokens=12, ignore_eos=True)
    for n_maxes in (["auto"] * 3, ["auto", "auto", 2]):
        m = replace(shipped_model, scheduler=None)
        sched = MTPBatchScheduler(m, 3, prior=default_seed(gpu=False))
        m = replace(m, scheduler=sched)
        assert not any(sched.controller(b).can_win for b in (1, 2, 3))
        decode_head = []  # per head forward: whether a round ran it (else a prefill chunk)
        forward = m.model.mtp.forward_batch
        m.model.mtp.forward_batch = lambda *a, **k: (decode_head.append(k.get("valid") is None), forward(*a, **k))[1]
        got: dict[int, object] = {}

        def one(i):
            got[i] = generate(PROMPTS[i], m, max_tokens=12, ignore_eos=True, spec="draft-mtp", n_max=n_maxes[i])

        try:
            _in_threads(one, range(3))
        finally:
            del m.model.mtp.forward_batch
            sched.stop()
        assert [got[i].token_ids for i in range(3)] == [w.token_ids for w in want]
        if 2 in n_maxes:
            assert sched.rounds_by_k.get(2, 0) > 0 and any(decode_head)
        else:
            # no head forward at all: neither in rounds nor over the prompts (nothing keeps their state)
            assert set(sched.rounds_by_k) == {0} and not decode_head, (sched.rounds_by_k, decode_head)
            assert all(got[i].stats["drafted"] == 0 for i in range(3))


def test_auto_batches_draft_by_the_controller_beside_every_other_kind_of_row(shipped_model):
    """Under a device prior where drafts may pay, n-max auto rows in a batch draft by the
    draft-length controller (its own choices, not a stand-in), beside rows of a fixed n-max, n-max
    0, plain and sampled rows, joining and leaving at different times: every answer is its answer
    alone (a plain sampled row's: its seed's draws, made on the device in the same order)."""

    from mtp_engine.batching import MTPBatchScheduler
    from mtp_engine.speculative.calibration import default_seed

    kinds = [dict(spec="draft-mtp", n_max="auto"), dict(spec="draft-mtp", n_max="auto"), dict(spec="draft-mtp", n_max=2),
             dict(spec="draft-mtp", n_max=0), dict(spec="none"), dict(spec="none", temperature=0.8, seed=7)]
    lengths = [14, 9, 12, 6, 10, 8]
    want = [generate(PROMPTS[i % len(PROMPTS)], shipped_model, max_tokens=lengths[i], ignore_eos=True,
                     **kinds[i]).token_ids for i in range(len(kinds))]
    m = replace(shipped_model, scheduler=None)
    # driven here once every request waits, in order: the batch's rows, and so which rounds are the
    # controller's (a fixed n-max row in the batch fixes its draft length), are the same every run
    sched = MTPBatchScheduler(m, 3, own_thread=False, prior=default_seed(gpu=True))
    m = replace(m, scheduler=sched)
    got: dict[int, list[int]] = {}

    def one(i):
        got[i] = generate(PROMPTS[i % len(PROMPTS)], m, max_tokens=lengths[i], ignore_eos=True, **kinds[i]).token_ids

    _drive_in_order(sched, one, len(kinds))
    assert [got.get(i) for i in range(len(kinds))] == want
    assert any(c.drafting_rounds for c in sched.controllers.values()), sched.rounds_by_k


def test_a_row_of_n_max_0_leaves_the_batchs_draft_length_to_the_others(shipped_model):
    """A draft-mtp request of n-max 0 drafts nothing, and beside a row of n-max 2 the batch still
    drafts 2 a round (the n-max 0 row keeps none of them): one client's n-max 0 does not turn MTP
    off for its batch. Each answer is its answer alone."""
    from mtp_engine.batching import MTPBatchScheduler

    kinds = [dict(spec="draft-mtp", n_max=0), dict(spec="draft-mtp", n_max=2)]
    want = [generate(PROMPTS[i], shipped_model, max_tokens=12, ignore_eos=True, **kinds[i]).token_ids for i in range(2)]
    sched = MTPBatchScheduler(replace(shipped_model, scheduler=None), 2, own_thread=False)
    m = replace(shipped_model, scheduler=sched)
    got: dict[int, list[int]] = {}

    def one(i):
        got[i] = generate(PROMPTS[i], m, max_tokens=12, ignore_eos=True, **kinds[i]).token_ids

    _drive_in_order(sched, one, 2)
    assert [got.get(i) for i in range(2)] == want
    assert sched.rounds_by_k.get(2, 0) >= 2, sched.rounds_by_k  # while both ran (the n-max 2 row is done first)


def _drive_in_order(sched, one, n: int) -> None:
    """one(i) for i < n, each in a thread of its own, each request waiting in the scheduler before
    the next is made; then the scheduler (own_thread=False) is driven here until all are answered:
    a batch's rows, and so its rounds, are the same every run."""
    threads = []
    for i in range(n):
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
        deadline = time.monotonic() + 60
        while sched.waiting <= i and time.monotonic() < deadline:
            time.sleep(0.002)
    sched.drive(lambda: not any(t.is_alive() for t in threads))


def test_auto_in_a_batch_is_the_draft_length_scheduler_per_batch_size(shipped_model):
    """One draft-length controller serves one row and many: n-max auto in a batch is a
    `DraftLengthScheduler` (a sequence alone's), one per batch-size bucket (1, 2, 4, 8, ...: a
    verify's rows cost more the more sequences share it), capped at the batch's `max_draft`; a
    batch's round gives it one acceptance sample per drafting row, and a round whose rows changed
    since the round before it gives no time sample."""
    from mtp_engine.batching import MTPBatchScheduler
    from mtp_engine.speculative.calibration import default_seed
    from mtp_engine.speculative.scheduler import DraftLengthScheduler

    sched = MTPBatchScheduler(shipped_model, 8, own_thread=False, max_draft=3, prior=default_seed(gpu=True))
    c = sched.controller(3)
    assert isinstance(c, DraftLengthScheduler) and c is sched.controller(4) and c is not sched.controller(5)
    assert sched.controller(5) is sched.controller(8) and sched.controller(1) is not sched.controller(2)
    assert c.k_max == 3 and c.can_win
    k = c.next_k(0)
    c.observe(k, [k, 0, 1], None)  # three rows' acceptance, no time
    assert c.acceptance.acc[0] + c.acceptance.rej[0] == pytest.approx(3.0, rel=0.2) and not c.times.samples()
    c.next_k(0)
    c.observe(0, 0, 0.01)
    assert c.times.samples() == 1


def test_batched_turns_reuse_the_prompt_cache(parallel_model, shipped_model):
    """A chat's next turn through the batch prefills only what is new, with the tokens it has alone."""
    from mtp_engine import PromptCache

    turn1 = "def area(r):\n    return 3.14159 * r * r\n\n"
    turn2 = turn1 + "def perimeter(r):\n"
    cache = PromptCache()
    a1 = generate(turn1, parallel_model, max_tokens=6, prompt_cache=cache)
    a2 = generate(turn2, parallel_model, max_tokens=6, prompt_cache=cache)
    assert a2.stats["cached_prompt_tokens"] == len(a1.prompt_token_ids) - 1
    alone = PromptCache()
    b1 = generate(turn1, shipped_model, max_tokens=6, prompt_cache=alone)
    b2 = generate(turn2, shipped_model, max_tokens=6, prompt_cache=alone)
    assert (a1.token_ids, a2.token_ids) == (b1.token_ids, b2.token_ids)
    assert "batch_size_mean" in a2.stats  # it did run in the batch


def test_batch_follows_each_sequences_grammar(shipped_model):
    pytest.importorskip("llguidance", reason="constrained decoding needs llguidance (pip install -e '.[test]')")
    from mtp_engine import Constraint

    c = Constraint.regex(r"[0-9]{3}-[a-z]{2}")
    want = _alone(shipped_model, PROMPTS[:3], max_tokens=12, constraint=c)
    got = batch_generate(PROMPTS[:3], shipped_model, max_tokens=12, constraint=c)
    assert [g.text for g in got] == [w.text for w in want]
    assert all(len(g.text) == 6 and g.text[3] == "-" for g in got)


def test_a_sampled_grammar_rows_logprobs_come_with_its_host_draws_alone_and_in_a_batch(shipped_model):
    """Sampled under a grammar a token is the host's draw (a plain round computes no logprobs for
    it): alone and in a batch each token's logprobs are the ones of the token drawn, the same."""
    pytest.importorskip("llguidance", reason="constrained decoding needs llguidance (pip install -e '.[test]')")
    from mtp_engine import Constraint

    kw = dict(max_tokens=8, temperature=0.8, seed=4, logprobs=2, constraint=Constraint.regex(r"[a-z ]{3,20}'"))
    want = _alone(shipped_model, PROMPTS[:2], **kw)
    got = batch_generate(PROMPTS[:2], shipped_model, **kw)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and [a["token"] for a in w.logprobs] == w.token_ids
        assert [(a["token"], [t for t, _ in a["top"]]) for a in g.logprobs] == \
            [(a["token"], [t for t, _ in a["top"]]) for a in w.logprobs]
        assert [a["logprob"] for a in g.logprobs] == pytest.approx([a["logprob"] for a in w.logprobs], abs=1e-4)


# ---- the batch caches ---------------------------------------------------------------------------

def test_batch_cache_rows_join_and_leave_without_moving_others(shipped_model):
    m = shipped_model.model
    caches = []
    for ids in ([1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11]):
        c = m.make_cache()
        m.forward(mx.array([ids]), c)
        caches.append(c)
    batch = BatchCache(m)
    for c in caches:
        batch.add(c)
    assert batch.host_lengths == [3, 7, 1] and batch.lengths.tolist() == [3, 7, 1]
    kv = next(layer for layer in batch.layers if hasattr(layer, "keys"))
    kv0 = next(layer for layer in caches[1].layers if hasattr(layer, "keys"))
    assert mx.array_equal(kv.keys[1, :, :7], kv0.keys[0, :, :7])
    batch.keep([1, 2])
    assert batch.host_lengths == [7, 1]
    kv = next(layer for layer in batch.layers if hasattr(layer, "keys"))
    assert mx.array_equal(kv.keys[0, :, :7], kv0.keys[0, :, :7])
    batch.keep([])
    assert len(batch) == 0 and batch.layers == []


# ---- serve --parallel -----------------------------------------------------------------------------

def test_serve_parallel_streams_together_and_shows_slots(shipped_model):
    """8 concurrent streamed completions on `serve --parallel 4`: each answer as generate gives it
    alone, the streams overlap, /slots shows the slots at work, and every slot is free after."""
    import json
    from concurrent.futures import ThreadPoolExecutor

    from tests.server_helpers import LiveServer

    prompts = [f"def g{i}(items):\n    " for i in range(8)]
    want = [r.text for r in _alone(shipped_model, prompts, max_tokens=12, ignore_eos=True)]
    server = LiveServer(SHIPPED, "--parallel", "4", "--log-level", "info")
    try:
        seen_slots: list = []
        first: dict[int, float] = {}
        ended: dict[int, float] = {}

        def one(i: int) -> str:
            c, resp = server.open_stream("/v1/completions", {"prompt": prompts[i], "max_tokens": 12,
                                                             "ignore_eos": True})
            text = []
            for raw in resp:  # event by event, as they arrive (sse_events reads them all first)
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    break
                piece = json.loads(line[6:])["choices"][0].get("text") or ""
                if piece and i not in first:
                    first[i] = time.perf_counter()
                text.append(piece)
            ended[i] = time.perf_counter()
            c.close()
            return "".join(text)

        done = threading.Event()

        def watch() -> None:  # what /slots says while the streams run
            while not done.is_set():
                seen_slots.append(server.request("GET", "/slots")[1])
                time.sleep(0.05)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            with ThreadPoolExecutor(8) as ex:
                got = list(ex.map(one, range(8)))
        finally:
            done.set()
            watcher.join()
        assert got == want
        # 4 slots: the first four streams to start all start before any stream ends
        assert sorted(first.values())[3] < min(ended.values()), (first, ended)
        assert all(len(s) == 4 for s in seen_slots)
        assert max(sum(x["state"] != "idle" for x in s) for s in seen_slots) == 4, json.dumps(seen_slots)
        assert any("drafted" in x for s in seen_slots for x in s)  # draft-mtp, the default, batched
        h = server.wait_idle()
        assert h["parallel"] == 4 and h["running"] == 0
        assert all(x["state"] == "idle" for x in server.request("GET", "/slots")[1])
        assert 'id="slots"' in server.request("GET", "/")[1]  # the page shows them too
        # a non-streamed batched draft-mtp answer carries the speculative usage a decoder alone
        # reports (a fixed draft length: auto drafts nothing in a batch on this CPU)
        status, body = server.request("POST", "/v1/completions", {"prompt": prompts[0], "max_tokens": 12,
                                                                  "ignore_eos": True, "spec_draft_n_max": 2})
        assert status == 200 and body["choices"][0]["text"] == want[0], body
        sd = body["usage"]["spec_decode"]
        assert sd["num_draft_tokens"] > 0 and 0 <= sd["mean_accepted_length"] and sd["acceptance_rate_per_pos"]
        # a request the batch cannot take runs alone beside it (here, on the CPU, as a plain run that
        # takes over the prompt state the batch kept in its own thread: `BatchCache.row` evaluates it)
        status, body = server.request("POST", "/v1/completions", {"prompt": prompts[0], "max_tokens": 8,
                                                                  "spec_type": "ngram", "ignore_eos": True})
        assert status == 200 and want[0].startswith(body["choices"][0]["text"])
    finally:
        server.stop()


def _answers_in_threads(model, prompts, keywords) -> dict[int, object]:
    """Each prompt's `generate(prompts[i], model, **keywords(i)).token_ids`, or the error it
    raised, each in a thread of its own (`keywords(i)` runs in that thread: it may wait)."""
    out: dict[int, object] = {}

    def one(i):
        kw = keywords(i)
        try:
            out[i] = generate(prompts[i], model, **kw).token_ids
        except Exception as e:  # noqa: BLE001 - checked by the caller
            out[i] = e

    _in_threads(one, range(len(prompts)))
    return out


def _in_threads(fn, args) -> None:
    """fn(a) for each a, each in a thread of its own, all started before any is waited for."""
    threads = [threading.Thread(target=fn, args=(a,)) for a in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)


def assert_close_at_scale(got: mx.array, want: mx.array, where) -> None:
    scale = max(1.0, float(mx.abs(want).max()))
    err = float(mx.abs(got - want).max())
    assert err <= 1e-4 * scale, (where, err, scale)


@pytest.mark.parametrize("path", [SHIPPED, MOE_Q4], ids=["trained", "moe"])
def test_rows_of_several_lengths_step_as_each_alone(models, path):
    """Prompts of 3, 40 and 17 tokens prefilled each on its own caches (one in two chunks, as a
    joining sequence's), then rows of one batch (`add`): two batched steps equal each prompt's
    steps alone, and a row that leaves (`keep`) takes nothing of the others with it."""
    m = models(need(path)).model
    prompts = [[5, 9, 250], [(7 * i + 3) % 500 + 1 for i in range(40)], [(11 * i + 2) % 500 + 1 for i in range(17)]]
    alone, batch = [], BatchCache(m)
    for i, p in enumerate(prompts):
        c, mine = m.make_cache(), m.make_cache()
        m.forward(mx.array([p]), c)
        for part in ([p[:20], p[20:]] if i == 1 else [p]):
            m.forward(mx.array([part]), mine)
        alone.append(c)
        batch.add(mine)
    assert batch.host_lengths == [3, 40, 17]
    for tok in (4, 77):
        nxt = m.forward_batch(mx.array([[tok]] * 3, mx.int32), batch)
        for b, c in enumerate(alone):
            ref = m.forward(mx.array([[tok]]), c)
            assert_close_at_scale(nxt[b], ref[0], (tok, b))
    batch.keep([2, 0])
    nxt = m.forward_batch(mx.array([[9], [9]], mx.int32), batch)
    for b, src in enumerate([2, 0]):
        assert_close_at_scale(nxt[b], m.forward(mx.array([[9]]), alone[src])[0], ("kept", b))


def test_plain_rounds_join_the_heads_block_and_later_drafts_are_those_of_a_head_run_every_round(shipped_model,
                                                                                                monkeypatch):
    """A stretch of plain rounds (n-max auto's k = 0) adds each round's row to the head's block
    instead of running the head every round (at 16 rows on an H100 auto's plain rounds ran at 0.84x
    of plain batching): the head runs once per 8 of them, and the drafts after the stretch are the
    drafts of a head run every round, so acceptance is unchanged, and so is every answer. (Both
    sequences are queued before the loop runs, so they join at the same step in both runs.)"""
    import time as _time

    from mtp_engine.batching import MTPBatchScheduler
    from mtp_engine.speculative import mtp_rows

    class Stretch(MTPBatchScheduler):  # 11 plain rounds, then rounds of 2 drafts
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.drafts: list = []
            self.runs = 0

        def _draft_length(self, rows):
            return 0 if self.steps < 11 else 2

        def _accept(self, rule, drafts, scored, q, live):
            self.drafts.append(drafts)
            return super()._accept(rule, drafts, scored, q, live)

    def run(widths):
        monkeypatch.setattr(mtp_rows, "WIDTHS", widths)
        sched = Stretch(replace(shipped_model, scheduler=None), 2, own_thread=False)
        real = sched.drafter._run_block

        def counted():
            sched.runs += 1
            return real()
        monkeypatch.setattr(sched.drafter, "_run_block", counted)
        m = replace(shipped_model, scheduler=sched)
        got: dict[int, list[int]] = {}

        def one(i):
            got[i] = generate(PROMPTS[i + 1], m, max_tokens=18, ignore_eos=True, spec="draft-mtp", n_max=2).token_ids
        threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = _time.time() + 60
        while len(sched._waiting) < 2 and _time.time() < deadline:
            _time.sleep(0.01)
        sched.drive(lambda: len(got) == 2 or _time.time() > deadline + 120)  # a failed reader ends the wait too
        for t in threads:
            t.join(60)
        # per round, the rows' drafts in any order: the two threads may queue in either order
        return [got[0], got[1]], [sorted(d.tolist()) for d in sched.drafts], sched.runs

    lazy, eager = run((1, 2, 4, 8)), run((1,))
    assert lazy[0] == eager[0] == [w.token_ids for w in _alone(shipped_model, PROMPTS[1:3], max_tokens=18,
                                                              ignore_eos=True)]
    assert lazy[1] and lazy[1] == eager[1], (lazy[1], eager[1])
    assert lazy[2] < eager[2] - 5, (lazy[2], eager[2])


@pytest.mark.parametrize("spec", ["none", "draft-mtp"])
def test_a_batched_prompt_reports_its_reading_as_one_alone_does(models, spec):
    """`GenerationRequest.progress` in a batch: the prompt's tokens handled of all of them, before
    its first chunk and after each, all of them at the end, as the same request alone reports."""
    from mtp_engine import EngineOptions, GenerationRequest, SpecConfig, stream_request

    opts = EngineOptions(prefill_chunk=4)
    prompt = PROMPTS[3]
    alone = models(SHIPPED, options=opts)
    n = len(alone.tokenizer.encode(prompt))
    reports: dict[str, list] = {"batch": [], "alone": []}
    for name, m in (("batch", models(SHIPPED, parallel=4, options=opts)), ("alone", alone)):
        req = GenerationRequest(prompt=prompt, max_tokens=3, spec=SpecConfig(spec),
                                progress=lambda d, t, r=reports[name]: r.append((d, t)))
        chunks = list(stream_request(req, m))
        assert ("batch_size_mean" in chunks[-1].stats) == (name == "batch")  # it ran where meant
    got = reports["batch"]
    assert got and all(t == n for _, t in got) and got[0][0] == 0 and got[-1][0] == n
    assert [d for d, _ in got] == sorted(d for d, _ in got) and len(got) >= n // 4
    assert reports["alone"][0] == (0, n) and reports["alone"][-1] == (n, n)


def test_a_precise_profile_times_a_batch_rounds_stages(shipped_model):
    """`MTPBatchScheduler(profile="precise")` times each round's stages as a sequence alone's
    precise profile does (the head's block, its chain, verify, accept, rollback; plain rounds'
    decode), and the answers stay the plain greedy ones."""
    from mtp_engine.batching import MTPBatchScheduler

    sched = MTPBatchScheduler(replace(shipped_model, scheduler=None), 2, profile="precise")
    m = replace(shipped_model, scheduler=sched)
    got: dict[int, list[int]] = {}

    def one(i):
        got[i] = generate(PROMPTS[i + 1], m, max_tokens=8, ignore_eos=True, spec="draft-mtp" if i else "none",
                          n_max=2).token_ids
    try:
        _in_threads(one, range(2))
    finally:
        sched.stop()
    assert [got[0], got[1]] == [w.token_ids for w in _alone(shipped_model, PROMPTS[1:3], max_tokens=8, ignore_eos=True)]
    stages = sched.prof.report()["stages"]
    assert {"catch_up", "draft", "verify", "accept", "rollback"} <= set(stages), stages
    assert all(v["seconds"] > 0 and v["count"] > 0 for k, v in stages.items() if k != "other")
    assert MTPBatchScheduler(replace(shipped_model, scheduler=None), 2, own_thread=False).prof.mode == "off"


def test_a_grammar_row_that_sits_out_keeps_its_caches_in_step(models, monkeypatch):
    """A grammar's row in an MTP batch sits out every other round (its token is the host's to
    choose): those rounds leave its trunk and head rows where they were, so its head never runs
    more than one row past its trunk (the host bounds the head's length by the trunk's; a head
    that ran ahead would write past what was reserved), and every row answers as alone."""
    pytest.importorskip("llguidance")
    from mtp_engine import Constraint
    from mtp_engine.batching import scheduler

    seen = []
    complete = scheduler.BatchScheduler._complete

    def checked(self, cur):
        complete(self, cur)
        if len(self._rows) == len(cur.rows) == 3:  # (the device's lengths, after the round queued ahead too)
            seen.append((self._batch.lengths.tolist(), self.drafter.cache.lengths.tolist(), any(cur.held)))

    monkeypatch.setattr(scheduler.BatchScheduler, "_complete", checked)
    m = models(need(TINY_Q4))
    par = models(need(TINY_Q4), parallel=3)
    grammar = dict(max_tokens=12, temperature=0.7, seed=3, constraint=Constraint.regex(r"[a-z ]+"))
    drafting = dict(max_tokens=24, ignore_eos=True, spec="draft-mtp", n_max=2)
    want = [generate(PROMPTS[1], m, **grammar).token_ids] + [generate(p, m, max_tokens=24, ignore_eos=True).token_ids
                                                              for p in PROMPTS[2:4]]
    held = []
    launch = scheduler.BatchScheduler._launch
    monkeypatch.setattr(scheduler.BatchScheduler, "_launch",
                        lambda self, rows, prev=None: held.append(any((r := launch(self, rows, prev)).held)) or r)
    out: dict[int, list[int]] = {}

    def one(i):
        out[i] = generate(PROMPTS[i + 1], par, **(grammar if i == 0 else drafting)).token_ids

    _in_threads(one, range(3))
    assert [out[i] for i in range(3)] == want
    assert sum(held) >= 4, held  # the grammar row sat rounds out
    assert sum(h for *_, h in seen) >= 4, seen
    for trunk, head, _ in seen:
        assert all(h <= t + 1 for h, t in zip(head, trunk)), seen
    # (the grammar row's head, never run in its prefill, starts behind its trunk: it must not gain on it)
    (t0, h0, _), (t1, h1, _) = seen[0], seen[-1]
    assert all(hb - ha <= tb - ta + 1 for ha, hb, ta, tb in zip(h0, h1, t0, t1)), seen


def test_a_sequence_that_never_drafts_prefills_in_an_mtp_batch_as_plain_decoding_does(models):
    """In an MTP batch a plain request prefills its whole prompt and draws its first token at the
    end, as plain decoding alone does (its first token waits for no round; the same chunks, the
    same numbers); one that may draft prefills all but its last token, which its first round reads."""
    from mtp_engine import load
    from mtp_engine.batching import MTPBatchScheduler

    par = load(need(TINY_Q4), parallel=2)  # its own scheduler: the test counts its rounds
    try:
        assert isinstance(par.scheduler, MTPBatchScheduler)
        alone = models(need(TINY_Q4))
        first = generate(PROMPTS[1], par, max_tokens=1)
        assert par.scheduler.steps == 0 and first.token_ids == generate(PROMPTS[1], alone, max_tokens=1).token_ids
        generate(PROMPTS[1], par, max_tokens=1, spec="draft-mtp", n_max=2)
        assert par.scheduler.steps >= 1  # its first token comes from its first round
        got = generate(PROMPTS[2], par, max_tokens=12, ignore_eos=True)
        assert got.token_ids == generate(PROMPTS[2], alone, max_tokens=12, ignore_eos=True).token_ids
    finally:
        par.scheduler.stop()
