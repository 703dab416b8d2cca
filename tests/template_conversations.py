"""Conversations to render real chat templates with, and the three-way comparison that
`test_real_chat_templates.py` runs: the engine's budgeted
render, the same compiled template with no budget in force, and a plain Jinja sandbox (the
environment transformers renders with) must give the same text, or the same refusal."""
from __future__ import annotations

import datetime
import json
from pathlib import Path

from mtp_engine.chat.template import compile_chat_template, render_chat_template
from mtp_engine.errors import MTPEngineError

FIELD = "tokenizer.chat_template"
REAL_TEMPLATES = Path(__file__).resolve().parent / "fixtures" / "chat_templates"

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City name"},
                                                    "days": {"type": "integer", "description": "Days ahead"}},
                   "required": ["city"]}}}]


def _tool_chat(arguments) -> list[dict]:
    return [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "call12345", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": "18C, sunny"},
            {"role": "assistant", "content": "18C and sunny."},
            {"role": "user", "content": "Thanks"}]


# (name, messages, extra variables)
CASES = [
    ("one user", [{"role": "user", "content": "Hello"}], {}),
    ("one user, tools offered", [{"role": "user", "content": "Hello"}], {"tools": TOOLS}),
    ("system + turns", [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi  "},
        {"role": "assistant", "content": "<think>\nplan\n</think>\n\nHello!"},
        {"role": "user", "content": "naïve 漢字 🙂 'x' * 3 {{ not code }} </s>"}], {}),
    ("system + turns, thinking off", [
        {"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}],
     {"enable_thinking": False}),
    ("tool call, object arguments", _tool_chat({"city": "Paris", "days": 2}), {"tools": TOOLS}),
    ("tool call, JSON-string arguments", _tool_chat('{"city": "Paris", "days": 2}'), {"tools": TOOLS}),
    ("long chat", [m for i in range(40) for m in (
        {"role": "user", "content": f"question {i} " + "word " * 200},
        {"role": "assistant", "content": f"answer {i} " + "text " * 200})]
     + [{"role": "user", "content": "x " * 25_000}], {}),
]


def reference_env():
    """The environment transformers renders with: a plain immutable sandbox, no budget."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Raised(Exception):
        pass

    def raise_exception(msg):
        raise Raised(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda v, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        v, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


def _first_line(e: BaseException) -> str:
    return str(e).replace("\r", "\\r").replace("\n", "\\n")[:120]


def compare(source: str, name: str) -> dict:
    """Renders `source` on every case (with and without a generation prompt) three ways; returns
    {"rendered": n, "refused": n, "problems": [...], "refusals": [...]}, refused meaning all three refused alike (a
    template that rejects a conversation, e.g. a system message or a tool call it cannot take)."""
    ref = reference_env().from_string(source)
    ours = compile_chat_template(source, file=name, field=FIELD)
    out = {"rendered": 0, "refused": 0, "problems": [], "refusals": []}
    for case, messages, extra in CASES:
        for gen in (True, False):
            variables = {"bos_token": "<s>", "eos_token": "</s>", **extra}
            where = f"{name}: {case}, add_generation_prompt={gen}"
            try:
                expected, error = ref.render(messages=messages, add_generation_prompt=gen, **variables), None
            except Exception as e:  # noqa: BLE001 - the template refused this conversation
                expected, error = None, e
            try:
                unbudgeted = ours.render(messages=messages, add_generation_prompt=gen, **variables)
            except Exception as e:  # noqa: BLE001
                unbudgeted = e
            try:
                budgeted = render_chat_template(ours, messages, gen, variables, file=name, field=FIELD)
            except MTPEngineError as e:
                budgeted = e
            if error is None:
                if unbudgeted != expected:
                    out["problems"].append(f"{where}: differs without the budget")
                elif budgeted != expected:
                    out["problems"].append(f"{where}: differs under the budget"
                                           + (f" ({budgeted})" if isinstance(budgeted, Exception) else ""))
                else:
                    out["rendered"] += 1
            else:
                kinds = {type(error).__name__, type(unbudgeted).__name__}
                same = (isinstance(unbudgeted, Exception) and str(unbudgeted) == str(error)
                        and (len(kinds) == 1 or kinds == {"Raised", "TemplateRaised"}))  # both raise_exception
                clean = isinstance(budgeted, MTPEngineError) and _first_line(error) in str(budgeted) \
                    and FIELD in str(budgeted)
                if same and clean:
                    out["refused"] += 1
                    out["refusals"].append(f"{case}: {type(error).__name__}: {_first_line(error)}")
                else:
                    out["problems"].append(f"{where}: plain sandbox raised {type(error).__name__}: "
                                           f"{_first_line(error)}; without budget {unbudgeted!r:.120}; "
                                           f"under budget {budgeted!r:.160}")
    return out
