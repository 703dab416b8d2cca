"""Chat templates: compiling and rendering a model's Jinja chat template the way transformers
does (sandboxed, trim_blocks, lstrip_blocks, ``raise_exception``, ``strftime_now``, a
``tojson`` that keeps non-ASCII text), under a budget.

A chat template comes from the model file, so it is untrusted code. Jinja's sandbox already
stops attribute escapes (``__class__``, ``__globals__``); on top of it every render has a budget
(:class:`RenderLimits`): loop iterations plus calls, characters produced (everything output,
including text captured by ``{% set %}`` blocks and macros), the size of any one string or list
built by ``*``, ``+``, ``~``, ``%``, ``format``, ``join``, ``replace``, ``ljust``, ``center``,
``indent``..., checked before it is built (a chain of up to 8 plain-string ``+`` once built), and
a wall-clock deadline. The hooks are put into the compiled template by rewriting its syntax tree
(see `template_budget`), so no template can skip them, and any exception a template raises
becomes MTPEngineError naming the field the template came from.

The budget costs a real template about nothing (docs/benchmarks.md):
one environment is built per process and a template text is compiled once; loops over short
lists are charged up front; the method calls real templates make (``split``, ``strip``,
``startswith``, ``get``, ``items``...) and macro calls skip layers of the sandbox that cannot
refuse them.

jinja2 is imported only when a template is actually used, so that loading a model for plain
text generation does not pay for it.
"""
from __future__ import annotations

import functools
import json
import threading
from typing import Any

from ..errors import MTPEngineError
from .budget import (
    CURRENT, NON_GROWING_METHODS, PLAIN_OWNERS, SIZED, Budget, OverBudget, RenderLimits, check_format_string,
    check_ints, check_str_call, input_chars,
)
from .hooks import HOOKS, NATIVE_ADD, guard_filter, instrument, render_counted
from .tojson import compact_json_bound, compact_json_size, indented_json

__all__ = ["compile_chat_template", "render_chat_template", "RenderLimits", "MAX_TEMPLATE_CHARS", "CHATML",
           "CHATML_NOTE"]

# A template source longer than this is refused before compiling: real chat templates are 1-20 KB.
MAX_TEMPLATE_CHARS = 1 << 20

# llama.cpp's built-in "chatml" template, its fallback for a model without a chat template (the
# command line's --chat and the server use it too; the API refuses `messages` without a template)
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_NOTE = "has no chat template: using ChatML (<|im_start|>role ... <|im_end|>), as llama.cpp does"


