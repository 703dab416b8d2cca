"""Hostile text through every entry point: lone surrogates, bytes that are not UTF-8, prompts past
the context, prompt files and standard input, output paths, unexpected errors in the CLI. The
property tests (hypothesis) require that any str / any bytes either generates or ends in the
engine's one error type naming the argument."""
from __future__ import annotations

import io
import os
import re
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import TINY_Q8, TRAINED_GGUF, need, run_cli
from mtp_engine import api
from mtp_engine.cli.main import main
from mtp_engine.errors import MTPEngineError
from mtp_engine.gguf.reader import GGUFFile
from mtp_engine.tokenizer.bounded import encode_prompt
from mtp_engine.text_input import (
    MAX_PROMPT_FILE_BYTES, argv_text, check_messages, check_stop, check_text, decode_utf8, read_prompt_file,
)
from mtp_engine.tokenizer.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])
# any code point, lone surrogates included (hypothesis leaves them out unless asked)
# any code point; one character in 15 a surrogate, so about half the strings hold one
_SURROGATE = st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=())
ANY_TEXT = st.lists(st.integers(0, 14).flatmap(lambda k: _SURROGATE if k == 0 else st.characters(exclude_categories=())),
                    max_size=40).map("".join)


@pytest.fixture(scope="module")
def tiny():
    m = api.load(need(TINY_Q8))
    m.tokenizer.chat_template = CHATML
    return m


# ------------------------------------------------------------------------------------------ units

def test_check_text_names_field_and_index():
    assert check_text("héllo 🙂", "prompt") == "héllo 🙂"
    with pytest.raises(MTPEngineError) as ei:
        check_text("hi\ud800x", "prompt")
    assert ei.value.field == "prompt" and "U+D800 at index 2" in str(ei.value)
    with pytest.raises(MTPEngineError, match="expected a string, found bytes"):
        check_text(b"hi", "prompt")


def test_decode_utf8_names_byte_offset():
    assert decode_utf8("é".encode(), "file") == "é"
    with pytest.raises(MTPEngineError) as ei:
        decode_utf8(b"ab\xc3(", "file", file="p.txt")
    assert "byte c3 at byte offset 2" in str(ei.value) and str(ei.value).startswith("p.txt: file:")


def test_argv_bytes_become_offsets():
    assert argv_text("plain", "prompt") == "plain"
    assert argv_text(os.fsdecode("é".encode()), "prompt") == "é"
    with pytest.raises(MTPEngineError, match="byte ff at byte offset 1"):
        argv_text(os.fsdecode(b"a\xff\xfe b"), "prompt")


def test_stop_and_messages_checked():
    assert check_stop(None) == [] and check_stop("x") == ["x"] and check_stop(("a", "")) == ["a", ""]
    with pytest.raises(MTPEngineError, match=r"stop\[1\]"):
        check_stop(["ok", "bad\udfff"])
    check_messages([{"role": "user", "content": "hi", "tool_calls": [1]}])
    with pytest.raises(MTPEngineError) as ei:
        check_messages([{"role": "user", "content": "ok"}, {"role": "user", "content": "\udc80"}])
    assert ei.value.field == "messages[1].content"


# ------------------------------------------------------------------------------ bounded encoding

@pytest.fixture(scope="module")
def tokenizers_():
    out = []
    for p in (TINY_Q8, TRAINED_GGUF):
        if p.exists():
            gf = GGUFFile(p)
            out.append(Tokenizer.from_gguf(gf.reader, gf.path))
    if not out:
        pytest.skip("no fixture tokenizer")
    return out


PIECES = ["a", "b", "Z", "q7", " ", "  ", "\n", "\n\n", "\t", "\r\n", "9", "é", "e\u0301", "\u1100\u1161\u11a8",
          "漢字", "<|im_start|>", "<|im_end|>", "'s", "'LL", "!", "...", "def", " x", "🙂", "\u00a0"]


@FAST
@given(parts=st.lists(st.sampled_from(PIECES), max_size=60), piece=st.integers(1, 24))
def test_encode_in_pieces_equals_whole(tokenizers_, parts, piece):
    text = "".join(parts)
    for tok in tokenizers_:
        assert encode_prompt(tok, text, 10**9, piece_chars=piece) == tok.encode(text)


