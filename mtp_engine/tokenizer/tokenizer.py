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

The pieces live in their own modules: the BPE backend in :mod:`mtp_engine.tokenizer.bpe`, chat templates in
:mod:`mtp_engine.chat.template`, streaming detokenization in :mod:`mtp_engine.tokenizer.detokenizer`, the
builders from GGUF metadata and from ``tokenizer.json`` in :mod:`mtp_engine.tokenizer.from_gguf` and
:mod:`mtp_engine.tokenizer.from_hf`; their public names are re-exported here so that callers need only
this module.
"""
from __future__ import annotations

from typing import Any, Iterable

import gguf
import tokenizers

from mtp_engine.chat.template import RenderLimits, compile_chat_template, render_chat_template
from mtp_engine.errors import MTPEngineError
from mtp_engine.text_input import check_text
from mtp_engine.tokenizer.bpe import (
    MAX_TOKEN_BYTES, PRE_TOKENIZER_REGEXES, TOKEN_TYPE_BYTE, TOKEN_TYPE_CONTROL, TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED, TOKEN_TYPE_USER_DEFINED, bytes_to_unicode,
)
from mtp_engine.tokenizer.detokenizer import StreamingDetokenizer
from mtp_engine.tokenizer.from_gguf import KEY_CHAT_TEMPLATE, tokenizer_parts_from_gguf
from mtp_engine.tokenizer.from_hf import tokenizer_parts_from_hf

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
        template_field: str = KEY_CHAT_TEMPLATE,
    ) -> None:
        """Low-level constructor; use :meth:`from_gguf` or :meth:`from_hf_file`."""
        self._backend = backend
        self.grammar_views: dict = {}  # vocabulary size -> a grammar engine's view of it (`constraint`)
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
        # bounds for mtp_engine.tokenizer.bounded: the most bytes one token stands for, and the special
        # tokens whose text could span a cut before a space
        self.max_token_bytes: int = max((len(b) for b in token_bytes), default=1)
        # (byte-level vocabulary entries spell a space "Ġ": a literal space marks an added token)
        self.spaced_special_texts: list[str] = [t for t in token_texts if t and len(t) > 1 and " " in t]

    # ---------------------------------------------------------------------------- builders

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader, path: str = "") -> "Tokenizer":
        """Build the tokenizer from a GGUF file's ``tokenizer.*`` metadata (see
        :func:`mtp_engine.tokenizer.from_gguf.tokenizer_parts_from_gguf` for what is checked)."""
        return cls(**tokenizer_parts_from_gguf(reader, path))

    @classmethod
    def from_hf_file(cls, path: str) -> "Tokenizer":
        """Build the tokenizer from a Hugging Face ``tokenizer.json`` (for HF checkpoints; see
        :func:`mtp_engine.tokenizer.from_hf.tokenizer_parts_from_hf` for where each setting comes from)."""
        return cls(**tokenizer_parts_from_hf(path))


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
    def backend(self) -> tokenizers.Tokenizer:
        """The `tokenizers` tokenizer underneath (its JSON is what grammar engines read)."""
        return self._backend

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
        render_limits: RenderLimits | None = None, template: str | None = None, **kwargs: Any
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

        ``template``: a template text used instead of the model's (a request's fallback, such as
        ChatML for a model that has none).

        Raises MTPEngineError (naming the template key) when there is no template, when it does
        not compile, when it calls ``raise_exception``, goes past its limits or fails in any way.
        """
        field = "chat template" if template is not None else self._template_field
        if template is not None:  # compiled once per text (compile_chat_template's cache)
            template = compile_chat_template(template, file=None, field=field)
        else:
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
            file=(self.source or None) if field == self._template_field else None,
            field=field,
            limits=render_limits,
        )
