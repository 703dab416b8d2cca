"""Repetition penalties and logprobs: llama.cpp's formula against a float64 NumPy reference,
draft-mtp's per-row verify histories (greedy parity here; the chi-square on a penalised
distribution is in test_spec.py), logprobs equal between plain and draft-mtp, provenance of emitted tokens."""
from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest

from tests.conftest import TINY, need
from tests.sampling_reference import reference_penalties
from mtp_engine import MTPEngineError, load, stream_generate
from mtp_engine import generate
from mtp_engine.generation.penalties import PenaltyConfig, PenaltyHistory

IDS = [349, 220, 451, 72]
_models: dict = {}


def _tiny():
    if "m" not in _models:
        _models["m"] = load(need(TINY / "qwen35-mtp-tiny-f32.gguf"), exact=True)
    return _models["m"]


@pytest.mark.parametrize("cfg", [PenaltyConfig(0.7, 0.4, 1.3, 6), PenaltyConfig(-0.5, 1.1, 0.8, 3),
                                 PenaltyConfig(0.2, 0.3, 1.5, -1), PenaltyConfig(0.0, 0.0, 1.2, 50)])
def test_penalize_rows_equal_reference(cfg):
    """Row r of a verify block is penalised with history + drafts[:r]; a draft step j with
    history + drafts[:j]; both against the reference on the explicit history."""
    rng = np.random.default_rng(0)
    vocab = 40
    history = [int(t) for t in rng.integers(0, 12, 9)]
    drafts = [int(t) for t in rng.integers(0, 12, 4)]
    logits = rng.normal(0, 2, (len(drafts) + 1, vocab)).astype(np.float32)
    h = PenaltyHistory(cfg)
    h.tokens = list(history)
    got = np.array(h.penalize(mx.array(logits), mx.array(drafts)))
    for r in range(len(drafts) + 1):
        np.testing.assert_allclose(got[r], reference_penalties(logits[r], history + drafts[:r], cfg), rtol=1e-5, atol=1e-5)
    for j in range(len(drafts) + 1):  # the drafter's chain: one row, offset j
        one = np.array(h.penalize(mx.array(logits[j]), mx.array(drafts[:j]) if j else None, j))
        np.testing.assert_allclose(one, reference_penalties(logits[j], history + drafts[:j], cfg), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cfg", [PenaltyConfig(0.7, 0.4, 1.3, 6), PenaltyConfig(0.2, 0.3, 1.5, -1),
                                 PenaltyConfig(0.0, 0.0, 1.2, 50)])
@pytest.mark.parametrize("count", [1, 3, 5])
def test_an_unread_rounds_tokens_count_as_history(cfg, count):
    """A round queued before the host read the one before it: that round's emitted tokens (5, of
    which a device count are real) continue the history, for the verify's rows and a draft step's."""
    rng = np.random.default_rng(count)
    vocab = 40
    history = [int(t) for t in rng.integers(0, 12, 9)]
    unread = [int(t) for t in rng.integers(0, 12, 5)]
    drafts = [int(t) for t in rng.integers(0, 12, 3)]
    logits = rng.normal(0, 2, (len(drafts) + 1, vocab)).astype(np.float32)
    h = PenaltyHistory(cfg)
    h.tokens = list(history)
    pending = (mx.array(unread), mx.array(count))
    got = np.array(h.penalize(mx.array(logits), mx.array(drafts), unread=pending))
    seen = history + unread[:count]
    for r in range(len(drafts) + 1):
        np.testing.assert_allclose(got[r], reference_penalties(logits[r], seen + drafts[:r], cfg), rtol=1e-5, atol=1e-5)
    for j in range(len(drafts) + 1):
        one = np.array(h.penalize(mx.array(logits[j]), mx.array(drafts[:j]) if j else None, j, pending))
        np.testing.assert_allclose(one, reference_penalties(logits[j], seen + drafts[:j], cfg), rtol=1e-5, atol=1e-5)


def test_penalties_off_leave_logits_untouched():
    h = PenaltyHistory(PenaltyConfig())
    h.tokens = [1, 1, 2]
    x = mx.array([0.5, -1.0, 2.0])
    assert h.penalize(x) is x
    assert PenaltyConfig(1.0, 1.0, 1.5, 0).active is False  # a 0 window disables (llama.cpp)


@pytest.mark.parametrize("kw", [dict(presence_penalty=2.5), dict(frequency_penalty=float("nan")),
                                dict(repeat_penalty=0.0), dict(repeat_penalty=True), dict(repeat_last_n=-2),
                                dict(repeat_last_n=1.5), dict(logprobs=21), dict(logprobs=-1)])
def test_bad_penalty_and_logprob_values(kw):
    field = next(iter(kw))
    with pytest.raises(MTPEngineError, match=field):
        generate(IDS, _tiny(), max_tokens=1, **kw)


