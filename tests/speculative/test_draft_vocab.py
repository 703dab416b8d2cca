"""Drafting over the first N token ids (`EngineOptions.draft_vocab`): the MTP head's output
product reads N rows instead of the whole vocabulary. Lossless by construction (the verify
decides every token; a sampled draft's distribution is zero past N): greedy draft-mtp still equals
plain decoding, the draft scores are the full ones on the first N ids and -inf past them, and
the drafts the head makes are among those ids."""
from __future__ import annotations

import numpy as np
import pytest

import mlx.core as mx

from tests.conftest import SHIPPED, TINY_Q4, need
from mtp_engine import EngineOptions, MTPEngineError, generate, load
from mtp_engine.generation.sampling import SamplerConfig, distribution


@pytest.fixture(scope="module")
def narrow():
    return load(need(SHIPPED), options=EngineOptions(draft_vocab=512))


def test_draft_scores_are_the_first_ids_of_the_full_ones(narrow):
    m = narrow.model
    h = mx.random.normal((2, m.cfg.hidden_size), key=mx.random.key(3))
    full, draft = np.array(m.logits(h)), np.array(m.draft_logits(h))
    assert draft.shape == full.shape
    np.testing.assert_allclose(draft[:, :512], full[:, :512], rtol=1e-5, atol=1e-4)
    assert np.isneginf(draft[:, 512:]).all()
    q = np.array(distribution(m.draft_logits(h[0]), SamplerConfig(temperature=0.8)))
    assert q[512:].sum() == 0 and abs(q.sum() - 1) < 1e-5


@pytest.mark.parametrize("n_max", [1, 3])
def test_greedy_draft_mtp_over_few_ids_equals_plain(narrow, n_max):
    prompt = "def fibonacci(n):\n"
    plain = generate(prompt, model=narrow, max_tokens=48, spec="none", ignore_eos=True)
    spec = generate(prompt, model=narrow, max_tokens=48, spec="draft-mtp", n_max=n_max, ignore_eos=True)
    assert spec.token_ids == plain.token_ids
    assert spec.stats["drafted"] > 0


def test_fewer_ids_fewer_accepted_drafts():
    """The option reaches the drafts: over 8 ids of the tiny model's 512 almost no draft can be
    right, over all of them many are."""
    prompt = "def f(x):"
    rates = []
    for n in (0, 8):
        mdl = load(need(TINY_Q4), options=EngineOptions(draft_vocab=n))
        out = generate(prompt, model=mdl, max_tokens=40, spec="draft-mtp", n_max=2, ignore_eos=True)
        rates.append(out.stats["acceptance_rate"])
    assert rates[1] < rates[0]


def test_sampled_draft_mtp_over_few_ids_runs_with_its_seed(narrow):
    kw = dict(model=narrow, max_tokens=32, temperature=0.8, seed=7, ignore_eos=True)
    a = generate("def f(x):", spec="draft-mtp", n_max=3, **kw)
    b = generate("def f(x):", spec="draft-mtp", n_max=3, **kw)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 32


@pytest.mark.parametrize("value", [-1, True, "many"])
def test_bad_draft_vocab_is_refused(value):
    with pytest.raises(MTPEngineError) as info:
        EngineOptions(draft_vocab=value)
    assert info.value.field == "draft_vocab"
