"""Tests for mtp_engine.tokenizer.tokenizer: ids against llama.cpp and the HF tokenizer, decoding,
streaming detokenization, chat templates and errors."""
from __future__ import annotations

import glob
import json
import os
import types
import unicodedata

import gguf
import numpy as np
import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import HF_TINY, TINY_TOKENIZER, TRAINED_GGUF, fixtures_dir
from mtp_engine.errors import MTPEngineError
from mtp_engine.tokenizer.tokenizer import StreamingDetokenizer, Tokenizer

FIXTURES = str(fixtures_dir())
TINY_GGUF = str(TINY_TOKENIZER)
TINY_REF = TINY_GGUF + ".ref.json"
TINY_HF = str(HF_TINY / "tokenizer.json")
CODE_GGUF = str(TRAINED_GGUF)
CODE_PROMPTS = f"{FIXTURES}/trained/prompts.json"
CODE_HF = f"{FIXTURES}/trained/hf/tokenizer.json"

TRICKY = [
    "",
    " ",
    "a",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x**2  # square\n\n\nclass A(B):\n\tpass\r\n",
    "if (a && b) { return c->d[0]; } else {x += 1;}",
    "    leading spaces and trailing spaces    ",
    "tabs\t\tand\n\n\nnewlines\r\n\r\nmixed \n \n",
    "   \n   \n",
    "don't, can't, I'm, you're, we've, they'll, he'd, IT'S, DON'T, It'S",
    "1234567890 3.14159 1e-10 0x1F 1,000,000",
    "你好，世界！今天是2026年8月13日",
    "日本語のテキストとカタカナ、ひらがな。",
    "한국어 텍스트",
    "Emoji: 🎉🚀👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "Ελληνικά, русский, العربية, עברית, हिन्दी, ไทย",
    "caf\u00e9 vs cafe\u0301 (NFC folds them together)",
    "x\u0301y z\u0308\u0323 combining marks",
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_start|><|im_end|><|endoftext|>",
    "not special: <|im_start |> <im_end> <|unknown|>",
    "___init___ __main__ ...!!!??? ---===+++",
    "'quoted' \"double\" `back` ‘curly’ “curly”",
    "\u00a0non-breaking\u2003em-space\u3000ideographic",
    "zero\u200bwidth\u200djoiner\ufeffbom",
    "control \x00\x01\x1f\x7f chars",
    "mixed123abc456 a1b2c3 ５６７ ①②③",
    "URL: https://example.com/path?q=1&r=2#frag",
    "snake_case camelCase PascalCase kebab-case SCREAMING_CASE",
    "'s 's's ''s ' s",
    "\U0001f600\U0001f601 \U0010ffff \ue000",
]


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(TINY_GGUF), TINY_GGUF)


@pytest.fixture(scope="module")
def code() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(CODE_GGUF), CODE_GGUF)


@pytest.fixture(scope="module")
def shipped() -> Tokenizer:
    """The tokenizer of the model shipped in `models/`."""
    from mtp_engine.api import default_model_path

    path = str(default_model_path())
    return Tokenizer.from_gguf(gguf.GGUFReader(path), path)


@pytest.fixture(scope="module")
def tokenizers_pair(tiny, code):
    """(GGUF tokenizer, reference HF tokenizers.Tokenizer, our from_hf_file tokenizer)."""
    return {
        "tiny": (tiny, tokenizers.Tokenizer.from_file(TINY_HF), Tokenizer.from_hf_file(TINY_HF)),
        "code": (code, tokenizers.Tokenizer.from_file(CODE_HF), Tokenizer.from_hf_file(CODE_HF)),
    }


# ------------------------------------------------------------------------------------ llama.cpp


def test_tiny_prompt_ids_match_llamacpp(tiny):
    ref = json.load(open(TINY_REF))
    assert len(ref["prompts"]) == 4
    for p in ref["prompts"]:
        assert tiny.encode(p["prompt"]) == p["prompt_ids"], p["prompt"]
        # every token's bytes are the piece llama.cpp printed
        assert [tiny.decode([i]) for i in p["prompt_ids"]] == p["prompt_pieces"]
        assert tiny.decode(p["prompt_ids"]) == p["prompt"]


@pytest.mark.parametrize(
    "ref_path", sorted(glob.glob(f"{FIXTURES}/llamacpp/qwen35-mtp-tiny-*.gguf.ref.json"))
)
def test_every_tiny_gguf_matches_llamacpp(ref_path):
    ref = json.load(open(ref_path))
    gguf_path = os.path.join(os.path.dirname(ref_path), ref["file"])
    tok = Tokenizer.from_gguf(gguf.GGUFReader(gguf_path), gguf_path)
    for p in ref["prompts"]:
        assert tok.encode(p["prompt"]) == p["prompt_ids"]
        # the server's generated text is the decoding of its generated ids
        assert tok.decode(p["generated_ids"]) == p["generated_text"]
        for step in p["steps"]:
            for cand in step["top5"]:
                assert tok.token_bytes(cand["id"]) == bytes(cand["bytes"])


