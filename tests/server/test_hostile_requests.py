"""Hostile inputs to the Python API and the command line: each gets the right result or
one clear error (the engine's own exception, naming what and where) in bounded time, and nothing a
user owns is overwritten."""
from __future__ import annotations

import hashlib
import importlib.util
import shutil
import time

import pytest

import mtp_engine as me
from mtp_engine.convert import convert
from mtp_engine.text_input import MAX_STOP_CHARS, MAX_STOPS
from tests.conftest import HF_TINY, TINY_Q4, TRAINED, need


@pytest.mark.parametrize("path", [123, 1.5, b"models/x.gguf", ["a.gguf"]])
def test_load_names_a_path_that_is_not_one(path):
    with pytest.raises(me.MTPEngineError, match="expected a path"):
        me.load(path)


def test_stop_strings_are_bounded(tiny_q4):
    with pytest.raises(me.MTPEngineError, match=f"at most {MAX_STOPS}"):
        me.generate("hello", model=tiny_q4, max_tokens=4, stop=["zz"] * (MAX_STOPS + 1))
    with pytest.raises(me.MTPEngineError, match=f"at most {MAX_STOP_CHARS}"):
        me.generate("hello", model=tiny_q4, max_tokens=4, stop=["z" * (MAX_STOP_CHARS + 1)])
    # the most a request may ask for costs little: every stop at its longest, none matching
    stops = [f"{i:04d}" + "\u2603" * (MAX_STOP_CHARS - 4) for i in range(MAX_STOPS)]
    t = time.perf_counter()
    out = me.generate("hello", model=tiny_q4, max_tokens=32, stop=stops, ignore_eos=True)
    free = me.generate("hello", model=tiny_q4, max_tokens=32, ignore_eos=True)
    assert out.token_ids == free.token_ids and time.perf_counter() - t < 30


def _digest(folder) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.mark.parametrize("where", ["same", "parent"])
def test_convert_never_writes_over_its_source(tmp_path, where):
    src = tmp_path / "ckpt"  # refused before anything is read: a folder without weights will do
    shutil.copytree(need(TRAINED / "hf"), src)
    before = _digest(src)
    out = src if where == "same" else tmp_path
    with pytest.raises(me.MTPEngineError, match="overwrite the source"):
        convert(src, out, overwrite=True)
    with pytest.raises(me.MTPEngineError, match="overwrite the source"):
        convert(src / "config.json", src / "config.json", gguf_type="F32", overwrite=True)
    assert _digest(src) == before


