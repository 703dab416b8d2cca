"""MLX's own modules compiled ahead in worker processes (`kernels.mlx_jit`): the recipes reproduce
the graphs the engine compiles (checked by name on the CPU, where MLX names its compiled C++ the
way its CUDA backend names modules), and the worker's hand-over into the cache folder."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import mlx.core as mx
import pytest

from mtp_engine.model import blocks
from mtp_engine.model.kernels import mlx_jit
from mtp_engine.speculative import round as spec_round

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _engine_choice_of_workers(monkeypatch):
    """These tests set the worker count themselves (gpu_check turns the workers off for the suite)."""
    from mtp_engine.options import ENV_PREPARE

    monkeypatch.delenv(ENV_PREPARE, raising=False)


def _compiled_names(tmp: Path, code: str, env: dict | None = None, keep_hash: bool = False) -> set[str]:
    """The compiled graphs' names MLX's CPU backend builds while `code` runs (its cache folder
    is under TMPDIR, so each run gets its own); `keep_hash`: with the hash of the constants written
    into each graph (a graph whose epsilon or scale differs is another module)."""
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONPATH=str(ROOT),
               **(env or {}))
    # MLX's CPU backend names its compiled C++ as the CUDA backend names modules, on any machine
    code = "import mlx.core as mx\nmx.set_default_device(mx.cpu)\n" + textwrap.dedent(code)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=600)
    names = set()
    for f in tmp.rglob("*.cpp"):
        stem = f.stem
        for tail in ("_contiguous", "_strided"):
            if tail in stem:
                stem = stem[:stem.index(tail)]
        names.add(stem if keep_hash else stem.rsplit("_", 1)[0])  # the variant goes; the hash ends the stem
    return names


def test_recipes_compile_the_graphs_the_round_and_the_model_compile(tmp_path):
    """Each fused graph the round's accept (one row and a batch's two) and the model's helpers
    compile is among those the piecewise recipes compile: a change to the round that breaks a
    recipe's match fails here, not only as a slower first run on a GPU."""
    real = _compiled_names(tmp_path / "real", """
        import mlx.core as mx
        from mtp_engine.speculative.round import accept_greedy_device
        from mtp_engine.model.blocks import _swiglu, _sigmoid_gate
        for b in (1, 2):
            d = mx.array([[3, 1, 2]] * b, mx.int32); live = mx.array([[True, True, False]] * b)
            mx.eval(mx.compile(accept_greedy_device.__wrapped__)(d, mx.random.normal((b, 4, 32)), live))
        x = mx.random.normal((1, 5, 64))
        mx.eval(mx.compile(_swiglu.__wrapped__)(x, x), mx.compile(_sigmoid_gate.__wrapped__)(x, x))
    """)
    pieces = [r for _, r in [*spec_round.JIT_RECIPES, *blocks.JIT_RECIPES] if "sampling" not in r]
    warmed = _compiled_names(tmp_path / "recipes", f"""
        import mlx.core as mx
        from mtp_engine.model.kernels.mlx_jit import resolve
        for r in {pieces!r}:
            mx.eval(resolve(r)())
    """)
    assert len(real) >= 4 and real <= warmed, sorted(real - warmed)


def test_every_recipe_runs():
    for _, r in [*mlx_jit.GENERIC, *blocks.JIT_RECIPES, *spec_round.JIT_RECIPES]:
        mx.eval(mlx_jit.resolve(r)())
    with pytest.raises(ValueError, match="no recipe"):
        mlx_jit.resolve(f"{mlx_jit.__name__}:nothing_here")


def _module(folder: Path, name: str, code: bytes = b"code") -> Path:
    p = folder / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.with_suffix(".txt").write_text("kernel\tmangled\n")
    p.write_bytes(code)
    return p


