"""The chat templates of real checkpoints (tests/fixtures/chat_templates: Qwen3.5, Qwen3, QwQ,
DeepSeek R1 and V3.1, Phi-3.5, Mistral Nemo, Small 3.1 and 3.2, Granite 3.3, gpt-oss, GLM-4.6)
render the same text under the engine's budget, without it, and in a plain Jinja sandbox, on every
conversation of `template_conversations.CASES` (tool calls included); where a template refuses a
conversation, all three refuse it alike and the engine's error names the field."""
from __future__ import annotations

import pytest

try:
    from tests.template_conversations import CASES, REAL_TEMPLATES, compare
except ImportError:  # tests/ as a plain folder on the path rather than a package
    from template_conversations import CASES, REAL_TEMPLATES, compare

TEMPLATES = sorted(REAL_TEMPLATES.glob("*.jinja"))


def _read(path) -> str:
    with open(path, encoding="utf-8", newline="") as f:  # byte-exact: no newline translation
        return f.read()


def test_the_real_templates_are_there_and_documented():
    names = {p.name for p in TEMPLATES}
    assert len(names) >= 10 and "Qwen3.5-4B.jinja" in names
    readme = (REAL_TEMPLATES / "README.md").read_text(encoding="utf-8")
    assert all(f"`{n}`" in readme for n in names), "every vendored template has its source and license"


@pytest.mark.parametrize("path", TEMPLATES, ids=[p.stem for p in TEMPLATES])
def test_real_template_renders_unchanged(path):
    result = compare(_read(path), path.name)
    assert not result["problems"], "\n".join(result["problems"])
    # a template that refused most conversations would check nothing: each renders at least 5 of 7
    assert result["rendered"] >= 2 * (len(CASES) - 2), result
