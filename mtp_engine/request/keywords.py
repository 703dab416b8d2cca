"""A generation request's options as objects: the API's flat keyword arguments (a contract kept
as it is) mapped onto `SpecConfig` and `SamplerConfig`, here and nowhere else.

`generate(..., spec=SpecConfig(n_max=3), sampler=SamplerConfig(temperature=0.7))` and
`generate(..., spec="draft-mtp", n_max=3, temperature=0.7)` are the same request. An option given
both ways (an object, and a keyword away from its default) is refused rather than guessed.
"""
from __future__ import annotations

import inspect

from ..errors import MTPEngineError
from ..generation.penalties import PenaltyConfig
from ..generation.sampling import SamplerConfig
from ..speculative.config import SpecConfig
from .request import GenerationRequest

# The API's keywords (`generate`, `stream_generate`; `batch_generate` takes them too), declared
# once: name -> (default, annotation). The functions' signatures are built from this table
# (`keyword_signature`), so help(), IDEs and `inspect` show each keyword with its default.
_SAMPLER, _PENALTIES = SamplerConfig(), PenaltyConfig()  # the sampling keywords' defaults are theirs
KEYWORDS: dict[str, tuple[object, str]] = {
    "messages": (None, "list[dict] | None"),
    "max_tokens": (256, "int"),
    "spec": (None, "str | SpecConfig | None"),
    "n_max": ("auto", "int | str"),
    "n_min": (0, "int"),
    "p_min": (0.0, "float"),
    "temperature": (_SAMPLER.temperature, "float"),
    "top_k": (_SAMPLER.top_k, "int"),
    "top_p": (_SAMPLER.top_p, "float"),
    "min_p": (_SAMPLER.min_p, "float"),
    "seed": (_SAMPLER.seed, "int | None"),
    "stop": (None, "list[str] | str | None"),
    "ignore_eos": (False, "bool"),
    "profile": (None, "str | None"),
    "presence_penalty": (_PENALTIES.presence_penalty, "float"),
    "frequency_penalty": (_PENALTIES.frequency_penalty, "float"),
    "repeat_penalty": (_PENALTIES.repeat_penalty, "float"),
    "repeat_last_n": (_PENALTIES.repeat_last_n, "int"),
    "logprobs": (_SAMPLER.logprobs, "int | None"),
    "sampler": (None, "SamplerConfig | None"),
    "tools": (None, "list[dict] | None"),
    "prompt_cache": (None, "PromptCache | None"),
    "constraint": (None, "Constraint | None"),
    "tool_choice": ("auto", "str | dict"),
}
SPEC_DEFAULTS = {k: KEYWORDS[k][0] for k in ("n_max", "n_min", "p_min")}
SAMPLER_DEFAULTS = {k: KEYWORDS[k][0] for k in ("temperature", "top_k", "top_p", "min_p", "seed", "presence_penalty",
                                                "frequency_penalty", "repeat_penalty", "repeat_last_n", "logprobs")}
# what only the server's requests set beside the API's keywords
_SERVER_ONLY = {"parallel_tool_calls": True, "fit_context": False, "progress": None}


def keyword_signature(returns: str, first: list[tuple[str, object, str]]) -> inspect.Signature:
    """A signature of `first` (name, default, annotation: positional-or-keyword) followed by the
    keywords of `KEYWORDS`, keyword-only."""
    P = inspect.Parameter
    params = [P(name, P.POSITIONAL_OR_KEYWORD, default=d, annotation=a) for name, d, a in first]
    params += [P(name, P.KEYWORD_ONLY, default=d, annotation=a) for name, (d, a) in KEYWORDS.items()]
    return inspect.Signature(params, return_annotation=returns)


def _given(flat: dict, defaults: dict) -> list[str]:
    """The keywords moved off their defaults."""
    return [k for k, v in flat.items() if not v == defaults[k]]


def spec_config(spec: str | SpecConfig | None, n_max: int | str = SPEC_DEFAULTS["n_max"],
                n_min: int = SPEC_DEFAULTS["n_min"], p_min: float = SPEC_DEFAULTS["p_min"]) -> SpecConfig:
    """`spec` (None/"none", "draft-mtp" or a SpecConfig) and the flat draft knobs as one SpecConfig
    (n_max "auto" becomes None here, the engine's spelling of auto)."""
    if isinstance(spec, SpecConfig):
        clash = _given({"n_max": n_max, "n_min": n_min, "p_min": p_min}, SPEC_DEFAULTS)
        if clash:
            raise MTPEngineError(f"{clash[0]} given both as a keyword and in spec=SpecConfig(...): give it once",
                                 field=clash[0])
        return spec
    if spec is not None and not isinstance(spec, str):
        raise MTPEngineError(f"expected a spec type name or a SpecConfig, found {type(spec).__name__}", field="spec")
    return SpecConfig("none" if spec is None else spec, n_max, n_min, p_min)


def sampler_config(sampler: SamplerConfig | None = None, **flat) -> SamplerConfig:
    """A SamplerConfig from `sampler` or from the flat sampling and penalty keywords (`flat`:
    names of `SAMPLER_DEFAULTS`, the others at their defaults)."""
    unknown = sorted(set(flat) - set(SAMPLER_DEFAULTS))
    if unknown:
        raise TypeError(f"sampler_config() got an unexpected keyword argument {unknown[0]!r}")
    flat = {**SAMPLER_DEFAULTS, **flat}
    if sampler is not None:
        if not isinstance(sampler, SamplerConfig):
            raise MTPEngineError(f"expected a SamplerConfig, found {type(sampler).__name__}", field="sampler")
        clash = _given(flat, SAMPLER_DEFAULTS)
        if clash:
            raise MTPEngineError(f"{clash[0]} given both as a keyword and in sampler=SamplerConfig(...): give it once",
                                 field=clash[0])
        return sampler
    penalties = PenaltyConfig(flat["presence_penalty"], flat["frequency_penalty"], flat["repeat_penalty"],
                              flat["repeat_last_n"])
    return SamplerConfig(flat["temperature"], flat["top_k"], flat["top_p"], flat["min_p"], flat["seed"], penalties,
                         flat["logprobs"])


def request_from_keywords(prompt: str | list[int] | None = None, *, caller: str = "request_from_keywords",
                          **keywords) -> GenerationRequest:
    """The `GenerationRequest` of the API's keywords (`KEYWORDS`; the server's own
    `parallel_tool_calls`, `fit_context` and `progress` too). A name that is neither is refused as
    Python refuses an unexpected keyword argument, naming `caller`."""
    unknown = [k for k in keywords if k not in KEYWORDS and k not in _SERVER_ONLY]
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    kw = {**{k: d for k, (d, _) in KEYWORDS.items()}, **_SERVER_ONLY, **keywords}
    sampling = {k: kw[k] for k in SAMPLER_DEFAULTS}
    return GenerationRequest(prompt=prompt, messages=kw["messages"], tools=kw["tools"], tool_choice=kw["tool_choice"],
                             parallel_tool_calls=kw["parallel_tool_calls"],
                             sampler=sampler_config(kw["sampler"], **sampling),
                             spec=spec_config(kw["spec"], kw["n_max"], kw["n_min"], kw["p_min"]),
                             constraint=kw["constraint"], stop=kw["stop"], max_tokens=kw["max_tokens"],
                             fit_context=kw["fit_context"], ignore_eos=kw["ignore_eos"], profile=kw["profile"],
                             prompt_cache=kw["prompt_cache"], progress=kw["progress"])
