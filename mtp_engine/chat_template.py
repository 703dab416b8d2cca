"""Chat templates: compiling and rendering a model's Jinja chat template the way transformers
does (sandboxed, trim_blocks, lstrip_blocks, ``raise_exception``, ``strftime_now``, a
``tojson`` that keeps non-ASCII text).

jinja2 is imported only when a template is actually used, so that loading a model for plain
text generation does not pay for it.
"""
from __future__ import annotations

import json
from typing import Any

from .errors import MTPEngineError

__all__ = ["compile_chat_template", "render_chat_template"]


class _TemplateRaised(Exception):
    """raise_exception() called from a chat template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def _jinja_env() -> Any:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def compile_chat_template(source: str, *, file: str | None, field: str) -> Any:
    """The compiled Jinja template of ``source``; MTPEngineError (naming ``file`` and
    ``field``) when it does not compile."""
    import jinja2

    env = _jinja_env()
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise MTPEngineError(f"invalid chat template: {e}", file=file, field=field) from e


def render_chat_template(
    template: Any,
    messages: list[dict],
    add_generation_prompt: bool,
    variables: dict[str, Any],
    *,
    file: str | None,
    field: str,
) -> str:
    """Render a template from :func:`compile_chat_template` with ``messages``,
    ``add_generation_prompt`` and the extra ``variables``.

    Raises MTPEngineError (naming ``file`` and ``field``) when the template calls
    ``raise_exception`` or fails while rendering.
    """
    import jinja2

    try:
        return template.render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
    except _TemplateRaised as e:
        raise MTPEngineError(
            f"chat template refused the input: {e}", file=file, field=field
        ) from e
    except jinja2.TemplateError as e:
        raise MTPEngineError(f"chat template failed: {e}", file=file, field=field) from e
