"""The drafter interface (speculative/drafter.py) with drafters other than production's: the
n-gram (prompt lookup) drafter is lossless under greedy decoding, and the ablation variants
(re-decode rollback, pre-norm feed, oracle acceptance) are selected outside the production class."""
from __future__ import annotations

import inspect

from pathlib import Path

import pytest

from mtp_engine import MTPEngineError
from mtp_engine import generate
from mtp_engine.generation.loop import run
from mtp_engine.generation.profiler import Profiler
from mtp_engine.generation.sampling import Sampler, SamplerConfig
from mtp_engine.speculative.ablations import ablation_decoder
from mtp_engine.speculative.config import DraftParams
from mtp_engine.speculative.decoder import SpeculativeDecoder
from mtp_engine.speculative.drafter import DraftContext
from mtp_engine.speculative.draft_mtp import DraftMTPDecoder
from mtp_engine.speculative.ngram import NGramDecoder, NGramDrafter

IDS = [349, 220, 451, 72, 389, 349, 220, 451, 72, 389, 349, 220]


@pytest.fixture
def tiny(tiny_any):
    return tiny_any  # the session's tiny f32 model (tests/conftest.py)


def _tokens(dec, tok, n, ids=IDS):
    out = []
    for ch in run(dec, tok, ids, n, ignore_eos=True):
        out += ch.token_ids
    return out, ch.stats


def _ctx():
    """A lookup's drafter: no model or profiler behind it (the lookup reads only tokens)."""
    return DraftContext(None, Sampler(SamplerConfig()), Profiler())


def test_ngram_lookup_proposes_what_followed_the_latest_match():
    d = NGramDrafter(_ctx(), max_ngram=2)
    d.start([5, 1, 2, 3, 9, 1, 2, 4, 7, 1, 2], 0, None)
    assert d.lookup(2) == [4, 7]  # the latest earlier "1 2" is followed by 4 7
    assert d.lookup(5) == [4, 7, 1, 2]  # up to the end of the history
    d.round_read([8])  # history ... 1 2 8: "2 8" and "8" never occurred before
    assert d.lookup(3) == []
    with pytest.raises(MTPEngineError):
        NGramDrafter(_ctx(), max_ngram=1, min_ngram=2)


@pytest.mark.parametrize("n_max", [1, 3])
def test_ngram_drafter_greedy_equals_plain(tiny, n_max):
    n = 40
    ref = generate(IDS, tiny, max_tokens=n, ignore_eos=True).token_ids
    for pipeline in (True, False):
        dec = SpeculativeDecoder(tiny.model, Sampler(SamplerConfig()), DraftParams(n_max), NGramDrafter,
                                 pipeline=pipeline)
        got, st = _tokens(dec, tiny.tokenizer, n)
        assert got == ref
        assert st["drafted"] > 0 and st["ngram_hits"] > 0  # the interface was exercised, not bypassed
        assert st["rounds"] == st["ngram_lookups"]


@pytest.mark.parametrize("n_max", [1, 3])
def test_ngram_rounds_on_the_device_equal_plain(tiny, n_max):
    """The n-gram decoder runs the device round (drafts looked up on the host, each round launched
    after the read of the one before): greedy output is plain decoding's, at fixed n-max, with and
    without pipelining asked for."""
    n = 40
    ref = generate(IDS, tiny, max_tokens=n, ignore_eos=True).token_ids
    for pipeline in (True, False):
        dec = NGramDecoder(tiny.model, Sampler(SamplerConfig()), DraftParams(n_max), pipeline=pipeline)
        got, st = _tokens(dec, tiny.tokenizer, n)
        assert dec.drafting and got == ref
        assert st["drafted"] > 0 and st["ngram_hits"] > 0 and st["ngram_lookups"] == st["rounds"]
        assert st["drafted"] <= n_max * st["rounds"]


def test_ngram_rounds_on_the_device_sample_reproducibly(tiny):
    def once():
        dec = NGramDecoder(tiny.model, Sampler(SamplerConfig(temperature=0.8, seed=3)), DraftParams(3))
        return _tokens(dec, tiny.tokenizer, 24), dec

    (a, st), dec = once()
    assert dec.drafting and a == once()[0][0] and len(a) == 24
    assert all(0 <= t < tiny.model.cfg.vocab_size for t in a)
    assert st["drafted"] > 0


