"""Streaming detokenization: generated token ids -> text, one token at a time, never splitting
a UTF-8 character across two pieces of output."""
from __future__ import annotations

from typing import Protocol

__all__ = ["StreamingDetokenizer"]


class _TokenSource(Protocol):
    """What the detokenizer needs from a tokenizer; a protocol rather than an import of
    ``Tokenizer`` so that ``tokenizer`` can import this module without a cycle."""

    def token_bytes(self, token_id: int) -> bytes: ...

    def is_special(self, token_id: int) -> bool: ...


def _utf8_need(lead: int) -> int:
    """Length of the UTF-8 sequence a lead byte starts (1 for ASCII and invalid leads)."""
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 1


def _emit_len(buf: bytearray) -> int:
    """How many leading bytes of ``buf`` can be decoded now: everything except a trailing
    lead byte (plus its continuation bytes) whose character is not complete yet.

    The cut is always just before a non-continuation byte, where a UTF-8 decoder always
    resynchronises, so decoding the parts separately (errors="replace") gives the same text as
    decoding the whole, even for invalid UTF-8.
    """
    n = len(buf)
    for k in range(1, min(4, n) + 1):
        b = buf[n - k]
        if b & 0xC0 != 0x80:  # not a continuation byte
            return n - k if _utf8_need(b) > k else n
    return n


# Why not `tokenizers.decoders.DecodeStream`: on every valid UTF-8 stream it emits the same text
# (tests/tokenizer/test_tokenizer.py compares them on the shipped model's tokenizer), though later: it holds
# back a whole token whose text ends inside a character, where we hold back only those bytes
# (' ' of ' ━' comes a token earlier here). And it has no flush:
# a generation that stops inside a character (max_tokens reached after the first byte token of an
# emoji, or ids that are not valid UTF-8) loses those bytes, where `Tokenizer.decode`, and so
# `generate()`'s text, ends in U+FFFD. Streamed and non-streamed text must be equal, so we keep
# this one (it is also O(token) per step, without DecodeStream's re-decode of a prefix window).
class StreamingDetokenizer:
    """Incremental decoding of generated tokens.

    :meth:`add` returns the text that became complete with one more token, holding back the
    bytes of a UTF-8 character that a token ended in the middle of; :meth:`flush` returns the
    rest. Concatenating every ``add`` result and ``flush()`` gives ``Tokenizer.decode`` of all
    the ids. Work per token is proportional to the token's length.
    """

    def __init__(self, tokenizer: _TokenSource, skip_special_tokens: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._pending = bytearray()
        self.tokens: list[int] = []

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly "")."""
        token_id = int(token_id)
        data = self._tokenizer.token_bytes(token_id)
        self.tokens.append(token_id)
        if self._skip_special and self._tokenizer.is_special(token_id):
            return ""
        buf = self._pending
        buf += data
        cut = _emit_len(buf)
        if cut == 0:
            return ""
        text = bytes(buf[:cut]).decode("utf-8", errors="replace")
        del buf[:cut]
        return text

    def flush(self) -> str:
        """Return the held-back bytes (an incomplete character becomes U+FFFD) and clear them."""
        text = bytes(self._pending).decode("utf-8", errors="replace")
        self._pending.clear()
        return text

    def reset(self) -> None:
        """Forget everything (pending bytes and the token list)."""
        self._pending.clear()
        self.tokens.clear()
