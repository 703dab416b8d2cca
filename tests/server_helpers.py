"""A live `mtp-engine serve` process for the server tests: start on a free port, wait for its URL,
stop it; and raw HTTP requests (the standard library's, to control sockets and malformed bodies)."""
from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent


class LiveServer:
    def __init__(self, model: Path, *flags: str, timeout: float = 120.0, launcher: tuple[str, ...] = ()):
        """`launcher`: interpreter arguments before the module (e.g. a memory profiler's `-m memray run ...`)."""
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, *launcher, "-m", "mtp_engine.cli", "serve", "-m", str(model),
                                      "--port", "0", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd=str(ROOT))
        self.stderr: list[str] = []
        self.banner = ""  # the line that says where it serves
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = self._wait_url(timeout)
        u = urlparse(self.url)
        self.host, self.port = u.hostname, u.port

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.stderr.append(line)

    def _wait_url(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        box: list[str] = []

        def read():
            for line in self.proc.stdout:
                m = re.search(r"(http://\S+/)", line)
                if m:
                    self.banner = line.strip()
                    box.append(m.group(1))
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        if not box:
            self.stop()
            raise RuntimeError(f"server did not start within {timeout:.0f} s: {''.join(self.stderr)[-2000:]}")
        assert time.monotonic() <= deadline + 1
        return box[0]

    def request(self, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 60.0,
                headers: dict | None = None):
        """(status, parsed JSON or text) of one request."""
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        c.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = c.getresponse()
        text = r.read().decode()
        c.close()
        try:
            return r.status, json.loads(text)
        except json.JSONDecodeError:
            return r.status, text

    def open_stream(self, path: str, body: dict, timeout: float = 60.0):
        """Starts a streaming request; returns (connection, response) with the headers read."""
        c = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        c.request("POST", path, body=json.dumps({**body, "stream": True}).encode(),
                  headers={"Content-Type": "application/json"})
        return c, c.getresponse()

    def health(self) -> dict:
        return self.request("GET", "/health")[1]

    def wait_idle(self, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            h = self.health()
            if not h["busy"] and h["waiting"] == 0:
                return h
            time.sleep(0.05)
        raise AssertionError(f"server still busy after {timeout} s: {self.health()}")

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def sse_events(resp) -> list:
    """Reads SSE `data:` lines until [DONE]; returns the parsed events (the string "[DONE]" last)."""
    out = []
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        payload = line[6:]
        if payload == "[DONE]":
            out.append(payload)
            break
        out.append(json.loads(payload))
    return out


def with_chat_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of GGUF `src` at `dst` whose tokenizer.chat_template is `template` (tensors as they are)."""
    import gguf

    from tests.conftest import write_gguf_copy

    return write_gguf_copy(gguf.GGUFReader(str(src)), dst,
                           {"tokenizer.chat_template": (template, gguf.GGUFValueType.STRING)})
