"""The command line: `mtp-engine generate ...` in process (`mtp_engine.cli.main.main`) and, once each, through
the installed console script and `python -m mtp_engine.cli`."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY_Q8, need, run_cli
from mtp_engine import generate
from mtp_engine.cli.main import main

PROMPT = "To be"


@pytest.fixture(scope="module")
def model_path() -> str:
    return str(need(TINY_Q8))


@pytest.fixture(scope="module")
def api_greedy(tiny_q8):
    return generate(PROMPT, tiny_q8, max_tokens=8)


cli = run_cli


def gen(capsys, model_path: str, *args: str) -> tuple[int, str, str]:
    return cli(capsys, "generate", "-m", model_path, *args)


def one_json(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected exactly one JSON line, got {out!r}"
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    return obj


# ---------------------------------------------------------------------------------------- --json

def test_json_output(capsys, model_path, api_greedy):
    rc, out, err = gen(capsys, model_path, "-p", PROMPT, "-n", "8", "--json", "--ignore-eos")
    assert rc == 0
    obj = one_json(out)
    assert {"text", "prompt_token_ids", "token_ids", "stats"} <= obj.keys()
    assert len(obj["token_ids"]) == 8
    assert obj["finish_reason"] == "length"
    assert obj["stats"]["generated_tokens"] == 8
    assert obj["prompt_token_ids"] == api_greedy.prompt_token_ids
    # greedy: the CLI equals the API
    assert obj["token_ids"] == api_greedy.token_ids
    assert obj["text"] == api_greedy.text
    assert "tok/s" not in err


def test_json_without_ignore_eos_matches_api(capsys, model_path, api_greedy):
    rc, out, _ = gen(capsys, model_path, "-p", PROMPT, "-n", "8", "--json")
    assert rc == 0 and one_json(out)["token_ids"] == api_greedy.token_ids


def test_json_sampling_seed_reproducible(capsys, model_path):
    args = ("-p", PROMPT, "-n", "8", "--json", "--temp", "0.8", "--top-k", "40", "--top-p", "0.95",
            "--min-p", "0.05", "-s", "11")
    a = one_json(gen(capsys, model_path, *args)[1])
    b = one_json(gen(capsys, model_path, *args)[1])
    assert a["token_ids"] == b["token_ids"]
    r = generate(PROMPT, model_path, max_tokens=8, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=11)
    assert a["token_ids"] == r.token_ids


def test_json_stop(capsys, model_path, api_greedy):
    stop = api_greedy.text[3:6]
    rc, out, _ = gen(capsys, model_path, "-p", PROMPT, "-n", "8", "--json", "--stop", "\x01never", "--stop", stop)
    obj = one_json(out)
    assert rc == 0 and obj["finish_reason"] == "stop"
    assert obj["text"] == api_greedy.text[:api_greedy.text.find(stop)]


# ---------------------------------------------------------------------------------------- streaming

def test_streaming_text_and_stats_line(capsys, model_path, api_greedy):
    rc, out, err = gen(capsys, model_path, "-p", PROMPT, "-n", "8")
    assert rc == 0
    assert out == api_greedy.text + "\n"
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert "tok/s" in lines[0] and "peak memory" in lines[0]
    assert "draft-mtp" not in lines[0]


def test_stats_line_says_no_drafts_rather_than_zero_of_zero():
    from mtp_engine.cli.output import format_stats
    base = {"prompt_tokens": 6, "prompt_tokens_per_second": 10.0, "generated_tokens": 8,
            "decode_tokens_per_second": 20.0, "peak_memory_bytes": 2**20, "rounds": 8, "accepted": 0,
            "acceptance_rate": 0.0, "tokens_per_round": 1.0}
    line = format_stats({**base, "drafted": 0})
    assert "draft-mtp: no drafts" in line and "0/0" not in line
    line = format_stats({**base, "drafted": 4, "accepted": 3, "acceptance_rate": 0.75, "tokens_per_round": 1.375})
    assert "draft-mtp: 3/4 accepted (75.0%), 1.38 tok/round" in line


def test_spec_draft_mtp(capsys, model_path, api_greedy):
    rc, out, err = gen(capsys, model_path, "-p", PROMPT, "-n", "8", "--spec-type", "draft-mtp",
                       "--spec-draft-n-max", "2")
    assert rc == 0
    assert out == api_greedy.text + "\n"
    assert "tok/s" in err and "draft-mtp:" in err and "accepted" in err and "tok/round" in err
    rc, out, _ = gen(capsys, model_path, "-p", PROMPT, "-n", "8", "--spec-type", "draft-mtp",
                     "--spec-draft-n-max", "2", "--spec-draft-n-min", "1", "--spec-draft-p-min", "0.0", "--json")
    obj = one_json(out)
    assert obj["token_ids"] == api_greedy.token_ids
    s = obj["stats"]
    assert len(s["acceptance_per_position"]) == 2
    assert sorted(s["accepted_length_histogram"]) == ["0", "1", "2"]
    assert s["rounds"] > 0


@pytest.mark.parametrize("mode", [None, "round"])
def test_profile_table(capsys, model_path, mode):
    args = ["-p", PROMPT, "-n", "6", "--spec-type", "draft-mtp", "--spec-draft-n-max", "2",
            "--profile"] + ([mode] if mode else [])
    rc, out, err = gen(capsys, model_path, *args)
    assert rc == 0
    lines = err.strip().splitlines()
    assert "tok/s" in lines[0]
    table = lines[1:]
    assert table[0].split()[:3] == ["stage", "ms", "calls"]
    stages = {ln.split()[0] for ln in table[1:]}
    assert {"prefill", "draft", "verify", "accept", "total"} <= stages
    assert f"({mode or 'precise'} mode)" in table[-1]


def test_profile_plain(capsys, model_path):
    rc, _, err = gen(capsys, model_path, "-p", PROMPT, "-n", "4", "--profile")
    assert rc == 0
    stages = {ln.split()[0] for ln in err.strip().splitlines()[2:]}
    assert {"prefill", "decode", "total"} <= stages


def test_prompt_file(capsys, model_path, api_greedy, tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_text(PROMPT, encoding="utf-8")
    rc, out, _ = gen(capsys, model_path, "-f", str(f), "-n", "8", "--json")
    assert rc == 0
    obj = one_json(out)
    assert obj["prompt_token_ids"] == api_greedy.prompt_token_ids
    assert obj["token_ids"] == api_greedy.token_ids


def test_max_tokens_zero(capsys, model_path):
    rc, out, _ = gen(capsys, model_path, "-p", PROMPT, "-n", "0", "--json")
    obj = one_json(out)
    assert rc == 0 and obj["token_ids"] == [] and obj["text"] == ""


# ---------------------------------------------------------------------------------------- bad input

BAD = [
    ("temp -1", ["-p", PROMPT, "--temp", "-1"]),
    ("temp nan", ["-p", PROMPT, "--temp", "nan"]),
    ("temp inf", ["-p", PROMPT, "--temp", "inf"]),
    ("top-p 0", ["-p", PROMPT, "--top-p", "0"]),
    ("top-p 1.5", ["-p", PROMPT, "--top-p", "1.5"]),
    ("min-p -0.1", ["-p", PROMPT, "--min-p", "-0.1"]),
    ("top-k -3", ["-p", PROMPT, "--top-k", "-3"]),
    ("spec-type foo", ["-p", PROMPT, "--spec-type", "foo"]),
    ("n-min > n-max", ["-p", PROMPT, "--spec-type", "draft-mtp", "--spec-draft-n-min", "5",
                       "--spec-draft-n-max", "2"]),
    ("p-min 1.5", ["-p", PROMPT, "--spec-type", "draft-mtp", "--spec-draft-p-min", "1.5"]),
    ("n -1", ["-p", PROMPT, "-n", "-1"]),
    ("n beyond context", ["-p", PROMPT, "-n", "100000"]),
    ("n not an int", ["-p", PROMPT, "-n", "abc"]),
    ("prompt beyond context", ["-p", "a " * 5000]),
    ("top-p nan", ["-p", PROMPT, "--top-p", "nan"]),
    ("min-p 1", ["-p", PROMPT, "--min-p", "1"]),
    ("p-min nan", ["-p", PROMPT, "--spec-type", "draft-mtp", "--spec-draft-p-min", "nan"]),
    ("n-max -1", ["-p", PROMPT, "--spec-type", "draft-mtp", "--spec-draft-n-max", "-1"]),
    ("empty prompt", ["-p", ""]),
    ("no prompt", []),
    ("-p and -f", ["-p", PROMPT, "-f", "x.txt"]),
    ("-f nonexistent", ["-f", "/nonexistent/prompt.txt"]),
    ("--profile bad mode", ["-p", PROMPT, "--profile", "bogus"]),
    ("unknown flag", ["-p", PROMPT, "--bogus-flag"]),
]


def assert_one_error_line(rc, out: str, err: str) -> None:
    assert rc == 2
    assert out == ""
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, f"expected one stderr line, got {err!r}"
    assert lines[0].startswith("mtp-engine: error:")
    assert "Traceback" not in err


@pytest.mark.parametrize("args", [b[1] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_exits_2(capsys, model_path, args):
    rc, out, err = gen(capsys, model_path, "-n", "4", *args)  # a later -n overrides
    assert_one_error_line(rc, out, err)


def test_prompt_beyond_context_names_prompt(capsys, model_path):
    rc, out, err = gen(capsys, model_path, "-n", "1", "-p", "a " * 5000)
    assert_one_error_line(rc, out, err)
    assert "prompt" in err and "context length" in err


def test_chat_without_template_uses_chatml_as_llamacpp(capsys, model_path):
    # llama.cpp's CLI and server fall back to ChatML for a model without a template, and so do ours
    # (said on stderr); the API's `messages` still refuses it (test_generate_api.py)
    from mtp_engine import load
    from mtp_engine.chat.template import CHATML

    rc, out, err = gen(capsys, model_path, "-n", "3", "-p", PROMPT, "--chat", "--json")
    assert rc == 0 and "has no chat template: using ChatML" in err and "Traceback" not in err
    m = load(model_path)
    assert m.tokenizer.chat_template is None
    m.tokenizer.chat_template = CHATML
    ref = generate(messages=[{"role": "user", "content": PROMPT}], model=m, max_tokens=3)
    got = json.loads(out)
    assert got["prompt_token_ids"] == ref.prompt_token_ids and got["token_ids"] == ref.token_ids
    assert m.tokenizer.decode(got["prompt_token_ids"]) == f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("path", ["/nonexistent/model.gguf", "DIR", "TEXTFILE"])
def test_bad_model_file(capsys, tmp_path, path):
    if path == "DIR":
        path = str(tmp_path)
    elif path == "TEXTFILE":
        (tmp_path / "not.gguf").write_text("hello, not a gguf file\n")
        path = str(tmp_path / "not.gguf")
    rc, out, err = cli(capsys, "generate", "-m", path, "-p", PROMPT, "-n", "2")
    assert_one_error_line(rc, out, err)
    assert path in err


def test_no_command(capsys):
    rc, out, err = cli(capsys)
    assert_one_error_line(rc, out, err)


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_out_of_range_seed_no_traceback(capsys, model_path, seed):
    """llama.cpp users pass `-s -1` (random seed). Accepting it or refusing it with one error line are
    both fine; an uncaught exception is not."""
    rc, out, err = gen(capsys, model_path, "-p", PROMPT, "-n", "4", "--temp", "1", "-s", seed,
                       "--spec-type", "draft-mtp", "--json")
    if rc == 0:
        assert len(one_json(out)["token_ids"]) == 4
    else:
        assert_one_error_line(rc, out, err)


# ---------------------------------------------------------------------------------------- real processes

def _console_script() -> str:
    exe = Path(sys.executable).parent / ("mtp-engine.exe" if os.name == "nt" else "mtp-engine")
    found = str(exe) if exe.exists() else shutil.which("mtp-engine")
    if not found:
        pytest.skip("the mtp-engine console script is not installed")
    return found


def test_console_script(model_path, api_greedy, tmp_path):
    p = subprocess.run([_console_script(), "generate", "-m", model_path, "-p", PROMPT, "-n", "8", "--json"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 0, p.stderr
    assert one_json(p.stdout)["token_ids"] == api_greedy.token_ids
    assert "Traceback" not in p.stderr


def test_module_entry_point_error_exit_status(model_path, tmp_path):
    p = subprocess.run([sys.executable, "-m", "mtp_engine.cli", "generate", "-m", model_path, "-p", PROMPT,
                        "--top-p", "0"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert_one_error_line(p.returncode, p.stdout, p.stderr)
    assert "top_p" in p.stderr


def test_json_schema_and_grammar_flags(capsys, tmp_path):
    """llama.cpp's -j/--json-schema and --grammar(-file): the output follows them; bad ones are one
    error line naming the flag."""
    pytest.importorskip("llguidance")
    path = str(need(TINY_Q8))
    schema = '{"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], ' \
             '"additionalProperties": false}'
    rc, out, err = gen(capsys, path, "-p", PROMPT, "-n", "40", "-j", schema, "--json")
    assert rc == 0 and json.loads(json.loads(out)["text"]) in ({"ok": True}, {"ok": False})
    g = tmp_path / "g.gbnf"
    g.write_text('root ::= "answer: " ("yes" | "no") "."\n')
    rc, out, err = gen(capsys, path, "-p", PROMPT, "-n", "40", "--grammar-file", str(g), "--json",
                       "--spec-type", "draft-mtp", "--spec-draft-n-max", "3")
    assert rc == 0 and json.loads(out)["text"] in ("answer: yes.", "answer: no.")
    for args, flag in [(["-j", "{bad"], "json-schema"), (["-j", "[1]"], "json-schema"),
                       (["--grammar", "root ::= ("], "constraint"), (["--json-schema-file", "/nonexistent"], "json-schema-file")]:
        rc, out, err = gen(capsys, path, "-p", PROMPT, "-n", "4", *args)
        assert_one_error_line(rc, out, err)
        assert flag in err, (args, err)
    with pytest.raises(SystemExit):
        main(["generate", "-m", path, "-p", PROMPT, "-j", "{}", "--grammar", "root ::= \"x\""])
