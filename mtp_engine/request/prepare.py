"""One preparation: a `GenerationRequest` and a loaded model in, what the generation loop runs out.

Two stages, because they run in different places:
  prepare       the prompt: a chat rendered (the model's template, or ChatML when it has none, as
                llama.cpp does; tools included), tokenized within the context, the context
                checked (`generation.loop.check_context`), a forced tool call's grammar made. Host
                work any thread may do: the server does it off its event loop.
  make_decoder  the sampler (with the constraint's matcher) and the decoder the request's spec
                asks for, with its prompt cache: device state, made on the thread that generates.
This is the one place a request's chat template is rendered.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from ..chat import tool_calls
from ..chat.template import CHATML, CHATML_NOTE
from ..constraint import Constraint
from ..errors import MTPEngineError
from ..generation.decode import PlainDecoder
from ..generation.loop import check_context
from ..generation.profiler import Profiler
from ..generation.sampling import Sampler
from ..model.loaded import Model
from ..speculative import calibration
from ..speculative.methods import NEEDS_MTP_HEAD, build_decoder
from ..speculative.scheduler import DraftLengthScheduler
from ..tokenizer.bounded import encode_prompt
from .request import GenerationRequest


@dataclass
class Prepared:
    """A request made concrete for one model: the prompt's token ids, the tokens the answer may
    have, the grammar it follows, and the tool-call format its text is parsed in (None: no tools)."""

    request: GenerationRequest
    prompt_ids: list[int]
    max_tokens: int
    constraint: Constraint | None
    tool_format: str | None


def chat_template_note(model: Model) -> str | None:
    """What a user should be told once about this model's chat template (None: nothing)."""
    return None if model.tokenizer.chat_template is not None else f"{model.path} {CHATML_NOTE}"


def render_chat(model: Model, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> str:
    """The prompt text of a chat: the model's template (ChatML when it has none), with `tools`;
    without the generation prompt, a finished conversation."""
    tok = model.tokenizer
    extra = {"tools": tools} if tools else {}
    fallback = CHATML if tok.chat_template is None else None
    return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, template=fallback, **extra)


def history_ids(model: Model, messages: list[dict]) -> list[int]:
    """The token ids of a finished conversation (no generation prompt): what the chat's next turn
    starts with, so that keeping their state lets that turn prefill only its new message."""
    cfg = model.model.cfg
    return encode_prompt(model.tokenizer, render_chat(model, messages, add_generation_prompt=False),
                         cfg.context_length, "messages", source=cfg.context_source)


def prepare(model: Model, request: GenerationRequest) -> Prepared:
    """The request's prompt ids, answer length, grammar and tool format for `model`; MTPEngineError
    (naming the field) for what this model cannot do with it."""
    if not isinstance(request, GenerationRequest):
        raise MTPEngineError(f"expected a GenerationRequest, found {type(request).__name__}", field="request")
    cfg = model.model.cfg
    constraint, tool_format = request.constraint, None
    if model.comm is not None:
        for name in ("constraint", "prompt_cache"):
            if getattr(request, name) is not None:
                raise MTPEngineError("not supported with a distributed model", field=name)
    if request.messages is not None:
        tools = request.rendered_tools
        forced, name = request.forced_call
        template = model.tokenizer.chat_template or CHATML
        if tools:  # a template whose calls this engine cannot parse is refused (field tools)
            tool_format = tool_calls.call_format(template)
        if forced:
            constraint = tool_calls.forced_call_constraint(tool_format, tools, name, request.parallel_tool_calls,
                                                           other=constraint)
        text = render_chat(model, request.messages, tools)
        ids = encode_prompt(model.tokenizer, text, cfg.context_length, "messages", source=cfg.context_source)
    elif isinstance(request.prompt, str):  # in pieces: a prompt past the context is refused early
        ids = encode_prompt(model.tokenizer, request.prompt, cfg.context_length, "prompt", source=cfg.context_source)
    else:
        ids = list(request.prompt)
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise MTPEngineError(f"token id {bad[0]} outside the vocabulary 0..{cfg.vocab_size - 1}", field="prompt")
    max_tokens = request.max_tokens
    if request.fit_context:
        max_tokens = min(max_tokens, max(cfg.context_length - len(ids), 0))
        if max_tokens == 0 and request.max_tokens > 0:
            raise MTPEngineError(f"the prompt ({len(ids)} tokens) fills the context ({cfg.context_length} tokens, "
                                 f"{cfg.context_source}): no room is left for the answer", field="prompt")
    check_context(len(ids), max_tokens, cfg)
    return Prepared(request, ids, max_tokens, constraint, tool_format)


def make_sampler(model: Model, prepared: Prepared, seed: int | None = None) -> Sampler:
    """The request's sampler, masking logits to its constraint's grammar (if any); `seed`
    replaces the request's."""
    cfg = prepared.request.sampler if seed is None else replace(prepared.request.sampler, seed=seed)
    grammar = None
    if prepared.constraint is not None:
        grammar = prepared.constraint.matcher(model.tokenizer, model.model.cfg.vocab_size)
    return Sampler(cfg, grammar)


def make_decoder(model: Model, prepared: Prepared, profiler: Profiler, seed: int | None = None,
                 agree: Callable[[int], int] | None = None) -> PlainDecoder:
    """The decoder of a prepared request: plain, or the speculative method its spec names
    (`speculative/methods.py`); n-max auto gets a scheduler seeded, for draft-mtp, with the costs
    earlier runs stored for this model file and device (another drafter's rounds cost something
    else: it starts from the prior). `seed` replaces the sampler's and `agree` makes auto's draft
    lengths common (distributed ranks share both)."""
    req = prepared.request
    sampler = make_sampler(model, prepared, seed)
    spec = req.spec
    if spec.method == "none":
        return PlainDecoder(model.model, sampler, profiler, prompt_cache=req.prompt_cache, progress=req.progress)
    if spec.method in NEEDS_MTP_HEAD and model.model.mtp is None and getattr(model.info, "has_mtp_tensors",
                                                                              True) is False:
        raise MTPEngineError(f"{spec.method} needs the MTP head, and this checkpoint has no mtp.* tensors (mlx-lm's "
                             "convert drops them; convert the HF checkpoint with `mtp-engine convert`)",
                             file=model.info.path, field="spec")
    params = spec.draft_params()
    stored = spec.method == "draft-mtp"
    scheduler = None
    if params.auto:
        # no calibration pass: stored costs from earlier runs (or a prior) seed what this run measures
        costs, acceptance = calibration.load(model.path, model.model, model.options.cache_path) if stored \
            else (None, None)
        scheduler = DraftLengthScheduler.for_model(model.model, costs, agree, acceptance)
    return build_decoder(spec.method, model.model, sampler, params, profiler, scheduler,
                         prompt_cache=req.prompt_cache, calibration_path=model.path if stored else "",
                         progress=req.progress)


