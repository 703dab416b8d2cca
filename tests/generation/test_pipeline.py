"""The pipelined decode loop: the next step queued before the host read gives the same
tokens, queues nothing past max_tokens, and the stats report time to first token, load and
compile time; n-max auto says once why it did not draft."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest

from tests.conftest import TINY, need
from mtp_engine import generate
from mtp_engine.cli.main import main
from mtp_engine.cli.output import format_stats
from mtp_engine.generation.decode import PlainDecoder, Queued
from mtp_engine.generation.penalties import PenaltyConfig
from mtp_engine.generation.loop import run
from mtp_engine.generation.sampling import Sampler, SamplerConfig
from mtp_engine.speculative.draft_mtp import DraftMTPDecoder, DraftParams

IDS = [349, 220, 451, 72, 389]


@pytest.fixture(scope="module")
def tiny(tiny_any):
    return tiny_any


def _tokens(dec, tok, n, logprobs=None):
    out = []
    for ch in run(dec, tok, IDS, n, ignore_eos=True):
        out += ch.token_ids
        if logprobs is not None:
            logprobs += ch.logprobs or []
    return out, ch.stats


@pytest.mark.parametrize("cfg", [{}, dict(temperature=0.8, top_p=0.9, seed=3, logprobs=2),
                                 dict(temperature=0.8, seed=3, penalties=PenaltyConfig(0.4, 0.3, 1.3, 6))],
                         ids=["greedy", "sampled", "penalised"])
@pytest.mark.parametrize("spec", ["none", 1, 3, "auto"])
def test_pipelined_equals_unpipelined_and_stops_at_max_tokens(tiny, spec, cfg):
    """Queued ahead or not, the same tokens (and logprobs): a sampled step draws on the device,
    its logprobs come with it, and penalties go on through the tokens of the step or round queued
    ahead (`Sampler.reading_ahead`), so sampling, logprobs and penalties keep the pipeline."""
    def make(pipeline):
        s = Sampler(SamplerConfig(**cfg))
        if spec == "none":
            return PlainDecoder(tiny.model, s, pipeline=pipeline)
        from mtp_engine.speculative.scheduler import DraftLengthScheduler
        return DraftMTPDecoder(tiny.model, s, DraftParams(spec), pipeline=pipeline,
                               scheduler=DraftLengthScheduler({k: 1.1 for k in range(1, 9)}) if spec == "auto" else None)

    n = 23
    a, b = make(True), make(False)
    lp_ref, lp = [], []
    ref, _ = _tokens(b, tiny.tokenizer, n, lp_ref)
    got, st = _tokens(a, tiny.tokenizer, n, lp)
    assert len(got) == n
    if spec == "auto" and cfg.get("temperature"):
        return  # auto's draft lengths follow measured times, and a sampled round's draws its length
    assert got == ref
    if cfg.get("logprobs"):  # every token's, whichever rounds emitted it
        assert [(x["token"], [t for t, _ in x["top"]]) for x in lp] == \
            [(x["token"], [t for t, _ in x["top"]]) for x in lp_ref] and len(lp) == n
        assert [x["logprob"] for x in lp] == pytest.approx([x["logprob"] for x in lp_ref], abs=1e-4)
    if spec == "none":
        assert a._ahead() and not b._ahead()
    if spec == "none":  # every token but the last was fed; no step was queued past max_tokens
        assert a.cache.offset == len(IDS) + n - 1
    assert st["time_to_first_token_seconds"] > 0 and "compile_seconds" in st


def test_sampling_is_reproducible_through_the_loop(tiny):
    kw = dict(max_tokens=20, ignore_eos=True, temperature=0.8, top_k=20, seed=5)
    for spec in (None, "draft-mtp"):
        a = generate(IDS, tiny, spec=spec, n_max=2, **kw).token_ids
        assert a == generate(IDS, tiny, spec=spec, n_max=2, **kw).token_ids


def test_stats_report_ttft_load_compile_and_autos_reason(tiny, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_ENGINE_CACHE_DIR", str(tmp_path))
    p = str(need(TINY / "qwen35-mtp-tiny-f32.gguf"))
    assert main(["generate", "-m", p, "-p", "To be", "-n", "6", "--spec-type", "draft-mtp", "--json"]) == 0
    st = json.loads(capsys.readouterr().out)["stats"]
    for key in ("time_to_first_token_seconds", "load_seconds", "compile_seconds", "auto_message"):
        assert key in st, key
    assert st["load_seconds"] > 0 and st["time_to_first_token_seconds"] <= st["prefill_seconds"] + st["decode_seconds"]
    # on MLX's CPU backend the default estimate says drafting cannot pay: plain rounds, and the reason
    if st["drafted"] == 0:
        assert st["auto_message"].startswith("auto: drafting cannot pay on this device")
        assert st["auto_message"] in format_stats(st)
    plain = generate(IDS, tiny, max_tokens=4).stats
    assert "auto_message" not in plain and "time_to_first_token_seconds" in plain


def test_resident_rounds_time_their_own_queuing_not_the_next_rounds(tiny, monkeypatch):
    """With device-resident rounds the host queues round r+1 before it reads round r: r's interval
    holds r+1's queuing. A drafting round that is slow to queue must not make the plain round
    before it look slow (auto measured drafting as free that way and kept drafting at a = 0.5)."""
    from mtp_engine.speculative import decoder

    ks = iter([1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0] + [0] * 40)
    orig = decoder.SpeculativeDecoder._launch

    def slow_drafting(self, k):
        if k:
            time.sleep(0.05)  # a drafting round costs the host 50 ms to queue; a plain one ~nothing
        return orig(self, k)

    monkeypatch.setattr(decoder.SpeculativeDecoder, "_launch", slow_drafting)
    steady = []
    complete = decoder.SpeculativeDecoder._complete
    monkeypatch.setattr(decoder.SpeculativeDecoder, "_complete",
                        lambda self, r: steady.append((r.k, r.steady)) or complete(self, r))
    d = DraftMTPDecoder(tiny.model, Sampler(SamplerConfig()), DraftParams(1))
    monkeypatch.setattr(d, "_choose_k", lambda: next(ks))
    _tokens(d, tiny.tokenizer, 36)
    # alternating rounds are no samples of t(k) for auto; a plain stretch is (but for its ends)
    assert not any(st for _, st in steady[:12]) and any(st for _, st in steady[15:-1]), steady
    assert d.drafting and d.pipeline
    timed = [(k, s) for k, s, first in d.clock.rounds[1:-1] if not first]
    plain = [s for k, s in timed if k == 0]
    drafting = [s for k, s in timed if k == 1]
    assert plain and drafting
    assert max(plain) < 0.04 <= min(drafting), timed


@pytest.mark.parametrize("p_min", [0.0, 0.3])
def test_the_host_reads_only_what_was_queued_with_the_round(tiny, monkeypatch, p_min):
    """Every device value the host reads from a resident round was handed to `mx.async_eval` when
    the round was queued. One created then but evaluated only at the read (the count of drafts
    that count was) is computed behind the next queued round, so the read waits for that round as
    well and the device idles while the host queues the one after (the loop's k = 3 round: 13.0 ms
    against 9.6 queued back to back on the H200)."""
    import mlx.core as mx
    from mtp_engine.speculative import decoder

    queued: list = []
    orig_async = mx.async_eval
    monkeypatch.setattr(decoder.mx, "async_eval", lambda *a: queued.extend(a) or orig_async(*a))
    late: list = []
    complete = decoder.SpeculativeDecoder._complete

    def reading(self, r):
        late.extend(x for x in r.read() if not any(x is q for q in queued))
        return complete(self, r)

    monkeypatch.setattr(decoder.SpeculativeDecoder, "_complete", reading)
    d = DraftMTPDecoder(tiny.model, Sampler(SamplerConfig()), DraftParams(3, p_min=p_min))
    got, st = _tokens(d, tiny.tokenizer, 20)
    assert d.drafting and st["drafted"] > 0
    assert not late, f"{len(late)} values read that were not queued with their round"
    from mtp_engine.generation.round import Round
    r = Queued(Round(3, *(mx.array([0]) for _ in range(7))), 4)
    assert len(r.read()) == 5  # emitted, n, drafted, drafts, finite: every device value the read takes


class _Whole:
    """A round's evaluated array that may only be read whole: `tolist` (and its shape). Any new
    operation on it (a slice, a reshape) would run behind the round queued after it."""

    def __init__(self, a):
        self._a, self.shape = a, a.shape

    def tolist(self):
        return self._a.tolist()


@pytest.mark.parametrize("spec", ["draft-mtp", "none"])
def test_the_host_reads_a_round_whole(tiny, monkeypatch, spec):
    """The host's read of a queued round takes the arrays it evaluated as they are: the read of a
    sequence alone (`SpeculativeDecoder`) and of a batch (`BatchScheduler`) go through `Round.host`,
    which only calls `tolist` on them (a slice of `emitted` read on the H100 waited for the next
    round: a one-draft round 9.2 ms against 6.9)."""
    import dataclasses

    import mlx.core as mx
    from mtp_engine.speculative import decoder
    from mtp_engine.batching import scheduler

    def whole(r):
        mx.eval(*r.read())
        return dataclasses.replace(r, **{f: _Whole(getattr(r, f)) for f in ("emitted", "n", "drafted", "drafts",
                                                                            "finite") if getattr(r, f) is not None})

    seen = []
    orig_eval = decoder.mx.eval
    monkeypatch.setattr(decoder.mx, "eval", lambda *a: orig_eval(*(x for x in a if not isinstance(x, _Whole))))
    complete = decoder.SpeculativeDecoder._complete

    def reading(self, q):
        seen.append(q.round.k)
        q.round = whole(q.round)
        return complete(self, q)

    monkeypatch.setattr(decoder.SpeculativeDecoder, "_complete", reading)
    d = DraftMTPDecoder(tiny.model, Sampler(SamplerConfig()), DraftParams(3))
    got, st = _tokens(d, tiny.tokenizer, 12)
    assert d.drafting and st["drafted"] > 0 and 3 in seen
    ref, _ = _tokens(PlainDecoder(tiny.model, Sampler(SamplerConfig())), tiny.tokenizer, 12)
    assert got == ref

    batch_complete = scheduler.BatchScheduler._complete
    monkeypatch.setattr(scheduler.BatchScheduler, "_complete",
                        lambda self, cur: batch_complete(self, cur._replace(round=whole(cur.round))))
    from mtp_engine import batch_generate
    prompts, kw = ["def f(x):", "import os"], dict(max_tokens=8, ignore_eos=True)
    out = batch_generate(prompts, tiny, spec=spec, **kw, **({"n_max": 3} if spec != "none" else {}))
    assert [o.text for o in out] == [generate(p, model=tiny, **kw).text for p in prompts]


def test_plain_stretches_of_any_length_reuse_a_few_head_shapes(tiny, monkeypatch):
    """After j plain rounds the MTP head owes j rows; the block it runs is padded to 1, 2, 4 or 8
    rows, so stretches of every length cost no new compile (each was seconds at 9B), and the
    output is still plain decoding's."""
    pattern = [k for j in range(1, 10) for k in [0] * j + [2]] + [0] * 200
    ks = iter(pattern)
    d = DraftMTPDecoder(tiny.model, Sampler(SamplerConfig()), DraftParams(2))
    monkeypatch.setattr(d, "_choose_k", lambda: next(ks))
    used = []
    shapes = d._shapes
    monkeypatch.setattr(d, "_shapes", lambda k: used.extend(shapes(k)) or shapes(k))
    n = 60
    got, _ = _tokens(d, tiny.tokenizer, n)
    ref, _ = _tokens(PlainDecoder(tiny.model, Sampler(SamplerConfig())), tiny.tokenizer, n)
    assert got == ref
    widths = {s[1] for s in used if s[0] == "mtp"}
    assert widths <= {1, 2, 3, 4, 8}, widths  # 3: a drafting round's k + 1


