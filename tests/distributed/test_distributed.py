"""Tensor- and pipeline-parallel decoding over MLX's ring backend: 2 and 3 local processes on
127.0.0.1 give the single-process tokens (greedy plain, draft-mtp, n-max auto; draft-mtp sampled
with a seed) on the dense and MoE fixtures; each rank reads and holds only its share; a rank that dies ends the others with an
error, in bounded time."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from tests.conftest import FIXTURES, ROOT, TINY, need
from tests.distributed.worker import run_keywords

from mtp_engine import api
from mtp_engine.distributed.local import spawn
from mtp_engine.distributed.shard import ShardReader, TPPlan, split
from mtp_engine.errors import MTPEngineError
from mtp_engine.gguf.reader import GGUFFile
from mtp_engine.model.config import Qwen35Config

DENSE = TINY / "qwen35-mtp-tiny-Q4_K_M.gguf"
MOE = FIXTURES / "llamacpp-moe" / "qwen35moe-mtp-tiny-Q4_K_M.gguf"
WORKER = Path(__file__).resolve().parent / "worker.py"  # run as a script: its folder shadows nothing
# spec:n-max[:temperature]: a sampled run (seed 3) too, whose draws every rank makes alike
RUNS = "none,draft-mtp:2,draft-mtp:auto,draft-mtp:2:0.8"
PROMPT = [1, 5, 9, 2, 7, 3]
MAX_TOKENS = 16
RUN_LIMIT = 300  # seconds for a whole group (load + 3 generations): a bound against hangs, far above
# its time alone (the CPU is shared: the suite runs on 2 busy cores)
PROMPT_END = 90  # seconds within which a dead rank ends the others (its watchdog is 10 s)


def _single(path: Path) -> dict:
    m = api.load(path)
    out = {"weight_bytes": m.info.weight_bytes}
    for run in RUNS.split(","):
        out[run] = api.generate(PROMPT, m, max_tokens=MAX_TOKENS, ignore_eos=True, **run_keywords(run)).token_ids
    return out


_SINGLE: dict = {}


def single(path: Path) -> dict:
    if path not in _SINGLE:
        _SINGLE[path] = _single(need(path))
    return _SINGLE[path]


# the ranks' no-progress watchdog in the tests that are not about it: as long as a whole group may
# take, so a busy 2-core machine (a compile there stalls every rank for seconds) cannot trip it; the
# watchdog's own tests pass small ones
WATCHDOG = float(RUN_LIMIT)


def _launch(n: int, path: Path, mode: str, tmp_path: Path, *extra: str, timeout: float = WATCHDOG,
            env_extra: dict | None = None, stopped: int | None = None):
    out = tmp_path / "out.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           **(env_extra or {})}
    argv = [sys.executable, str(WORKER), str(path), "--mode", mode, "--out", str(out), "--runs", RUNS,
            "--max-tokens", str(MAX_TOKENS), "--timeout", str(timeout), "--prompt", *map(str, PROMPT), *extra]
    procs, hostfile = spawn(n, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    results = []
    try:
        # the stopped rank (if any) is waited for last, and killed once the others are done
        for i in sorted(range(n), key=lambda i: i == stopped):
            p = procs[i]
            left = 0.5 if i == stopped else max(1.0, RUN_LIMIT - (time.monotonic() - t0))
            try:
                stdout, stderr = p.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                p.kill()
                stdout, stderr = p.communicate()
                results.append((i, None, stderr.decode(errors="replace"), time.monotonic() - t0))
                continue
            results.append((i, p.returncode, stderr.decode(errors="replace"), time.monotonic() - t0))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        os.unlink(hostfile)
    return [r[1:] for r in sorted(results)], out, time.monotonic() - t0


@pytest.mark.parametrize("path,mode,n,compiled", [
    (DENSE, "tp", 2, "0"), (DENSE, "tp", 3, "0"), (DENSE, "pp", 2, "0"), (DENSE, "pp", 3, "0"),
    (MOE, "tp", 2, "1"), (MOE, "pp", 3, "0"),
], ids=["dense-tp2", "dense-tp3", "dense-pp2", "dense-pp3", "moe-tp2-compiled", "moe-pp3"])
def test_sharded_greedy_equals_single_process(path, mode, n, compiled, tmp_path):
    """(Compiled steps, the GPU default, with the all-reduces inside the traced graph: moe-tp2.)"""
    want = single(path)
    results, out, _ = _launch(n, path, mode, tmp_path, env_extra={"MTP_ENGINE_COMPILE": compiled})
    assert all(r[0] == 0 for r in results), [r[:2] for r in results if r[0] != 0]
    got = json.loads(out.read_text())
    assert got["size"] == n
    for run in RUNS.split(","):
        assert got[run] == want[run], run
    # rank 0 holds and reads less than the whole model
    assert got["weight_bytes"] < want["weight_bytes"]
    assert got["bytes_read"] < path.stat().st_size


def test_dead_rank_ends_the_others_with_an_error(tmp_path):
    need(DENSE)
    results, _, seconds = _launch(3, DENSE, "tp", tmp_path, "--die-rank", "1", "--die-after", "3", timeout=10.0)
    assert results[1][0] == 9  # the rank that died
    for rank in (0, 2):
        rc, err, _ = results[rank]
        assert rc in (3, 75), (rank, rc, err[-2000:])  # MTPEngineError, or the watchdog's exit
        assert f"rank {rank}" in err and ("peer" in err), err[-2000:]
    assert seconds < PROMPT_END


def test_silent_rank_ends_the_others_within_the_timeout(tmp_path):
    """A rank that stops without closing its connections: the others' collective blocks inside
    MLX; the watchdog ends them (exit 75) after --timeout seconds of no progress."""
    need(DENSE)
    results, _, seconds = _launch(2, DENSE, "tp", tmp_path, "--die-rank", "1", "--die-after", "3", "--hang",
                                  timeout=3.0, stopped=1)
    assert results[1][0] is None  # still stopped: killed by the test
    rc, err, seconds = results[0]
    assert rc == 75, (rc, err[-2000:])
    assert "rank 0: no progress" in err and "distributed_timeout=3" in err, err[-2000:]
    assert seconds < 25


# ---- in-process: plans and sharded reads ------------------------------------------------------

def test_split_deals_units_evenly():
    assert [split(7, 3, r) for r in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [split(1, 3, r) for r in range(3)] == [(0, 1), (1, 1), (1, 1)]


@pytest.mark.parametrize("path", [DENSE, MOE], ids=["dense", "moe"])
@pytest.mark.parametrize("size", [2, 3])
def test_tp_plans_cover_every_row_and_column_once(path, size):
    gf = GGUFFile(need(path))
    cfg = Qwen35Config.from_gguf(gf)
    for name in gf.tensor_names:
        shape = gf.numpy_shape(name)
        sels = [TPPlan(cfg, r, size).selection(name, shape) for r in range(size)]
        rows = [s[0] for s in sels if s[0] is not None]
        cols = [s[1] for s in sels if s[1] is not None]
        for parts, n in ((rows, int(np.prod(shape[:-1])) if len(shape) > 1 else shape[0]), (cols, shape[-1])):
            if parts:
                assert len(parts) == size, name
                assert sorted(np.concatenate(parts).tolist()) == list(range(n)), name


@pytest.mark.parametrize("name", ["token_embd.weight", "blk.0.ffn_down.weight", "blk.0.ssm_out.weight",
                                  "blk.3.attn_output.weight"])
def test_sharded_columns_equal_the_full_tensor_sliced(name):
    """Columns read from the blocks around them (Q4_K: 256-wide blocks, cut at 32-wide groups)
    dequantize to exactly the full tensor's columns."""
    gf = GGUFFile(need(DENSE))
    reader = ShardReader(gf)
    shape = gf.numpy_shape(name)
    full = reader.read(name, shape, None, None, True).dense()
    rows = np.array([1, 4, 5, 9])
    cols = np.concatenate([np.arange(32, 96), np.arange(160, 224)])
    part = reader.read(name, shape, rows, cols, True).dense()
    assert np.array_equal(np.array(part), np.array(full)[rows][:, cols])


def test_bad_distributed_arguments_are_engine_errors():
    with pytest.raises(MTPEngineError, match="distributed"):
        api.load(need(DENSE), distributed="zz")
    with pytest.raises(MTPEngineError, match="distributed_timeout"):
        api.load(need(DENSE), distributed="tp", distributed_timeout=0)


def test_a_group_of_one_is_the_whole_model():
    """Without mlx.launch the group has one rank: the sharded path then holds everything and
    decodes exactly as the plain load (the same code the ranks run)."""
    want = single(DENSE)
    m = api.load(DENSE, distributed="tp")
    assert m.comm.size == 1
    got = api.generate(PROMPT, m, max_tokens=MAX_TOKENS, ignore_eos=True, spec="draft-mtp", n_max=2).token_ids
    assert got == want["draft-mtp:2"]
    mx.eval(mx.zeros(1))