@FAST
@given(text=st.text(max_size=200), piece=st.integers(1, 40))
def test_encode_in_pieces_equals_whole_any_text(tokenizers_, text, piece):
    for tok in tokenizers_:
        assert encode_prompt(tok, text, 10**9, piece_chars=piece) == tok.encode(text)


def test_prompt_past_context_refused_early(tokenizers_):
    tok = tokenizers_[0]
    text = "word " * 2_000_000  # 10 MB
    with pytest.raises(MTPEngineError) as ei:
        encode_prompt(tok, text, 4096, "prompt")
    msg = str(ei.value)
    assert ei.value.field == "prompt" and "context length 4096" in msg
    done = int(re.search(r"after tokenizing (\d+) of its", msg).group(1))
    assert done <= 4096 * 5 + 16384 * 2, done  # about one context, not 10 MB
    # a prompt that cannot fit by its size alone is refused without tokenizing anything
    with pytest.raises(MTPEngineError, match="after tokenizing 0 of its"):
        encode_prompt(tok, "x" * 200_000, 100)


# ------------------------------------------------------------------------------------------ API

@FAST
@given(prompt=ANY_TEXT)
def test_api_any_prompt(tiny, prompt):
    _generate_or_clean(tiny, {"prompt": prompt}, ("prompt",))


@FAST
@given(stop=st.lists(ANY_TEXT, max_size=3))
def test_api_any_stop(tiny, stop):
    _generate_or_clean(tiny, {"prompt": "Hello", "stop": stop}, ("stop",))


@FAST
@given(content=ANY_TEXT, role=st.sampled_from(["user", "system", "assistant", "\ud800"]))
def test_api_any_message(tiny, content, role):
    _generate_or_clean(tiny, {"messages": [{"role": role, "content": content}]}, ("messages",))


def _generate_or_clean(model, kwargs, fields):
    try:
        r = api.generate(model=model, max_tokens=1, **kwargs)
    except MTPEngineError as e:
        assert e.field and e.field.split("[")[0] in fields, str(e)
        return
    assert isinstance(r.text, str) and len(r.token_ids) <= 1


def test_lone_surrogate_refused_everywhere(tiny):
    with pytest.raises(MTPEngineError, match="index 2") as ei:
        api.generate("hi\ud800x", tiny, max_tokens=1)
    assert ei.value.field == "prompt"
    with pytest.raises(MTPEngineError) as ei:
        api.generate("hi", tiny, max_tokens=1, stop=["\udfff"])
    assert ei.value.field == "stop[0]"
    with pytest.raises(MTPEngineError) as ei:
        api.generate(messages=[{"role": "user", "content": "a\ud83d"}], model=tiny, max_tokens=1)
    assert ei.value.field == "messages[0].content"
    with pytest.raises(MTPEngineError) as ei:
        tiny.tokenizer.encode("\ud800")
    assert ei.value.field == "text"


# ------------------------------------------------------------------------------------------ CLI

@pytest.fixture
def cli(tiny, monkeypatch, capsys):
    monkeypatch.setattr(api, "load", lambda *a, **k: tiny)  # one load for every CLI call

    def run(*args: str) -> tuple[int, str, str]:
        return run_cli(capsys, *args)

    return run


def _clean(rc, err, ok=(0, 2)):
    assert rc in ok, err
    assert "Traceback" not in err
    if rc:
        assert len(err.strip().splitlines()) == 1 and err.startswith("mtp-engine: error:"), err


@FAST
@given(data=st.binary(max_size=64))
def test_cli_any_prompt_file_bytes(cli, tmp_path_factory, data):
    path = tmp_path_factory.mktemp("p") / "prompt.txt"
    path.write_bytes(data)
    rc, out, err = cli("generate", "-f", str(path), "-n", "1", "--json")
    _clean(rc, err)
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as e:
        assert rc == 2 and f"at byte offset {e.start}" in err


@FAST
@given(data=st.binary(max_size=48).filter(lambda b: b"\0" not in b), stop=st.binary(max_size=8))
def test_cli_any_argv_bytes(cli, data, stop):
    # argv as Python gives it: bytes decoded with surrogateescape
    rc, out, err = cli("generate", "-p", os.fsdecode(data), "--stop", os.fsdecode(stop), "-n", "1", "--json")
    _clean(rc, err)