def test_code_prompt_ids_match(code):
    prompts = json.load(open(CODE_PROMPTS))["prompts"]
    assert len(prompts) == 5
    for p in prompts:
        assert code.encode(p["prompt"]) == p["token_ids"], p["source"]
        assert code.decode(p["token_ids"]) == p["prompt"]


def test_special_token_ids(tiny, code):
    assert (tiny.eos_token_id, tiny.pad_token_id, tiny.bos_token_id) == (511, 509, None)
    assert tiny.eos_token_ids == {509, 511}
    assert tiny.vocab_size == 512 and not tiny.add_bos_token
    assert code.eos_token_id == 8189 and code.eos_token_ids == {8189, 8191}
    assert code.vocab_size == 8192 and not code.add_bos_token
    assert code.encode("<|im_start|>") == [8190]
    assert code.is_special(8190) and not code.is_special(0)
    assert code.token_to_id("<|im_end|>") == 8191 and code.id_to_token(8191) == "<|im_end|>"


# ------------------------------------------------------------------------------------ HF


@pytest.mark.parametrize("which", ["tiny", "code"])
@pytest.mark.parametrize("text", TRICKY)
def test_matches_hf_tokenizer(tokenizers_pair, which, text):
    ours, ref, from_hf = tokenizers_pair[which]
    expected = ref.encode(text, add_special_tokens=False).ids
    assert ours.encode(text) == expected
    assert from_hf.encode(text) == expected
    assert ours.decode(expected) == ref.decode(expected, skip_special_tokens=False)
    assert from_hf.decode(expected) == ours.decode(expected)


@pytest.mark.parametrize("which", ["tiny", "code"])
def test_hf_file_metadata_matches_gguf(tokenizers_pair, which):
    ours, _, from_hf = tokenizers_pair[which]
    assert from_hf.vocab_size == ours.vocab_size
    assert from_hf.eos_token_ids == ours.eos_token_ids
    assert all(from_hf.token_bytes(i) == ours.token_bytes(i) for i in range(ours.vocab_size))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=60))
def test_matches_hf_tokenizer_random(tokenizers_pair, text):
    ours, ref, _ = tokenizers_pair["code"]
    assert ours.encode(text) == ref.encode(text, add_special_tokens=False).ids


# ------------------------------------------------------------------------------------ decode

# Characters assigned in Python's Unicode database: NFC of a code point unassigned there but
# assigned in the (newer) tables of the tokenizers library could legitimately differ.
ASSIGNED = st.characters(codec="utf-8", exclude_categories=("Cs", "Cn"))


@pytest.mark.parametrize("text", TRICKY)
def test_roundtrip_tricky(code, text):
    assert code.decode(code.encode(text)) == unicodedata.normalize("NFC", text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=ASSIGNED, max_size=80))
def test_roundtrip_random(code, tiny, text):
    nfc = unicodedata.normalize("NFC", text)
    assert code.decode(code.encode(text)) == nfc
    assert tiny.decode(tiny.encode(text)) == nfc


def test_decode_special_and_skip(code):
    ids = code.encode("<|im_start|>hi<|im_end|>")
    assert code.decode(ids) == "<|im_start|>hi<|im_end|>"
    assert code.decode(ids, skip_special_tokens=True) == "hi"


def test_decode_rejects_bad_id(code):
    with pytest.raises(MTPEngineError, match="outside the vocabulary"):
        code.decode([0, code.vocab_size])
    with pytest.raises(MTPEngineError):
        code.detokenizer().add(-1)


# ------------------------------------------------------------------------------------ streaming


def _stream(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    d = tok.detokenizer()
    assert isinstance(d, StreamingDetokenizer)
    return [d.add(i) for i in ids], d.flush()


def test_streaming_splits_multibyte_characters(tiny):
    # The tiny vocabulary has no multi-byte merges: every byte of "é🎉你" is its own token.
    text = "é🎉你a"
    ids = tiny.encode(text)
    assert len(ids) == 2 + 4 + 3 + 1
    pieces, rest = _stream(tiny, ids)
    assert pieces == ["", "é", "", "", "", "🎉", "", "", "你", "a"]
    assert rest == ""


def test_streaming_flush_incomplete(tiny):
    ids = tiny.encode("🎉")[:3]  # three of four bytes
    pieces, rest = _stream(tiny, ids)
    assert pieces == ["", "", ""]
    assert rest == "\ufffd"
    assert tiny.decode(ids) == rest


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.text(
        alphabet=st.one_of(
            ASSIGNED,
            st.sampled_from("é你🎉👍🏽👨‍👩‍👧‍👦한€"),
        ),
        max_size=60,
    )
)
def test_streaming_equals_decode(tiny, code, text):
    for tok in (tiny, code):
        ids = tok.encode(text)
        pieces, rest = _stream(tok, ids)
        assert "".join(pieces) + rest == tok.decode(ids) == unicodedata.normalize("NFC", text)
        assert rest == ""
        # nothing is emitted before its character is complete
        assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(min_value=0, max_value=511), max_size=40))
