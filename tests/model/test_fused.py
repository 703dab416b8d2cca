"""`fused`: helpers compiled where their operations run on a GPU, plain on the CPU, where MLX's
compile builds C++ with the system compiler at first use (a fresh machine's first generate: 32 s
instead of 4 s). On the CPU a generation compiles nothing, so a new machine starts at once."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import mlx.core as mx

from tests.conftest import ROOT, TINY_Q4, need
from mtp_engine.model import fused as fused_module


def test_fused_runs_the_function_itself_on_the_cpu_and_the_compiled_form_on_a_gpu(monkeypatch):
    calls = []

    def twice(x):
        calls.append(1)  # runs on every plain call, only while tracing for the compiled form
        return x * 2

    f = fused_module.fused(twice)
    assert f.__name__ == "twice"
    monkeypatch.setattr(fused_module, "on_gpu", lambda: False)
    for _ in range(3):
        assert f(mx.array([1.0, 2.0])).tolist() == [2.0, 4.0]
    assert len(calls) == 3
    calls.clear()
    monkeypatch.setattr(fused_module, "on_gpu", lambda: True)  # compiled: traced once, then replayed
    for _ in range(3):
        assert f(mx.array([1.0, 2.0])).tolist() == [2.0, 4.0]
    assert len(calls) == 1


def test_on_gpu_follows_the_stream_a_caller_chose():
    with mx.stream(mx.cpu):
        assert not fused_module.on_gpu()


def test_a_generation_on_the_cpu_builds_no_compiled_code(tmp_path):
    """A fresh temp folder (where MLX's CPU backend keeps the libraries its compile builds):
    plain and draft-mtp generations leave none there."""
    if fused_module.on_gpu():
        import pytest
        pytest.skip("the GPU fuses these helpers")
    code = textwrap.dedent(f"""
        import mtp_engine as me
        m = me.load({str(need(TINY_Q4))!r})
        for spec in (None, "draft-mtp"):
            me.generate([349, 220, 451, 72], m, max_tokens=12, spec=spec, n_max=3, ignore_eos=True)
        print("ok")
    """)
    env = {**os.environ, "TMPDIR": str(tmp_path), "MTP_ENGINE_CACHE_DIR": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
    built = [p.name for p in tmp_path.rglob("*") if p.suffix in (".so", ".dylib", ".cpp")]
    assert not built, built
