"""EngineOptions: given to load(), kept on the model, the environment only filling defaults; two
models in one process run under their own options (no module-global switches)."""
from __future__ import annotations

import mlx.core as mx
import pytest

from tests.conftest import TINY_Q4, need
from mtp_engine import EngineOptions, MTPEngineError, load
from mtp_engine import generate
from mtp_engine.model import kernels
from mtp_engine.options import ENV


def _linears(model):
    return model.model.linears()


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for name in ENV.values():
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(ENV["cache_dir"], str(tmp_path))  # measured costs stay out of $HOME
    return monkeypatch


def test_environment_fills_only_the_defaults(clean_env):
    clean_env.setenv(ENV["row_pad"], "4")
    clean_env.setenv(ENV["compile_steps"], "1")
    clean_env.setenv(ENV["cache_dir"], "/tmp/somewhere")
    opts = EngineOptions().resolve()
    assert (opts.row_pad, opts.compile_steps, str(opts.cache_dir)) == (4, True, "/tmp/somewhere")
    assert opts.sources["row_pad"] == ENV["row_pad"]
    given = EngineOptions(row_pad=2, compile_steps=False).resolve()
    assert (given.row_pad, given.compile_steps) == (2, False) and given.sources["row_pad"] == "argument"


def test_device_defaults_without_environment(clean_env):
    clean_env.delenv(ENV["cache_dir"])
    opts = EngineOptions().resolve()
    gpu = mx.default_device() == mx.gpu
    assert opts.compile_steps == gpu and opts.row_pad == (8 if gpu else 0) and opts.kernels == "custom"
    assert opts.dequant_rows == (256 if gpu else 0)
    assert opts.kv_dtype == "float32" and opts.joint_read is False
    assert opts.memory_limit is None and opts.cache_dir


@pytest.mark.parametrize("kw", [dict(kernels="fast"), dict(row_pad=-1), dict(memory_limit="lots"),
                                dict(dequant_rows=-2), dict(dequant_rows=True), dict(kv_dtype="f16"),
                                dict(kv_dtype="float64"), dict(joint_read="no"), dict(compile_steps=1)])
def test_bad_options_are_refused(kw):
    with pytest.raises(MTPEngineError) as info:
        EngineOptions(**kw)
    assert info.value.field == next(iter(kw))


@pytest.mark.parametrize("name,value", [("kernels", "fastest"), ("compile_steps", "true"), ("row_pad", "-3"),
                                        ("row_pad", "eight"), ("memory_limit", "lots"), ("dequant_rows", "x"),
                                        ("kv_dtype", "half"), ("joint_read", "yes")])
def test_bad_environment_names_the_variable(clean_env, name, value):
    # each was once ignored without a word (the engine ran on its defaults)
    clean_env.setenv(ENV[name], value)
    with pytest.raises(MTPEngineError) as info:
        EngineOptions.from_env()
    assert info.value.field == ENV[name]


def test_two_models_in_one_process_keep_their_options(clean_env):
    path = need(TINY_Q4)
    a = load(path, options=EngineOptions(compile_steps=False, row_pad=0, kernels="mlx"))
    b = load(path, options=EngineOptions(compile_steps=True, row_pad=8))
    assert a.options.compile_steps is False and b.options.compile_steps is True
    assert a.model.compile_steps is False and b.model.compile_steps is True
    assert {lin.row_pad for lin in _linears(a)} == {0} and {lin.row_pad for lin in _linears(b)} == {8}
    ra = generate("def fib(n):", a, max_tokens=12, spec="draft-mtp", n_max=3)
    rb = generate("def fib(n):", b, max_tokens=12, spec="draft-mtp", n_max=3)
    assert ra.token_ids == rb.token_ids  # greedy: the options change how, never what
    # only b traced compiled graphs; a loading b changed nothing in a
    assert b.model.graphs.compiled and not a.model.graphs.compiled
    assert a.options.row_pad == 0 and {lin.row_pad for lin in _linears(a)} == {0}


