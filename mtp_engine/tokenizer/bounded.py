"""Tokenizing a prompt in bounded pieces, so that a prompt longer than the context is refused
after tokenizing about one context's worth of it, not the whole text.

A 10 MB prompt file used to be tokenized in full (6.2M tokens, 18.7 s, 2.0 GB) before the context
check refused it, and a 100 MB rendered prompt made the tokenizer backend abort the process.

Pieces are cut only where tokenizing the pieces one by one gives exactly the ids of tokenizing
the whole text: just before an ASCII space that follows an ASCII letter or digit. Why that is
exact for the byte-level BPE of `mtp_engine.tokenizer.bpe`:

* pre-tokenizer (llama.cpp's qwen2 / qwen35 regex, "isolated"): matches are found left to right,
  the match that ends at the letter or digit cannot extend over a space (no alternative that
  starts with a letter or digit takes whitespace), and the next match starts at the space in both
  cases; the regex has no look-behind, so what it does from the space on depends only on the text
  from the space on;
* BPE runs inside one pre-token, so never across the cut;
* NFC: a space is a starter that composes with nothing before it, so NFC(a + b) = NFC(a) + NFC(b);
* special tokens (matched literally first): a cut is skipped when a special token's text could
  span it (only tokens whose text holds a space can).

`tests/generation/test_text_input.py` checks the equality against whole-text tokenization on arbitrary text.
"""
from __future__ import annotations

from typing import Any

from ..errors import MTPEngineError

__all__ = ["encode_prompt", "PIECE_CHARS"]

PIECE_CHARS = 16384  # ~4k tokens of English: tokenizing one piece takes ~5 ms


def _safe(text: str, c: int, spaced_specials: list[str]) -> bool:
    prev = text[c - 1]
    return (prev.isascii() and prev.isalnum()
            and not any(text.find(s, max(0, c - len(s) + 1), c + len(s)) != -1 for s in spaced_specials))


def _last_cut(text: str, start: int, end: int, spaced_specials: list[str]) -> int:
    """The last safe cut in text[start + 1 : end], or -1."""
    c = text.rfind(" ", start + 1, end)
    while c > start and not _safe(text, c, spaced_specials):
        c = text.rfind(" ", start + 1, c)
    return c if c > start else -1


def _next_cut(text: str, start: int, spaced_specials: list[str]) -> int:
    """The first safe cut at or after `start`, or len(text)."""
    c = text.find(" ", max(start, 1))
    while c != -1 and not _safe(text, c, spaced_specials):
        c = text.find(" ", c + 1)
    return len(text) if c == -1 else c


def encode_prompt(tokenizer: Any, text: str, limit: int, field: str = "prompt",
                  piece_chars: int = PIECE_CHARS, source: str = "the model's") -> list[int]:
    """`tokenizer.encode(text)` (BOS included when the model asks for it), refusing with
    MTPEngineError naming `field` as soon as the ids exceed `limit` (the context length), after
    tokenizing at most `piece_chars` characters past it. Exact: the ids equal those of encoding
    the whole text at once. `source`: what set the limit, for the message (a -c cap, the model)."""
    from ..text_input import check_text

    check_text(text, field)
    backend = tokenizer.backend
    bos = [tokenizer.bos_token_id] if tokenizer.add_bos_token and tokenizer.bos_token_id is not None else []
    ids: list[int] = list(bos)
    max_bytes = max(1, tokenizer.max_token_bytes)
    spaced = tokenizer.spaced_special_texts
    n = len(text)
    start = 0
    too_long = False
    while start < n and not too_long:
        # a token covers at most max_bytes bytes, and NFC leaves at least a third of the characters
        # (Hangul L+V+T -> one syllable), each one byte or more: a lower bound without tokenizing
        if len(ids) + (n - start) // (3 * max_bytes) > limit:
            too_long = True
            break
        end = start + piece_chars
        cut = n if end >= n else _last_cut(text, start, end, spaced)
        if cut < 0:  # no safe cut in this piece (e.g. text without spaces): take up to the next one
            cut = _next_cut(text, end, spaced)
        ids.extend(backend.encode(text[start:cut], add_special_tokens=False).ids)
        start = cut
        too_long = len(ids) > limit
    if too_long:
        done = "" if start >= n else f" after tokenizing {start} of its {n} characters"
        raise MTPEngineError(f"the prompt (more than {limit} tokens{done}) is longer than the context length "
                             f"{limit} ({source})", field=field)
    return ids