def test_p_min_and_n_min_decide_which_drafts_count(tiny):
    """llama.cpp's rules on the device: a draft counts while the head's top-10 probability stays
    >= p-min (a prefix: the first unsure draft ends it), and a round with fewer than n-min counting
    drafts drafts nothing."""
    import mlx.core as mx

    from mtp_engine.speculative.round import live_drafts

    def live(confident, n_min):
        return np.array(live_drafts(mx.array([confident]), 3, n_min))[0].tolist()

    assert live([True, True, True], 0) == [True, True, True]
    assert live([True, False, True], 0) == [True, False, False]  # a prefix
    assert live([False, True, True], 0) == [False, False, False]
    assert live([True, True, False], 2) == [True, True, False]
    assert live([True, True, False], 3) == [False, False, False]  # fewer than n-min: none
    for p_min, counted in ((1e-9, 3), (1.0, 0)):  # every top-10 probability passes 1e-9; none reaches 1
        d = DraftMTPDecoder(tiny.model, Sampler(SamplerConfig()), DraftParams(3, 0, p_min))
        d.prefill(IDS)
        _, _, confident = d.drafter.draft(3, p_min)
        assert confident is not None and int(np.array(confident).sum()) == counted, (p_min, confident)
        d.finish()


@pytest.mark.parametrize("case", ["auto cannot pay", "n-max 0", "auto can pay", "n-max 2"])
def test_a_run_that_will_not_draft_keeps_the_plain_decoders_steps(tiny, case):
    """Device rounds keep KV offsets on the device (attention reads past the valid positions);
    on the CPU their plain rounds cost 2-3% more than the plain decoder's. A run that is not
    expected to draft (n-max 0; auto whose costs say even full acceptance cannot pay) decodes as
    the plain decoder does; one that may draft runs device rounds. Output is plain decoding's
    either way."""
    from mtp_engine.speculative.calibration import default_seed
    from mtp_engine.speculative.scheduler import DraftLengthScheduler

    costs = {"auto cannot pay": default_seed(gpu=False), "auto can pay": {k: 1.1 for k in range(1, 9)}}.get(case)
    n_max = {"n-max 0": 0, "n-max 2": 2}.get(case)
    d = DraftMTPDecoder(tiny.model, Sampler(SamplerConfig()), DraftParams(n_max),
                        scheduler=DraftLengthScheduler(costs) if costs else None, trace=[])
    got, st = _tokens(d, tiny.tokenizer, 12)
    assert d.drafting == (case in ("auto can pay", "n-max 2"))
    # every round is traced and counted either way (a plain run's first token comes from its prefill)
    traced = [t for r in d.trace for t in r["emitted"]]
    assert traced == got[len(got) - len(traced):] and len(traced) >= len(got) - 1 and st["rounds"] == len(d.trace)
    ref, _ = _tokens(PlainDecoder(tiny.model, Sampler(SamplerConfig())), tiny.tokenizer, 12)
    assert got == ref