def test_streaming_equals_decode_arbitrary_ids(tiny, ids):
    # Arbitrary ids give arbitrary (often invalid) UTF-8; the stream must still agree.
    pieces, rest = _stream(tiny, ids)
    assert "".join(pieces) + rest == tiny.decode(ids)


def _decode_stream(tok, ids):
    from tokenizers.decoders import DecodeStream

    ds = DecodeStream(skip_special_tokens=False)
    return [ds.step(tok.backend, i) or "" for i in ids]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.one_of(ASSIGNED, st.sampled_from("é你🎉👍🏽👨‍👩‍👧‍👦한€𝔘━")), max_size=60))
def test_streaming_matches_tokenizers_decode_stream(shipped, text):
    """On valid UTF-8 `tokenizers`' DecodeStream gives the same text, and ours is never behind it:
    after every token, what we emitted so far starts with what DecodeStream emitted so far. (Ours
    may be ahead: DecodeStream holds back a whole token whose text ends inside a character, we
    hold back only that character's bytes.)"""
    ids = shipped.encode(text)
    pieces, rest = _stream(shipped, ids)
    theirs = _decode_stream(shipped, ids)
    assert rest == "" and "".join(pieces) == "".join(theirs)
    ours_so_far = theirs_so_far = ""
    for mine, other in zip(pieces, theirs):
        ours_so_far += mine
        theirs_so_far += other
        assert ours_so_far.startswith(theirs_so_far)


def test_streaming_emits_the_complete_part_of_a_token_early(shipped):
    """' ━' is two tokens, 'Ġ' + two bytes of '━', then its last byte: the space is complete after
    the first token and we emit it then; DecodeStream waits for the second token (found by the
    property test above in CI)."""
    ids = shipped.encode(" ━")
    assert len(ids) == 2
    assert _stream(shipped, ids) == ([" ", "━"], "")
    assert _decode_stream(shipped, ids) == ["", " ━"]


def test_decode_stream_drops_a_truncated_character(shipped, tiny):
    """A generation may stop inside a character (max_tokens after an emoji's first byte token):
    `decode` ends in U+FFFD, our stream's flush gives the same, DecodeStream has no flush and
    loses the bytes. This is why the engine keeps its own streaming detokenizer."""
    ids = tiny.encode("ok 🎉")[:-2]
    pieces, rest = _stream(tiny, ids)
    assert "".join(pieces) + rest == tiny.decode(ids) == "ok \ufffd"
    assert "".join(_decode_stream(tiny, ids)) == "ok "


# ------------------------------------------------------------------------------------ GGUF files

CHATML = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role: ' + message['role']) }}"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _tokenizer_fields(src: str) -> dict:
    r = gguf.GGUFReader(src)
    return {k: f for k, f in r.fields.items() if k.startswith("tokenizer.")}


def _write_gguf(path: str, src: str, drop: tuple = (), override: dict | None = None) -> str:
    """Copy the tokenizer metadata of ``src`` into a tensor-less GGUF at ``path``, without the
    keys in ``drop`` and with string values replaced by ``override``."""
    override = dict(override or {})
    w = gguf.GGUFWriter(path, "qwen35")
    for key, f in _tokenizer_fields(src).items():
        if key in drop or key in override:
            continue
        vtype = f.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = f.types[1]
            if sub == gguf.GGUFValueType.STRING:
                val = [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            else:
                val = [f.parts[i][0].item() for i in f.data]
            w.add_key_value(key, val, vtype, sub_type=sub)
        elif vtype == gguf.GGUFValueType.STRING:
            w.add_key_value(key, bytes(f.parts[f.data[0]]).decode("utf-8"), vtype)
        else:
            w.add_key_value(key, f.parts[f.data[0]][0].item(), vtype)
    for key, value in override.items():
        w.add_key_value(key, value, gguf.GGUFValueType.STRING)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def test_chat_template_from_gguf(tmp_path):
    path = _write_gguf(
        str(tmp_path / "t.gguf"), TINY_GGUF, override={"tokenizer.chat_template": CHATML}
    )
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path), path)
    assert tok.chat_template == CHATML
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("assistant\n")
    ids = tok.encode(text)
    assert ids[0] == 510 and ids.count(511) == 2 and ids.count(510) == 3
    with pytest.raises(MTPEngineError, match="bad role: tool") as e:
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    assert e.value.field == "tokenizer.chat_template"


