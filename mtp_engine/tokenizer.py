"""Text <-> token ids for Qwen3.5 GGUF models (byte-level BPE), plus chat templates and
streaming detokenization.

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
"""
from __future__ import annotations

import json
import os
from typing import Any, Iterable

import gguf
import tokenizers

from mtp_engine.errors import MTPEngineError

__all__ = [
    "Tokenizer",
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

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type / gguf.TokenType).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

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


def _byte_level_decode(token: str) -> bytes:
    """Bytes of a byte-level BPE token; a token holding a character outside GPT-2's byte
    alphabet is returned as its own UTF-8 (what HF's ByteLevel decoder does)."""
    try:
        return bytes(_UNICODE_TO_BYTE[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


# --------------------------------------------------------------------------------------------
# GGUF metadata access
# --------------------------------------------------------------------------------------------

def _field_types(field: Any) -> list:
    return list(getattr(field, "types", []) or [])


def _read_string(reader: Any, key: str, path: str, *, required: bool) -> str | None:
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise MTPEngineError("required key is missing", file=path or None, field=key)
        return None
    types = _field_types(field)
    if types[:1] != [gguf.GGUFValueType.STRING]:
        raise MTPEngineError(
            f"expected a string, found type {[t.name for t in types]}", file=path or None, field=key
        )
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except UnicodeDecodeError as e:
        raise MTPEngineError(f"string is not valid UTF-8 ({e})", file=path or None, field=key) from e


def _read_string_array(reader: Any, key: str, path: str) -> list[str]:
    field = reader.fields.get(key)
    if field is None:
        raise MTPEngineError("required key is missing", file=path or None, field=key)
    types = _field_types(field)
    if types[:2] != [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING]:
        raise MTPEngineError(
            f"expected an array of strings, found type {[t.name for t in types]}",
            file=path or None,
            field=key,
        )
    out = []
    for n, i in enumerate(field.data):
        try:
            out.append(bytes(field.parts[i]).decode("utf-8"))
        except UnicodeDecodeError as e:
            raise MTPEngineError(
                f"element {n} is not valid UTF-8 ({e})", file=path or None, field=key
            ) from e
    return out


_INT_TYPES = {
    gguf.GGUFValueType.UINT8, gguf.GGUFValueType.INT8, gguf.GGUFValueType.UINT16,
    gguf.GGUFValueType.INT16, gguf.GGUFValueType.UINT32, gguf.GGUFValueType.INT32,
    gguf.GGUFValueType.UINT64, gguf.GGUFValueType.INT64,
}


def _read_int_array(reader: Any, key: str, path: str) -> list[int]:
    field = reader.fields.get(key)
    if field is None:
        raise MTPEngineError("required key is missing", file=path or None, field=key)
    types = _field_types(field)
    if len(types) < 2 or types[0] != gguf.GGUFValueType.ARRAY or types[1] not in _INT_TYPES:
        raise MTPEngineError(
            f"expected an array of integers, found type {[t.name for t in types]}",
            file=path or None,
            field=key,
        )
    return [int(field.parts[i][0]) for i in field.data]


def _read_scalar(reader: Any, key: str, path: str, kind: str) -> int | bool | None:
    """An optional integer (kind 'int') or boolean (kind 'bool') scalar; None when absent."""
    field = reader.fields.get(key)
    if field is None:
        return None
    types = _field_types(field)
    if kind == "bool":
        ok = types == [gguf.GGUFValueType.BOOL]
    else:
        ok = len(types) == 1 and types[0] in _INT_TYPES
    if not ok:
        raise MTPEngineError(
            f"expected a scalar {kind}, found type {[t.name for t in types]}",
            file=path or None,
            field=key,
        )
    value = field.parts[field.data[0]][0]
    return bool(value) if kind == "bool" else int(value)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

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

    # ---------------------------------------------------------------------------- builders

    @classmethod
    def from_gguf(cls, reader: gguf.GGUFReader, path: str = "") -> "Tokenizer":
        """Build the tokenizer from a GGUF file's ``tokenizer.*`` metadata.

        ``reader`` is a ``gguf.GGUFReader`` (anything with a ``fields`` mapping of
        ``gguf.ReaderField`` works); ``path`` is only used in error messages.

        Raises MTPEngineError, naming the file and key, when a required key
        (``tokenizer.ggml.model``, ``.pre``, ``.tokens``, ``.merges``, ``.token_type``,
        ``.eos_token_id``) is missing or malformed, when the model is not ``gpt2`` (byte-level
        BPE), or when the pre-tokenizer is not one of :data:`PRE_TOKENIZER_REGEXES`.
        """
        file = path or None
        model = _read_string(reader, _KEY_MODEL, path, required=True)
        if model != "gpt2":
            raise MTPEngineError(
                f"unsupported tokenizer model {model!r}; expected 'gpt2' (byte-level BPE)",
                file=file,
                field=_KEY_MODEL,
            )
        pre = _read_string(reader, _KEY_PRE, path, required=True)
        if pre not in PRE_TOKENIZER_REGEXES:
            raise MTPEngineError(
                f"unsupported pre-tokenizer {pre!r}; expected one of {sorted(PRE_TOKENIZER_REGEXES)}",
                file=file,
                field=_KEY_PRE,
            )
        tokens = _read_string_array(reader, _KEY_TOKENS, path)
        if not tokens:
            raise MTPEngineError("the vocabulary is empty", file=file, field=_KEY_TOKENS)
        merges = _read_string_array(reader, _KEY_MERGES, path)
        token_types = _read_int_array(reader, _KEY_TOKEN_TYPE, path)
        if len(token_types) != len(tokens):
            raise MTPEngineError(
                f"expected {len(tokens)} entries (one per token), found {len(token_types)}",
                file=file,
                field=_KEY_TOKEN_TYPE,
            )
        n = len(tokens)

        def check_id(key: str, value: int | None) -> int | None:
            if value is not None and not 0 <= value < n:
                raise MTPEngineError(
                    f"token id {value} is outside the vocabulary [0, {n})", file=file, field=key
                )
            return value

        eos = _read_scalar(reader, _KEY_EOS, path, "int")
        if eos is None:
            raise MTPEngineError("required key is missing", file=file, field=_KEY_EOS)
        eos = check_id(_KEY_EOS, eos)
        bos = check_id(_KEY_BOS, _read_scalar(reader, _KEY_BOS, path, "int"))
        eot = check_id(_KEY_EOT, _read_scalar(reader, _KEY_EOT, path, "int"))
        pad = check_id(_KEY_PAD, _read_scalar(reader, _KEY_PAD, path, "int"))
        add_bos = _read_scalar(reader, _KEY_ADD_BOS, path, "bool")
        chat_template = _read_string(reader, _KEY_CHAT_TEMPLATE, path, required=False)

        # Vocabulary for the BPE model. llama.cpp's token_to_id keeps the last id of a
        # duplicated text; so does this dict.
        vocab: dict[str, int] = {}
        for i, t in enumerate(tokens):
            vocab[t] = i
        merge_pairs: list[list[str]] = []
        for k, m in enumerate(merges):
            sep = m.find(" ", 1)  # llama.cpp: word.find(' ', 1)
            if sep < 0:
                raise MTPEngineError(
                    f"merge {k} ({m!r}) is not of the form 'a b'", file=file, field=_KEY_MERGES
                )
            merge_pairs.append([m[:sep], m[sep + 1:]])

        added_tokens = []
        special_ids: set[int] = set()
        token_bytes: list[bytes] = []
        for i, (t, tt) in enumerate(zip(tokens, token_types)):
            if tt in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
                # Matched literally in the input (not normalized, not pre-tokenized) and
                # decoded as its own text.
                added_tokens.append(
                    {
                        "id": i,
                        "content": t,
                        "single_word": False,
                        "lstrip": False,
                        "rstrip": False,
                        "normalized": False,
                        "special": tt == TOKEN_TYPE_CONTROL,
                    }
                )
                if tt == TOKEN_TYPE_CONTROL:
                    special_ids.add(i)
                token_bytes.append(t.encode("utf-8"))
            else:
                token_bytes.append(_byte_level_decode(t))

        spec = _tokenizer_json(PRE_TOKENIZER_REGEXES[pre], vocab, merge_pairs, added_tokens)
        try:
            backend = tokenizers.Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
        except Exception as e:  # tokenizers raises a plain Exception for bad merges etc.
            raise MTPEngineError(
                f"cannot build the BPE tokenizer from the vocabulary and merges: {e}",
                file=file,
                field=_KEY_MERGES,
            ) from e

        eos_ids = {eos}
        if eot is not None:
            eos_ids.add(eot)
        for text in _END_TOKENS:
            i = vocab.get(text)
            if i is not None and token_types[i] == TOKEN_TYPE_CONTROL:
                eos_ids.add(i)

        return cls(
            backend=backend,
            token_bytes=token_bytes,
            token_texts=list(tokens),
            special_ids=special_ids,
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
            token_bytes[i] = _byte_level_decode(t)
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
        if not isinstance(text, str):
            raise MTPEngineError(f"expected a str to encode, found {type(text).__name__}", field="text")
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
            import jinja2

            env = _jinja_env()
            try:
                self._compiled_template = env.from_string(self._chat_template)
            except jinja2.TemplateError as e:
                raise MTPEngineError(
                    f"invalid chat template: {e}", file=self.source or None, field=self._template_field
                ) from e
        return self._compiled_template

    def _special_text(self, token_id: int | None) -> str:
        if token_id is None:
            return ""
        return self._token_bytes[token_id].decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with the chat
        template into prompt text (to be passed to :meth:`encode`).

        The template runs in a sandboxed Jinja environment (trim_blocks, lstrip_blocks, as in
        transformers) with the variables ``messages``, ``add_generation_prompt``,
        ``bos_token``, ``eos_token`` and any extra keyword arguments (e.g. ``tools``,
        ``enable_thinking``), the helpers ``raise_exception(msg)`` and ``strftime_now(fmt)``
        and a ``tojson`` filter that keeps non-ASCII text.

        Raises MTPEngineError (naming the template key) when there is no template, when it does
        not compile, or when it calls ``raise_exception``.
        """
        import jinja2

        template = self._template()
        variables = dict(kwargs)
        variables.setdefault("bos_token", self._special_text(self.bos_token_id))
        variables.setdefault("eos_token", self._special_text(self.eos_token_id))
        variables.setdefault("pad_token", self._special_text(self.pad_token_id))
        try:
            return template.render(
                messages=messages, add_generation_prompt=add_generation_prompt, **variables
            )
        except _TemplateRaised as e:
            raise MTPEngineError(
                f"chat template refused the input: {e}",
                file=self.source or None,
                field=self._template_field,
            ) from e
        except jinja2.TemplateError as e:
            raise MTPEngineError(
                f"chat template failed: {e}", file=self.source or None, field=self._template_field
            ) from e


class _TemplateRaised(Exception):
    """raise_exception() called from a chat template."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def _jinja_env() -> Any:
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


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


# --------------------------------------------------------------------------------------------
# Streaming detokenizer
# --------------------------------------------------------------------------------------------

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


class StreamingDetokenizer:
    """Incremental decoding of generated tokens.

    :meth:`add` returns the text that became complete with one more token, holding back the
    bytes of a UTF-8 character that a token ended in the middle of; :meth:`flush` returns the
    rest. Concatenating every ``add`` result and ``flush()`` gives ``Tokenizer.decode`` of all
    the ids. Work per token is proportional to the token's length.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False) -> None:
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
