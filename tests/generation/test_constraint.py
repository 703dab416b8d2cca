"""Constrained decoding: the text follows the grammar (JSON schema, any JSON object, regex), greedy
draft-mtp gives exactly what plain constrained decoding gives at every n-max, the grammar's masks
are right row by row and leave its state as it was, and every misuse is an MTPEngineError (or a 400
on the server)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("llguidance", reason="constrained decoding needs llguidance (pip install -e '.[test]')")

from mtp_engine import Constraint, MTPEngineError
from mtp_engine import generate  # noqa: E402
from mtp_engine import constraint as constraint_module  # noqa: E402
from mtp_engine.constraint import response_format_constraint  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                    "maxItems": 2}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def _valid(text: str) -> dict:
    obj = json.loads(text)
    assert set(obj) == {"name", "age", "tags"} and isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["age"], int) and obj["age"] >= 0 and len(obj["tags"]) <= 2
    return obj


@pytest.fixture(scope="module")
def shipped(models):
    from tests.conftest import SHIPPED

    return models(SHIPPED)


def test_json_schema_plain_and_draft_mtp_agree(shipped):
    prompt = "def get_user():\n    return "
    plain = generate(prompt, model=shipped, max_tokens=80, constraint=Constraint.json(SCHEMA))
    assert plain.finish_reason == "stop"
    _valid(plain.text)
    for n_max in (1, 2, 4, "auto"):
        r = generate(prompt, model=shipped, max_tokens=80, spec="draft-mtp", n_max=n_max,
                     constraint=Constraint.json(SCHEMA))
        assert r.text == plain.text and r.token_ids == plain.token_ids, n_max
        if n_max != "auto":  # the device round drafted under the grammar (auto may not draft on this CPU)
            assert r.stats["drafted"] > 0 and r.stats["accepted"] > 0, r.stats


def test_any_json_object_and_regex_with_sampling(shipped, tiny_q4):
    for model in (shipped, tiny_q4):
        r = generate("x = ", model=model, max_tokens=60, constraint=Constraint.json())
        if r.finish_reason == "stop":
            assert isinstance(json.loads(r.text), dict)
        else:  # cut by max_tokens: still a prefix of an object
            assert r.text.startswith("{")
        for seed in range(3):
            s = generate("answer: ", model=model, max_tokens=8, temperature=1.0, seed=seed, spec="draft-mtp", n_max=2,
                         constraint=Constraint.regex(r"(yes|no|maybe)( please)?"))
            assert re.fullmatch(r"(yes|no|maybe)( please)?", s.text) and s.finish_reason == "stop", s.text


def test_masks_row_by_row_leave_the_state_alone(shipped):
    tok = shipped.tokenizer
    c = Constraint.json(SCHEMA)
    good = generate("u = ", model=shipped, max_tokens=40, constraint=c).token_ids[:6]  # tokens the masks allowed
    g = c.matcher(tok, shipped.model.cfg.vocab_size)
    before = g.masks([])
    bad = int((~g.masks(good)[-1]).nonzero()[0][0])  # a token the grammar refuses after them
    rows = g.masks(good + [bad, 7])  # then anything: never looked at
    assert rows.shape == (len(good) + 3, shipped.model.cfg.vocab_size)
    assert rows[0].tolist() == before[0].tolist() and 1 <= rows[0].sum() < rows.shape[1]
    for i, t in enumerate(good):  # each allowed by the row before it
        assert rows[i][t]
    assert not rows[len(good)][bad]
    assert (rows[-1] == rows[len(good)]).all()
    assert g.masks([]).tolist() == before.tolist()  # the state did not move
    g.accept(good)
    assert g.masks([])[0].tolist() == rows[len(good)].tolist()
    with pytest.raises(MTPEngineError, match="does not follow the grammar"):
        g.accept([bad])


def test_misuse_is_an_engine_error(shipped):
    with pytest.raises(MTPEngineError) as e:
        Constraint.regex("(unclosed")
    assert e.value.field == "constraint"
    with pytest.raises(MTPEngineError):
        Constraint.json(["not", "a", "schema"])
    with pytest.raises(MTPEngineError, match="ignore_eos"):
        generate("x", model=shipped, max_tokens=2, ignore_eos=True, constraint=Constraint.json())
    with pytest.raises(MTPEngineError) as e:
        generate("x", model=shipped, max_tokens=2, constraint={"type": "json_object"})
    assert e.value.field == "constraint"
    assert response_format_constraint({"type": "text"}) is None
    for bad in ({"type": "json_schema"}, {"type": "xml"}, "json", {"type": "json_schema", "json_schema": {"schema": 3}}):
        with pytest.raises(MTPEngineError) as e:
            response_format_constraint(bad)
        assert e.value.field == "response_format"


def test_without_llguidance_the_error_says_how_to_get_it(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_llguidance(name, *a, **k):
        if name == "llguidance":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    with pytest.raises(MTPEngineError, match=r"mtp-engine\[constrained\]"):
        Constraint.json()


def test_an_llguidance_too_old_is_named_with_the_version_needed(monkeypatch):
    """Below the oldest version the tests pass with (0.7.8 fails them), the error says which is
    installed and which is needed, instead of failing inside llguidance on the first grammar."""
    from importlib import metadata

    from mtp_engine import constraint

    constraint._version.cache_clear()
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "0.7.8" if name == "llguidance" else real(name))
    try:
        with pytest.raises(MTPEngineError, match=r"llguidance 0\.7\.8 is too old.*>= 0\.7\.9"):
            Constraint.json()
    finally:
        constraint._version.cache_clear()
    monkeypatch.setattr(metadata, "version", lambda name: "0.7.9rc1" if name == "llguidance" else real(name))
    assert constraint._version("llguidance") == (0, 7, 9)
    constraint._version.cache_clear()


def test_the_head_drafts_only_what_the_grammar_allows(shipped):
    """Masked drafting: every draft of a chain is allowed after the ones before it (unmasked, this
    code model drafts the pretty-printed JSON it was trained on, which the grammar refuses)."""
    import mlx.core as mx

    from mtp_engine.generation.profiler import Profiler
    from mtp_engine.generation.sampling import Sampler, SamplerConfig
    from mtp_engine.speculative.drafter import DraftContext
    from mtp_engine.speculative.mtp_drafter import MTPDrafter

    tok, m = shipped.tokenizer, shipped.model
    text = '{"name": "ab'
    ids = tok.encode("PACKAGE = ") + tok.encode(text)
    post = m.forward(mx.array([ids[:-1]]), m.make_cache())
    sampler = Sampler(SamplerConfig())
    sampler.grammar = Constraint.json(SCHEMA).matcher(tok, m.cfg.vocab_size)
    sampler.grammar.accept(tok.encode(text)[:-1])  # the grammar has seen the text up to the last token
    drafter = MTPDrafter(DraftContext(m, sampler, Profiler("off")))
    drafter.start(ids, 0, None)
    drafter.read(ids[:-1], post)
    drafter.to_device()
    tokens, _, counts = drafter.draft(6)
    drafts = tokens[0].tolist()[:int(np.cumprod(np.array(counts[0])).sum())]  # those before the text's end
    assert drafts
    before = [tok.encode(text)[-1]]
    for d in drafts:
        assert sampler.grammar.allowed_after(before)[d], (tok.decode(before), d)
        before.append(d)


def test_grammars_llguidance_cannot_roll_back(shipped):
    """A Lark grammar with a stop= lexeme (llguidance cannot roll those back): the verify rows and
    the drafts are worked out on a copy of the state, so draft-mtp still equals plain decoding."""
    grammar = ('%llguidance {}\nstart: "<tool_call>\\n<function=get_weather>\\n" param* "</function>"\n'
               'param: "<parameter=" pname ">\\n" value "\\n"\npname: "city" | "days"\n'
               'value[stop="\\n</parameter>"]: /(?s:.*)/\n')
    c = Constraint.lark(grammar)
    plain = generate("def f():\n    ", model=shipped, max_tokens=40, constraint=c)
    assert plain.text.startswith("<tool_call>\n<function=get_weather>\n")
    for n_max in (2, 4):
        r = generate("def f():\n    ", model=shipped, max_tokens=40, constraint=c, spec="draft-mtp", n_max=n_max)
        assert r.token_ids == plain.token_ids, n_max


def test_llguidance_before_1_7_gets_one_end_token(monkeypatch):
    """llguidance 1.0-1.6 take one `eos_token` int (a list raises TypeError); 1.7 on take a list.
    pyproject's `llguidance>=1.0` holds because the first end token is passed to the old ones
    (checked by hand with 1.0.0, 1.6.0 and 1.9.1: the tests above pass on each)."""
    import types

    from mtp_engine import constraint

    seen = []

    class OldTokenizer:
        def __init__(self, source, n_vocab, eos_token):
            if isinstance(eos_token, list):
                raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
            seen.append(eos_token)

    monkeypatch.setattr(constraint, "_llg", lambda: types.SimpleNamespace(LLTokenizer=OldTokenizer))
    tok = types.SimpleNamespace(eos_token_ids={7, 3}, backend=types.SimpleNamespace(to_str=lambda: "{}"),
                                grammar_views={})
    constraint._ll_tokenizer(tok, 16)
    assert seen == [3]


def _nested(depth: int) -> dict:
    root = cur = {"type": "object"}
    for _ in range(depth):
        cur["properties"] = {"a": {"type": "object"}}
        cur = cur["properties"]["a"]
    return root


def _cyclic() -> dict:
    s = {"type": "object"}
    s["properties"] = {"self": s}
    return s


@pytest.mark.parametrize("schema, says", [
    (_nested(9000), "nested too deep"),  # llguidance's converter recursed into a SIGSEGV
    (_cyclic(), "cyclic at $.properties.self"),
    ({"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(30_000)}}, "too large"),
    ({"type": "string", "maxLength": 10 ** 5000}, "integer at $.maxLength is out of range"),
    ({"type": "number", "maximum": float("inf")}, "not finite"),
    ({"type": "string", "pattern": "\ud800"}, "lone surrogate"),
    ({"type": "object", "properties": {1: {"type": "string"}}}, "key 1 at $.properties is not a string"),
    ({"type": str}, "is a type, not JSON"),
])
def test_pathological_schemas_are_refused_before_llguidance(schema, says):
    import time
    t = time.perf_counter()
    with pytest.raises(MTPEngineError) as e:
        Constraint.json(schema)
    assert says in str(e.value) and time.perf_counter() - t < 2.0
    # a schema at the depth limit still compiles: the limit is where it says
    depth_ok = _nested(constraint_module.MAX_SCHEMA_DEPTH // 2 - 1)
    assert Constraint.json(depth_ok).what == "JSON schema"


@pytest.mark.parametrize("make, text, says", [
    (Constraint.regex, "\ud800+", "lone surrogate"),
    (Constraint.regex, "a(", "invalid regex"),
    (Constraint.lark, "start: \ud800", "lone surrogate"),
    (Constraint.regex, "a" * 1_000_001, "too long"),
])
def test_bad_grammar_text_is_an_engine_error(make, text, says):
    with pytest.raises(MTPEngineError) as e:
        make(text)
    assert says in str(e.value)