def _scan(history: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """The lookup by definition: a scan for the latest earlier occurrence, longest n-gram first."""
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        for start in range(len(history) - n - 1, -1, -1):
            if history[start:start + n] == history[-n:]:
                return history[start + n:start + n + k]
    return []


def test_ngram_index_agrees_with_a_scan_of_the_history():
    import random

    rng = random.Random(0)
    for _ in range(200):
        hist = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        d = NGramDrafter(_ctx())
        d.start(hist[:len(hist) // 2], 0, None)
        for t in hist[len(hist) // 2:]:
            d.round_read([t])
        assert d.history == hist
        assert d.lookup(4) == _scan(hist, 4)


@pytest.mark.parametrize("n_max", [2, "auto"])
def test_spec_ngram_reaches_the_ngram_drafter_through_the_api(tiny, n_max):
    n = 32
    ref = generate(IDS, tiny, max_tokens=n, ignore_eos=True)
    got = generate(IDS, tiny, max_tokens=n, ignore_eos=True, spec="ngram", n_max=n_max)
    assert got.token_ids == ref.token_ids
    assert "ngram_lookups" in got.stats and "catch_up_rows_dropped" not in got.stats  # not the MTP head
    if n_max != "auto":  # auto on this CPU rightly does not draft (verifying S rows costs ~S steps here)
        assert got.stats["ngram_lookups"] > 0


def test_spec_ngram_from_the_command_line_and_the_server(tiny, tmp_path, capsys):
    from mtp_engine.cli.main import main
    from mtp_engine.server.schemas import ServerDefaults, parse_completion

    rc = main(["generate", "-m", tiny.path, "-p", "To be or not to be, to be", "-n", "8", "--spec-type", "ngram",
               "--spec-draft-n-max", "2",
               "--json", "--temp", "0"])
    assert rc == 0
    import json
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["ngram_lookups"] > 0
    req = parse_completion({"prompt": "x", "spec_type": "ngram"}, ServerDefaults())
    assert req.kwargs["spec"] == "ngram"


def test_ngram_drafter_samples_losslessly_shaped_output(tiny):
    """At temperature > 0 the n-gram drafts (one-hot q) go through speculative sampling: valid
    tokens, reproducible with a seed."""
    def once():
        dec = SpeculativeDecoder(tiny.model, Sampler(SamplerConfig(temperature=0.8, seed=3)), DraftParams(3),
                                 NGramDrafter)
        return _tokens(dec, tiny.tokenizer, 24)

    a, st = once()
    assert a == once()[0] and len(a) == 24
    assert all(0 <= t < tiny.model.cfg.vocab_size for t in a)
    assert st["drafted"] > 0


def test_production_decoder_has_no_experiment_switches():
    params = inspect.signature(DraftMTPDecoder).parameters
    assert not {"rollback", "feed", "oracle_acceptance"} & set(params)
    assert {"model", "sampler", "params", "profiler", "scheduler"} <= set(params)


def test_pre_norm_feed_keeps_greedy_output(tiny):
    """The pre-norm feed changes acceptance, never the greedy output (verify decides)."""
    n = 24
    ref = generate(IDS, tiny, max_tokens=n, ignore_eos=True).token_ids
    dec = ablation_decoder(tiny.model, Sampler(SamplerConfig()), DraftParams(3), feed="pre_norm")
    assert type(dec) is not DraftMTPDecoder and isinstance(dec, DraftMTPDecoder)
    got, st = _tokens(dec, tiny.tokenizer, n)
    assert got == ref and st["drafted"] > 0


def _redecode_decoder() -> type:
    """Notebook d's host-read variant (docs/notebooks/redecode.py: not in the package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "docs" / "notebooks" / "redecode.py"
    spec = importlib.util.spec_from_file_location("redecode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.RedecodeDecoder


@pytest.mark.parametrize("n_max", [1, 3])
def test_redecode_rollback_gives_capture_rounds(tiny, n_max):
    """Same drafts, acceptances and tokens round by round as the production (capture) rollback,
    rejections included."""
    traces = []
    for cls in (DraftMTPDecoder, _redecode_decoder()):
        dec = cls(tiny.model, Sampler(SamplerConfig()), DraftParams(n_max), trace=[])
        dec.prefill(IDS)
        for _ in range(12):
            dec.step()
        traces.append(dec.trace)
    assert traces[0] == traces[1]
    assert any(r["n_accepted"] < len(r["draft"]) for r in traces[0])  # a rollback re-decoded


@pytest.mark.parametrize("oracle", [0.0, 1.0])
def test_oracle_acceptance_sets_the_acceptance(tiny, oracle):
    dec = ablation_decoder(tiny.model, Sampler(SamplerConfig(seed=0)), DraftParams(2), oracle_acceptance=oracle)
    _, st = _tokens(dec, tiny.tokenizer, 12)
    assert st["drafted"] > 0 and st["acceptance_rate"] == oracle


def test_ablation_names_are_checked(tiny):
    with pytest.raises(MTPEngineError, match="pre_norm"):
        ablation_decoder(tiny.model, Sampler(SamplerConfig()), DraftParams(3), feed="mid_norm")


def test_a_dense_model_has_no_expert_observer(tiny):
    assert tiny.model.expert_use is None
