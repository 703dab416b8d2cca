"""Text <-> token ids for Qwen3.5 GGUF models (byte-level BPE).

The tokenizer is built from the GGUF's own ``tokenizer.ggml.*`` metadata, the way llama.cpp
builds it, and run through the Hugging Face ``tokenizers`` library (which provides the Unicode
regex engine the pre-tokenizer needs):

* normalizer: NFC;
* special tokens: every ``control`` (type 3) and ``user-defined`` (type 4) token is matched
  literally in the input text before anything else (llama.cpp's ``parse_special = true``);
* pre-tokenizer: ``Split`` with the llama.cpp regex of ``tokenizer.ggml.pre`` (``qwen35`` or
  ``qwen2``), behaviour "isolated", then ``ByteLevel`` (no prefix space, no regex of its own);
* model: BPE over the GGUF vocabulary (GPT-2 byte-to-unicode form) with the GGUF merge ranks;
* decoding: byte-level for normal tokens, the literal UTF-8 text for control and user-defined
  tokens (what ``llama_token_to_piece(..., special=true)`` and HF's ``decode`` give).

llama.cpp itself does not NFC-normalise its input; for NFC input (almost all text) the two agree.

The pieces live in their own modules: the BPE backend in :mod:`mtp_engine.bpe`, chat templates in
:mod:`mtp_engine.chat_template`, streaming detokenization in :mod:`mtp_engine.detokenizer`; their
public names are re-exported here so that callers need only this module.
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

import gguf
import tokenizers

from mtp_engine.bpe import (
    MAX_TOKEN_BYTES,
    PRE_TOKENIZER_REGEXES,
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED,
    TOKEN_TYPE_USER_DEFINED,
    byte_level_decode,
    build_byte_level_bpe,
    bytes_to_unicode,
    check_vocabulary,
)
from mtp_engine.chat_template import RenderLimits, compile_chat_template, render_chat_template
from mtp_engine.detokenizer import StreamingDetokenizer
from mtp_engine.errors import MTPEngineError
from mtp_engine.text_input import check_text
from mtp_engine.gguf.fields import read_int_array, read_scalar, read_string, read_string_array

__all__ = [
    "Tokenizer",
    "MAX_TOKEN_BYTES",
    "StreamingDetokenizer",
    "PRE_TOKENIZER_REGEXES",
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_BYTE",
    "bytes_to_unicode",
]

_KEY_MODEL = "tokenizer.ggml.model"
_KEY_PRE = "tokenizer.ggml.pre"
_KEY_TOKENS = "tokenizer.ggml.tokens"
_KEY_MERGES = "tokenizer.ggml.merges"
_KEY_TOKEN_TYPE = "tokenizer.ggml.token_type"
_KEY_EOS = "tokenizer.ggml.eos_token_id"
_KEY_BOS = "tokenizer.ggml.bos_token_id"
_KEY_EOT = "tokenizer.ggml.eot_token_id"
_KEY_PAD = "tokenizer.ggml.padding_token_id"
_KEY_ADD_BOS = "tokenizer.ggml.add_bos_token"
_KEY_CHAT_TEMPLATE = "tokenizer.chat_template"

# Control tokens that end a turn / a document in Qwen chat models, added to eos_token_ids.
_END_TOKENS = ("<|im_end|>", "<|endoftext|>")


def _embedding_rows(reader: Any) -> int | None:
    """Rows of the GGUF's token embedding (GGUF dims are [hidden, rows]); None without one."""
    for t in getattr(reader, "tensors", None) or []:
        if t.name == "token_embd.weight" and len(t.shape) >= 2:
            return int(t.shape[1])
    return None


