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

from typing import Any

import mlx.core as mx
import numpy as np

from .errors import MTPEngineError

FIELD = "constraint"


def _llg() -> Any:
    try:
        import llguidance
    except ImportError:
        raise MTPEngineError("constrained decoding needs llguidance: pip install 'mtp-engine[constrained]'",
                             field=FIELD) from None
    return llguidance


class Constraint:
    """A grammar the generated text must follow. Build one with `Constraint.json(schema)` (None:
    any JSON object), `Constraint.regex(pattern)` or `Constraint.lark(grammar)`; give it to
    `generate(..., constraint=...)`. Generation stops at the end-of-sequence token once the text is
    complete (or at max_tokens, with the text cut)."""

    def __init__(self, grammar: str, what: str):
        self.grammar, self.what = grammar, what
        err = _llg().LLMatcher.validate_grammar(grammar)
        if err:
            raise MTPEngineError(f"{what}: {err}", field=FIELD)

    @classmethod
    def json(cls, schema: dict | None = None) -> "Constraint":
        """Text that is JSON matching `schema` (a JSON Schema object), or any JSON object."""
        if schema is not None and not isinstance(schema, dict):
            raise MTPEngineError(f"expected a JSON schema object, found {type(schema).__name__}", field=FIELD)
        try:
            # no free whitespace between tokens: a model may otherwise pad forever (a known JSON-mode
            # failure); separators as json.dumps writes them
            grammar = _llg().LLMatcher.grammar_from_json_schema(
                schema if schema is not None else {"type": "object"},
                defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        except (ValueError, TypeError) as e:
            raise MTPEngineError(f"not a usable JSON schema: {e}", field=FIELD) from None
        return cls(grammar, "JSON schema" if schema is not None else "JSON object")

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        """Text that matches the regular expression `pattern` in full."""
        if not isinstance(pattern, str):
            raise MTPEngineError(f"expected a pattern string, found {type(pattern).__name__}", field=FIELD)
        return cls(_llg().LLMatcher.grammar_from_regex(pattern), "regex")

    @classmethod
    def lark(cls, grammar: str) -> "Constraint":
        """Text in the language of a Lark grammar (llguidance's dialect)."""
        if not isinstance(grammar, str):
            raise MTPEngineError(f"expected a grammar string, found {type(grammar).__name__}", field=FIELD)
        return cls(_llg().LLMatcher.grammar_from_lark(grammar), "Lark grammar")

    @classmethod
    def gbnf(cls, grammar: str) -> "Constraint":
        """Text in the language of a llama.cpp GBNF grammar (`--grammar`; Lark is accepted too)."""
        if not isinstance(grammar, str):
            raise MTPEngineError(f"expected a grammar string, found {type(grammar).__name__}", field=FIELD)
        _llg()
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(grammar)
        except Exception as e:  # the converter raises plain exceptions on bad input
            raise MTPEngineError(f"not a GBNF grammar: {type(e).__name__}: {e}", field=FIELD) from None
        return cls(_llg().LLMatcher.grammar_from_lark(lark), "GBNF grammar")

    def matcher(self, tokenizer: Any, vocab_size: int) -> "GrammarState":
        """The grammar's state for one generation."""
        return GrammarState(self, tokenizer, vocab_size)

    def __repr__(self) -> str:
        return f"Constraint({self.what})"


def _ll_tokenizer(tokenizer: Any, vocab_size: int) -> Any:
    """llguidance's view of the vocabulary, built once per tokenizer (the token trie)."""
    cache = tokenizer.__dict__.setdefault("_llguidance", {})
    if vocab_size not in cache:
        eos = sorted(tokenizer.eos_token_ids)
        llg, source = _llg(), tokenizer._backend.to_str()
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
