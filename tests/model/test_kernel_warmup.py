"""The custom kernels compiled ahead, together (model/kernels/warmup.py, cuda_kernel.recording and
compile_all): the list covers every variant a model's forwards launch, recording launches nothing
and changes no verdict, and the compiles run at once. All on the CPU: a recording needs no CUDA
back-end, and the compiler is a stand-in."""
from __future__ import annotations

import threading
from pathlib import Path

import mlx.core as mx
import pytest

from mtp_engine import load
from mtp_engine.model import gdn, kernels
from mtp_engine.model.batch_cache import BatchCache
from mtp_engine.model.layers import Linear
from mtp_engine.model.blocks import GatedAttention, GatedDeltaNet
from tests.conftest import SHIPPED, TINY_Q4, need


def _self_tests(cfg):
    dims = gdn.Dims(cfg.ssm_key_heads, cfg.ssm_key_dim, cfg.ssm_value_heads, cfg.ssm_value_dim, cfg.conv_kernel,
                    cfg.eps)
    shape = (cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_rot)
    return [kernels.qmv.self_test, lambda: kernels.gdn.self_test(dims), lambda: kernels.attn.self_test(shape),
            kernels.norm.self_test]


def _forwards_with_every_kernel(net) -> dict[str, str]:
    """What the model's forwards launch with every kernel on: the trunk at 1..8 rows (decode,
    verify), the MTP head's step, a batch of two sequences' step, recorded (nothing runs)."""
    net.compile_steps = False
    for part in net.modules():
        if isinstance(part, Linear):
            part.custom_kernel = True
        elif isinstance(part, (GatedAttention, GatedDeltaNet)):
            part.fused_kernel = True
    net.fused_norm = True
    if net.mtp is not None:
        net.mtp.fused_norm = True
    with kernels.cuda_kernel.recording() as rec:
        for s in range(1, kernels.qmv.MAX_ROWS + 1):
            cache = net.make_cache()
            h = net.forward(mx.array([[3] * s]), cache)
            if net.mtp is not None and s == 1:
                net.mtp(net.embed_tokens(mx.array([[5]])), h, net.mtp.make_cache())
        batch = BatchCache(net)
        for _ in range(2):
            one = net.make_cache()
            net.forward(mx.array([[4, 5]]), one)
            batch.add(one)
        net.forward_batch(mx.array([[1], [2]]), batch)
    return rec.variants


@pytest.mark.parametrize("path", [SHIPPED, TINY_Q4], ids=["shipped", "tiny-q4"])
def test_every_variant_the_forwards_launch_is_compiled_ahead(path, monkeypatch):
    # a model of its own: the kernels are forced on in it below
    net = load(need(Path(path))).model
    monkeypatch.setattr(kernels.cuda_kernel, "cuda", lambda: True)
    monkeypatch.setattr(kernels, "REGISTRY", kernels.Registry())
    ahead = kernels.warmup.launched_variants(_self_tests(net.cfg), net.linears(),
                                             net.cfg.hidden_size)
    assert all(kernels.REGISTRY.verdict(name) is None for name in ("qmv", "gdn", "attn", "norm"))  # no verdict made
    launched = _forwards_with_every_kernel(net)
    assert launched, "the forwards launched no custom kernel: the test sees nothing"
    missing = sorted(set(launched) - set(ahead))
    assert not missing, f"launched by the model but not compiled ahead: {missing}"
    assert all(ahead[name] == launched[name] for name in launched)  # the same source, so the same module


def test_a_recording_launches_nothing_and_returns_the_output_shapes():
    k = kernels.cuda_kernel.CudaKernel("probe", ["x"], ["y", "z"], "y[0] = x[0];")
    with kernels.cuda_kernel.recording() as rec:  # on this CPU a launch would raise: no CUDA back-end
        y, z = k(inputs=[mx.ones((4,))], template=[("N", 4)], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                 output_shapes=[(2, 3), (5,)], output_dtypes=[mx.float32, mx.int32])
    assert y.shape == (2, 3) and z.shape == (5,) and z.dtype == mx.int32
    assert list(rec.variants) == ["custom_kernel_probe_4"]
    assert "constexpr int N = 4;" in rec.variants["custom_kernel_probe_4"]


def test_recordings_are_per_thread():
    """A recording in one thread does not catch another thread's launch: that one runs for real
    (on a CUDA GPU it computes; elsewhere MLX's kernel cannot be built and it raises). The GPU
    suite's one failure: this test used to expect the raise everywhere."""
    k = kernels.cuda_kernel.CudaKernel("probe", ["x"], ["y"], "y[0] = x[0];")
    errors, results = [], []

    def other():
        try:
            y = k(inputs=[mx.full((1,), 3.0)], template=[], grid=(1, 1, 1), threadgroup=(1, 1, 1),
                  output_shapes=[(1,)], output_dtypes=[mx.float32])[0]
            results.append(float(y.item()))
        except Exception as e:  # not recorded there: MLX's kernel is built, and off CUDA it raises
            errors.append(e)

    with kernels.cuda_kernel.recording() as rec:
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert not rec.variants
    assert results == [3.0] if kernels.cuda() else (errors and not results)


