"""The Jinja environment chat templates run in: Jinja's immutable sandbox with the render budget
built in (`template.py` says what the budget covers and why).

`Instrument` rewrites a parsed template so every loop, every ``+`` chain and ``~``, and every
output inside a capture goes through the hook filters (`hooks.HOOKS`); `BudgetedEnvironment`
checks operators and calls before their values are built; `BudgetedCodeGenerator` compiles a
short plain-string ``+`` chain to Python's ``+``. Imported only when a template is used: loading a
model for plain text generation does not pay for jinja2.
"""
from __future__ import annotations

from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from .budget import (
    CURRENT, NON_GROWING_METHODS, PLAIN_OWNERS, SIZED, check_format_string, check_ints, check_str_call,
)
from .hooks import HOOKS, NATIVE_ADD, SHORT_CHAIN, guard_filter, raise_exception, strftime_now
from .tojson import tojson_filter

_BUILTIN_METHOD = type("".join)
_FUNCTION = type(lambda: None)
_sandbox_call = ImmutableSandboxedEnvironment.call


def _hook(name: str, value: Any, *args: Any, lineno: int) -> Any:
    return nodes.Filter(value, name, list(args), [], None, None, lineno=lineno)


def _add_hook(operands: list) -> Any:
    name = f"mtp_add{len(operands)}" if len(operands) <= 6 else "mtp_add"
    return _hook(name, operands[0], *operands[1:], lineno=operands[0].lineno)


class Instrument(NodeTransformer):
    """Routes every loop, ``+`` chain, ``~`` and captured output of a parsed template through the
    budget hooks (the top level's output is counted by `hooks.render_counted`)."""

    # > 0 inside a scope whose output Jinja collects in a list instead of yielding it (macros,
    # call, filter and set blocks, recursive loops; blocks, which self.name() collects)
    captured = 0

    def _scope(self, node: Any) -> Any:
        self.captured += 1
        try:
            return self.generic_visit(node)
        finally:
            self.captured -= 1

    visit_Macro = visit_CallBlock = visit_FilterBlock = visit_AssignBlock = visit_Block = _scope

    def visit_For(self, node: Any) -> Any:
        node = self._scope(node) if node.recursive else self.generic_visit(node)
        node.iter = _hook("mtp_loop", node.iter, lineno=node.lineno)
        return node

    def _operands(self, node: Any) -> list:
        operands = []
        while isinstance(node, nodes.Add):  # a + b + c parses as ((a + b) + c)
            operands.append(node.right)
            node = node.left
        operands.append(node)
        return [self.visit(o) for o in reversed(operands)]

    def visit_Add(self, node: Any) -> Any:
        return _add_hook(self._operands(node))

    def _output_child(self, node: Any) -> Any:
        """A top-level output item; a short ``+`` chain led by a string literal is left to
        Python's ``+`` (see NATIVE_ADD)."""
        if not isinstance(node, nodes.Add):
            return self.visit(node)
        operands = self._operands(node)
        if not (len(operands) <= SHORT_CHAIN and isinstance(operands[0], nodes.Const)
                and type(operands[0].value) is str):
            return _add_hook(operands)
        chain = operands[0]
        for o in operands[1:]:
            chain = nodes.Add(chain, o, lineno=o.lineno)
            setattr(chain, NATIVE_ADD, True)
        return chain

    def visit_Concat(self, node: Any) -> Any:
        node = self.generic_visit(node)
        return _hook("mtp_concat", node.nodes[0], *node.nodes[1:], lineno=node.lineno)

    def visit_Output(self, node: Any) -> Any:
        if not self.captured:
            node.nodes = [self._output_child(c) for c in node.nodes]
            return node
        node = self.generic_visit(node)
        literal = sum(len(c.data) for c in node.nodes if isinstance(c, nodes.TemplateData))
        wrapped = [c if isinstance(c, nodes.TemplateData) else _hook("mtp_out", c, lineno=c.lineno)
                   for c in node.nodes]
        head = [_hook("mtp_emit", nodes.Const(""), nodes.Const(literal), lineno=node.lineno)] if literal else []
        node.nodes = head + wrapped
        return node


class BudgetedCodeGenerator(CodeGenerator):
    """Jinja's code generator, compiling a + chain `Instrument` marked NATIVE_ADD to Python's +."""

    def visit_Add(self, node: Any, frame: Any) -> None:
        if not getattr(node, NATIVE_ADD, False):
            return super().visit_Add(node, frame)
        self.write("(")
        self.visit(node.left, frame)
        self.write(" + ")
        self.visit(node.right, frame)
        self.write(")")


class BudgetedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox with the render budget: templates instrumented as they are parsed,
    operators and calls checked before their values are built."""

    code_generator_class = BudgetedCodeGenerator
    # `Instrument` turns every + chain into a hook; "+" stays here in case one is left. (// and
    # the comparisons cannot build anything large: left to Python.)
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> Any:
        return Instrument().visit(super()._parse(source, name, filename))

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
            return _sandbox_call(__self, __context, __obj, *args, **kwargs)
        b.steps_left -= 1
        if b.steps_left & 63 == 0 or b.steps_left < 0:
            b.check()
        _budget_call(b, __obj, args, kwargs)
        out = _sandbox_call(__self, __context, __obj, *args, **kwargs)
        if type(out) in SIZED and len(out) > b.max_chars:
            b.size(len(out), "a call")
        return out


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


def environment() -> BudgetedEnvironment:
    """A new environment as transformers renders chat templates (trim_blocks, lstrip_blocks, loop
    controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), every
    filter guarded and the budget's hook filters added."""
    env = BudgetedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson_filter
    env.filters = {name: guard_filter(name, f) for name, f in env.filters.items()}
    # the hooks `Instrument` puts in: filters, because a filter is called directly where a call
    # goes through the sandbox's checks; pass_context keeps Jinja from running them at compile time
    for name, hook in HOOKS.items():
        env.filters[name] = jinja2.pass_context(hook)
    # lipsum(n) writes n paragraphs in one call: no chat template needs it
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
