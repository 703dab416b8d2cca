"""Byte-level BPE: GPT-2's byte alphabet, llama.cpp's pre-tokenizer regexes, and the Hugging
Face ``tokenizers`` backend that reproduces llama.cpp's gpt2-model tokenizer from a GGUF
vocabulary (tokens, token types, merges)."""
from __future__ import annotations

import json
from typing import NamedTuple

import tokenizers

from ..errors import MTPEngineError

__all__ = [
    "ByteLevelBPE",
    "MAX_TOKEN_BYTES",
    "check_vocabulary",
    "build_byte_level_bpe",
    "PRE_TOKENIZER_REGEXES",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_BYTE",
    "bytes_to_unicode",
    "byte_level_decode",
]

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type / gguf.TokenType).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Longest vocabulary entry accepted, in UTF-8 bytes. Byte-level BPE entries are merges of words and
# whitespace runs, far below this (the shipped model's longest: 64 bytes); one 32 MiB control token took
# 2.88 GB in the tokenizer backend (77x the file).
MAX_TOKEN_BYTES = 1024
# llama.cpp's llama_token_type: 0 undefined, 1 normal, 2 unknown, 3 control, 4 user-defined,
# 5 unused, 6 byte
_TOKEN_TYPES = range(0, 7)


def check_vocabulary(tokens: list[str], token_types: list[int], *, file: str | None, tokens_field: str,
                     types_field: str) -> None:
    """Every vocabulary entry at most MAX_TOKEN_BYTES long, every token type a known one;
    MTPEngineError naming the file, the field and the token otherwise."""
    for i, t in enumerate(tokens):
        if len(t) > MAX_TOKEN_BYTES // 4 and len(t.encode("utf-8")) > MAX_TOKEN_BYTES:
            raise MTPEngineError(f"token {i} is {len(t.encode('utf-8'))} bytes long: expected at most "
                                 f"{MAX_TOKEN_BYTES}", file=file, field=tokens_field)
    for i, tt in enumerate(token_types):
        if tt not in _TOKEN_TYPES:
            raise MTPEngineError(f"token {i} has type {tt}: expected 0..6 (llama_token_type)",
                                 file=file, field=types_field)


# The pre-tokenizer regexes, exactly as llama.cpp spells them (src/llama-vocab.cpp).
# HF's tokenizer.json writes the contraction alternatives as ``(?i:'s|'t|'re|'ve|'m|'ll|'d)``;
# llama.cpp's explicit ``'[sS]`` form is used here so that Unicode case folding (e.g. U+017F
# LATIN SMALL LETTER LONG S folding to "s") cannot make a difference.
#
# qwen35 differs from qwen2 in treating combining marks (\p{M}) like letters: they join letter
# runs and are excluded from the punctuation run.
PRE_TOKENIZER_REGEXES: dict[str, str] = {
    "qwen35": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
        r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
        r"|\p{N}"
        r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+"
        r"|\s+(?!\S)"
        r"|\s+"
    ),
    "qwen2": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
        r"|[^\r\n\p{L}\p{N}]?\p{L}+"
        r"|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+"
        r"|\s+(?!\S)"
        r"|\s+"
    ),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode-character map used by byte-level BPE."""
    bs = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_UNICODE = bytes_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in _BYTE_TO_UNICODE.items()}


def byte_level_decode(token: str) -> bytes:
    """Bytes of a byte-level BPE token; a token holding a character outside GPT-2's byte
    alphabet is returned as its own UTF-8 (what HF's ByteLevel decoder does)."""
    try:
        return bytes(_UNICODE_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


def _tokenizer_json(
    regex: str, vocab: dict[str, int], merges: list[list[str]], added_tokens: list[dict]
) -> dict:
    """The HF tokenizer.json equivalent of llama.cpp's gpt2-model tokenizer."""
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_tokens,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": regex},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": False,
                    "use_regex": False,
                },
            ],
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": False,
            "use_regex": False,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": merges,
        },
    }


class ByteLevelBPE(NamedTuple):
    """What :func:`build_byte_level_bpe` makes of a GGUF vocabulary."""

    backend: tokenizers.Tokenizer
    vocab: dict[str, int]  # text -> id; a duplicated text maps to its last id
    token_bytes: list[bytes]  # per id: the bytes it decodes to
    special_ids: set[int]  # ids of control tokens


def _merge_pairs(merges: list[str], file: str | None, merges_field: str) -> list[list[str]]:
    """Each ``"a b"`` merge as its pair, split at the first space after the first character (as
    llama.cpp does: a merge may start with a space)."""
    pairs: list[list[str]] = []
    for k, m in enumerate(merges):
        sep = m.find(" ", 1)  # llama.cpp: word.find(' ', 1)
        if sep < 0:
            raise MTPEngineError(
                f"merge {k} ({m!r}) is not of the form 'a b'", file=file, field=merges_field
            )
        pairs.append([m[:sep], m[sep + 1:]])
    return pairs


def _added_tokens(tokens: list[str], token_types: list[int]) -> tuple[list[dict], set[int], list[bytes]]:
    """The control and user-defined tokens as `tokenizers` added tokens (matched literally in the
    input, not normalized, not pre-tokenized, decoded as their own text), the control ids, and every
    id's bytes."""
    added, special_ids, token_bytes = [], set(), []
    for i, (t, tt) in enumerate(zip(tokens, token_types)):
        if tt in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
            added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": tt == TOKEN_TYPE_CONTROL})
            if tt == TOKEN_TYPE_CONTROL:
                special_ids.add(i)
            token_bytes.append(t.encode("utf-8"))
        else:
            token_bytes.append(byte_level_decode(t))
    return added, special_ids, token_bytes


def build_byte_level_bpe(
    regex: str,
    tokens: list[str],
    token_types: list[int],
    merges: list[str],
    *,
    file: str | None,
    merges_field: str,
) -> ByteLevelBPE:
    """The ``tokenizers`` backend of llama.cpp's gpt2-model tokenizer over ``tokens`` (with
    their ``token_types``) and the ``"a b"`` ``merges``, pre-tokenizing with ``regex``.

    Raises MTPEngineError naming ``file`` and ``merges_field`` when a merge is malformed or the
    backend refuses the vocabulary and merges.
    """
    # llama.cpp's token_to_id keeps the last id of a duplicated text; so does this dict.
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab[t] = i
    merge_pairs = _merge_pairs(merges, file, merges_field)
    added_tokens, special_ids, token_bytes = _added_tokens(tokens, token_types)
    spec = _tokenizer_json(regex, vocab, merge_pairs, added_tokens)
    try:
        backend = tokenizers.Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    except Exception as e:  # tokenizers raises a plain Exception for bad merges etc.
        raise MTPEngineError(
            f"cannot build the BPE tokenizer from the vocabulary and merges: {e}",
            file=file,
            field=merges_field,
        ) from e
    return ByteLevelBPE(backend, vocab, token_bytes, special_ids)