def test_kernel_choice_is_per_model(clean_env, monkeypatch):
    """With the custom kernel available (stood in for by MLX's product, counting calls), the model
    loaded with kernels="qmv" routes its few-row products through it, the "mlx" one never does."""
    calls = []

    def fake(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        x, wq, s, b = inputs
        t = dict(template)
        calls.append(x.shape[0])
        return [mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=t["GROUP"], bits=t["BITS"])]

    monkeypatch.setattr(kernels, "REGISTRY", kernels.Registry({("qmv", None): True}))
    monkeypatch.setattr(kernels.qmv, "_kernel", fake)  # one row
    monkeypatch.setattr(kernels.mma, "_kernel", fake)  # 2..8 rows
    path = need(TINY_Q4)
    custom = load(path, options=EngineOptions(kernels="qmv", compile_steps=False))
    plain = load(path, options=EngineOptions(kernels="mlx", compile_steps=False))
    assert any(lin.custom_kernel for lin in _linears(custom)) and not any(lin.custom_kernel for lin in _linears(plain))
    calls.clear()  # loading compiles the few-row variants ahead on a GPU (kernels.warmup): not a generation's
    rp = generate("x = 1", plain, max_tokens=4)
    assert calls == []
    rc = generate("x = 1", custom, max_tokens=4)
    assert calls and rc.token_ids == rp.token_ids


def test_memory_limit_option_refuses_the_load(clean_env):
    path = need(TINY_Q4)
    with pytest.raises(MTPEngineError) as info:
        load(path, options=EngineOptions(memory_limit=1000))
    assert info.value.field == "memory" and "1000" in str(info.value)


def test_no_module_global_switches():
    """The switches that used to be module globals are gone: nothing to flip behind a model's back."""
    from mtp_engine.model import layers, step
    from mtp_engine.model import kernels

    assert not hasattr(layers, "ROW_PAD") and not hasattr(kernels, "ACTIVE")
    assert not hasattr(kernels.gdn, "ACTIVE") and not hasattr(kernels.norm, "ACTIVE")
    assert not hasattr(step, "default_enabled")


def test_use_applies_new_options_to_a_loaded_model():
    m = load(need(TINY_Q4), options=EngineOptions(row_pad=0, compile_steps=True))
    generate("x", m, max_tokens=3)
    assert m.model.graphs.compiled  # traced under row_pad 0
    m.model.use(m.options.updated(row_pad=4))
    assert m.options.row_pad == 4 and {lin.row_pad for lin in _linears(m)} == {4}
    assert not m.model.graphs.compiled  # graphs of the old options are not reused


def test_load_refuses_options_of_another_type():
    with pytest.raises(MTPEngineError) as info:
        load(need(TINY_Q4), options={"row_pad": 8})
    assert info.value.field == "options"


def test_dequantized_products_of_many_rows(clean_env, monkeypatch):
    """`dequant_rows`: products of that many rows or more run on the weight dequantized
    (prefill chunks on a GPU), fewer rows on the quantized product unchanged; a model run so
    prefills to nearly the same logits and draft-mtp's greedy output stays plain's."""
    import numpy as np

    from mtp_engine.model.layers import Linear
    w = mx.random.normal((64, 256), key=mx.random.key(1))
    q = mx.quantize(w, group_size=32, bits=4)
    lin = Linear(*q, bits=4, group_size=32, dequant_rows=8)
    calls = []
    real = mx.dequantize
    monkeypatch.setattr(mx, "dequantize", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for rows in (1, 7, 8, 40):
        x = mx.random.normal((rows, 256), key=mx.random.key(rows))
        want = mx.quantized_matmul(x, *q, transpose=True, group_size=32, bits=4)
        got = lin(x)
        assert got.dtype == mx.float32 and got.shape == want.shape
        err = float(mx.abs(got - want).max() / mx.abs(want).max())
        assert (err == 0.0) if rows < 8 else err < 1e-5, (rows, err)
        assert len(calls) == (rows >= 8) + (rows > 8), rows  # the dense product from 8 rows on
    path = need(TINY_Q4)
    a = load(path, options=EngineOptions(dequant_rows=0))
    b = load(path, options=EngineOptions(dequant_rows=4))
    assert {lin.dequant_rows for lin in _linears(b)} == {4}
    ids = mx.array([[(5 * i) % 400 + 7 for i in range(40)]])
    la, lb = (np.array(m.model.logits(m.model.forward(ids, m.model.make_cache())[0, -1])) for m in (a, b))
    assert np.abs(la - lb).max() < 1e-4 * np.abs(la).max()
    prompt = [(5 * i) % 400 + 7 for i in range(40)]
    plain = generate(prompt, b, max_tokens=10, ignore_eos=True)
    spec = generate(prompt, b, max_tokens=10, ignore_eos=True, spec="draft-mtp", n_max=3)
    assert plain.token_ids == spec.token_ids