def test_cli_stdin(cli, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"Hello there")))
    rc, out, err = cli("generate", "-f", "-", "-n", "1", "--json")
    assert rc == 0, err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"bad \xff")))
    rc, out, err = cli("generate", "-f", "-", "-n", "1")
    _clean(rc, err)
    assert rc == 2 and "<stdin>" in err and "byte offset 4" in err


def test_prompt_file_limits(tmp_path, cli):
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:
        f.truncate(MAX_PROMPT_FILE_BYTES + 1)
    rc, _, err = cli("generate", "-f", str(big), "-n", "1")
    _clean(rc, err)
    assert rc == 2 and f"limit of {MAX_PROMPT_FILE_BYTES} bytes" in err
    assert read_prompt_file(str(big), limit=MAX_PROMPT_FILE_BYTES + 1) == "\0" * (MAX_PROMPT_FILE_BYTES + 1)
    for path, needle in ((tmp_path, "Is a directory"), (tmp_path / "missing", "No such file")):
        rc, _, err = cli("generate", "-f", str(path), "-n", "1")
        _clean(rc, err)
        assert rc == 2 and needle in err


def test_output_paths_checked_before_work(tmp_path, cli, monkeypatch):
    def no_work(*a, **k):
        raise AssertionError("work started before the output path was checked")

    monkeypatch.setattr(api, "load", no_work)
    for path, needle in ((tmp_path / "no" / "dir" / "p.json", "does not exist"), (tmp_path, "found a directory")):
        rc, _, err = cli("generate", "-p", "hi", "-n", "1", "--profile-out", str(path))
        _clean(rc, err)
        assert rc == 2 and "--profile-out" in err and needle in err
    afile = tmp_path / "file"
    afile.write_text("x")
    import mtp_engine.cli.bench as bench
    monkeypatch.setattr(bench, "run_bench", no_work)
    rc, _, err = cli("bench", "--out", str(afile))
    _clean(rc, err)
    assert rc == 2 and "--out" in err and "expected a folder" in err


def test_unexpected_error_is_one_line_with_debug_hint(cli, monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(api, "load", boom)
    rc, out, err = cli("generate", "-p", "hi", "-n", "1")
    _clean(rc, err, ok=(1,))
    assert "RuntimeError: boom\\nsecond line" in err and "--debug" in err
    with pytest.raises(RuntimeError, match="boom"):
        main(["generate", "-p", "hi", "-n", "1", "--debug"])


@pytest.mark.parametrize("template", ["{{ 'a' * 3000000000 }}", "{{ 'x'.ljust(5000000000) }}", "{{ 1/0 }}",
                                      "{% include 'x' %}", "{{ range(10**9) }}"])
def test_cli_chat_with_hostile_template(cli, tiny, template):
    tiny.tokenizer.chat_template = template
    try:
        rc, out, err = cli("generate", "--chat", "-p", "hi", "-n", "1")
    finally:
        tiny.tokenizer.chat_template = CHATML
    _clean(rc, err)
    assert rc == 2 and "tokenizer.chat_template" in err and str(TINY_Q8) in err


@FAST
@given(parts=st.lists(st.sampled_from(["hello", " ", "world", "o w", "x", "\n"]), max_size=40), piece=st.integers(1, 12))
def test_encode_in_pieces_keeps_spaced_special_tokens(tokenizers_, parts, piece):
    # an added token whose text holds a space ("o w") must never be cut in two
    from types import SimpleNamespace

    import tokenizers

    base = tokenizers_[0]
    backend = tokenizers.Tokenizer.from_str(base.backend.to_str())
    backend.add_special_tokens([tokenizers.AddedToken("o w", special=True, normalized=False)])
    tok = SimpleNamespace(backend=backend, bos_token_id=None, add_bos_token=False,
                          max_token_bytes=base.max_token_bytes, spaced_special_texts=["o w"])
    text = "".join(parts)
    assert encode_prompt(tok, text, 10**9, piece_chars=piece) == backend.encode(text, add_special_tokens=False).ids
