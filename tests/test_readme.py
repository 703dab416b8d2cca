"""The README's Python example runs as pasted, on the model shipped in models/."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _python_block(section: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(section)
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def test_use_example_runs_as_pasted(monkeypatch):
    monkeypatch.delenv("MTP_ENGINE_MODEL", raising=False)  # me.load() must find models/ by itself
    code = _python_block("## Use")
    assert "me.load()" in code
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    text = out.getvalue()
    # print(r.text, acceptance rate, tokens/s): a line ends in the two numbers; then the streamed text
    assert re.search(r" (0|1)(\.\d+)? \d+\.\d+$", text, re.M), text[:500]
    assert len(text) > 100