class _TemplateRaised(Exception):
    """raise_exception() called from a chat template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    b = CURRENT.get()
    if b is None:
        return encoder.encode(value)
    if isinstance(indent, int) and indent > b.max_chars:  # the encoder builds ' ' * indent before anything else
        b.size(indent, "the filter tojson")

    def over(size: int) -> int:
        b.size(size, "the filter tojson")
        return b.max_chars  # widened by the input's share

    if indent is None and (separators is None or sum(map(len, separators)) <= 8):
        # compact: measured first (shared parts once, so a value repeating a large part is refused
        # before its text exists), then encoded at once in C; the exact count only when the quick
        # bound is over the budget
        seps = {"item_separator": encoder.item_separator, "key_separator": encoder.key_separator}
        if compact_json_bound(value, ensure_ascii=ensure_ascii, **seps) > b.max_chars:
            compact_json_size(value, ensure_ascii=ensure_ascii, **seps, limit=b.max_chars, over=over)
        return encoder.encode(value)
    # indented (or with long separators) it can be far larger than the value (an indent of 10^6 on
    # a nested value): counted while it is built, and refused before the text exists
    if (isinstance(indent, (int, str)) and type(encoder.item_separator) is str
            and type(encoder.key_separator) is str):
        return indented_json(value, ensure_ascii=ensure_ascii, indent=indent, item_separator=encoder.item_separator,
                             key_separator=encoder.key_separator, sort_keys=sort_keys, limit=b.max_chars, over=over)
    parts, size, limit = [], 0, b.max_chars
    for chunk in encoder.iterencode(value):
        size += len(chunk)
        if size > limit:
            b.size(size, "the filter tojson")
            limit = b.max_chars  # widened by the input's share
        parts.append(chunk)
    return "".join(parts)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def _jinja_env() -> Any:
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.compiler import CodeGenerator
    from jinja2.runtime import Macro
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    sandbox_call = ImmutableSandboxedEnvironment.call

    class BudgetedEnvironment(ImmutableSandboxedEnvironment):
        # `instrument` turns every + chain into a hook; "+" stays here in case one is left. (// and
        # the comparisons cannot build anything large: left to Python.)
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
            tree = super()._parse(source, name, filename)
            return instrument(tree, nodes)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if type(left) is int and type(right) is int and operator == "%":  # loop.index0 % 2
                return left % right
            b = CURRENT.get()
            if b is not None:
                _budget_binop(b, operator, left, right)
            out = super().call_binop(context, operator, left, right)
            if b is not None:
                b.size((len(out) if type(out) in SIZED else 0), f"the operator {operator}")
            return out

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            kind = type(__obj)
            if kind is _BUILTIN_METHOD:
                if __obj.__name__ in NON_GROWING_METHODS and type(__obj.__self__) in PLAIN_OWNERS:
                    # what the sandbox's call comes to for these (nothing to refuse, no context to
                    # pass), done directly: most of a real template's calls, kept as cheap as a call
                    if kwargs:
                        kwargs.pop("_loop_vars", None)
                        kwargs.pop("_block_vars", None)
                    return __obj(*args, **kwargs)
            elif kind is Macro:  # a step (recursion), then the sandbox's call less its checks
                b = CURRENT.get()
                if b is not None:
                    b.steps_left -= 1
                    if b.steps_left & 63 == 0 or b.steps_left < 0:
                        b.check()
                return __context.call(__obj, *args, **kwargs)
            b = CURRENT.get()
            if b is None:
                return sandbox_call(__self, __context, __obj, *args, **kwargs)
            b.steps_left -= 1
            if b.steps_left & 63 == 0 or b.steps_left < 0:
                b.check()
            _budget_call(b, __obj, args, kwargs)
            out = sandbox_call(__self, __context, __obj, *args, **kwargs)
            if type(out) in SIZED and len(out) > b.max_chars:
                b.size(len(out), "a call")
            return out

    class BudgetedCodeGenerator(CodeGenerator):
        def visit_Add(self, node: Any, frame: Any) -> None:
            if not getattr(node, NATIVE_ADD, False):
                return super().visit_Add(node, frame)
            self.write("(")
            self.visit(node.left, frame)
            self.write(" + ")
            self.visit(node.right, frame)
            self.write(")")

    BudgetedEnvironment.code_generator_class = BudgetedCodeGenerator
    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: guard_filter(name, f) for name, f in env.filters.items()}
    # the hooks `instrument` puts in: filters, because a filter is called directly where a call
    # goes through the sandbox's checks; pass_context keeps Jinja from running them at compile time
    for name, hook in HOOKS.items():
        env.filters[name] = jinja2.pass_context(hook)
    # lipsum(n) writes n paragraphs in one call: no chat template needs it
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _budget_binop(b: Any, operator: str, left: Any, right: Any) -> None:
    """Refuses, before it is built, what a binary operator would make past the render's budget."""
    what = f"the operator {operator}"
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(n, int) and isinstance(seq, (str, list, tuple, bytes)):
                b.size(len(seq) * max(n, 0), what)
        if isinstance(left, int) and isinstance(right, int):
            b.size((abs(left).bit_length() + abs(right).bit_length()) // 4, what)
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            b.size(right * abs(left).bit_length() // 4, what)
    elif operator == "+":
        if isinstance(left, (str, list, tuple, bytes)) and type(left) is type(right):
            b.size(len(left) + len(right), what)
    elif operator == "%" and isinstance(left, str):
        check_format_string(b, left, what)
        check_ints(b, right if isinstance(right, tuple) else (right,), what)


def _budget_call(b: Any, obj: Any, args: tuple, kwargs: dict) -> None:
    """Refuses, before it runs, a str/bytes/int method call (or the sandbox's wrapped str.format)
    whose result would pass the render's budget."""
    kind = type(obj)
    if kind is _BUILTIN_METHOD:
        if type(obj.__self__) in (str, bytes, int):
            check_str_call(b, obj.__self__, obj.__name__, args, kwargs)
    elif kind is _FUNCTION:  # the sandbox wraps str.format / format_map in a function
        target = getattr(obj, "__wrapped__", None)
        if type(target) is _BUILTIN_METHOD and type(target.__self__) is str:
            check_str_call(b, target.__self__, target.__name__, args, kwargs)


def _template_error() -> type:
    import jinja2  # loaded by then: only looked up when a render fails

    return jinja2.TemplateError


_DEFAULT_LIMITS = RenderLimits()
_BUILTIN_METHOD = type("".join)
_FUNCTION = type(_strftime_now)
_ENV: Any = None
_ENV_LOCK = threading.Lock()


def _environment() -> Any:
    """The one budgeted environment, built on first use (a Jinja environment is safe to share
    between threads once built; building one costs more than most renders)."""
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            _ENV = _jinja_env()
        return _ENV


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> Any:
    # Jinja folds constant filter calls at compile time ('x'|center(5000000000)): under a budget, a
    # fold that goes past it is left to the render, which refuses it
    token = CURRENT.set(Budget(RenderLimits(), 0))
    try:
        return _environment().from_string(source)
    finally:
        CURRENT.reset(token)


def compile_chat_template(source: str, *, file: str | None, field: str) -> Any:
    """The compiled Jinja template of ``source``; MTPEngineError (naming ``file`` and
    ``field``) when it does not compile or is longer than MAX_TEMPLATE_CHARS."""
    if not isinstance(source, str):
        raise MTPEngineError(f"expected a string, found {type(source).__name__}", file=file, field=field)
    if len(source) > MAX_TEMPLATE_CHARS:
        raise MTPEngineError(f"chat template of {len(source)} characters: expected at most {MAX_TEMPLATE_CHARS}",
                             file=file, field=field)
    try:  # compiled once per template text (a few are kept), then shared
        return _compile(source)
    except Exception as e:  # TemplateSyntaxError, and RecursionError/MemoryError on absurd nesting
        raise MTPEngineError(f"invalid chat template: {_one_line(e)}", file=file, field=field) from None


def _one_line(e: BaseException, limit: int = 300) -> str:
    text = f"{e}" or type(e).__name__
    text = text.replace("\r", "\\r").replace("\n", "\\n")
    return text if len(text) <= limit else text[:limit] + "..."


def render_chat_template(
    template: Any,
    messages: list[dict],
    add_generation_prompt: bool,
    variables: dict[str, Any],
    *,
    file: str | None,
    field: str,
    limits: RenderLimits | None = None,
) -> str:
    """Render a template from :func:`compile_chat_template` with ``messages``,
    ``add_generation_prompt`` and the extra ``variables``, within ``limits`` (default
    :class:`RenderLimits`).

    Raises MTPEngineError (naming ``file`` and ``field``) when the template calls
    ``raise_exception``, goes past its budget, or fails in any other way while rendering.
    """
    budget = Budget(limits or _DEFAULT_LIMITS, lambda: input_chars(messages, variables))
    token = CURRENT.set(budget)
    try:
        return render_counted(template, budget,
                              dict(variables, messages=messages, add_generation_prompt=add_generation_prompt))
    except _TemplateRaised as e:
        raise MTPEngineError(f"chat template refused the input: {_one_line(e)}", file=file, field=field) from None
    except OverBudget as e:
        raise MTPEngineError(f"chat template stopped: {e}", file=file, field=field) from None
    except RecursionError:
        raise MTPEngineError("chat template failed: recursion too deep", file=file, field=field) from None
    except MemoryError:
        raise MTPEngineError("chat template failed: out of memory", file=file, field=field) from None
    except _template_error() as e:
        raise MTPEngineError(f"chat template failed: {_one_line(e)}", file=file, field=field) from None
    except Exception as e:  # ZeroDivisionError, TypeError, OverflowError...: the template's fault
        raise MTPEngineError(f"chat template failed: {type(e).__name__}: {_one_line(e)}",
                             file=file, field=field) from None
    finally:
        CURRENT.reset(token)