# a stand-in NVRTC for the worker processes (nvrtc.py runs it from its file): each compile marks
# itself in a folder, then waits until `TOGETHER` compiles have, so a run one after another fails
STAND_IN = """
import os, time
from pathlib import Path
FOLDER, TOGETHER = Path({folder!r}), {together}

class Compiler:
    def compile(self, source, name, kernel):
        if "bad" in source:
            raise RuntimeError("NVRTC could not compile " + name)
        (FOLDER / name).write_text(str(os.getpid()))
        deadline = time.time() + 30
        while len(list(FOLDER.iterdir())) < TOGETHER:
            if time.time() > deadline:
                raise RuntimeError("compiled alone: no other compile ran at the same time")
            time.sleep(0.01)
        return ("code:" + source).encode(), kernel + "_mangled"
"""


class _StandIn:
    """What `kernels.cuda_kernel._compiler()` returns, pointing the workers at the stand-in."""

    def __init__(self, tmp_path: Path, together: int):
        (tmp_path / "marks").mkdir()
        path = tmp_path / "stand_in.py"
        path.write_text(STAND_IN.format(folder=str(tmp_path / "marks"), together=together))
        self.spec = {"stand_in": str(path)}


def _cache_in(tmp_path, monkeypatch, together: int) -> None:
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(kernels.cuda_kernel.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.setattr(kernels.cuda_kernel, "_nvrtc", _StandIn(tmp_path, together))
    monkeypatch.setattr(kernels.cuda_kernel, "STATS", dict(kernels.cuda_kernel.STATS, compiled=0))


def test_compile_all_compiles_in_processes_at_once_and_stores_each_once(tmp_path, monkeypatch):
    _cache_in(tmp_path, monkeypatch, together=4)
    variants = {f"custom_kernel_k{i}": f"source {i}" for i in range(4)}
    assert kernels.cuda_kernel.compile_all(variants, workers=4) == 4
    modules = {name: f"{name}_{kernels.cuda_kernel.std_hash(source.encode()):x}" for name, source in variants.items()}
    marks = {p.name: p.read_text() for p in (tmp_path / "marks").iterdir()}
    assert sorted(marks) == sorted(modules.values()) and len(set(marks.values())) == 4  # four processes
    for name, source in variants.items():
        for folder in (tmp_path / "ptx", tmp_path / "tmp" / "mlx" / mx.__version__ / "ptx"):
            assert (folder / f"{modules[name]}.ptx").read_bytes() == b"code:" + source.encode()
            assert (folder / f"{modules[name]}.txt").read_text() == f"mlx::core::cu::{name}\tmlx::core::cu::{name}_mangled\n"
    for p in (tmp_path / "marks").iterdir():
        p.unlink()
    assert kernels.cuda_kernel.compile_all(variants, workers=4) == 0 and not any((tmp_path / "marks").iterdir())


def test_compile_all_leaves_a_failing_kernel_to_its_launch(tmp_path, monkeypatch):
    _cache_in(tmp_path, monkeypatch, together=1)
    assert kernels.cuda_kernel.compile_all({"custom_kernel_a": "good", "custom_kernel_b": "bad"}, workers=2) == 1
    assert [p.name.split("_")[2] for p in (tmp_path / "ptx").glob("*.ptx")] == ["a"]


def test_a_worker_that_cannot_start_its_compiler_fails_its_jobs_only(tmp_path, monkeypatch):
    _cache_in(tmp_path, monkeypatch, together=1)
    kernels.cuda_kernel._nvrtc.spec = {"lib": str(tmp_path / "no-libnvrtc.so"), "arch": "sm_90a", "includes": []}
    assert kernels.cuda_kernel.compile_all({"custom_kernel_a": "x", "custom_kernel_b": "y"}, workers=2) == 0
    assert not (tmp_path / "ptx").exists() or not any((tmp_path / "ptx").iterdir())


def test_off_cuda_nothing_is_compiled_ahead(tiny_q4):
    if kernels.cuda():
        pytest.skip("a CUDA machine")
    assert kernels.warmup.compile_ahead([], [p for p in tiny_q4.model.modules() if isinstance(p, Linear)], 64) == 0


@pytest.mark.gpu
def test_code_compiled_in_the_workers_is_what_mlx_runs():
    """Worker processes compile a fresh kernel with MLX's own NVRTC; its launch then finds it stored
    (nothing compiled in this process) and computes the right values."""
    import uuid
    k = kernels.cuda_kernel.CudaKernel(name=f"mtp_probe_ahead_{uuid.uuid4().hex[:12]}", input_names=["x"],
                                output_names=["out"], source="out[threadIdx.x] = 7.0f * x[threadIdx.x];")
    x = mx.arange(4, dtype=mx.float32)
    call = dict(inputs=[x], template=[], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
                output_dtypes=[mx.float32])
    with kernels.cuda_kernel.recording() as rec:
        k(**call)
    func, source = next(iter(rec.variants.items()))
    paths = [kernels.cuda_kernel.module_path(d, f"{func}_{kernels.cuda_kernel.std_hash(source.encode()):x}")
             for d in kernels.cuda_kernel.mlx_cache_dirs()]
    try:
        assert kernels.cuda_kernel.compile_all(rec.variants, workers=2) == 1
        assert all(p.is_file() for p in paths)
        compiled = kernels.cuda_kernel.STATS["compiled"]
        assert k(**call)[0].tolist() == [0.0, 7.0, 14.0, 21.0]
        assert kernels.cuda_kernel.STATS["compiled"] == compiled  # found stored, not compiled again
    finally:
        for p in paths:
            p.unlink(missing_ok=True)
            p.with_suffix(".txt").unlink(missing_ok=True)