def test_modules_move_whole_and_never_over_one_there(tmp_path):
    staging, cache = tmp_path / "staging", tmp_path / "cache"
    _module(staging, "gather_float32_int32_1.ptx")
    _module(staging, "a" * 245 + "/tail.ptx")  # MLX's folders for a long name
    _module(staging, "kept.ptx", b"new")
    _module(cache, "kept.ptx", b"old")
    (staging / "half.ptx").write_bytes(b"x")  # code without its names: MLX still writing
    assert mlx_jit.move_modules(staging, cache) == 2
    assert (cache / "gather_float32_int32_1.txt").is_file()
    assert (cache / ("a" * 245) / "tail.ptx").read_bytes() == b"code"
    assert (cache / "kept.ptx").read_bytes() == b"old" and not (cache / "half.ptx").exists()


def test_a_worker_reads_what_others_compiled(tmp_path):
    """Before each recipe a worker links into its staging folder every whole module the cache
    folder holds (its MLX then reads them rather than compiling them again), never another
    worker's staging, a marker or a module still without its names; what it had stays."""
    staging, cache = tmp_path / "staging", tmp_path / "cache"
    _module(cache, "gather_float32_int32_1.ptx")
    _module(cache, "deep/Cf4_VV_f4_123.ptx", b"fused")
    _module(cache, ".staging/77-0/other.ptx")
    (cache / "half.ptx").write_bytes(b"x")
    _module(staging, "mine.ptx", b"own")
    _module(cache, "mine.ptx", b"cached")
    assert mlx_jit.share_modules(cache, staging) == 2
    assert (staging / "deep" / "Cf4_VV_f4_123.ptx").read_bytes() == b"fused"
    assert (staging / "gather_float32_int32_1.txt").is_file()
    assert not (staging / ".staging").exists() and not (staging / "half.ptx").exists()
    assert (staging / "mine.ptx").read_bytes() == b"own"
    assert mlx_jit.share_modules(cache, staging) == 0
    assert mlx_jit.move_modules(staging, cache) == 0  # nothing new: what was linked stays where it was


RECIPE = """
import os
from pathlib import Path
import mlx.core as mx
def fake(name):  # stands in for MLX writing a module into its cache folder (here, the worker's staging)
    d = Path(os.environ["MLX_PTX_CACHE_DIR"])
    (d / f"{name}.txt").write_text("k\\tm\\n")
    (d / f"{name}.ptx").write_bytes(b"ptx")
    return mx.zeros(1)
def broken():
    raise RuntimeError("no such graph")
"""


