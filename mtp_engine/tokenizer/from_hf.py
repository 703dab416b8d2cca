"""A tokenizer's parts from a Hugging Face ``tokenizer.json`` and the ``tokenizer_config.json`` /
``chat_template.jinja`` beside it (HF checkpoint folders)."""
from __future__ import annotations

import json
import os
from typing import Any

import tokenizers

from mtp_engine.errors import MTPEngineError
from mtp_engine.tokenizer.bpe import byte_level_decode
from mtp_engine.tokenizer.from_gguf import END_TOKENS


def tokenizer_parts_from_hf(path: str) -> dict[str, Any]:
    """The `Tokenizer` constructor's arguments from a Hugging Face ``tokenizer.json``.

    Special-token settings (``eos_token``, ``bos_token``, ``pad_token``, ``add_bos_token``,
    ``chat_template``) come from ``tokenizer_config.json`` next to it when present, and the
    chat template from ``chat_template.jinja`` when the config has none. Without a configured
    EOS token, ``<|im_end|>`` (else ``<|endoftext|>``) is used.
    """
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
        backend = tokenizers.Tokenizer.from_str(json.dumps(spec))
    except Exception as e:  # OSError, JSON errors, tokenizers errors
        raise MTPEngineError(f"cannot read tokenizer: {e}", file=path) from e
    token_bytes, token_texts, special_ids = _vocabulary(spec, path)
    text_to_id = {t: i for i, t in enumerate(token_texts) if t is not None}
    directory = os.path.dirname(os.path.abspath(path))
    config, config_path = _config(directory)
    eos, eos_ids, bos, pad = _special_tokens(config, config_path, text_to_id, special_ids)
    return dict(
        backend=backend,
        token_bytes=token_bytes,
        token_texts=token_texts,
        special_ids=special_ids,
        eos_token_id=eos,
        eos_token_ids=eos_ids,
        bos_token_id=bos,
        add_bos_token=bool(config.get("add_bos_token", False)) and bos is not None,
        pad_token_id=pad,
        chat_template=_chat_template(config, directory),
        source=path,
        template_field="chat_template",
    )


def _vocabulary(spec: dict, path: str) -> tuple[list[bytes], list[str | None], set[int]]:
    """Each id's bytes and text (byte-level BPE pieces decoded; added tokens as written) and the
    ids of the special added tokens."""
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise MTPEngineError(
            f"unsupported tokenizer model type {model.get('type')!r}; expected 'BPE'",
            file=path,
            field="model.type",
        )
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = spec.get("added_tokens") or []
    ids = list(vocab.values()) + [a["id"] for a in added]
    if not ids:
        raise MTPEngineError("the vocabulary is empty", file=path, field="model.vocab")
    n = max(ids) + 1
    token_bytes: list[bytes] = [b""] * n
    token_texts: list[str | None] = [None] * n
    for t, i in vocab.items():
        token_bytes[i] = byte_level_decode(t)
        token_texts[i] = t
    special_ids: set[int] = set()
    for a in added:
        token_bytes[a["id"]] = a["content"].encode("utf-8")
        token_texts[a["id"]] = a["content"]
        if a.get("special"):
            special_ids.add(a["id"])
    return token_bytes, token_texts, special_ids


def _config(directory: str) -> tuple[dict, str]:
    """``tokenizer_config.json`` beside the tokenizer ({} when there is none) and its path."""
    config_path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.exists(config_path):
        return {}, config_path
    try:
        with open(config_path, encoding="utf-8") as f:
            return json.load(f), config_path
    except (OSError, ValueError) as e:
        raise MTPEngineError(f"cannot read tokenizer config: {e}", file=config_path) from e


def _special_tokens(config: dict, config_path: str, text_to_id: dict[str, int],
                    special_ids: set[int]) -> tuple[int, set[int], int | None, int | None]:
    """EOS (configured, else ``<|im_end|>`` or ``<|endoftext|>``), every id that ends a turn, BOS
    and PAD."""
    def token_id(key: str) -> int | None:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if value is None:
            return None
        if value not in text_to_id:
            raise MTPEngineError(
                f"token {value!r} is not in the vocabulary", file=config_path, field=key
            )
        return text_to_id[value]

    eos = token_id("eos_token")
    if eos is None:
        eos = next((text_to_id[t] for t in ("<|im_end|>", "<|endoftext|>") if t in text_to_id), None)
    if eos is None:
        raise MTPEngineError("no EOS token configured", file=config_path, field="eos_token")
    eos_ids = {eos} | {text_to_id[t] for t in END_TOKENS if text_to_id.get(t) in special_ids}
    return eos, eos_ids, token_id("bos_token"), token_id("pad_token")


def _chat_template(config: dict, directory: str) -> str | None:
    """The config's template (of named ones, "default"), else ``chat_template.jinja`` beside it."""
    chat_template = config.get("chat_template")
    if isinstance(chat_template, list):  # named templates: take "default"
        named = {d.get("name"): d.get("template") for d in chat_template}
        chat_template = named.get("default")
    if chat_template is None:
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                chat_template = f.read()
    return chat_template
