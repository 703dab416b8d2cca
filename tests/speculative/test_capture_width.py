"""Fixed-width captures (`RecurrentCache.capture_width`): with compiled steps, a round's graph no
longer depends on the draft length of the round before it, so an auto run that changes its draft
length traces each width once instead of once per pair of successive lengths (each such trace fell
in the middle of a run); the padded slots change no token."""
from __future__ import annotations

import random

import mlx.core as mx
import pytest

from tests.conftest import SHIPPED, TINY_Q4, need
from mtp_engine import EngineOptions, generate, load
from mtp_engine.model import gdn, step
from mtp_engine.model.cache import RecurrentCache, capture_at_width
from mtp_engine.speculative import decoder as decoder_module

PROMPT = [349, 220, 451, 72, 389, 11]


@pytest.fixture(scope="module")
def compiled_model():
    return load(need(TINY_Q4), options=EngineOptions(compile_steps=True))


class _Traces:
    """Counts the trunk's traces (a compiled graph's body runs only while mx.compile traces it, on
    the graph's cache views) and drives the draft length of every round from a list."""

    def __init__(self, model, monkeypatch, ks: list[int]):
        self.count, self.ks = 0, list(ks)
        body = model.model._body

        def counting(ids, caches):
            self.count += isinstance(caches[0], (step._KVView, step._RecurrentView))  # a trace, not a call
            return body(ids, caches)

        monkeypatch.setattr(model.model, "_body", counting)
        monkeypatch.setattr(model.model, "graphs", step.StepGraphs())  # traced afresh here
        monkeypatch.setattr(decoder_module.SpeculativeDecoder, "_choose_k",
                            lambda d: self.ks.pop(0) if self.ks else 2)


def _every_transition(k_max: int, seed: int) -> list[int]:
    """Draft lengths 0..k_max in an order holding every ordered pair of them once at least."""
    pairs = [(a, b) for a in range(k_max + 1) for b in range(k_max + 1)]
    random.Random(seed).shuffle(pairs)
    return [k for p in pairs for k in p]


def test_a_run_traces_each_width_once_whatever_the_draft_lengths_before_it(compiled_model, monkeypatch):
    ks = _every_transition(4, seed=0)
    t = _Traces(compiled_model, monkeypatch, ks + _every_transition(4, seed=1))
    first = generate(PROMPT, compiled_model, max_tokens=len(ks) * 3, spec="draft-mtp", n_max=4, ignore_eos=True)
    assert first.stats["drafted"] > 0
    # widths 1..5 (a plain step, verifies of 2..5), each from a plain state or a picked slot, and
    # the prompt's prefill: 11 (26 without the fixed width, below)
    assert t.count <= 2 * 5 + 1, t.count
    t.count = 0
    generate(PROMPT[:-1], compiled_model, max_tokens=len(ks) * 3, spec="draft-mtp", n_max=4, ignore_eos=True)
    # every pair of successive draft lengths again, in another order: nothing new to trace (the
    # prompt of another length is the prefill's own graph)
    assert t.count <= 1, t.count


def test_without_a_fixed_width_each_pair_of_lengths_is_a_trace(compiled_model, monkeypatch):
    """The cause, shown: the same runs with captures of their own length trace many more graphs
    (so the test above fails without the fixed width)."""
    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "prefill", _prefill_without_width)
    ks = _every_transition(4, seed=0)
    t = _Traces(compiled_model, monkeypatch, ks + _every_transition(4, seed=1))
    generate(PROMPT, compiled_model, max_tokens=len(ks) * 3, spec="draft-mtp", n_max=4, ignore_eos=True)
    assert t.count > 2 * (2 * 5 + 1), t.count


_prefill = decoder_module.SpeculativeDecoder.prefill


def _prefill_without_width(self, ids, budget=None):
    out = _prefill(self, ids, budget)
    capture_at_width(self.cache.layers, None)
    return out