def test_chat_template_injected_vars(tiny):
    tok = Tokenizer.from_gguf(gguf.GGUFReader(TINY_GGUF), TINY_GGUF)
    tok.chat_template = "{{ bos_token }}|{{ eos_token }}|{{ messages | tojson }}|{{ extra }}"
    out = tok.apply_chat_template([{"role": "user", "content": "é"}], extra=7)
    assert out == '|<|im_end|>|[{"role": "user", "content": "é"}]|7'


def test_chat_template_sandboxed(tiny):
    tok = Tokenizer.from_gguf(gguf.GGUFReader(TINY_GGUF), TINY_GGUF)
    tok.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(MTPEngineError, match="chat template"):
        tok.apply_chat_template([])
    tok.chat_template = "{% if %}"
    with pytest.raises(MTPEngineError, match="invalid chat template"):
        tok.apply_chat_template([])


def test_missing_chat_template_raises(tiny):
    assert tiny.chat_template is None  # the fixture GGUFs carry none
    with pytest.raises(MTPEngineError) as e:
        tiny.apply_chat_template([{"role": "user", "content": "hi"}])
    assert e.value.field == "tokenizer.chat_template"
    assert "tokenizer.chat_template" in str(e.value) and TINY_GGUF in str(e.value)


# ------------------------------------------------------------------------------------ errors


def _fake_reader(drop: str) -> types.SimpleNamespace:
    fields = {k: v for k, v in gguf.GGUFReader(TINY_GGUF).fields.items() if k != drop}
    return types.SimpleNamespace(fields=fields)


@pytest.mark.parametrize(
    "key",
    [
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.token_type",
        "tokenizer.ggml.eos_token_id",
    ],
)
def test_missing_key_names_field(key):
    with pytest.raises(MTPEngineError) as e:
        Tokenizer.from_gguf(_fake_reader(key), "model.gguf")
    assert e.value.field == key and e.value.file == "model.gguf"
    assert key in str(e.value) and "model.gguf" in str(e.value)


def test_unsupported_model(tmp_path):
    path = _write_gguf(str(tmp_path / "m.gguf"), TINY_GGUF, override={"tokenizer.ggml.model": "llama"})
    with pytest.raises(MTPEngineError, match="'llama'") as e:
        Tokenizer.from_gguf(gguf.GGUFReader(path), path)
    assert e.value.field == "tokenizer.ggml.model"


def test_unsupported_pre(tmp_path):
    path = _write_gguf(str(tmp_path / "p.gguf"), TINY_GGUF, override={"tokenizer.ggml.pre": "llama-bpe"})
    with pytest.raises(MTPEngineError, match="llama-bpe") as e:
        Tokenizer.from_gguf(gguf.GGUFReader(path), path)
    assert e.value.field == "tokenizer.ggml.pre"


def test_qwen2_pre_supported(tmp_path, tiny):
    path = _write_gguf(str(tmp_path / "q2.gguf"), TINY_GGUF, override={"tokenizer.ggml.pre": "qwen2"})
    tok = Tokenizer.from_gguf(gguf.GGUFReader(path), path)
    for p in json.load(open(TINY_REF))["prompts"]:
        assert tok.encode(p["prompt"]) == p["prompt_ids"]
    # qwen35 keeps combining marks with their letters; qwen2 splits them off as punctuation
    split35 = [w for w, _ in tiny.backend.pre_tokenizer.pre_tokenize_str("x\u0301y!")]
    split2 = [w for w, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x\u0301y!")]
    assert len(split35) == 2 and len(split2) == 3


def test_wrong_field_type():
    fields = dict(gguf.GGUFReader(TINY_GGUF).fields)
    fields["tokenizer.ggml.tokens"] = fields["tokenizer.ggml.token_type"]
    with pytest.raises(MTPEngineError, match="array of strings") as e:
        Tokenizer.from_gguf(types.SimpleNamespace(fields=fields), "x.gguf")
    assert e.value.field == "tokenizer.ggml.tokens"


def test_eos_out_of_range():
    fields = dict(gguf.GGUFReader(TINY_GGUF).fields)
    eos = fields["tokenizer.ggml.eos_token_id"]
    fields["tokenizer.ggml.eos_token_id"] = gguf.ReaderField(
        offset=0, name=eos.name, parts=[np.array([9999], dtype=np.uint32)], data=[0], types=eos.types
    )
    with pytest.raises(MTPEngineError, match="9999") as e:
        Tokenizer.from_gguf(types.SimpleNamespace(fields=fields), "x.gguf")
    assert e.value.field == "tokenizer.ggml.eos_token_id"


def test_hf_file_missing(tmp_path):
    with pytest.raises(MTPEngineError):
        Tokenizer.from_hf_file(str(tmp_path / "nope.json"))
