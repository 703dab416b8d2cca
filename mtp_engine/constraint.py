"""Constrained decoding: the output follows a grammar (a JSON schema, any JSON object, a regular
expression or a Lark grammar), by masking every scored row's logits to the tokens the grammar
allows next. The grammar engine is llguidance (optional: `pip install 'mtp-engine[constrained]'`).

With draft-mtp the verify rows are masked too: row i by the grammar's state after drafts 1..i, so
a draft the grammar refuses is never accepted (greedy: the masked argmax differs from it;
sampling: its probability is 0), and the output is what plain constrained decoding gives. The MTP
head's drafts are masked as well (each step reads the previous draft on the host): unmasked, a
code model drafts the pretty-printed JSON it was trained on, which the grammar then rejects. The
grammar state advances with the tokens each round emits.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any

import mlx.core as mx
import numpy as np

from .errors import MTPEngineError
from .text_input import check_text

FIELD = "constraint"
# a schema past these is refused before llguidance sees it: its converter recurses (a schema nested
# ~9000 deep, or a cyclic dict, killed the process with SIGSEGV) and its work grows with the size
MAX_SCHEMA_DEPTH = 64  # nested objects/arrays (a deep real schema: ~20)
MAX_SCHEMA_NODES = 20_000  # values in all
MAX_SCHEMA_INT = 2**63  # |integers| in a schema (bounds, lengths): beyond int64 is no schema's
MAX_GRAMMAR_CHARS = 1_000_000  # a regex, Lark or GBNF grammar


def check_schema(schema: Any) -> None:
    """Refuses, with the place and the limit named, a schema that is cyclic, deeper than
    MAX_SCHEMA_DEPTH, larger than MAX_SCHEMA_NODES, holds an integer beyond MAX_SCHEMA_INT, a key
    that is not a string, a value that is not JSON, or a string that is not valid UTF-8 (a lone
    surrogate). Iterative: a hostile schema cannot exhaust the stack here either."""
    stack: list[tuple[Any, str, int, tuple]] = [(schema, "$", 1, ())]
    nodes = 0
    while stack:
        value, where, depth, path_ids = stack.pop()
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            raise MTPEngineError(f"JSON schema too large: more than {MAX_SCHEMA_NODES} values", field=FIELD)
        if isinstance(value, (dict, list)):
            if id(value) in path_ids:
                raise MTPEngineError(f"JSON schema is cyclic at {where} (it contains itself)", field=FIELD)
            if depth > MAX_SCHEMA_DEPTH:
                raise MTPEngineError(f"JSON schema nested too deep at {_short(where)}: more than {MAX_SCHEMA_DEPTH} "
                                     "levels", field=FIELD)
            if nodes + len(stack) + len(value) > MAX_SCHEMA_NODES:
                raise MTPEngineError(f"JSON schema too large: more than {MAX_SCHEMA_NODES} values", field=FIELD)
            inner = path_ids + (id(value),)
            if isinstance(value, dict):
                for key, v in value.items():
                    if not isinstance(key, str):
                        raise MTPEngineError(f"JSON schema key {key!r} at {where} is not a string", field=FIELD)
                    check_text(key, f"{FIELD} {where} (a key)")
                    stack.append((v, f"{where}.{key[:40]}", depth + 1, inner))
            else:
                stack.extend((v, f"{where}[{i}]", depth + 1, inner) for i, v in enumerate(value))
        elif isinstance(value, str):
            check_text(value, f"{FIELD} {where}")
        elif isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):
            if abs(value) > MAX_SCHEMA_INT:
                raise MTPEngineError(f"JSON schema integer at {where} is out of range (|n| > 2**63)", field=FIELD)
        elif isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                raise MTPEngineError(f"JSON schema number at {where} is not finite", field=FIELD)
        else:
            raise MTPEngineError(f"JSON schema value at {where} is a {type(value).__name__}, not JSON", field=FIELD)


def _short(where: str) -> str:
    return where if len(where) <= 120 else f"{where[:50]}...{where[-60:]}"


def _check_grammar(text: Any, kind: str) -> str:
    if not isinstance(text, str):
        raise MTPEngineError(f"expected a {kind} string, found {type(text).__name__}", field=FIELD)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise MTPEngineError(f"{kind} too long: {len(text)} characters (at most {MAX_GRAMMAR_CHARS})", field=FIELD)
    check_text(text, f"{FIELD} {kind}")
    return text


def _compile(build, what: str) -> str:
    """llguidance's grammar builders raise plain exceptions on bad input: the engine's error."""
    try:
        return build()
    except (ValueError, TypeError, RuntimeError, UnicodeError) as e:
        raise MTPEngineError(f"not a usable {what}: {e}", field=FIELD) from None


# the oldest llguidance the constraint tests pass with (0.7.8's `validate_grammar` takes other arguments)
LLGUIDANCE_MIN = (0, 7, 9)


def _llg() -> Any:
    try:
        import llguidance
    except ImportError:
        raise MTPEngineError("constrained decoding needs llguidance: pip install 'mtp-engine[constrained]'",
                             field=FIELD) from None
    have = _version("llguidance")
    if have is not None and have < LLGUIDANCE_MIN:
        need = ".".join(map(str, LLGUIDANCE_MIN))
        raise MTPEngineError(f"llguidance {'.'.join(map(str, have))} is too old: constrained decoding needs "
                             f"llguidance >= {need} (pip install -U 'mtp-engine[constrained]')", field=FIELD)
    return llguidance


@functools.cache
def _version(package: str) -> tuple[int, ...] | None:
    """An installed package's release numbers (None when unknown: a source checkout)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        text = version(package)
    except PackageNotFoundError:
        return None
    parts = []
    for p in text.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, p))
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


