"""A tokenizer's parts from a GGUF file's ``tokenizer.ggml.*`` metadata, built the way llama.cpp
builds its vocabulary (see :mod:`mtp_engine.tokenizer.tokenizer` for the pipeline they make)."""
from __future__ import annotations

from typing import Any

import gguf

from mtp_engine.errors import MTPEngineError
from mtp_engine.gguf.fields import read_int_array, read_scalar, read_string, read_string_array
from mtp_engine.tokenizer.bpe import PRE_TOKENIZER_REGEXES, TOKEN_TYPE_CONTROL, build_byte_level_bpe, check_vocabulary

KEY_MODEL = "tokenizer.ggml.model"
KEY_PRE = "tokenizer.ggml.pre"
KEY_TOKENS = "tokenizer.ggml.tokens"
KEY_MERGES = "tokenizer.ggml.merges"
KEY_TOKEN_TYPE = "tokenizer.ggml.token_type"
KEY_EOS = "tokenizer.ggml.eos_token_id"
KEY_BOS = "tokenizer.ggml.bos_token_id"
KEY_EOT = "tokenizer.ggml.eot_token_id"
KEY_PAD = "tokenizer.ggml.padding_token_id"
KEY_ADD_BOS = "tokenizer.ggml.add_bos_token"
KEY_CHAT_TEMPLATE = "tokenizer.chat_template"

# Control tokens that end a turn / a document in Qwen chat models, added to eos_token_ids.
END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def _embedding_rows(reader: Any) -> int | None:
    """Rows of the GGUF's token embedding (GGUF dims are [hidden, rows]); None without one."""
    for t in getattr(reader, "tensors", None) or []:
        if t.name == "token_embd.weight" and len(t.shape) >= 2:
            return int(t.shape[1])
    return None


def tokenizer_parts_from_gguf(reader: gguf.GGUFReader, path: str = "") -> dict[str, Any]:
    """The `Tokenizer` constructor's arguments from a GGUF file's ``tokenizer.*`` metadata.

    ``reader`` is a ``gguf.GGUFReader`` (anything with a ``fields`` mapping of
    ``gguf.ReaderField`` works); ``path`` is only used in error messages.

    Raises MTPEngineError, naming the file and key, when a required key
    (``tokenizer.ggml.model``, ``.pre``, ``.tokens``, ``.merges``, ``.token_type``,
    ``.eos_token_id``) is missing or malformed, when the model is not ``gpt2`` (byte-level
    BPE), when the pre-tokenizer is not one of :data:`PRE_TOKENIZER_REGEXES`, or when the
    vocabulary has more tokens than the file's ``token_embd.weight`` has rows.
    """
    file = path or None
    pre, tokens, token_types, merges = _vocabulary(reader, path)
    n = len(tokens)

    def check_id(key: str, value: int | None) -> int | None:
        if value is not None and not 0 <= value < n:
            raise MTPEngineError(
                f"token id {value} is outside the vocabulary [0, {n})", file=file, field=key
            )
        return value

    eos = read_scalar(reader, KEY_EOS, path, "int")
    if eos is None:
        raise MTPEngineError("required key is missing", file=file, field=KEY_EOS)
    eos = check_id(KEY_EOS, eos)
    bos = check_id(KEY_BOS, read_scalar(reader, KEY_BOS, path, "int"))
    eot = check_id(KEY_EOT, read_scalar(reader, KEY_EOT, path, "int"))
    pad = check_id(KEY_PAD, read_scalar(reader, KEY_PAD, path, "int"))
    add_bos = read_scalar(reader, KEY_ADD_BOS, path, "bool")
    chat_template = read_string(reader, KEY_CHAT_TEMPLATE, path, required=False)

    bpe = build_byte_level_bpe(
        PRE_TOKENIZER_REGEXES[pre], tokens, token_types, merges,
        file=file, merges_field=KEY_MERGES,
    )
    # EOS, the end-of-turn token, and the control tokens that end a turn in the known templates
    eos_ids = {eos} | ({eot} if eot is not None else set())
    eos_ids |= {bpe.vocab[t] for t in END_TOKENS if t in bpe.vocab and token_types[bpe.vocab[t]] == TOKEN_TYPE_CONTROL}

    return dict(
        backend=bpe.backend,
        token_bytes=bpe.token_bytes,
        token_texts=list(tokens),
        special_ids=bpe.special_ids,
        eos_token_id=eos,
        eos_token_ids=eos_ids,
        bos_token_id=bos,
        add_bos_token=bool(add_bos) and bos is not None,
        pad_token_id=pad,
        chat_template=chat_template,
        source=path,
        template_field=KEY_CHAT_TEMPLATE,
    )


def _vocabulary(reader: gguf.GGUFReader, path: str) -> tuple[str, list[str], list[int], list[str]]:
    """The pre-tokenizer's name, the tokens, their types and the merges, each checked (a byte-level
    BPE, a known pre-tokenizer, one type per token, no more tokens than the embedding has rows)."""
    file = path or None
    model = read_string(reader, KEY_MODEL, path, required=True)
    if model != "gpt2":
        raise MTPEngineError(
            f"unsupported tokenizer model {model!r}; expected 'gpt2' (byte-level BPE)",
            file=file,
            field=KEY_MODEL,
        )
    pre = read_string(reader, KEY_PRE, path, required=True)
    if pre not in PRE_TOKENIZER_REGEXES:
        raise MTPEngineError(
            f"unsupported pre-tokenizer {pre!r}; expected one of {sorted(PRE_TOKENIZER_REGEXES)}",
            file=file,
            field=KEY_PRE,
        )
    tokens = read_string_array(reader, KEY_TOKENS, path)
    if not tokens:
        raise MTPEngineError("the vocabulary is empty", file=file, field=KEY_TOKENS)
    merges = read_string_array(reader, KEY_MERGES, path)
    token_types = read_int_array(reader, KEY_TOKEN_TYPE, path)
    if len(token_types) != len(tokens):
        raise MTPEngineError(
            f"expected {len(tokens)} entries (one per token), found {len(token_types)}",
            file=file,
            field=KEY_TOKEN_TYPE,
        )
    check_vocabulary(tokens, token_types, file=file, tokens_field=KEY_TOKENS, types_field=KEY_TOKEN_TYPE)
    rows = _embedding_rows(reader)
    if rows is not None and len(tokens) > rows:
        # a token id past the embedding table would be looked up out of bounds, silently
        raise MTPEngineError(
            f"the vocabulary has {len(tokens)} tokens but token_embd.weight has only {rows} rows",
            file=file,
            field=KEY_TOKENS,
        )
    return pre, tokens, token_types, merges
