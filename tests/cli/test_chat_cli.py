"""`mtp-engine chat` driven through standard input as a script would: answers streamed per line,
each turn after the first reusing the previous prompt's state, commands, errors that keep the chat
going, and the same answers as `generate` on the same conversation."""
from __future__ import annotations

import io

import pytest

from mtp_engine import generate
from mtp_engine import load
from mtp_engine.chat.template import CHATML
from mtp_engine.cli.main import build_parser
from mtp_engine.request.prepare import history_ids
from tests.conftest import TINY_Q4, need


def _chat(lines: list[str], *flags: str) -> tuple[int, str, str]:
    from mtp_engine.cli.chat import run_chat

    args = build_parser().parse_args(["chat", "-m", str(need(TINY_Q4)), "-n", "6", "--temp", "0", *flags])
    out, err = io.StringIO(), io.StringIO()
    rc = run_chat(args, io.StringIO("".join(line + "\n" for line in lines)), out, err)
    return rc, out.getvalue(), err.getvalue()


def test_a_scripted_chat_answers_as_generate_does():
    rc, out, err = _chat(["To be", "/stats", "or not", "/exit", "never read"], "--stats", "-sys", "Be brief.")
    assert rc == 0
    answers = out.split("\n")[:2]
    m = load(need(TINY_Q4))
    m.tokenizer.chat_template = CHATML
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be"}]
    first = generate(messages=conv, model=m, max_tokens=6, spec="draft-mtp")
    conv += [{"role": "assistant", "content": first.text}]
    history = history_ids(m, conv)  # turn 1 with its answer: kept while the user types
    conv += [{"role": "user", "content": "or not"}]
    second = generate(messages=conv, model=m, max_tokens=6, spec="draft-mtp")
    assert answers == [first.text, second.text]
    stats = [line for line in err.splitlines() if line.startswith("prompt:")]
    assert len(stats) == 3  # --stats after each answer, and /stats once
    # turn 2 prefills only the new message: the answer's state was kept after turn 1
    assert "cached" not in stats[0] and f"({len(history) - 1} cached)" in stats[2]
    assert len(history) > len(first.prompt_token_ids) and second.prompt_token_ids[:len(history)] == history
    assert "using ChatML" in err and "Traceback" not in err


def test_commands_and_errors_keep_the_chat_going():
    rc, out, err = _chat(["/stats", "/bogus", "   ", "bad \ud800 text", "hi", "/reset", "hi"])
    assert rc == 0
    assert "no answer yet" in err and "unknown command '/bogus'" in err and "/reset starts over" in err
    assert "error: message" in err and "surrogate" in err  # the bad line is refused, the chat goes on
    answers = [a for a in out.split("\n") if a]
    assert len(out.split("\n")) == 3 and answers[0] == answers[-1]  # after /reset: the same first answer


def test_full_context_is_said_not_crashed():
    rc, out, err = _chat(["word " * 400, "hi"], "-c", "64")
    assert rc == 0 and "longer than the context length 64 (the max_context / -c cap)" in err and "/reset" in err


@pytest.mark.parametrize("flag", [["-n", "0"], ["-c", "-1"]])
def test_bad_sizes_refused(flag, capsys):
    from mtp_engine.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["chat", *flag])
    assert e.value.code == 2 and "positive integer" in capsys.readouterr().err


def test_an_overlong_line_is_refused_in_bounded_memory(monkeypatch):
    import mtp_engine.cli.chat as chat_cli

    monkeypatch.setattr(chat_cli, "MAX_LINE_CHARS", 100)
    rc, out, err = _chat(["x" * 1000, "To be"])
    assert rc == 0 and "longer than 100 characters" in err
    assert len([a for a in out.split("\n") if a]) == 1  # the next line was still answered