@pytest.mark.parametrize("path", [TINY_Q4, SHIPPED], ids=["tiny", "shipped"])
def test_fixed_width_rounds_equal_plain_decoding(path, monkeypatch):
    m = load(need(path), options=EngineOptions(compile_steps=True))
    plain = generate(PROMPT, m, max_tokens=40, ignore_eos=True).token_ids
    _Traces(m, monkeypatch, [3, 1, 4, 0, 2, 4, 1, 0, 0, 3, 2, 2, 4, 1, 3, 0, 4, 4, 2, 1] * 3)
    r = generate(PROMPT, m, max_tokens=40, spec="draft-mtp", n_max=4, ignore_eos=True)
    assert r.token_ids == plain and r.stats["drafted"] > 0


def test_mix_pads_a_captured_pass_to_its_width_and_keeps_the_first_slots():
    d = gdn.Dims(2, 16, 4, 16, 4, 1e-6)
    ch = 2 * d.kh * d.kd + d.vh * d.vd
    ks = mx.random.split(mx.random.key(3), 8)
    args = (mx.random.normal((1, 3, ch), key=ks[0]), mx.random.normal((1, 3, d.vh * d.vd), key=ks[1]),
            mx.random.normal((1, 3, d.vh), key=ks[2]), mx.random.normal((1, 3, d.vh), key=ks[3]),
            mx.random.normal((1, d.kernel - 1, ch), key=ks[4]),
            0.1 * mx.random.normal((1, d.vh, d.kd, d.vd), key=ks[5]), 0.5 * mx.random.normal((ch, d.kernel), key=ks[6]),
            mx.zeros((d.vh,)), -mx.ones((d.vh,)), mx.ones((d.vd,)))
    exact = gdn.mix(d, *args, capture=True)
    wide = gdn.mix(d, *args, capture=True, width=5)
    assert exact.state.shape[1] == 4 and wide.state.shape[1] == 6 and wide.conv.shape[1] == d.kernel - 1 + 5
    assert mx.array_equal(wide.state[:, :4], exact.state) and mx.array_equal(wide.conv[:, :d.kernel - 1 + 3], exact.conv)
    assert mx.array_equal(wide.y, exact.y)
    with pytest.raises(ValueError):
        gdn.mix(d, *args, capture=True, width=2)
    # the cache counts the pass's tokens, not the slots: rolling back to any of them works
    c = RecurrentCache(d.kernel, ch, d.vh, d.kd, d.vd)
    c.capture_width = 5
    c.begin_capture()
    c.update(wide.conv, wide.state, tokens=3)
    with pytest.raises(ValueError):
        c.rollback(4)
    c.rollback(2)
    assert mx.array_equal(c.state, exact.state[:, 2]) and mx.array_equal(c.conv, exact.conv[:, 2:2 + d.kernel - 1])


def test_a_new_prompt_length_costs_no_trace(compiled_model, monkeypatch):
    """A prompt's prefill is a shape that may not recur: it runs uncompiled unless its graph is
    traced already (a trace costs more than dispatching its operations once), so after a first
    generation of each kind, a second one with another prompt length traces nothing."""
    t = _Traces(compiled_model, monkeypatch, [])
    monkeypatch.setattr(decoder_module.SpeculativeDecoder, "_choose_k", lambda d: d.params.k_max)
    plain = {n: generate(PROMPT[:n], compiled_model, max_tokens=12, ignore_eos=True).token_ids for n in (3, 4)}
    spec = {n: generate(PROMPT[:n], compiled_model, max_tokens=12, spec="draft-mtp", n_max=2, ignore_eos=True)
            for n in (3, 4)}
    first = t.count
    assert first > 0
    for n in (5, 6, 2):
        assert generate(PROMPT[:n], compiled_model, max_tokens=12, ignore_eos=True).token_ids
        assert generate(PROMPT[:n], compiled_model, max_tokens=12, spec="draft-mtp", n_max=2, ignore_eos=True).stats[
            "drafted"] > 0
    assert t.count == first, (first, t.count)
    assert all(spec[n].token_ids == plain[n] for n in plain)  # uncompiled prefill, compiled rounds: same tokens
