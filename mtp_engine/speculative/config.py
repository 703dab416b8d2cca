"""Speculative decoding's options: `DraftParams` (llama.cpp's three draft knobs, what the decoder
reads) and `SpecConfig` (a request's choice of method plus those knobs, what `generate` takes).

Inside the engine `n_max` is an int, or None for `n-max auto`; the string "auto" of the command
line, the server and the flat API keywords is turned into None by `parse_n_max`, at the edge.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import MTPEngineError
from .scheduler import AUTO_MAX

SPEC_METHODS = ("none", "draft-mtp", "ngram")  # speculative/methods.py builds each
N_MAX_LIMIT = 64


def parse_n_max(value: int | str | None) -> int | None:
    """n-max as the engine holds it: an int in 0..64, or None for auto ("auto" is accepted for it)."""
    if value is None or value == "auto":
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= N_MAX_LIMIT:
        raise MTPEngineError(f"expected an integer in 0..{N_MAX_LIMIT} or 'auto', found {value!r}", field="n-max")
    return value


def _check_draft_knobs(n_max: int | None, n_min: int, p_min: float) -> None:
    if not isinstance(n_min, int) or isinstance(n_min, bool) or not 0 <= n_min <= N_MAX_LIMIT:
        raise MTPEngineError(f"expected an integer in 0..{N_MAX_LIMIT}, found {n_min!r}", field="n-min")
    if n_min > (AUTO_MAX if n_max is None else n_max):
        shown = "auto" if n_max is None else n_max
        raise MTPEngineError(f"n-min ({n_min}) must not exceed n-max ({shown})", field="n-min")
    if not isinstance(p_min, (int, float)) or isinstance(p_min, bool) or not 0.0 <= p_min <= 1.0:
        raise MTPEngineError(f"expected a number in [0, 1], found {p_min!r}", field="p-min")


@dataclass(frozen=True)
class DraftParams:
    """llama.cpp's knobs. n_max: drafts per round (0 = no drafting), None = auto (the scheduler
    picks k each round, speculative/scheduler.py; the API's default too). n_min: a round with fewer
    surviving drafts discards them and decodes plainly. p_min: stop drafting when the next draft's
    probability (softmax over the drafter's top-10 logits at temperature 1) is below it.
    `DraftParams("auto")` is read as None (code written when auto was a string keeps working)."""

    n_max: int | None = None
    n_min: int = 0
    p_min: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "n_max", parse_n_max(self.n_max))
        _check_draft_knobs(self.n_max, self.n_min, self.p_min)

    @property
    def auto(self) -> bool:
        return self.n_max is None

    @property
    def k_max(self) -> int:
        """The longest draft a round may ask for."""
        return AUTO_MAX if self.n_max is None else self.n_max


@dataclass(frozen=True)
class SpecConfig:
    """A request's speculative decoding: `method` "draft-mtp" (the model's MTP head drafts), "ngram"
    (prompt lookup: the tokens that followed the latest earlier occurrence of the last few) or
    "none" (plain decoding), and the draft knobs (see `DraftParams`; n_max None = auto)."""

    method: str = "draft-mtp"
    n_max: int | None = None
    n_min: int = 0
    p_min: float = 0.0

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise MTPEngineError(f"unknown spec type {self.method!r}: expected one of {list(SPEC_METHODS)}",
                                 field="spec")
        object.__setattr__(self, "n_max", parse_n_max(self.n_max))
        _check_draft_knobs(self.n_max, self.n_min, self.p_min)

    @property
    def speculative(self) -> bool:
        return self.method != "none"

    def draft_params(self) -> DraftParams:
        return DraftParams(self.n_max, self.n_min, self.p_min)
