"""Tool calling: OpenAI-style `tools` and earlier `tool_calls` checked and shaped for the chat
template, and the model's tool-call blocks turned back into OpenAI `tool_calls`, whole or as a
stream (`generate(messages=..., tools=...)` and the server's chat endpoint).

The model writes its calls in the format its chat template teaches it, so the format is read from
the template: Qwen3.5 / Qwen3-Coder write XML,

    <tool_call>
    <function=NAME>
    <parameter=ARG>
    VALUE
    </parameter>
    </function>
    </tool_call>

(strings raw, other values as JSON; the tool's schema says which), and Qwen3 / QwQ / Hermes-style
templates write JSON, ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``. A block
that does not parse (or that max_tokens cut) is returned as text, never dropped.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import MTPEngineError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
XML, HERMES = "xml", "hermes"
MAX_TOOLS = 256

_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def template_format(template: str | None) -> str | None:
    """The tool-call format a chat template teaches (XML or HERMES), None if it renders no tools."""
    if not template or "tools" not in template:
        return None
    if "<function=" in template:
        return XML
    if OPEN in template:
        return HERMES
    return None


def call_format(template: str | None) -> str:
    """`template_format`, or MTPEngineError (field tools) for a template this engine cannot use
    with tools."""
    fmt = template_format(template)
    if fmt is None:
        what = "the chat template (ChatML when the model has none) does not render tools" \
            if not template or "tools" not in template else \
            "the chat template does not render tools in a format this engine parses " \
            "(Qwen's <function=...> XML or <tool_call>{json})"
        raise MTPEngineError(f"{what}; give it one that does: --chat-template-file FILE (command line and "
                             "server) or model.tokenizer.chat_template = ... (Python), e.g. Qwen3.5's own",
                             field="tools")
    return fmt


def check_tool_list(tools: Any) -> list[dict]:
    """OpenAI's tool list: [{"type": "function", "function": {"name", "description"?, "parameters"?}}];
    MTPEngineError naming the tool and key otherwise."""
    if not isinstance(tools, (list, tuple)) or len(tools) > MAX_TOOLS:
        raise MTPEngineError(f"expected a list of at most {MAX_TOOLS} tools, found "
                             f"{len(tools) if isinstance(tools, (list, tuple)) else type(tools).__name__}", field="tools")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict):
            raise MTPEngineError("expected {\"type\": \"function\", \"function\": {...}}", field=f"tools[{i}]")
        if not isinstance(f.get("name"), str) or not f["name"].strip():
            raise MTPEngineError("expected a non-empty string", field=f"tools[{i}].function.name")
        if "description" in f and not isinstance(f["description"], str):
            raise MTPEngineError("expected a string", field=f"tools[{i}].function.description")
        if "parameters" in f and not isinstance(f["parameters"], dict):
            raise MTPEngineError("expected a JSON schema object", field=f"tools[{i}].function.parameters")
    return list(tools)


def message_tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant message's earlier `tool_calls` as templates read them: arguments as a mapping
    (OpenAI sends them as a JSON string; Qwen3.5's template iterates their items)."""
    if not isinstance(calls, (list, tuple)):
        raise MTPEngineError("expected a list", field=f"messages[{i}].tool_calls")
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise MTPEngineError("expected {\"function\": {\"name\": ..., \"arguments\": ...}}", field=where)
        args = f.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise MTPEngineError(f"not valid JSON ({e.msg} at character {e.pos})",
                                     field=f"{where}.function.arguments") from None
        if not isinstance(args, dict):
            raise MTPEngineError("expected a JSON object", field=f"{where}.function.arguments")
        out.append({"id": c.get("id") or new_call_id(), "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


def with_tool_calls(messages: list[dict]) -> list[dict]:
    """`messages` with every assistant turn's `tool_calls` in the template's shape (an assistant
    turn that only called tools may have no content)."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls"):
            m = {**m, "content": m.get("content") or "", "tool_calls": message_tool_calls(i, m["tool_calls"])}
        out.append(m)
    return out


_SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def forced_call_constraint(fmt: str, tools: list[dict], name: str | None = None, parallel: bool = True,
                           other: Any = None):
    """A Constraint that makes the answer one call (or, `parallel`, several) in the template's
    format: to any of `tools` (tool_choice "required"), or to the tool `name`. The arguments follow
    the tool's JSON schema in both formats: in Qwen's XML, each parameter at most once in the
    schema's order, the required ones always, values typed (`_xml_value`); Hermes JSON whole.
    `other`: a constraint the request also gives (refused: one grammar at a time)."""
    from ..constraint import Constraint, _llg

    if other is not None:
        raise MTPEngineError("a forced call cannot be combined with another constraint (response_format)",
                             field="tool_choice")
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise MTPEngineError(f"no tool named {name!r} in tools", field="tool_choice")
    rules, alts = [], []
    for i, t in enumerate(chosen):
        f = t["function"]
        params = f.get("parameters") or {}
        names = [f["name"], *(params.get("properties") or {})]
        bad = [n for n in names if not isinstance(n, str) or not _SAFE_NAME.fullmatch(n)]
        if bad:
            raise MTPEngineError(f"a forced call needs tool and parameter names of letters, digits, _ . - "
                                 f"(found {bad[0]!r})", field="tool_choice")
        head = json.dumps(f"<tool_call>\n<function={f['name']}>\n")
        if fmt == XML:
            props = params.get("properties") or {}
            required = set(params.get("required") or [])
            body = []
            for j, (pname, pschema) in enumerate(props.items()):
                rules.append(f"p_{i}_{j}: " + json.dumps(f"<parameter={pname}>\n") + " "
                             + _xml_value(pschema if isinstance(pschema, dict) else {}))
                body.append(f"p_{i}_{j}" + ("" if pname in required else "?"))
            rules.append(f"call_{i}: {head} " + "".join(b + " " for b in body) + '"</function>\\n</tool_call>"')
        else:
            schema = {"type": "object", "properties": {"name": {"const": f["name"]},
                                                       "arguments": params or {"type": "object"}},
                      "required": ["name", "arguments"], "additionalProperties": False,
                      "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
            rules.append(f'call_{i}: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"')
        alts.append(f"call_{i}")
    lines = ["%llguidance {}", 'start: call ("\\n" call)*' if parallel else "start: call",
             "call: " + " | ".join(alts), *rules]
    if fmt == XML:
        lines.append('text[stop="\\n</parameter>"]: /(?s:.*)/')
    try:
        grammar = _llg().LLMatcher.grammar_from_lark("\n".join(lines))
    except ValueError as e:
        raise MTPEngineError(f"cannot build the forced call's grammar: {e}", field="tool_choice") from None
    return Constraint(grammar, "forced tool call")


def _xml_value(schema: dict) -> str:
    """A Lark expression for one XML parameter's value and its closing tag, as the template writes
    values (`_typed` reads them back): strings raw up to the closing tag, enums as their literals,
    numbers, integers and booleans as JSON scalars, objects and arrays as JSON under their schema."""
    close = '"\\n</parameter>\\n"'
    kind = schema.get("type")
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        alts = [json.dumps(v if isinstance(v, str) else json.dumps(v)) for v in schema["enum"]]
        return "(" + " | ".join(alts) + ") " + close
    if kind == "integer":
        return "/-?(0|[1-9][0-9]{0,17})/ " + close
    if kind == "number":
        return "/-?(0|[1-9][0-9]{0,17})(\\.[0-9]{1,17})?([eE][-+]?[0-9]{1,3})?/ " + close
    if kind == "boolean":
        return '("true" | "false") ' + close
    if kind in ("object", "array"):
        return "%json " + json.dumps(schema) + " " + close
    return 'text "\\n"'  # a string (or no type): free text; `text` ends with the closing tag


def tool_choice_name(choice: Any) -> tuple[bool, str | None]:
    """(whether a call is forced, the tool it must be) of OpenAI's tool_choice: "auto" and "none"
    force nothing, "required" any tool, {"type": "function", "function": {"name": N}} tool N."""
    if choice in (None, "auto", "none"):
        return False, None
    if choice == "required":
        return True, None
    f = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise MTPEngineError('expected "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
                             field="tool_choice")
    return True, f["name"]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# ---- the model's output -------------------------------------------------------------------------

def _schema_types(tools: list[dict]) -> dict[str, dict[str, Any]]:
    """{function name: {parameter: its JSON-schema type}}."""
    out = {}
    for t in tools:
        f = t["function"]
        props = (f.get("parameters") or {}).get("properties") or {}
        out[f["name"]] = {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return out


def _typed(value: str, kind: Any) -> Any:
    """An XML parameter's text as its schema type says (the template wrote non-strings as JSON)."""
    kinds = kind if isinstance(kind, list) else [kind]
    if kinds == ["string"] or kind is None:
        return value
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return value
    names = {"integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list,
             "null": type(None)}
    for k in kinds:
        t = names.get(k)
        if t is not None and isinstance(parsed, t) and not (k in ("integer", "number") and isinstance(parsed, bool)):
            return parsed
    return value


def _strip_newline(s: str) -> str:
    # the template writes "<parameter=x>\n" VALUE "\n</parameter>"
    if s.startswith("\n"):
        s = s[1:]
    if s.endswith("\n"):
        s = s[:-1]
    return s


def parse_block(body: str, fmt: str, types: dict[str, dict[str, Any]]) -> list[dict] | None:
    """The calls in the text between <tool_call> and </tool_call>, None if it does not parse."""
    if fmt == HERMES:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        return [_call(obj["name"], args)] if isinstance(args, dict) else None
    calls = []
    for m in _FUNCTION.finditer(body):
        name = m.group(1).strip()
        kinds = types.get(name, {})
        args = {p.group(1).strip(): _typed(_strip_newline(p.group(2)), kinds.get(p.group(1).strip()))
                for p in _PARAMETER.finditer(m.group(2))}
        calls.append(_call(name, args))
    return calls or None


def _call(name: str, args: dict) -> dict:
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}}


