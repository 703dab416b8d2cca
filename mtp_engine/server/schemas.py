"""Request bodies of the OpenAI-compatible endpoints: checked field by field into the keyword
arguments of `stream_generate`, or refused with an OpenAI-style error naming the field.

Unknown fields are ignored (as OpenAI-compatible servers do, so clients that send extras work);
known fields of the wrong type or out of range, and features this engine cannot honour (n > 1,
logit_bias), are refused with 400. JSON response formats are constraints
(constraint.py); tools: tool_calls.py.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from ..chat.tool_calls import check_tool_list, message_tool_calls, tool_choice_name
from ..constraint import response_format_constraint
from ..errors import MTPEngineError
from ..generation.penalties import PenaltyConfig
from ..generation.prompt_cache import PromptCache
from ..generation.sampling import MAX_LOGPROBS
from ..request.keywords import request_from_keywords
from ..request.request import GenerationRequest
from ..speculative.config import SPEC_METHODS
from ..speculative.scheduler import AUTO_MAX
from ..text_input import check_stop

MAX_BODY_BYTES = 8 * 2**20  # a request body above this is refused before it is parsed


class APIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str | None = None, retry_after: int | None = None):
        """`retry_after`: seconds a client should wait before it retries (a 503's `Retry-After`)."""
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after = retry_after if retry_after is not None else (1 if status == 503 else None)
        self.type = type_ or {400: "invalid_request_error", 401: "invalid_request_error", 404: "not_found_error",
                              405: "invalid_request_error", 408: "invalid_request_error",
                              503: "server_overloaded"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class ServerDefaults:
    """Generation settings a request does not give (the `serve` command's flags)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    spec: str = "draft-mtp"
    n_max: int | str = "auto"
    n_min: int = 0
    p_min: float = 0.0
    penalties: PenaltyConfig = field(default_factory=PenaltyConfig)

    @property
    def n_max_cap(self) -> int:
        """The longest draft a request may ask for: `--spec-draft-n-max` (auto's longest when auto)."""
        return self.n_max if isinstance(self.n_max, int) else AUTO_MAX


@dataclass
class GenRequest:
    """One checked request: what to generate and how to answer."""

    kind: str  # "chat" or "completion"
    kwargs: dict  # generate's keywords (prompt or messages, sampling, draft settings); max_tokens None: not given
    stream: bool = False
    include_usage: bool = False
    mtp_trace: bool = False
    logprobs: int | None = None  # alternatives per token; None: no logprobs in the answer
    tools: list[dict] | None = None  # tools the template renders and the answer may call (chat only)
    forced_call: dict | None = None  # tool_choice "required" / a named tool: {"name", "parallel"}
    return_progress: bool = False  # llama-server's: a streamed answer reports the prompt's reading


# the engine's names of the fields a request's own checks refuse, as this API spells them
_PARAMS = {"spec": "spec_type", "n-max": "spec_draft_n_max", "n-min": "spec_draft_n_min",
           "p-min": "spec_draft_p_min"}


def engine_error(e: MTPEngineError) -> APIError:
    """A 400 naming the request field the engine refused."""
    code = "context_length_exceeded" if "context" in str(e) else None
    return APIError(400, str(e), _PARAMS.get(e.field, e.field), code)


def generation_request(req: GenRequest, d: ServerDefaults, prompt_cache: PromptCache | None) -> GenerationRequest:
    """The engine's typed request of a checked body: without max_tokens, the server's default,
    shrunk to what the context leaves; `prompt_cache` unless the body turned cache_prompt off."""
    kw = dict(req.kwargs)
    given = kw["max_tokens"] is not None
    kw["max_tokens"] = kw["max_tokens"] if given else d.max_tokens
    kw["logprobs"] = req.logprobs
    cache = prompt_cache if kw.pop("cache_prompt", True) else None
    if req.tools:
        kw["tools"] = req.tools
        if req.forced_call is not None:
            name = req.forced_call["name"]
            kw["tool_choice"] = "required" if name is None else {"type": "function", "function": {"name": name}}
            kw["parallel_tool_calls"] = req.forced_call["parallel"]
    try:
        return request_from_keywords(**kw, fit_context=not given, prompt_cache=cache)
    except MTPEngineError as e:
        raise engine_error(e) from None


def parse_json(raw: bytes) -> dict:
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(400, f"request body is {len(raw)} bytes; at most {MAX_BODY_BYTES} are accepted")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "JSON body nested too deep", code="invalid_json") from None
    except ValueError as e:  # e.g. an integer of more than 4300 digits (Python's conversion limit)
        raise APIError(400, f"unreadable JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, f"expected a JSON object, found {type(body).__name__}")
    return body


def _type_name(v) -> str:
    return "null" if v is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                      list: "array", dict: "object"}.get(type(v), type(v).__name__)


def _shown(v) -> str:
    """A value for an error message: a huge integer by its size, not its 4000 digits."""
    return f"an integer of {len(str(abs(v)))} digits" if isinstance(v, int) and abs(v) > 10**15 else str(v)


def _number(body: dict, name: str, lo: float, hi: float, default, lo_open: bool = False):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise APIError(400, f"{name}: expected a number, found {_type_name(v)}", name)
    if isinstance(v, int) and abs(v) > 2**53:  # beyond float precision (and math.isfinite's reach)
        raise APIError(400, f"{name}: expected a number in [{lo}, {hi}], found {_shown(v)}", name)
    if not math.isfinite(v):
        raise APIError(400, f"{name}: expected a number, found {_type_name(v)}", name)
    if v < lo or v > hi or (lo_open and v == lo):
        raise APIError(400, f"{name}: expected a number in {'(' if lo_open else '['}{lo}, {hi}], found {v}", name)
    return v


def _integer(body: dict, name: str, lo: int, hi: int, default):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool):
        raise APIError(400, f"{name}: expected an integer, found {_type_name(v)}", name)
    if not lo <= v <= hi:
        raise APIError(400, f"{name}: expected an integer in [{lo}, {hi}], found {_shown(v)}", name)
    return v


def _boolean(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise APIError(400, f"{name}: expected a boolean, found {_type_name(v)}", name)
    return v


def _refuse_unsupported(body: dict, chat: bool = False) -> None:
    n = _integer(body, "n", 1, 2**31, 1)
    if n != 1:
        raise APIError(400, f"n: only n = 1 is supported (one choice per request), found {n}", "n")
    if _integer(body, "best_of", 1, 2**31, 1) != 1:
        raise APIError(400, "best_of: only 1 is supported", "best_of")
    if not chat and (body.get("tools") or body.get("functions")):
        raise APIError(400, "tools: tool calling is for /v1/chat/completions", "tools")
    if body.get("logit_bias"):
        raise APIError(400, "logit_bias: not supported", "logit_bias")
    if body.get("echo") or body.get("suffix"):
        raise APIError(400, "echo/suffix: not supported", "echo" if body.get("echo") else "suffix")


def _stop(body: dict):
    v = body.get("stop")
    if v is None:
        return None
    if not (isinstance(v, str) or isinstance(v, list) and all(isinstance(s, str) for s in v)):
        raise APIError(400, f"stop: expected a string or an array of strings, found {_type_name(v)}", "stop")
    try:
        return check_stop(v)  # the engine's bounds (count, length, valid text)
    except MTPEngineError as e:
        raise APIError(400, str(e), e.field or "stop") from None


def _draft(body: dict, d: ServerDefaults) -> dict:
    spec = body.get("spec_type", d.spec)
    if spec not in SPEC_METHODS:
        raise APIError(400, f"spec_type: expected one of {', '.join(SPEC_METHODS)}, found {spec!r:.60}", "spec_type")
    n_max = body.get("spec_draft_n_max", d.n_max)
    if n_max != "auto" and (not isinstance(n_max, int) or isinstance(n_max, bool) or not 0 <= n_max <= 64):
        raise APIError(400, f"spec_draft_n_max: expected an integer in [0, 64] or \"auto\", found {n_max!r:.60}",
                       "spec_draft_n_max")
    n_min = _integer(body, "spec_draft_n_min", 0, 64, d.n_min)
    if n_max != "auto" and n_max > d.n_max_cap:
        # the server's --spec-draft-n-max caps every request: one client's long drafts would slow
        # every stream that shares its batch or waits behind it; the output is the same either way
        n_max, n_min = d.n_max_cap, min(n_min, d.n_max_cap)
    if n_min > (AUTO_MAX if n_max == "auto" else n_max):
        raise APIError(400, f"spec_draft_n_min ({n_min}) must not exceed spec_draft_n_max ({n_max})",
                       "spec_draft_n_min")
    return dict(spec=spec, n_max=n_max, n_min=n_min, p_min=_number(body, "spec_draft_p_min", 0.0, 1.0, d.p_min))


def _sampling(body: dict, d: ServerDefaults) -> dict:
    p = d.penalties
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    return dict(
        max_tokens=_integer({name: max_tokens}, name, 0, 2**31, None),
        temperature=_number(body, "temperature", 0.0, 100.0, d.temperature),
        top_p=_number(body, "top_p", 0.0, 1.0, d.top_p, lo_open=True),
        top_k=_integer(body, "top_k", 0, 2**31, d.top_k),
        min_p=_number(body, "min_p", 0.0, 0.999999, d.min_p),
        seed=_integer(body, "seed", -1, 2**63 - 1, d.seed),
        stop=_stop(body),
        ignore_eos=_boolean(body, "ignore_eos"),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0, p.presence_penalty),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0, p.frequency_penalty),
        repeat_penalty=_number(body, "repeat_penalty", 0.0, 10.0, p.repeat_penalty, lo_open=True),
        repeat_last_n=_integer(body, "repeat_last_n", -1, 2**31, p.repeat_last_n),
        cache_prompt=_boolean(body, "cache_prompt", True),
        constraint=_response_format(body),
        **_draft(body, d),
    )