def test_workers_prepare_once_per_cache_folder(tmp_path, monkeypatch):
    """Real worker processes, two for three recipes: each runs its recipes with MLX's cache at its
    staging folder, moves the modules into the cache folder and marks the recipes; a failing recipe
    is said and left to the main process; the next `prepare` starts nothing for what was done, and
    off a CUDA GPU nothing starts at all."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "fake_recipes.py").write_text(RECIPE)
    monkeypatch.syspath_prepend(str(tmp_path / "pkg"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "pkg"), str(ROOT)]))
    cache = tmp_path / "cache"
    recipes = [(0, "fake_recipes:fake:one"), (0, "fake_recipes:broken"), (1, "fake_recipes:fake:two")]
    assert mlx_jit.prepare(recipes, cache) is None  # this CPU: no CUDA
    monkeypatch.setattr(mlx_jit, "cuda", lambda: True)
    prep = mlx_jit.prepare(recipes, cache, workers=2)
    assert prep is not None and prep.wait(120)
    assert sorted((r, rc) for r, rc, _ in prep.done) == [
        ("fake_recipes:broken", 1), ("fake_recipes:fake:one", 0), ("fake_recipes:fake:two", 0)], prep.done
    for name in ("one", "two"):
        assert (cache / f"{name}.ptx").read_bytes() == b"ptx" and (cache / f"{name}.txt").is_file()
        assert mlx_jit.marker(cache, f"fake_recipes:fake:{name}").exists()
    assert not mlx_jit.marker(cache, "fake_recipes:broken").exists()
    deadline = time.time() + 30
    while any((cache / mlx_jit.STAGING).iterdir()) and time.time() < deadline:  # workers end when stdin closes
        time.sleep(0.05)
    assert not any((cache / mlx_jit.STAGING).iterdir())
    monkeypatch.setattr(mlx_jit, "_claim", lambda done: True)  # the failed recipe's claim is still fresh
    again = mlx_jit.prepare(recipes, cache, workers=1)
    assert again is not None and again.wait(120) and [r for r, _, _ in again.done] == ["fake_recipes:broken"]


def test_a_claimed_recipe_is_left_to_its_claimant_until_the_claim_is_stale(tmp_path, monkeypatch):
    monkeypatch.setattr(mlx_jit, "cuda", lambda: True)
    monkeypatch.setattr(mlx_jit, "Preparation", lambda todo, cache, n: todo)
    r = f"{mlx_jit.__name__}:dynamic_offset"
    assert mlx_jit.prepare([(1, r)], tmp_path) == [r]
    assert mlx_jit.prepare([(1, r)], tmp_path) is None  # another process holds it
    claim = mlx_jit.marker(tmp_path, r).with_name(mlx_jit.marker(tmp_path, r).name + ".claim")
    old = claim.stat().st_mtime - mlx_jit.CLAIM_SECONDS - 1
    os.utime(claim, (old, old))
    assert mlx_jit.prepare([(1, r)], tmp_path) == [r]


def test_recipes_run_in_phase_order(tmp_path, monkeypatch):
    monkeypatch.setattr(mlx_jit, "cuda", lambda: True)
    monkeypatch.setattr(mlx_jit, "Preparation", lambda todo, cache, n: todo)
    got = mlx_jit.prepare([(3, "m:c"), (0, "m:a"), (2, "m:b"), (0, "m:a")], tmp_path)
    assert got == ["m:a", "m:b", "m:c"]


def test_the_worker_count_comes_from_the_environment_and_zero_turns_it_off(tmp_path, monkeypatch):
    from mtp_engine.errors import MTPEngineError
    from mtp_engine.options import ENV_PREPARE, mlx_prepare_workers

    assert mlx_prepare_workers({}) is None and mlx_prepare_workers({ENV_PREPARE: " 3 "}) == 3
    for bad in ("-1", "two", "65"):
        with pytest.raises(MTPEngineError, match=ENV_PREPARE):
            mlx_prepare_workers({ENV_PREPARE: bad})
    monkeypatch.setattr(mlx_jit, "cuda", lambda: True)
    monkeypatch.setattr(mlx_jit, "Preparation", lambda todo, cache, n: (todo, n))
    monkeypatch.setenv(ENV_PREPARE, "0")
    assert mlx_jit.prepare([(0, "m:a")], tmp_path) is None
    monkeypatch.setenv(ENV_PREPARE, "3")
    assert mlx_jit.prepare([(0, "m:a"), (1, "m:b")], tmp_path) == (["m:a", "m:b"], 3)


def test_the_miniature_warms_every_graph_of_a_long_prompt_and_a_batch(tmp_path):
    """The warm recipes (`batching.warm`: the model's miniature through a long prompt alone and a
    server's first batched steps, plain and draft-mtp) compile every fused graph the real model's
    same runs compile, constants included (the name carries their hash), under compiled steps as
    on a GPU: the graphs a fresh GPU compiled one by one in a server's first step (48.6 s)."""
    from tests.conftest import SHIPPED

    model = str(SHIPPED)
    # the recipes first, then the real runs in the same cache folder: a graph they compile anew is
    # one the recipes missed (each compile is seconds on this CPU: the real runs mostly read)
    warmed = _compiled_names(tmp_path, f"""
        import mlx.core as mx
        from mtp_engine.batching import warm
        from mtp_engine.model.kernels.mlx_jit import resolve
        for _, r in warm.recipes({model!r}):
            mx.eval(resolve(r)())
    """, env={"MTP_ENGINE_COMPILE": "1"}, keep_hash=True)
    real = _compiled_names(tmp_path, f"""
        import mtp_engine as me
        m = me.load({model!r})
        long = [(7 * i + 3) % 500 + 1 for i in range(300)]
        me.generate(long[:40], model=m, max_tokens=6)
        me.generate(long, model=m, max_tokens=6)
        me.generate(long[:40], model=m, max_tokens=6, spec="draft-mtp", n_max=2)
        for spec in ("none", "draft-mtp"):
            me.batch_generate([long[:40], [5, 6, 7, 8, 9]], model=m, max_tokens=6, spec=spec, parallel=2)
            me.batch_generate([[1, 2, 3, 4, 5], [5, 6, 7, 8, 9]], model=m, max_tokens=6, spec=spec, parallel=2)
    """, env={"MTP_ENGINE_COMPILE": "1"}, keep_hash=True)
    assert len(warmed) >= 20 and real <= warmed, sorted(real - warmed)


def test_a_prompts_pieces_warm_every_graph_its_prefill_compiles(tmp_path):
    """The prompt's pieces (`warm.jit_part`: a delta-net layer, an attention layer, a feed-forward,
    the output layer, each its own recipe so that workers compile them side by side) compile every
    fused graph a real prefill of a medium and a long prompt compiles (the helpers fused as on a GPU)."""
    from tests.conftest import SHIPPED

    model = str(SHIPPED)
    # the pieces first, then the real prefills in the same cache folder: a graph they compile anew
    # is one the pieces missed
    warmed = _compiled_names(tmp_path, f"""
        from mtp_engine.model import fused
        fused.on_gpu = lambda: True
        import mlx.core as mx
        from mtp_engine.batching import warm
        from mtp_engine.model.kernels.mlx_jit import resolve
        for _, r in warm.recipes({model!r}):
            if ":jit_part:" in r:
                mx.eval(resolve(r)())
    """, keep_hash=True)
    real = _compiled_names(tmp_path, f"""
        from mtp_engine.model import fused
        fused.on_gpu = lambda: True
        import mtp_engine as me
        m = me.load({model!r})
        long = [(7 * i + 3) % 500 + 1 for i in range(300)]
        me.generate(long[:40], model=m, max_tokens=1)
        me.generate(long, model=m, max_tokens=1)
    """, keep_hash=True)
    assert len(warmed) >= 10 and real <= warmed, sorted(real - warmed)


def test_the_miniature_keeps_the_constants_and_the_bits(models):
    """Every constant a graph may hold (epsilon, head sizes, stream width, experts per token) and
    each matrix's bits are the real file's, for a dense and an MoE model; the layers stop after the
    first attention layer and the vocabulary is small."""
    from tests.conftest import MOE_Q4, SHIPPED, need

    from mtp_engine.batching import warm
    from mtp_engine.model.miniature import VOCAB, miniature

    for path in (SHIPPED, need(MOE_Q4)):
        real = models(path).model
        mini = miniature(str(path))
        c, r = mini.cfg, real.cfg
        for f in ("hidden_size", "eps", "head_dim", "n_head", "n_head_kv", "n_rot", "rope_base", "ssm_key_dim",
                  "ssm_key_heads", "ssm_value_heads", "ssm_inner", "conv_kernel", "n_expert_used", "arch"):
            assert getattr(c, f) == getattr(r, f), f
        assert c.vocab_size == VOCAB and c.recurrent == r.recurrent[:c.n_layer] and not c.recurrent[-1]
        assert mini.mtp is not None
        assert {lin.bits for lin in mini.linears()} <= {lin.bits for lin in real.linears()}
        for _, recipe in warm.recipes(str(path))[:1]:
            mx.eval(mlx_jit.resolve(recipe)())

