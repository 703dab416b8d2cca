"""The custom kernels' self-tests run at the loaded model's own shapes (so the kernels they compile
are the ones the model then runs: a cold NVRTC compile of the 9B-shaped GDN kernel took 31.7 s on
the H200), and a shape the kernel cannot take falls back to the built-in test shape. The kernels
themselves cannot run here: their arithmetic is recorded, not executed."""
from __future__ import annotations

import pytest

from mtp_engine.model import kernels


@pytest.fixture
def recorded(monkeypatch):
    calls = {"gdn": [], "attn": []}
    monkeypatch.setattr(kernels.cuda_kernel, "cuda", lambda: True)
    monkeypatch.setattr(kernels, "REGISTRY", kernels.Registry())
    monkeypatch.setattr(kernels.gdn, "max_error", lambda d, s, seed=0, **kw: calls["gdn"].append((d, s, kw.get("batch", 1))) or 0.0)
    monkeypatch.setattr(kernels.attn, "max_error", lambda *a, seed=0, dtype=None: calls["attn"].append(a) or 0.0)
    return calls


def test_self_tests_use_the_models_shapes(recorded, tiny_q4, monkeypatch, tmp_path):
    c = tiny_q4.model.cfg
    before = tiny_q4.model.options
    was = [getattr(layer.mixer, "fused_kernel", False) for layer in tiny_q4.model.layers]
    try:
        # an empty self-test cache: on a GPU an earlier process's pass would skip the recorded check
        tiny_q4.model.use(tiny_q4.model.options.updated(kernels="gdn,attn", cache_dir=str(tmp_path)))
        (d, *_), *_ = recorded["gdn"]
        assert (d.kh, d.kd, d.vh, d.vd, d.kernel) == (c.ssm_key_heads, c.ssm_key_dim, c.ssm_value_heads,
                                                      c.ssm_value_dim, c.conv_kernel)
        assert {a[:4] for a in recorded["attn"]} == {(c.n_head, c.n_head_kv, c.head_dim, c.n_rot)}
        # batched steps run the kernels too: each self-test has a case of several sequences
        assert any(b > 1 for *_, b in recorded["gdn"]) and any(isinstance(a[5], list) for a in recorded["attn"])
        assert all(layer.mixer.fused_kernel for layer in tiny_q4.model.layers)
    finally:  # the shared model goes back to what this machine really offers
        monkeypatch.undo()
        tiny_q4.model.use(before)
        assert [getattr(layer.mixer, "fused_kernel", False) for layer in tiny_q4.model.layers] == was


def test_unsupported_shapes_fall_back_to_the_test_shape(recorded):
    from mtp_engine.model import gdn
    assert kernels.available("attn", (16, 4, 512, 64, "float32"))  # a head wider than a block
    assert recorded["attn"][0][:4] == (4, 2, 64, 16)
    assert kernels.available("gdn", gdn.Dims(2, 66, 4, 64, 4, 1e-6))  # key dim not split over 4 lanes
    assert recorded["gdn"][0][0].kd == 64


def test_a_passed_self_test_is_remembered_for_the_next_process(recorded, tiny_q4, monkeypatch, tmp_path):
    from mtp_engine.model import kernels
    before = tiny_q4.model.options
    opts = before.updated(kernels="gdn,attn", cache_dir=str(tmp_path))
    try:
        tiny_q4.model.use(opts)  # first process: the checks run and their passes are stored
        # one check per case of each kernel's self-test (one of them a batch)
        n_gdn, n_attn = len(recorded["gdn"]), len(recorded["attn"])
        assert n_gdn >= 2 and n_attn >= 2
        assert (tmp_path / kernels.verdicts.FILE).exists()

        kernels.REGISTRY.forget()  # a new process
        tiny_q4.model.use(opts)
        assert len(recorded["gdn"]) == n_gdn and len(recorded["attn"]) == n_attn  # skipped
        assert all(layer.mixer.fused_kernel for layer in tiny_q4.model.layers)

        kernels.REGISTRY.forget()  # a new process with a changed kernel
        monkeypatch.setattr(kernels.gdn, "_SOURCE", kernels.gdn._SOURCE + "\n// changed")
        tiny_q4.model.use(opts)
        assert len(recorded["gdn"]) == 2 * n_gdn and len(recorded["attn"]) == n_attn

        kernels.REGISTRY.forget()  # a failing check is never remembered
        monkeypatch.setattr(kernels.attn, "max_error", lambda *a, seed=0, dtype=None: 1.0)
        monkeypatch.setattr(kernels.attn, "_ATTEND_SOURCE", kernels.attn._ATTEND_SOURCE + "\n// changed")
        tiny_q4.model.use(opts)
        assert not any(getattr(layer.mixer, "fused_kernel", False) for layer in tiny_q4.model.layers
                       if hasattr(layer.mixer, "q_norm"))
        k = kernels.verdicts.key("attn", kernels.attn.source(),
                                 (tiny_q4.model.cfg.n_head, tiny_q4.model.cfg.n_head_kv, tiny_q4.model.cfg.head_dim,
                                  tiny_q4.model.cfg.n_rot, opts.resolve().kv_dtype))
        assert not kernels.verdicts.passed(tmp_path, k)
    finally:
        monkeypatch.undo()
        tiny_q4.model.use(before)


def test_an_unreadable_verdict_file_means_checking_again(tmp_path):
    from mtp_engine.model import kernels
    (tmp_path / kernels.verdicts.FILE).write_text("{not json")
    assert not kernels.verdicts.passed(tmp_path, "k")
    kernels.verdicts.remember(tmp_path, "k")
    assert kernels.verdicts.passed(tmp_path, "k")
    assert not kernels.verdicts.passed(tmp_path / "missing", "k")


def test_a_first_run_says_which_kernels_it_compiles_and_tests(recorded, tiny_q4, monkeypatch, tmp_path):
    """On a GPU a first run compiles and tests its custom kernels (seconds each): the
    command line says so as each starts, and how it ended; a run that finds the verdicts kept
    says nothing."""
    import io
    import logging

    from mtp_engine.load_progress import show_kernel_notices

    before = tiny_q4.model.options
    out = io.StringIO()
    logger = logging.getLogger("mtp_engine.kernels")
    handlers, level, propagate = list(logger.handlers), logger.level, logger.propagate
    show_kernel_notices()  # an earlier command in this process (e.g. a CLI test's)
    show_kernel_notices(stream=out)  # replaces it: lines are not doubled
    try:
        opts = before.updated(kernels="gdn,attn", cache_dir=str(tmp_path))
        tiny_q4.model.use(opts)
        lines = out.getvalue().splitlines()
        assert [ln for ln in lines if "first run of the gdn CUDA kernel" in ln and str(tmp_path) in ln]
        assert [ln for ln in lines if ln.startswith("mtp-engine: attn kernel passed in ")]
        assert len(lines) == 4, lines  # gdn and attn: a start and an end each
        kernels.REGISTRY.forget()  # a new process: the verdicts are kept
        tiny_q4.model.use(opts)
        assert len(out.getvalue().splitlines()) == 4
    finally:
        logger.handlers, logger.propagate = handlers, propagate
        logger.setLevel(level)
        monkeypatch.undo()  # the shared model goes back to what this machine really offers
        tiny_q4.model.use(before)