def _response_format(body: dict):
    """OpenAI's response_format (text, json_object, json_schema) as the engine's Constraint."""
    rf = body.get("response_format")
    if rf is None:
        return None
    try:
        return response_format_constraint(rf)
    except MTPEngineError as e:
        raise APIError(400, str(e), "response_format") from None


def _stream_options(body: dict) -> bool:
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise APIError(400, f"stream_options: expected an object, found {_type_name(so)}", "stream_options")
    return _boolean(so, "include_usage")


def _tools(body: dict) -> tuple[list[dict] | None, dict | None]:
    """The request's tools for the template (None: none, or tool_choice "none"), and the call it
    forces ({"name": tool or None for any, "parallel": bool}; None: the model chooses)."""
    tools, choice = body.get("tools"), body.get("tool_choice", "auto")
    if body.get("functions") is not None:
        raise APIError(400, "functions: the deprecated functions API is not supported; send tools", "functions")
    pc = body.get("parallel_tool_calls")
    if pc is not None and not isinstance(pc, bool):
        raise APIError(400, f"parallel_tool_calls: expected a boolean, found {_type_name(pc)}", "parallel_tool_calls")
    try:
        forced, name = tool_choice_name(choice)
    except MTPEngineError as e:
        raise APIError(400, str(e), "tool_choice") from None
    if tools is None:
        if forced:
            raise APIError(400, "tool_choice: forces a call, but the request has no tools", "tool_choice")
        return None, None
    try:
        tools = check_tool_list(tools)
    except MTPEngineError as e:
        raise APIError(400, str(e), "tools") from None
    if not tools or choice == "none":
        return None, None
    return tools, ({"name": name, "parallel": pc is not False} if forced else None)


