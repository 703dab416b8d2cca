"""The page at `/` in headless Chromium (Debian's `chromium` package, driven by playwright): a
message sent, the streamed answer equal to `generate()`'s, each token coloured by its provenance
(accepted draft vs trunk token) exactly as draft-mtp produced it, live figures shown.

Skips with a message when no Chromium or no playwright is installed. The screenshot goes to the
test's temporary folder; MTP_UPDATE_SCREENSHOT=1 writes docs/server-page.png instead, from the
code model in models/ (real text, high acceptance) rather than the tiny fixture.
"""
from __future__ import annotations

import os
import shutil

import pytest

from tests.conftest import ROOT, SHIPPED, TINY, need
from mtp_engine import load, stream_generate
from tests.server_helpers import LiveServer

UPDATE = os.environ.get("MTP_UPDATE_SCREENSHOT") == "1"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
DRAFTED_RGB = "rgb(183, 235, 192)"  # .tok-drafted in static/index.html
VERIFIED_RGB = "rgb(217, 227, 255)"  # .tok-verified


def _chromium() -> str | None:
    for name in (os.environ.get("MTP_CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@pytest.fixture(scope="module")
def browser():
    exe = _chromium()
    if exe is None:
        pytest.skip("no Chromium found (apt-get install chromium, or set MTP_CHROMIUM): page test skipped")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install playwright): page test skipped")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.mark.needs_tool  # Chromium, outside Python: .ci/run installs it where it may
def test_page_streams_and_colours_tokens(browser, tmp_path):
    if UPDATE:
        model_path, prompt, n, raw = SHIPPED, "def parse_args(argv):", 96, True
        penalty = 1.15
    else:
        model_path, prompt, n, raw = TINY / "qwen35-mtp-tiny-Q8_0.gguf", "Hello page", 24, False
        penalty = 1.0
    server = LiveServer(need(model_path), "--spec-draft-n-max", "3")
    try:
        m = load(model_path)
        if not raw:
            from mtp_engine.chat.template import CHATML
            m.tokenizer.chat_template = CHATML
        src = dict(prompt=prompt) if raw else dict(messages=[{"role": "user", "content": prompt}])
        chunks = list(stream_generate(model=m, max_tokens=n, spec="draft-mtp", n_max=3, repeat_penalty=penalty, **src))
        want_text = "".join(c.text for c in chunks)
        want_flags = [f for c in chunks for f in c.drafted]
        assert any(want_flags) and not all(want_flags)  # both colours must appear

        page = browser.new_page(viewport={"width": 1000, "height": 640})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url, wait_until="load")
        page.wait_for_function("document.getElementById('model').textContent.endsWith('.gguf')", timeout=10_000)
        page.select_option("#nmax", "3")
        page.fill("#maxtok", str(n))
        page.fill("#rpen", str(penalty))
        if raw:
            page.check("#raw")
        page.fill("#input", prompt)
        page.press("#input", "Enter")
        page.wait_for_selector(".assistant[data-done='1']", timeout=60_000)
        spans = page.eval_on_selector_all(
            ".assistant span", "els => els.map(e => [e.textContent, e.className, getComputedStyle(e).backgroundColor])")
        assert not errors, errors
        assert "".join(s[0] for s in spans) == want_text
        assert [s[1] == "tok-drafted" for s in spans] == want_flags
        assert {s[2] for s in spans if s[1] == "tok-drafted"} == {DRAFTED_RGB}
        assert {s[2] for s in spans if s[1] == "tok-verified"} == {VERIFIED_RGB}
        assert page.text_content("#acc").endswith("%") and float(page.text_content("#tps")) > 0
        meta = page.text_content(".assistant .meta")
        assert f"{n} tokens" in meta and f"accepted {chunks[-1].stats['accepted']}" in meta
        shot = ROOT / "docs" / "server-page.png" if UPDATE else tmp_path / "server-page.png"
        page.screenshot(path=str(shot))
        assert shot.stat().st_size > 10_000
        page.close()
    finally:
        server.stop()


@pytest.mark.needs_tool  # Chromium, outside Python: .ci/run installs it where it may
def test_page_asks_for_the_key_and_keeps_working(browser):
    """A server with --api-key: the page asks for the key once (a prompt dialog), then shows the
    model, answers a message and fills in the slots, which need the key too."""
    key = "page-k3y"
    server = LiveServer(need(TINY / "qwen35-mtp-tiny-Q8_0.gguf"), "--api-key", key)
    try:
        page = browser.new_page(viewport={"width": 1000, "height": 640})
        asked: list[str] = []

        def answer(dialog):
            asked.append(dialog.message)
            dialog.accept(key)

        page.on("dialog", answer)
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url, wait_until="load")
        page.wait_for_function("document.getElementById('model').textContent.endsWith('.gguf')", timeout=10_000)
        page.fill("#maxtok", "6")
        page.fill("#input", "Hello")
        page.press("#input", "Enter")
        page.wait_for_selector(".assistant[data-done='1']", timeout=60_000)
        page.wait_for_function("document.getElementById('slots').textContent.includes('·')", timeout=10_000)
        assert len(asked) == 1 and "key" in asked[0] and not errors, (asked, errors)
        assert page.text_content(".assistant .meta")
        page.close()
    finally:
        server.stop()