@pytest.mark.parametrize("kw", [dict(repeat_penalty=1.3), dict(presence_penalty=2.0, frequency_penalty=0.5),
                                dict(repeat_penalty=0.5, repeat_last_n=4), dict(repeat_penalty=0.3, repeat_last_n=2),
                                dict(repeat_penalty=1.5, frequency_penalty=0.3, repeat_last_n=-1)])
def test_greedy_parity_under_penalties(kw):
    """draft-mtp emits plain decoding's tokens under penalties. The repeat_penalty < 1 cases
    reward recent tokens so that drafts repeat inside a round: verifying every row with the
    round's starting history instead fails them (checked when this test was written)."""
    m = _tiny()
    plain = generate(IDS, m, max_tokens=48, ignore_eos=True, **kw).token_ids
    if "unpenalised" not in _models:
        _models["unpenalised"] = generate(IDS, m, max_tokens=48, ignore_eos=True).token_ids
    assert plain != _models["unpenalised"]  # the penalty really changes the text
    accepted = 0
    for n_max in (2, 6):
        r = generate(IDS, m, max_tokens=48, ignore_eos=True, spec="draft-mtp", n_max=n_max, **kw)
        assert r.token_ids == plain, n_max
        accepted += r.stats["accepted"]
    assert accepted > 0


def test_logprobs_equal_between_plain_and_draft_mtp():
    m = _tiny()
    a = generate(IDS, m, max_tokens=24, ignore_eos=True, logprobs=3)
    b = generate(IDS, m, max_tokens=24, ignore_eos=True, logprobs=3, spec="draft-mtp", n_max=3)
    assert a.token_ids == b.token_ids and len(a.logprobs) == len(b.logprobs) == 24
    for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids):
        assert x["token"] == y["token"] == t
        assert x["logprob"] == pytest.approx(y["logprob"], abs=1e-3)
        assert [i for i, _ in x["top"]] == [i for i, _ in y["top"]]
        assert x["top"][0][0] == t  # greedy: the chosen token is the most likely one
        assert all(p1 >= p2 for (_, p1), (_, p2) in zip(x["top"], x["top"][1:]))
    # against a direct computation from the model's logits for the first token
    logits = np.array(m.model.logits(m.model.forward(mx.array([IDS]), m.model.make_cache())[0, -1]), np.float64)
    ref = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    assert a.logprobs[0]["logprob"] == pytest.approx(ref[a.token_ids[0]], abs=1e-4)
    assert [i for i, _ in a.logprobs[0]["top"]] == list(np.argsort(-ref)[:3])
    assert "logprobs" in a.to_json() and "logprobs" not in generate(IDS, m, max_tokens=2).to_json()


def test_chunks_carry_provenance():
    """Each streamed token says whether it was an accepted draft; their count is the accepted total."""
    m = _tiny()
    chunks = list(stream_generate(IDS, m, max_tokens=40, ignore_eos=True, spec="draft-mtp", n_max=3,
                                  repeat_penalty=0.5, repeat_last_n=4))
    flags = [f for c in chunks for f in c.drafted]
    assert len(flags) == sum(len(c.token_ids) for c in chunks) == 40
    stats = chunks[-1].stats
    assert 0 < sum(flags) <= stats["accepted"]  # the last round may be cut at max_tokens
    assert all(c.n_drafted in (0, 3) for c in chunks[:-1])
    plain = list(stream_generate(IDS, m, max_tokens=5, ignore_eos=True))
    assert not any(f for c in plain for f in c.drafted)


def test_cli_penalty_flags_and_n_probs(capsys):
    """`generate --repeat-penalty ... --n-probs N --json` equals the API; `serve` refuses bad flags
    with one line and exit 2 before loading anything."""
    from mtp_engine.cli.main import main

    path = str(need(TINY / "qwen35-mtp-tiny-f32.gguf"))
    kw = dict(repeat_penalty=0.5, repeat_last_n=4, presence_penalty=0.2, frequency_penalty=0.1)
    ref = generate("To be", load(path), max_tokens=8, logprobs=2, **kw)
    rc = main(["generate", "-m", path, "-p", "To be", "-n", "8", "--json", "--n-probs", "2", "--repeat-penalty", "0.5",
               "--repeat-last-n", "4", "--presence-penalty", "0.2", "--frequency-penalty", "0.1"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["token_ids"] == ref.token_ids
    assert [e["token"] for e in out["logprobs"]] == ref.token_ids and all(len(e["top"]) == 2 for e in out["logprobs"])
    for flags, field in [(["--queue-size", "0"], "queue-size"), (["--repeat-penalty", "0"], "repeat_penalty"),
                         (["--spec-type", "eagle"], "spec-type"), (["--port", "70000"], "port")]:
        rc = main(["serve", "-m", path, *flags])
        err = capsys.readouterr().err
        assert rc == 2 and field in err and err.count("\n") == 1, err