def parse_chat(body: dict, d: ServerDefaults) -> GenRequest:
    """POST /v1/chat/completions."""
    _refuse_unsupported(body, chat=True)
    tools, forced = _tools(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, f"messages: expected a non-empty array of messages, found {_type_name(msgs)}", "messages")
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}]: expected an object, found {_type_name(m)}", "messages")
        role, content = m.get("role"), m.get("content")
        if role not in ("system", "user", "assistant", "developer", "tool"):
            raise APIError(400, f"messages[{i}].role: expected system, user, assistant or tool, found {role!r:.40}",
                           "messages")
        calls = m.get("tool_calls") if role == "assistant" else None
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if content is None and calls:  # an assistant turn that only called tools
            content = ""
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content: expected a string, found {_type_name(content)}", "messages")
        msg = {"role": "system" if role == "developer" else role, "content": content}
        if calls:
            try:
                msg["tool_calls"] = message_tool_calls(i, calls)
            except MTPEngineError as e:
                raise APIError(400, str(e), "messages") from None
        for key in ("tool_call_id", "name"):  # a tool's answer: which call it answers
            if role == "tool" and isinstance(m.get(key), str):
                msg[key] = m[key]
        clean.append(msg)
    kw = _sampling(body, d)
    top = _integer(body, "top_logprobs", 0, MAX_LOGPROBS, None)
    want = _boolean(body, "logprobs")
    if top is not None and not want:
        raise APIError(400, "top_logprobs: needs logprobs set to true", "top_logprobs")
    kw["messages"] = clean
    return GenRequest("chat", kw, _boolean(body, "stream"), _stream_options(body),
                      _boolean(body, "mtp_trace"), (top or 0) if want else None, tools, forced,
                      _boolean(body, "return_progress"))


def parse_completion(body: dict, d: ServerDefaults) -> GenRequest:
    """POST /v1/completions: a prompt string, an array of token ids, or a one-element array of either."""
    _refuse_unsupported(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        pass
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(t, (str, list)) for t in prompt):
        raise APIError(400, "prompt: batches of prompts are not supported; send one prompt per request", "prompt")
    elif not isinstance(prompt, str) or not prompt:
        raise APIError(400, f"prompt: expected a non-empty string or array of token ids, found {_type_name(prompt)}",
                       "prompt")
    kw = _sampling(body, d)
    kw["prompt"] = prompt
    lp = _integer(body, "logprobs", 0, MAX_LOGPROBS, None)
    return GenRequest("completion", kw, _boolean(body, "stream"),
                      _stream_options(body), _boolean(body, "mtp_trace"), lp,
                      return_progress=_boolean(body, "return_progress"))