def test_compiled_plain_rounds_keep_kv_offsets_on_the_device(monkeypatch):
    """Pipelined compiled plain rounds (the GPU's default; forced here) run with the KV offsets
    held on the device, as a batch's lengths are: the host counts a round when it reads it. The
    answers equal uncompiled decoding's, through tails of 12 positions that move many times and a
    prompt cache's kept state taken up by the next prompt."""
    from mtp_engine import EngineOptions, PromptCache, load
    from mtp_engine.model.kv_cache import KVCache

    path = need(TINY / "qwen35-mtp-tiny-Q4_K_M.gguf")
    ref, comp = load(path), load(path, options=EngineOptions(compile_steps=True, kv_tail=12))
    device_offsets = []
    read = PlainDecoder._read

    def spy(self, r):
        if self.model is comp.model:
            device_offsets.append(any(isinstance(c, KVCache) and c.bound is not None for c in self.cache.layers))
        return read(self, r)

    monkeypatch.setattr(PlainDecoder, "_read", spy)
    cache = PromptCache()
    for prompt in ("def f(x):", "def f(x):\n# more"):
        want = generate(prompt, ref, max_tokens=60, ignore_eos=True).token_ids
        assert generate(prompt, comp, max_tokens=60, ignore_eos=True, prompt_cache=cache).token_ids == want
    assert len(device_offsets) > 100 and all(device_offsets), device_offsets[:5]
