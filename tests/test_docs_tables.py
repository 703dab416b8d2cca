"""The documented options and flags, read from the docs and checked against the code, so the two
cannot drift apart again (the docs once said n-max defaults to 3, that `--debug` works on every
command, and tabled environment variables whose bad values were silently ignored)."""
from __future__ import annotations

import argparse
import re
from dataclasses import fields
from pathlib import Path

import pytest

from mtp_engine import options
from mtp_engine.cli.main import build_parser
from mtp_engine.errors import MTPEngineError

DOCS = Path(__file__).resolve().parent.parent / "docs"
README = DOCS.parent / "README.md"
ROW = re.compile(r"^\| `(\w+)` \| `(MTP_ENGINE_\w+)`")


def _option_rows(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for line in text.splitlines() if (m := ROW.match(line))}


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


@pytest.mark.parametrize("where", ["docs/architecture.md", "options.py docstring"])
def test_option_tables_name_every_field_and_its_variable(where):
    text = (DOCS / "architecture.md").read_text() if where.startswith("docs") else options.__doc__
    documented = _option_rows(text)
    code = {f.name for f in fields(options.EngineOptions) if f.name != "sources"}
    assert set(documented) == code
    assert documented == {k: options.ENV[k] for k in code}


@pytest.mark.parametrize("field", ["compile_steps", "kernels", "row_pad", "memory_limit"])
def test_every_tabled_variable_refuses_a_bad_value(field):
    with pytest.raises(MTPEngineError) as info:
        options.EngineOptions.from_env({options.ENV[field]: "-3x"})
    assert info.value.field == options.ENV[field]


def test_debug_on_every_command_as_the_readme_says():
    assert "`--debug` shows its traceback" in README.read_text()
    missing = [name for name, p in _commands().items() if "--debug" not in _flags(p)]
    assert missing == []


def test_spec_flags_and_defaults_in_docs_spec_md():
    text = (DOCS / "spec.md").read_text()
    cli_line = next(line for line in text.splitlines() if line.startswith("CLI: "))
    named = re.findall(r"--[\w-]+", cli_line)
    assert named, cli_line
    for command in ("generate", "serve", "chat"):
        flags = _flags(_commands()[command])
        assert [f for f in named if f not in flags] == [], command
    gen = _flags(_commands()["generate"])
    defaults = re.search(r"defaults: ([^)]*)\)", text).group(1)
    documented = [d.strip() for d in defaults.split(",")]
    code = [gen["--spec-draft-n-max"].default, gen["--spec-draft-n-min"].default, gen["--spec-draft-p-min"].default]
    assert documented == [str(c) for c in code]
    assert "`auto` (our default)" in text and code[0] == "auto"
