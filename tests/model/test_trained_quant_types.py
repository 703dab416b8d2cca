"""The trained code model in every quant type we can write: it loads, and its next-token loss on
held-out code stays close to the shipped Q4_K_M file's (a model that loaded wrong would be far off)."""
from __future__ import annotations

import json

import mlx.core as mx
import pytest

from tests.conftest import TRAINED, TRAINED_GGUF, need
from mtp_engine import generate
from mtp_engine import load
from mtp_engine.gguf.writer import WRITABLE, requantize


def _nll(m, ids: list[int]) -> float:
    h = m.model.forward(mx.array([ids]), m.model.make_cache())
    logits = m.model.logits(h[0, :-1])
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tgt = mx.array(ids[1:])
    return float(-mx.take_along_axis(lp, tgt[:, None], axis=-1).mean().item())


@pytest.fixture(scope="module")
def reference():
    src = need(TRAINED_GGUF)
    prompts = json.loads(need(TRAINED / "prompts.json").read_text())["prompts"]
    m = load(src)
    ids = prompts[1]["token_ids"][:32]  # (a forward is its arithmetic on this CPU: 32 tokens say what 64 do)
    return src, ids, _nll(m, ids)


@pytest.mark.parametrize("qtype", WRITABLE)
def test_trained_model_in_every_writable_type(qtype, reference, tmp_path):
    src, ids, nll_ref = reference
    dst = tmp_path / f"code-{qtype}.gguf"
    requantize(src, dst, qtype)
    m = load(dst)
    nll = _nll(m, ids)
    # measured: F32/F16/BF16/Q8_0 within 1% of Q4_K_M, Q4_0/Q4_1/Q5_x within ~10% (random-level NLL is ~9)
    assert nll < nll_ref * 1.2 + 0.05, (qtype, nll, nll_ref)
    r = generate(ids, m, max_tokens=12, ignore_eos=True)
    assert len(r.text) > 10
    r2 = generate(ids, m, max_tokens=12, ignore_eos=True, spec="draft-mtp", n_max=2)
    assert r2.token_ids == r.token_ids