class Constraint:
    """A grammar the generated text must follow. Build one with `Constraint.json(schema)` (None:
    any JSON object), `Constraint.regex(pattern)` or `Constraint.lark(grammar)`; give it to
    `generate(..., constraint=...)`. Generation stops at the end-of-sequence token once the text is
    complete (or at max_tokens, with the text cut)."""

    def __init__(self, grammar: str, what: str):
        self.grammar, self.what = grammar, what
        err = _compile(lambda: _llg().LLMatcher.validate_grammar(grammar), what)
        if err:
            raise MTPEngineError(f"{what}: {err}", field=FIELD)

    @classmethod
    def json(cls, schema: dict | None = None) -> "Constraint":
        """Text that is JSON matching `schema` (a JSON Schema object), or any JSON object."""
        if schema is not None and not isinstance(schema, dict):
            raise MTPEngineError(f"expected a JSON schema object, found {type(schema).__name__}", field=FIELD)
        if schema is not None:
            check_schema(schema)
        llg = _llg()
        # no free whitespace between tokens: a model may otherwise pad forever (a known JSON-mode
        # failure); separators as json.dumps writes them
        grammar = _compile(lambda: llg.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"},
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}), "JSON schema")
        return cls(grammar, "JSON schema" if schema is not None else "JSON object")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """Text that matches the regular expression `pattern` in full."""
        pattern = _check_grammar(pattern, "pattern")
        llg = _llg()
        return cls(_compile(lambda: llg.LLMatcher.grammar_from_regex(pattern), "regex"), "regex")

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        """Text in the language of a Lark grammar (llguidance's dialect)."""
        grammar = _check_grammar(grammar, "grammar")
        llg = _llg()
        return cls(_compile(lambda: llg.LLMatcher.grammar_from_lark(grammar), "Lark grammar"), "Lark grammar")

    @classmethod
    def gbnf(cls, grammar: str) -> "Constraint":
        """Text in the language of a llama.cpp GBNF grammar (`--grammar`; Lark is accepted too)."""
        grammar = _check_grammar(grammar, "grammar")
        _llg()
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(grammar)
        except Exception as e:  # the converter raises plain exceptions on bad input
            raise MTPEngineError(f"not a GBNF grammar: {type(e).__name__}: {e}", field=FIELD) from None
        return cls(_compile(lambda: _llg().LLMatcher.grammar_from_lark(lark), "GBNF grammar"), "GBNF grammar")

    def matcher(self, tokenizer: Any, vocab_size: int) -> "GrammarState":
        """The grammar's state for one generation."""
        return GrammarState(self, tokenizer, vocab_size)

    def __repr__(self) -> str:
        return f"Constraint({self.what})"