class Tokenizer:
    """Byte-level BPE tokenizer of a Qwen3.5 model.

    Build it with :meth:`from_gguf` (from a GGUF's metadata alone) or :meth:`from_hf_file`
    (from a Hugging Face ``tokenizer.json``). Attributes:

    * ``eos_token_id``: the model's end-of-sequence id.
    * ``eos_token_ids``: every id that ends generation: ``eos_token_id``, the end-of-turn id when
      the GGUF has one, and ``<|im_end|>`` / ``<|endoftext|>`` when present as control tokens.
    * ``bos_token_id`` (or None), ``add_bos_token``, ``pad_token_id`` (or None).
    * ``vocab_size``: number of token ids (the length of ``tokenizer.ggml.tokens``).
    * ``chat_template``: the Jinja chat template, or None. It may be assigned.
    """

    def __init__(
        self,
        *,
        backend: tokenizers.Tokenizer,
        token_bytes: list[bytes],
        token_texts: list[str | None],
        special_ids: set[int],
        eos_token_id: int,
        eos_token_ids: set[int],
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        source: str = "",
        template_field: str = _KEY_CHAT_TEMPLATE,
    ) -> None:
        """Low-level constructor; use :meth:`from_gguf` or :meth:`from_hf_file`."""
        self._backend = backend
        self._token_bytes = token_bytes
        self._token_texts = token_texts
        self._special_ids = frozenset(special_ids)
        self.vocab_size: int = len(token_bytes)
        self.eos_token_id: int = eos_token_id
        self.eos_token_ids: set[int] = set(eos_token_ids)
        self.bos_token_id: int | None = bos_token_id
        self.add_bos_token: bool = add_bos_token
        self.pad_token_id: int | None = pad_token_id
        self.source: str = source
        self._template_field = template_field
        self._chat_template: str | None = chat_template
        self._compiled_template: Any = None
        # bounds for mtp_engine.prompt_encode: the most bytes one token stands for, and the special
        # tokens whose text could span a cut before a space
        self.max_token_bytes: int = max((len(b) for b in token_bytes), default=1)
        # (byte-level vocabulary entries spell a space "Ġ": a literal space marks an added token)
        self.spaced_special_texts: list[str] = [t for t in token_texts if t and len(t) > 1 and " " in t]

    # ---------------------------------------------------------------------------- builders

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader, path: str = "") -> "Tokenizer":
        """Build the tokenizer from a GGUF file's ``tokenizer.*`` metadata.

        ``reader`` is a ``gguf.GGUFReader`` (anything with a ``fields`` mapping of
        ``gguf.ReaderField`` works); ``path`` is only used in error messages.

        Raises MTPEngineError, naming the file and key, when a required key
        (``tokenizer.ggml.model``, ``.pre``, ``.tokens``, ``.merges``, ``.token_type``,
        ``.eos_token_id``) is missing or malformed, when the model is not ``gpt2`` (byte-level
        BPE), when the pre-tokenizer is not one of :data:`PRE_TOKENIZER_REGEXES`, or when the
        vocabulary has more tokens than the file's ``token_embd.weight`` has rows.
        """
        file = path or None
        model = read_string(reader, _KEY_MODEL, path, required=True)
        if model != "gpt2":
            raise MTPEngineError(
                f"unsupported tokenizer model {model!r}; expected 'gpt2' (byte-level BPE)",
                file=file,
                field=_KEY_MODEL,
            )
        pre = read_string(reader, _KEY_PRE, path, required=True)
        if pre not in PRE_TOKENIZER_REGEXES:
            raise MTPEngineError(
                f"unsupported pre-tokenizer {pre!r}; expected one of {sorted(PRE_TOKENIZER_REGEXES)}",
                file=file,
                field=_KEY_PRE,
            )
        tokens = read_string_array(reader, _KEY_TOKENS, path)
        if not tokens:
            raise MTPEngineError("the vocabulary is empty", file=file, field=_KEY_TOKENS)
        merges = read_string_array(reader, _KEY_MERGES, path)
        token_types = read_int_array(reader, _KEY_TOKEN_TYPE, path)
        if len(token_types) != len(tokens):
            raise MTPEngineError(
                f"expected {len(tokens)} entries (one per token), found {len(token_types)}",
                file=file,
                field=_KEY_TOKEN_TYPE,
            )
        check_vocabulary(tokens, token_types, file=file, tokens_field=_KEY_TOKENS, types_field=_KEY_TOKEN_TYPE)
        n = len(tokens)
        rows = _embedding_rows(reader)
        if rows is not None and n > rows:
            # a token id past the embedding table would be looked up out of bounds, silently
            raise MTPEngineError(
                f"the vocabulary has {n} tokens but token_embd.weight has only {rows} rows",
                file=file,
                field=_KEY_TOKENS,
            )

        def check_id(key: str, value: int | None) -> int | None:
            if value is not None and not 0 <= value < n:
                raise MTPEngineError(
                    f"token id {value} is outside the vocabulary [0, {n})", file=file, field=key
                )
            return value

        eos = read_scalar(reader, _KEY_EOS, path, "int")
        if eos is None:
            raise MTPEngineError("required key is missing", file=file, field=_KEY_EOS)
        eos = check_id(_KEY_EOS, eos)
        bos = check_id(_KEY_BOS, read_scalar(reader, _KEY_BOS, path, "int"))
        eot = check_id(_KEY_EOT, read_scalar(reader, _KEY_EOT, path, "int"))
        pad = check_id(_KEY_PAD, read_scalar(reader, _KEY_PAD, path, "int"))
        add_bos = read_scalar(reader, _KEY_ADD_BOS, path, "bool")
        chat_template = read_string(reader, _KEY_CHAT_TEMPLATE, path, required=False)

        bpe = build_byte_level_bpe(
            PRE_TOKENIZER_REGEXES[pre], tokens, token_types, merges,
            file=file, merges_field=_KEY_MERGES,
        )

        eos_ids = {eos}
        if eot is not None:
            eos_ids.add(eot)
        for text in _END_TOKENS:
            i = bpe.vocab.get(text)
            if i is not None and token_types[i] == TOKEN_TYPE_CONTROL:
                eos_ids.add(i)

        return cls(
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
            template_field=_KEY_CHAT_TEMPLATE,
        )

    @classmethod
    def from_hf_file(cls, path: str) -> "Tokenizer":
        """Build the tokenizer from a Hugging Face ``tokenizer.json`` (for HF checkpoints).

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
        for text in _END_TOKENS:
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

        return cls(
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

    # ---------------------------------------------------------------------------- encode/decode

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``. Control and user-defined tokens written literally in the
        text (e.g. ``<|im_start|>``) become their ids. A BOS id is prepended only when the
        model asks for it (``add_bos_token`` true and a BOS id exists)."""
        check_text(text, "text")  # a lone surrogate would make the backend raise a bare TypeError
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id] + ids
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes that token ``token_id`` stands for (control tokens: their own text)."""
        if not 0 <= token_id < self.vocab_size:
            raise MTPEngineError(
                f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})",
                file=self.source or None,
                field="token_id",
            )
        return self._token_bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        """True for control (special) tokens such as ``<|im_end|>``."""
        return token_id in self._special_ids

    def token_to_id(self, text: str) -> int | None:
        """Id of the vocabulary entry spelled ``text`` (byte-level form for normal tokens,
        literal text for control tokens), or None."""
        return self._backend.token_to_id(text)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of ``token_id`` as stored (byte-level form for normal tokens)."""
        self.token_bytes(token_id)  # range check
        return self._token_texts[token_id]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of a sequence of token ids; invalid UTF-8 is replaced with U+FFFD.

        Control tokens decode to their literal text unless ``skip_special_tokens``."""
        tb = self._token_bytes
        n = self.vocab_size
        parts = []
        for i in ids:
            i = int(i)
            if not 0 <= i < n:
                raise MTPEngineError(
                    f"token id {i} is outside the vocabulary [0, {n})",
                    file=self.source or None,
                    field="ids",
                )
            if skip_special_tokens and i in self._special_ids:
                continue
            parts.append(tb[i])
        return b"".join(parts).decode("utf-8", errors="replace")

    def detokenizer(self, skip_special_tokens: bool = False) -> "StreamingDetokenizer":
        """A new :class:`StreamingDetokenizer` for one generated sequence."""
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)

    # ---------------------------------------------------------------------------- chat template

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template (``tokenizer.chat_template``), or None."""
        return self._chat_template

    @chat_template.setter
    def chat_template(self, value: str | None) -> None:
        self._chat_template = value
        self._compiled_template = None

    def _template(self) -> Any:
        if self._chat_template is None:
            raise MTPEngineError(
                "the model has no chat template", file=self.source or None, field=self._template_field
            )
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(
                self._chat_template, file=self.source or None, field=self._template_field
            )
        return self._compiled_template

    def _special_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._token_bytes[token_id].decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, *,
        render_limits: RenderLimits | None = None, **kwargs: Any
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat
        template into prompt text (to be passed to :meth:`encode`).

        The template runs in a sandboxed Jinja environment (trim_blocks, lstrip_blocks, as in
        transformers) with the variables ``messages``, ``add_generation_prompt``,
        ``bos_token``, ``eos_token`` and any extra keyword arguments (e.g. ``tools``,
        ``enable_thinking``), the helpers ``raise_exception(msg)`` and ``strftime_now(fmt)``
        and a ``tojson`` filter that keeps non-ASCII text.

        The render runs under ``render_limits`` (default :class:`RenderLimits`: loop iterations
        and calls, characters produced, wall-clock seconds).

        Raises MTPEngineError (naming the template key) when there is no template, when it does
        not compile, when it calls ``raise_exception``, goes past its limits or fails in any way.
        """
        template = self._template()
        variables = dict(kwargs)
        variables.setdefault("bos_token", self._special_text(self.bos_token_id))
        variables.setdefault("eos_token", self._special_text(self.eos_token_id))
        variables.setdefault("pad_token", self._special_text(self.pad_token_id))
        return render_chat_template(
            template,
            messages,
            add_generation_prompt,
            variables,
            file=self.source or None,
            field=self._template_field,
            limits=render_limits,
        )
