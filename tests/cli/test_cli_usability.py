"""The command line as a new user meets it: every flag's help and default, --version, -c/--ctx-size
on every command that loads a model, a progress line for slow loads (never on stdout)."""
from __future__ import annotations

import argparse
import io
import re

import pytest

import mtp_engine
from tests.conftest import TINY_Q4, need
from mtp_engine.cli.main import HelpFormatter, build_parser, main
from mtp_engine.load_progress import load_progress

COMMANDS = ("generate", "bench", "serve", "convert", "chat")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags(p: argparse.ArgumentParser):
    return [a for a in p._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_help_and_shows_its_default(command, capsys):
    p = _subparsers()[command]
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--help"])
    assert e.value.code == 0
    text = re.sub(r"\s+", "", capsys.readouterr().out)  # argparse wraps lines (also at hyphens)
    for a in _flags(p):
        assert a.help and a.help.strip(), f"{command} {a.option_strings[-1]} has no help"
        line = HelpFormatter("x")._get_help_string(a).replace("%%", "%")
        assert re.sub(r"\s+", "", line) in text
        if a.default not in (None, False, [], argparse.SUPPRESS):
            assert "default" in line, f"{command} {a.option_strings[-1]}: default {a.default!r} not shown"


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_ctx_size_maps_to_max_context(command):
    p = _subparsers()[command]
    extra = ["-p", "x"] if command == "generate" else []
    assert p.parse_args(["-c", "128", *extra]).max_context == 128
    assert p.parse_args(["--ctx-size", "64", *extra]).max_context == 64
    assert p.parse_args(extra).max_context is None


@pytest.mark.parametrize("value", ["0", "-1", "x", "1.5"])
def test_ctx_size_refuses_what_is_not_a_positive_integer(value, capsys):
    # named by its flag (the API's own check would name `max_context`, which the user never typed)
    with pytest.raises(SystemExit) as e:
        main(["generate", "-p", "x", "-c", value])
    assert e.value.code == 2
    assert f"argument -c/--ctx-size: expected a positive integer, found '{value}'" in capsys.readouterr().err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"mtp-engine {mtp_engine.__version__}"
    assert re.match(r"\d+\.\d+", mtp_engine.__version__)


def test_ctx_size_caps_the_context(capsys):
    path = str(need(TINY_Q4))
    rc = main(["generate", "-m", path, "-c", "16", "-p", "one two three " * 10, "-n", "1", "--json"])
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == "" and "context" in cap.err and len(cap.err.strip().splitlines()) == 1
    assert main(["generate", "-m", path, "-c", "512", "-p", "one two three " * 10, "-n", "1", "--json"]) == 0


def test_ctx_size_beyond_the_trained_length_warns_once_and_is_used(caplog, capsys, tmp_path):
    """-c past the model's trained length: allowed with one warning (llama.cpp's rule), a prompt
    longer than the trained length then generates; the memory check still applies to what was
    asked (a context that cannot fit is refused with the numbers, before any weight is read).
    (The tiny model's copy says it was trained to 256 tokens: a prompt past 4096 is minutes of
    prefill on this CPU.)"""
    import logging

    import gguf

    import mtp_engine as me
    from tests.conftest import write_gguf_copy
    path = write_gguf_copy(gguf.GGUFReader(str(need(TINY_Q4))), tmp_path / "short.gguf",
                           {"qwen35.context_length": (256, gguf.GGUFValueType.UINT32)})
    trained = me.load(path).model.cfg.context_length
    assert trained == 256
    with caplog.at_level(logging.WARNING, logger="mtp_engine"):
        m = me.load(path, max_context=trained + 64)
    warned = [r for r in caplog.records if "beyond the model's trained length" in r.getMessage()]
    assert len(warned) == 1 and str(trained) in warned[0].getMessage()
    assert m.model.cfg.context_length == trained + 64
    r = me.generate([(7 * i) % 500 + 5 for i in range(trained + 8)], m, max_tokens=4, ignore_eos=True)
    assert len(r.token_ids) == 4
    with pytest.raises(me.MTPEngineError, match="memory"):
        me.load(path, max_context=10 ** 9)
    import subprocess
    import sys
    p = subprocess.run([sys.executable, "-m", "mtp_engine.cli", "generate", "-m", str(path), "-c", str(trained * 2),
                        "-p", "x", "-n", "1"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stderr.count("beyond the model's trained length") == 1, p.stderr


class _Stream(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


def test_progress_is_silent_for_a_fast_load():
    s = _Stream(tty=True)
    p = load_progress("m.gguf", stream=s, after=60.0)
    for i in range(1, 9):
        p(i, 8)
    assert s.getvalue() == ""


@pytest.mark.parametrize("tty", [True, False])
def test_progress_line_for_a_slow_load(tty):
    s = _Stream(tty)
    p = load_progress("m.gguf", stream=s, after=0.0)
    for i in range(1, 41):
        p(i, 40)
    out = s.getvalue()
    assert "loading m.gguf: 40/40 blocks (100%)" in out and out.endswith("\n")
    if tty:
        assert out.count("\r") == 40 and out.count("\n") == 1
    else:  # logs: a line per tenth, not per block
        assert out.count("\n") <= 11 and "\r" not in out


def test_progress_names_other_work():
    s = _Stream(tty=False)
    p = load_progress("ckpt", stream=s, after=0.0, verb="converting", unit="tensors")
    p(71, 71)
    assert s.getvalue().startswith("converting ckpt: 71/71 tensors (100%)")


def test_progress_quiet_and_the_cli_keeps_stdout_for_json(capsys):
    s = _Stream(tty=True)
    p = load_progress("m.gguf", quiet=True, stream=s, after=0.0)
    p(1, 2), p(2, 2)
    assert s.getvalue() == ""
    path = str(need(TINY_Q4))
    assert main(["generate", "-m", path, "-p", "x", "-n", "2", "--json"]) == 0
    out = capsys.readouterr().out
    assert "loading" not in out and out.count("\n") == 1


@pytest.mark.parametrize("spec", ["none", "draft-mtp"])
def test_a_long_prefill_shows_its_progress(capsys, monkeypatch, tmp_path, spec):
    """A prompt of several prefill chunks reports each chunk (tokens done of total), and the
    command line prints them as a progress line with a rate on stderr (here shown at once: a real
    one waits a second), never on stdout."""
    import mtp_engine as me
    import importlib
    cli_main = importlib.import_module("mtp_engine.cli.main")
    monkeypatch.setenv("MTP_ENGINE_PREFILL_CHUNK", "16")  # the API's load and the command line's
    m = me.load(need(TINY_Q4))
    prompt = "".join(f"x{i} = {i}\n" for i in range(20))
    n = len(m.tokenizer.encode(prompt))
    seen: list[tuple[int, int]] = []
    req = me.GenerationRequest(prompt=prompt, max_tokens=2, spec=me.SpecConfig(spec),
                               progress=lambda done, total: seen.append((done, total)))
    list(me.stream_request(req, m))
    assert seen and seen[-1][0] in (n - 1, n) and all(b == seen[0][1] for _, b in seen)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and len(seen) >= n // 16
    with pytest.raises(me.MTPEngineError, match="callable"):
        me.GenerationRequest(prompt="x", progress=3)
    real = cli_main.load_progress
    monkeypatch.setattr(cli_main, "load_progress", lambda *a, **kw: real(*a, **{**kw, "after": 0.0}))
    f = tmp_path / "p.txt"
    f.write_text(prompt)
    assert main(["generate", "-m", str(need(TINY_Q4)), "-f", str(f), "-n", "2", "--spec-type", spec]) == 0
    out, err = capsys.readouterr()
    assert "prefilling the prompt:" in err and "tokens/s" in err and "prefilling" not in out