def _ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of the vocabulary, built once per tokenizer (the token trie)."""
    cache = tokenizer.grammar_views
    if vocab_size not in cache:
        eos = sorted(tokenizer.eos_token_ids)
        llg, source = _llg(), tokenizer.backend.to_str()
        try:
            cache[vocab_size] = llg.LLTokenizer(source, n_vocab=vocab_size, eos_token=eos or None)
        except TypeError:  # llguidance < 1.7 takes one end-of-text token: the first ends grammars
            cache[vocab_size] = llg.LLTokenizer(source, n_vocab=vocab_size, eos_token=eos[0] if eos else None)
    return cache[vocab_size]


class GrammarState:
    """One generation's position in the grammar."""

    def __init__(self, constraint: Constraint, tokenizer: Any, vocab_size: int):
        self.vocab_size = vocab_size
        self.eos = set(tokenizer.eos_token_ids)
        self.m = _llg().LLMatcher(_ll_tokenizer(tokenizer, vocab_size), constraint.grammar)
        if self.m.is_error():
            raise MTPEngineError(f"{constraint.what}: {self.m.get_error()}", field=FIELD)

    def _mask(self, m: Any = None) -> np.ndarray:
        bits = np.frombuffer((self.m if m is None else m).compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def _walk(self, tokens: list[int]) -> list[np.ndarray]:
        """The masks before each of `tokens` and after the last one the grammar allows. Stops at a
        token the previous mask refuses or at an end-of-sequence token (nothing follows the end).
        The walk runs on a copy of the state (< 1 us): llguidance cannot roll back grammars with
        stop= or max_tokens= lexemes."""
        rows = [self._mask()]
        if not tokens:
            return rows
        walker = self.m.deep_copy()
        for t in tokens:
            t = int(t)
            if t in self.eos or not rows[-1][t]:
                break
            walker.consume_token(t)
            rows.append(self._mask(walker))
        return rows

    def masks(self, drafts: list[int]) -> np.ndarray:
        """[len(drafts) + 1, V]: row i, the tokens allowed after drafts 1..i (rows after a draft the
        grammar refuses repeat the last valid one: they are never used, that draft being rejected)."""
        rows = self._walk(drafts)
        rows += [rows[-1]] * (len(drafts) + 1 - len(rows))
        return np.stack(rows)

    def allowed_after(self, tokens: list[int]) -> np.ndarray | None:
        """[V]: the tokens allowed after `tokens` (None when one of them is refused or ends the text)."""
        rows = self._walk(tokens)
        return rows[-1] if len(rows) == len(tokens) + 1 else None

    def apply(self, logits: mx.array, drafts: list[int] | None = None) -> mx.array:
        """`logits` ([V] or [R, V], R = len(drafts) + 1) with every refused token at -inf."""
        mask = self.masks(list(drafts or []))
        return masked(logits, mask if logits.ndim == 2 else mask[0])

    def accept(self, tokens: list[int]) -> None:
        """The generation emitted `tokens` (which the masks allowed; a round may run past the end of
        the text, which the generation loop cuts there)."""
        for t in tokens:
            if self.m.is_stopped():
                return
            if not self.m.consume_token(int(t)):
                raise MTPEngineError(f"token {int(t)} does not follow the grammar ({self.m.get_error() or 'refused'})",
                                     field=FIELD)


def masked(logits: mx.array, allowed: np.ndarray) -> mx.array:
    """`logits` with the tokens `allowed` (a boolean mask of the same shape) refuses at -inf."""
    return mx.where(mx.array(allowed), logits, mx.array(-np.inf, dtype=logits.dtype))


def response_format_constraint(fmt: Any) -> Constraint | None:
    """OpenAI's `response_format` ({"type": "text" | "json_object" | "json_schema", ...}) as a
    Constraint (None for text)."""
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise MTPEngineError('expected {"type": "text" | "json_object" | "json_schema"}', field="response_format")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return Constraint.json()
    spec = fmt.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise MTPEngineError("json_schema: expected {\"name\": ..., \"schema\": {...}}", field="response_format")
    return Constraint.json(schema)