def test_convert_from_the_command_line_says_it_in_one_line(tmp_path, capsys):
    from mtp_engine.cli.main import main
    src = tmp_path / "ckpt"
    shutil.copytree(need(TRAINED / "hf"), src)
    rc = main(["convert", str(src), str(src), "--force"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "overwrite the source" in err[0]


def test_server_refuses_too_many_stops_with_a_400():
    from mtp_engine.server.schemas import APIError, _stop
    with pytest.raises(APIError) as e:
        _stop({"stop": ["x"] * (MAX_STOPS + 1)})
    assert e.value.status == 400 and "at most" in str(e.value)
    assert _stop({"stop": "ab"}) == ["ab"]


@pytest.mark.parametrize("raw, says", [
    (b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", "unreadable JSON body"),
    (b'{"prompt": "x", "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deep"),
])
def test_server_json_bodies_that_python_cannot_read_are_400(raw, says):
    from mtp_engine.server.schemas import APIError, parse_json
    with pytest.raises(APIError) as e:
        parse_json(raw)
    assert e.value.status == 400 and says in e.value.message


@pytest.mark.parametrize("field, value", [("temperature", 10 ** 400), ("top_p", -(10 ** 30)),
                                          ("max_tokens", 10 ** 4000), ("frequency_penalty", 10 ** 20)])
def test_server_huge_integers_are_400(field, value):
    from mtp_engine.server.schemas import APIError, ServerDefaults, parse_completion
    with pytest.raises(APIError) as e:
        parse_completion({"prompt": "x", field: value}, ServerDefaults())
    assert e.value.status == 400 and e.value.param == field and len(e.value.message) < 200


def test_serve_on_a_port_in_use_says_so_before_loading(capsys):
    import socket

    from mtp_engine.cli.main import main
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        t = time.perf_counter()
        rc = main(["serve", "-m", "no-such-model.gguf", "--port", str(port), "--host", "127.0.0.1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and len(err) == 1 and "in use" in err[0] and time.perf_counter() - t < 5


def _cli(args, capsys) -> tuple[int, list[str], float]:
    from mtp_engine.cli.main import main
    t = time.perf_counter()
    rc = main(args)
    return rc, capsys.readouterr().err.strip().splitlines(), time.perf_counter() - t


def test_a_fifo_prompt_file_is_refused_not_waited_on(tmp_path, capsys):
    import os
    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)
    rc, err, dt = _cli(["generate", "-m", str(need(TINY_Q4)), "-f", str(fifo), "-n", "2"], capsys)
    assert rc == 2 and "not a regular file" in err[-1] and dt < 10


@pytest.mark.parametrize("flags, says", [
    (["--p-min", "5"], "p-min"),
    (["--n-max", "2,99"], "n-max"),
    (["--out", "/proc/mtp-engine-test"], "--out"),
])
def test_bench_refuses_bad_flags_before_it_loads(flags, says, capsys):
    rc, err, dt = _cli(["bench", "-m", str(need(TINY_Q4))] + flags, capsys)
    # one line, and before the first pass (whose progress line would come first)
    assert rc == 2 and len(err) == 1 and says in err[0] and dt < 10


def test_a_checkpoint_without_its_untied_output_head_is_refused(tmp_path):
    """config.json says the output head is its own tensor and none is stored: loading and both
    conversions refuse (the head was silently tied to the embeddings)."""
    import mlx.core as mx
    src = tmp_path / "ckpt"
    shutil.copytree(need(HF_TINY), src)
    tensors = mx.load(str(src / "model.safetensors"))  # bf16: numpy cannot hold it
    heads = [k for k in tensors if k.endswith("lm_head.weight")]
    assert heads
    mx.save_safetensors(str(src / "model.safetensors"), {k: v for k, v in tensors.items() if k not in heads})
    for attempt in (lambda: me.load(src), lambda: convert(src, tmp_path / "mlx"),
                    lambda: convert(src, tmp_path / "m.gguf", gguf_type="F32")):
        with pytest.raises(me.MTPEngineError, match="tie_word_embeddings is false"):
            attempt()
    assert not (tmp_path / "mlx").exists() and not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("host, key, warns", [("127.0.0.1", None, False), ("::1", None, False),
                                              ("localhost", None, False), ("0.0.0.0", None, True),
                                              ("192.168.1.5", None, True), ("0.0.0.0", "k", False)])
def test_serve_warns_when_others_can_reach_it_without_a_key(host, key, warns):
    from mtp_engine.cli.serve import open_bind_warning
    assert (open_bind_warning(host, key) is not None) == warns


@pytest.mark.parametrize("content, ok", [("abc123\n", True), ("", False), ("two words\n", False),
                                         ("x" * 5000, False)])
def test_api_key_file_is_checked(tmp_path, content, ok):
    import types

    from mtp_engine.cli.serve import api_key_from_args
    f = tmp_path / "key"
    f.write_text(content)
    args = types.SimpleNamespace(api_key=None, api_key_file=str(f))
    if ok:
        assert api_key_from_args(args) == content.strip()
    else:
        with pytest.raises(me.MTPEngineError, match="api-key"):
            api_key_from_args(args)
    with pytest.raises(me.MTPEngineError, match="cannot read the API key"):
        api_key_from_args(types.SimpleNamespace(api_key=None, api_key_file=str(tmp_path / "missing")))


@pytest.mark.parametrize("argv", [["generate", "-f", "-", "-n", "2"], ["chat"]])
def test_a_closed_stdin_is_one_line(argv):
    import subprocess
    import sys
    import os

    p = subprocess.run([sys.executable, "-m", "mtp_engine.cli", argv[0], "-m", str(need(TINY_Q4)), *argv[1:]],
                       capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.close(0))
    err = p.stderr.strip().splitlines()
    assert p.returncode == 2 and "standard input is closed" in err[-1] and "Traceback" not in p.stderr


@pytest.mark.parametrize("edit, says", [
    (lambda c: c.replace('"hidden_size"', '"nested": ' + "[" * 100_000 + "]" * 100_000 + ', "hidden_size"'),
     "nested too deep"),
    (lambda c: c.replace('"rms_norm_eps"', '"huge": ' + "9" * 5000 + ', "rms_norm_eps"'), "unreadable JSON"),
    (lambda c: c + " " * (5 << 20), "not a model's config"),
])
def test_hostile_checkpoint_configs_are_one_clear_error(tmp_path, edit, says):
    src = tmp_path / "ckpt"  # the config is read before any weight: the trained model's HF folder has none
    shutil.copytree(need(TRAINED / "hf"), src)
    cfg = src / "config.json"
    cfg.write_text(edit(cfg.read_text()))
    for attempt in (lambda: me.load(src), lambda: convert(src, tmp_path / "out")):
        with pytest.raises(me.MTPEngineError, match=says):
            attempt()


def test_huge_integers_in_a_config_are_one_clear_error(tmp_path):
    import json as _json
    src = tmp_path / "ckpt"
    shutil.copytree(need(TRAINED / "hf"), src)
    cfg = _json.loads((src / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    text["hidden_size"] = 10 ** 4000
    (src / "config.json").write_text(_json.dumps(cfg))
    with pytest.raises(me.MTPEngineError):
        me.load(src)


def test_output_files_appear_whole_or_not_at_all(tmp_path):
    from mtp_engine.output_files import atomic_open, write_text
    target = tmp_path / "report.json"
    write_text(target, "old, complete")
    with pytest.raises(RuntimeError):
        with atomic_open(target) as f:
            f.write("new, half")
            raise RuntimeError("the run failed while writing")
    assert target.read_text() == "old, complete" and [p.name for p in tmp_path.iterdir()] == ["report.json"]
    write_text(target, "new, complete")
    assert target.read_text() == "new, complete"


def test_an_interrupted_conversion_leaves_the_target_as_it_was(tmp_path):
    out = tmp_path / "mlx"
    out.mkdir()
    (out / "keep.txt").write_text("the previous conversion")

    def stop(done, total):
        if done == 3:
            raise KeyboardInterrupt  # Ctrl-C mid-way

    with pytest.raises(KeyboardInterrupt):
        convert(need(HF_TINY), out, overwrite=True, progress=stop)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and [p.name for p in tmp_path.iterdir()] == ["mlx"]
    convert(HF_TINY, out, overwrite=True)
    assert (out / "config.json").exists() and not (out / "keep.txt").exists()
    assert me.load(out).model.cfg.n_layer > 0


def test_an_idle_server_hands_its_memory_back(monkeypatch):
    """`serve --idle-release S`: once no request came for S seconds after one ran, the worker frees
    MLX's cached buffers and trims the C heap (requests run on threads of their own, whose malloc
    arenas otherwise keep freed memory: idle RSS after 10k requests 124 -> ~91 MiB)."""
    import asyncio

    from mtp_engine.request import prepare, request_from_keywords
    from mtp_engine.server import worker as W

    trims = []
    monkeypatch.setattr(W, "_trim_heap", lambda: trims.append(time.monotonic()))
    w = W.GenerationWorker(str(need(TINY_Q4)), queue_size=2, idle_release_s=0.05)
    w.start()
    model = W.wait_ready(w, timeout=60)
    time.sleep(0.3)
    assert trims == []  # nothing ran yet: nothing to hand back
    loop = asyncio.new_event_loop()
    try:
        job = W.Job(prepare(model, request_from_keywords("x", max_tokens=2)), False, loop)
        w.submit(job)
        deadline = time.monotonic() + 30
        while not trims and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(trims) == 1 and w.completed == 1
        time.sleep(0.3)
        assert len(trims) == 1  # once per idle spell, not every timeout
    finally:
        w.jobs.put(None)
        loop.close()
    monkeypatch.undo()
    W._trim_heap()  # the real one runs here (glibc) or does nothing


def test_warm_up_reaches_every_batch_width_and_json_mode(monkeypatch):
    """`serve --parallel N` warms up one sequence per slot, each a step longer than the last, so
    every batch width N..1 is built before the first request (compiled per width on a GPU, memory
    first used here rather than by requests); with llguidance, a JSON-mode request too."""
    from mtp_engine.batching.mtp import MTPBatchScheduler
    from mtp_engine.batching.scheduler import BatchScheduler
    from mtp_engine.server import worker as W

    widths = []
    for cls in (BatchScheduler, MTPBatchScheduler):
        def decode(self, _decode=cls._decode):
            widths.append(len(self._rows))
            _decode(self)
        monkeypatch.setattr(cls, "_decode", decode)
    w = W.GenerationWorker(str(need(TINY_Q4)), queue_size=2, warm_up={}, parallel=3)
    w.start()
    try:
        model = W.wait_ready(w, timeout=120)
        assert w.warm_seconds is not None and {3, 2, 1} <= set(widths), widths
        if importlib.util.find_spec("llguidance") is not None:
            assert model.tokenizer.grammar_views  # JSON mode's vocabulary trie is built
    finally:
        w.stop()


@pytest.mark.parametrize("server, asked, want", [("auto", 64, (8, 0)), (3, 64, (3, 0)), (3, 2, (2, 0)),
                                                 (3, "auto", ("auto", 0)), (0, 5, (0, 0)), (4, (9, 6), (4, 4))])
def test_a_request_never_drafts_longer_than_the_server_allows(server, asked, want):
    """--spec-draft-n-max caps what a request may ask for (auto: auto's longest draft): a client
    asking for 64 drafts a round would slow every stream beside it; a request may ask for less."""
    from mtp_engine.server.schemas import ServerDefaults, parse_completion
    n_max, n_min = asked if isinstance(asked, tuple) else (asked, 0)
    kw = parse_completion({"prompt": "x", "spec_draft_n_max": n_max, "spec_draft_n_min": n_min},
                          ServerDefaults(n_max=server)).kwargs
    assert (kw["n_max"], kw["n_min"]) == want