@dataclass
class ToolCallStream:
    """Splits generated text into content and tool calls as it arrives: `feed` returns the content
    that is safe to show and the calls completed so far; `finish` the rest (an unclosed or
    unparsable block comes back as content). Whitespace between and after calls (the newlines the
    format puts there) is not content; the result does not depend on how the text was cut."""

    fmt: str
    tools: list[dict]
    buffer: str = ""
    in_call: bool = False
    calls: list[dict] = field(default_factory=list)
    gap: str | None = None  # text since the last call, held while it is only whitespace

    def __post_init__(self) -> None:
        self.types = _schema_types(self.tools)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, new = [], []
        while True:
            if not self.in_call:
                i = self.buffer.find(OPEN)
                if i < 0:
                    keep = _partial_suffix(self.buffer, OPEN)  # might be the start of "<tool_call>"
                    content.append(self._text(self.buffer[:len(self.buffer) - keep], False))
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self._text(self.buffer[:i], True))
                self.buffer = self.buffer[i:]
                self.in_call = True
            j = self.buffer.find(CLOSE)
            if j < 0:
                break
            block, self.buffer = self.buffer[:j + len(CLOSE)], self.buffer[j + len(CLOSE):]
            self.in_call = False
            parsed = parse_block(block[len(OPEN):-len(CLOSE)], self.fmt, self.types)
            if parsed is None:
                content.append(block)
            else:
                new.extend(parsed)
                self.gap = ""
        self.calls.extend(new)
        return "".join(content), new

    def _text(self, text: str, before_call: bool) -> str:
        if self.gap is None:
            return text
        self.gap += text
        if not self.gap.strip():
            if before_call:
                self.gap = ""
            return ""
        out, self.gap = self.gap, None
        return out

    def finish(self) -> str:
        rest, self.buffer = self.buffer, ""
        if self.in_call:
            self.in_call = False
            return self._text("", True) + rest
        return self._text(rest, False)


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest end of `text` that is a proper start of `token`."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def split_tool_calls(text: str, fmt: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """A whole answer: (its content, None when empty around calls; the calls)."""
    s = ToolCallStream(fmt, tools)
    content, calls = s.feed(text)
    content += s.finish()
    if calls:
        content = content.strip()
    return (content or None) if calls else content, calls
