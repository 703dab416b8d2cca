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
    text_to_id = {t: i for i, t in enumerate(token_texts) if t is not None}

    directory = os.path.dirname(os.path.abspath(path))
    config: dict = {}
    config_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise MTPEngineError(f"cannot read tokenizer config: {e}", file=config_path) from e

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
        for text in ("<|im_end|>", "<|endoftext|>"):
            if text in text_to_id:
                eos = text_to_id[text]
                break
    if eos is None:
        raise MTPEngineError("no EOS token configured", file=config_path, field="eos_token")
    bos = token_id("bos_token")
    pad = token_id("pad_token")
    eos_ids = {eos}
    for text in END_TOKENS:
        i = text_to_id.get(text)
        if i is not None and i in special_ids:
            eos_ids.add(i)

    chat_template = config.get("chat_template")
    template_field = "chat_template"
    if isinstance(chat_template, list):  # named templates: take "default"
        named = {d.get("name"): d.get("template") for d in chat_template}
        chat_template = named.get("default")
    if chat_template is None:
        jinja_path = os.path.join(directory, "chat_template.jinja")
        if os.path.exists(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                chat_template = f.read()

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
        chat_template=chat_template,
        source=path,
        template_field=template_field,
    )
