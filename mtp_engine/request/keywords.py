"""A generation request's options as objects: the API's flat keyword arguments (a contract kept
as it is) mapped onto `SpecConfig` and `SamplerConfig`, here and nowhere else.

`generate(..., spec=SpecConfig(n_max=3), sampler=SamplerConfig(temperature=0.7))` and
`generate(..., spec="draft-mtp", n_max=3, temperature=0.7)` are the same request. An option given
both ways (an object, and a keyword away from its default) is refused rather than guessed.
"""
from __future__ import annotations

from ..errors import MTPEngineError
from ..generation.penalties import PenaltyConfig
from ..generation.sampling import SamplerConfig
from ..speculative.config import SpecConfig
from .request import GenerationRequest

# the flat keywords' defaults, as `generate`/`stream_generate` declare them
SPEC_DEFAULTS = {"n_max": "auto", "n_min": 0, "p_min": 0.0}
SAMPLER_DEFAULTS = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": None,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0, "repeat_penalty": 1.0, "repeat_last_n": 64,
                    "logprobs": None}


def _given(flat: dict, defaults: dict) -> list[str]:
    """The keywords moved off their defaults."""
    return [k for k, v in flat.items() if not v == defaults[k]]


def spec_config(spec: str | SpecConfig | None, n_max: int | str = "auto", n_min: int = 0,
                p_min: float = 0.0) -> SpecConfig:
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


def sampler_config(sampler: SamplerConfig | None = None, *, temperature: float = 0.0, top_k: int = 0,
                   top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None, presence_penalty: float = 0.0,
                   frequency_penalty: float = 0.0, repeat_penalty: float = 1.0, repeat_last_n: int = 64,
                   logprobs: int | None = None) -> SamplerConfig:
    """A SamplerConfig from `sampler` or from the flat sampling and penalty keywords."""
    flat = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n, logprobs=logprobs)
    if sampler is not None:
        if not isinstance(sampler, SamplerConfig):
            raise MTPEngineError(f"expected a SamplerConfig, found {type(sampler).__name__}", field="sampler")
        clash = _given(flat, SAMPLER_DEFAULTS)
        if clash:
            raise MTPEngineError(f"{clash[0]} given both as a keyword and in sampler=SamplerConfig(...): give it once",
                                 field=clash[0])
        return sampler
    penalties = PenaltyConfig(presence_penalty, frequency_penalty, repeat_penalty, repeat_last_n)
    return SamplerConfig(temperature, top_k, top_p, min_p, seed, penalties, logprobs)


def request_from_keywords(prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                          max_tokens: int = 256, spec: str | SpecConfig | None = None, n_max: int | str = "auto",
                          n_min: int = 0, p_min: float = 0.0, stop: list[str] | str | None = None,
                          ignore_eos: bool = False, profile: str | None = None,
                          sampler: SamplerConfig | None = None, tools: list[dict] | None = None,
                          tool_choice: str | dict = "auto", parallel_tool_calls: bool = True, constraint=None,
                          prompt_cache=None, fit_context: bool = False, progress=None, **sampling) -> GenerationRequest:
    """The `GenerationRequest` of `generate`'s keywords (`sampling`: the flat sampling and
    penalty keywords of `sampler_config`)."""
    return GenerationRequest(prompt=prompt, messages=messages, tools=tools, tool_choice=tool_choice,
                             parallel_tool_calls=parallel_tool_calls,
                             sampler=sampler_config(sampler, **sampling), spec=spec_config(spec, n_max, n_min, p_min),
                             constraint=constraint, stop=stop, max_tokens=max_tokens, fit_context=fit_context,
                             ignore_eos=ignore_eos, profile=profile, prompt_cache=prompt_cache, progress=progress)
