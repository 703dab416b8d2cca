"""A generation request as one typed object, checked once when it is made.

Every way in builds it: the API's keywords (`request.keywords.request_from_keywords`), the command
line's flags, the chat command's turns and the server's JSON bodies. What it holds is checked
here without the model (types, bounds, combinations); what needs the model (rendering, token
ids, the context) is `request.prepare`'s work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..chat import tool_calls
from ..constraint import Constraint
from ..errors import MTPEngineError
from ..generation.prompt_cache import PromptCache
from ..generation.sampling import SamplerConfig
from ..speculative.config import SpecConfig
from ..text_input import check_messages, check_stop

PROFILE_MODES = ("off", "round", "precise")  # generation.profiler.Profiler's


def _plain() -> SpecConfig:
    return SpecConfig("none")


@dataclass(frozen=True)
class GenerationRequest:
    """What to generate and how.

    `prompt` (text or token ids) or `messages` (a chat the model's template renders), exactly one.
    `tools` (with messages) are rendered by the template; `tool_choice` as OpenAI's ("auto",
    "none", "required", or {"type": "function", "function": {"name": ...}}), a forced call made by
    a grammar (several calls allowed when `parallel_tool_calls`). `sampler`, `spec`: sampling and
    speculative decoding. `constraint`: a grammar the text follows. `stop`: stop strings.
    `max_tokens`: the most tokens to generate; with `fit_context` it shrinks to what the context
    leaves after the prompt (the server's default and the chat's turns) instead of being refused.
    `profile`: None, "off", "round" or "precise". `prompt_cache`: where successive requests keep
    and reuse prompt state. `progress(done, total)`: told the prompt's tokens handled of all
    `total`, once before the first prefill chunk (done: those reused from `prompt_cache`) and after
    each chunk, `total` of `total` at the end (the command line's progress line for a long prompt,
    a streamed server answer's `prompt_progress`)."""

    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    spec: SpecConfig = field(default_factory=_plain)
    constraint: Constraint | None = None
    stop: list[str] = field(default_factory=list)
    max_tokens: int = 256
    fit_context: bool = False
    ignore_eos: bool = False
    profile: str | None = None
    prompt_cache: PromptCache | None = None
    progress: Callable[[int, int], None] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise MTPEngineError("give exactly one of prompt or messages", field="prompt")
        if self.prompt is not None:
            self._set("prompt", _checked_prompt(self.prompt))
        if not isinstance(self.sampler, SamplerConfig):
            raise MTPEngineError(f"expected a SamplerConfig, found {type(self.sampler).__name__}", field="sampler")
        if not isinstance(self.spec, SpecConfig):
            raise MTPEngineError(f"expected a SpecConfig, found {type(self.spec).__name__}", field="spec")
        mt = self.max_tokens
        if not isinstance(mt, int) or isinstance(mt, bool) or mt < 0:
            raise MTPEngineError(f"expected an integer >= 0, found {mt!r}", field="max_tokens")
        self._set("stop", check_stop(self.stop))
        self._check_chat()
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise MTPEngineError(f"expected a Constraint, found {type(self.constraint).__name__}",
                                     field="constraint")
            if self.ignore_eos:
                raise MTPEngineError("ignore_eos would run past the end of the constrained text", field="constraint")
        if self.prompt_cache is not None and not isinstance(self.prompt_cache, PromptCache):
            raise MTPEngineError(f"expected a PromptCache, found {type(self.prompt_cache).__name__}",
                                 field="prompt_cache")
        if self.progress is not None and not callable(self.progress):
            raise MTPEngineError(f"expected a callable (done, total), found {type(self.progress).__name__}",
                                 field="progress")
        if self.profile not in (None, *PROFILE_MODES):
            raise MTPEngineError(f"expected one of {', '.join(PROFILE_MODES)} or None, found {self.profile!r:.40}",
                                 field="profile")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)

    def _check_chat(self) -> None:
        forced, _ = tool_calls.tool_choice_name(self.tool_choice)
        if self.messages is None:
            if self.tools is not None:
                raise MTPEngineError("tools are rendered by the chat template: give messages, not a prompt",
                                     field="tools")
            if forced:
                raise MTPEngineError("forces a call, but no tools were given", field="tool_choice")
            return
        if forced and not self.tools:
            raise MTPEngineError("forces a call, but no tools were given", field="tool_choice")
        messages = self.messages
        if isinstance(messages, (list, tuple)):  # earlier calls' arguments as mappings; content may be None
            messages = tool_calls.with_tool_calls(messages)
        check_messages(messages)
        self._set("messages", list(messages))
        if self.tools is not None:
            self._set("tools", tool_calls.check_tool_list(self.tools))

    @property
    def forced_call(self) -> tuple[bool, str | None]:
        """Whether `tool_choice` forces a call, and to which tool (None: any)."""
        return tool_calls.tool_choice_name(self.tool_choice)

    @property
    def rendered_tools(self) -> list[dict] | None:
        """The tools the template renders (none when tool_choice is "none")."""
        return self.tools if self.tools and self.tool_choice != "none" else None


def _checked_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt  # its text is checked as it is tokenized (tokenizer.bounded)
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise MTPEngineError(f"expected text or a list of token ids, found {type(prompt).__name__}", field="prompt")
