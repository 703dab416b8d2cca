"""Options as objects: `SpecConfig` and `SamplerConfig` given to generate /
stream_generate are the same request as the flat keywords; "auto" is None inside the engine."""
from __future__ import annotations

import pytest

from mtp_engine import MTPEngineError, SamplerConfig, SpecConfig, stream_generate
from mtp_engine import generate
from mtp_engine.generation.penalties import PenaltyConfig
from mtp_engine.request.keywords import sampler_config, spec_config
from mtp_engine.speculative.config import DraftParams, parse_n_max

IDS = [349, 220, 451, 72, 389]


@pytest.fixture
def tiny(tiny_any):
    return tiny_any  # the session's tiny f32 model (tests/conftest.py)


def test_auto_is_none_inside_the_engine():
    assert parse_n_max("auto") is None and parse_n_max(None) is None and parse_n_max(5) == 5
    assert DraftParams().n_max is None and DraftParams().auto  # the API's default: auto
    assert DraftParams("auto") == DraftParams(None)
    assert SpecConfig(n_max="auto").n_max is None
    assert spec_config("draft-mtp", "auto") == SpecConfig("draft-mtp", None)
    assert spec_config(None) == SpecConfig("none")
    for bad in ("3", -1, 65, 2.0, True):
        with pytest.raises(MTPEngineError) as ei:
            parse_n_max(bad)
        assert ei.value.field == "n-max"
    with pytest.raises(MTPEngineError, match="n-min"):
        SpecConfig(n_max=2, n_min=3)
    with pytest.raises(MTPEngineError, match="spec type"):
        SpecConfig("eagle")


def test_flat_keywords_map_onto_the_objects():
    s = sampler_config(temperature=0.5, top_k=4, seed=7, repeat_penalty=1.1, logprobs=2)
    assert s == SamplerConfig(0.5, 4, 1.0, 0.0, 7, PenaltyConfig(0.0, 0.0, 1.1, 64), 2)
    assert sampler_config() == SamplerConfig()
    obj = SamplerConfig(temperature=0.3)
    assert sampler_config(obj) is obj


@pytest.mark.parametrize("flat,spec,sampler", [
    (dict(spec="draft-mtp", n_max=2), SpecConfig(n_max=2), None),
    (dict(spec="draft-mtp", n_max="auto", p_min=0.2), SpecConfig(p_min=0.2), None),
    (dict(spec=None, temperature=0.7, top_k=5, seed=3), None, SamplerConfig(temperature=0.7, top_k=5, seed=3)),
    (dict(spec="draft-mtp", n_max=3, temperature=0.9, seed=11, repeat_penalty=1.2),
     SpecConfig("draft-mtp", 3), SamplerConfig(temperature=0.9, seed=11, penalties=PenaltyConfig(repeat_penalty=1.2))),
])
def test_objects_give_the_same_generation_as_keywords(tiny, flat, spec, sampler):
    a = generate(IDS, tiny, max_tokens=16, ignore_eos=True, **flat)
    kw = {k: v for k, v in flat.items() if k == "spec"} if spec is None else {}
    b = generate(IDS, tiny, max_tokens=16, ignore_eos=True, **kw,
                 **({"spec": spec} if spec is not None else {}), **({"sampler": sampler} if sampler else {}))
    assert a.token_ids == b.token_ids
    assert ("drafted" in a.stats) == ("drafted" in b.stats)
    assert a.stats.get("n_max") == b.stats.get("n_max")


def test_logprobs_through_the_sampler_object(tiny):
    r = generate(IDS, tiny, max_tokens=4, sampler=SamplerConfig(logprobs=2))
    assert r.logprobs is not None and len(r.logprobs) == 4 and len(r.logprobs[0]["top"]) == 2


@pytest.mark.parametrize("kwargs,field", [
    (dict(spec=SpecConfig(n_max=2), n_max=3), "n_max"),
    (dict(spec=SpecConfig(), p_min=0.5), "p_min"),
    (dict(sampler=SamplerConfig(), temperature=0.5), "temperature"),
    (dict(sampler=SamplerConfig(), repeat_last_n=8), "repeat_last_n"),
    (dict(sampler={"temperature": 0.5}), "sampler"),
    (dict(spec=3), "spec"),
])
def test_an_option_given_twice_or_of_the_wrong_type_is_refused(tiny, kwargs, field):
    with pytest.raises(MTPEngineError) as ei:
        generate(IDS, tiny, max_tokens=2, **kwargs)
    assert ei.value.field == field
    with pytest.raises(MTPEngineError):
        list(stream_generate(IDS, tiny, max_tokens=2, **kwargs))


def test_the_keywords_are_declared_once():
    """`generate`/`stream_generate` show the table's keywords and defaults (their signatures are
    built from it), a misspelt keyword is refused as Python refuses one, and the command line's
    sampling and draft flags default to the same values."""
    import argparse
    import inspect

    from mtp_engine import api
    from mtp_engine.cli.flags import add_sampling_flags, add_spec_flags, sampling_kwargs
    from mtp_engine.request.keywords import KEYWORDS

    for fn in (api.generate, api.stream_generate):
        params = inspect.signature(fn).parameters
        assert list(params)[:2] == ["prompt", "model"]
        assert {k: p.default for k, p in params.items() if k in KEYWORDS} == {k: d for k, (d, _) in KEYWORDS.items()}
    with pytest.raises(TypeError, match="generate\\(\\) got an unexpected keyword argument 'temprature'"):
        api.generate("x", model=object(), temprature=0.5)
    p = argparse.ArgumentParser()
    add_sampling_flags(p)
    add_spec_flags(p, str, "draft-mtp")
    flags = sampling_kwargs(p.parse_args([]))
    assert {k: v for k, v in flags.items() if k != "spec"} == {k: KEYWORDS[k][0] for k in flags if k != "spec"}
