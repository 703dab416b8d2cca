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
import threading
from typing import Any

from ..errors import MTPEngineError
from .budget import CURRENT, Budget, OverBudget, RenderLimits, input_chars
from .hooks import TemplateRaised, render_counted

__all__ = ["compile_chat_template", "render_chat_template", "RenderLimits", "MAX_TEMPLATE_CHARS", "CHATML",
           "CHATML_NOTE"]

# A template source longer than this is refused before compiling: real chat templates are 1-20 KB.
MAX_TEMPLATE_CHARS = 1 << 20

# llama.cpp's built-in "chatml" template, its fallback for a model without a chat template (the
# command line's --chat and the server use it too; the API refuses `messages` without a template)
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML_NOTE = "has no chat template: using ChatML (<|im_start|>role ... <|im_end|>), as llama.cpp does"


def _template_error() -> type:
    import jinja2  # loaded by then: only looked up when a render fails

    return jinja2.TemplateError


_DEFAULT_LIMITS = RenderLimits()
_ENV: Any = None
_ENV_LOCK = threading.Lock()


def _environment() -> Any:
    """The one budgeted environment, built on first use (a Jinja environment is safe to share
    between threads once built; building one costs more than most renders)."""
    global _ENV
    with _ENV_LOCK:
        if _ENV is None:
            from .sandbox import environment  # jinja2: only once a template is used
            _ENV = environment()
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
    except TemplateRaised as e:
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
