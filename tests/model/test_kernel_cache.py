"""The custom kernels' compiled code kept across processes (model/kernels/cuda_kernel.py): the names MLX
gives their modules are reproduced exactly (its hash, its generated source), and on a GPU MLX loads
what is stored under that name. The hash's expected values come from libstdc++ itself
(`printf("%zx", std::hash<std::string>{}(s))`, g++ 13 on x86_64)."""
from __future__ import annotations

import os
import sys
import uuid

import mlx.core as mx
import pytest

from mtp_engine.model import kernels
from mtp_engine.model.kernels.cuda_kernel import CudaKernel, build_source, module_path, std_hash, template_suffix

gpu_only = pytest.mark.gpu  # conftest skips these off CUDA

LIBSTDCXX = {"": "553e93901e462a6e", "a": "454ddee488c1ed6b", "abcdefg": "deee6830a3af82af",
             "abcdefgh": "783db3e38db898bb", "abcdefghi": "b4ec9257851c8aaf",
             "custom_kernel_mtp_qmv_rows_1_8_4_32 source\n{ x = 1; }\n": "89e8bea17986a39d",
             "0123456789abcdef0123456789abcdef012": "8e94eab126a13bf3"}


@pytest.mark.parametrize("text", list(LIBSTDCXX))
def test_the_hash_is_libstdcxx_std_hash(text):
    assert f"{std_hash(text.encode()):x}" == LIBSTDCXX[text]


def test_long_module_names_become_folders_as_mlx_makes_them(tmp_path):
    assert module_path(tmp_path, "k_1") == tmp_path / "k_1.ptx"
    name = "n" * 300
    assert module_path(tmp_path, name) == tmp_path / ("n" * 245) / ("n" * 55 + ".ptx")


def test_the_source_declares_what_the_body_uses_as_mlx_does():
    body = "const int K = x_shape[1]; const long r = y_strides[0]; out[0] = BITS;"
    src = build_source("custom_kernel_k" + template_suffix([("BITS", 4), ("ON", True)]), "// hdr\n", body,
                       ["x", "y", "z"], [(mx.float32, 2), (mx.uint32, 2), (mx.int32, 0)], ["out"], [mx.float32],
                       [("BITS", 4), ("ON", True)])
    assert "__global__ void custom_kernel_k_4_t(\n" in src
    assert "    const float* x,\n    const __grid_constant__ Shape x_shape,\n    const uint32_t* y,\n" in src
    assert "    const __grid_constant__ Strides y_strides,\n    const int32_t* z,\n    float* out) {\n" in src
    assert "x_strides" not in src.split(body)[0] and "  constexpr int BITS = 4;\n  constexpr bool ON = true;\n" in src
    assert src.index("// hdr") < src.index("namespace mlx::core::cu {") and src.endswith(body + "\n}\n\n} // namespace mlx::core::cu\n")


def test_off_cuda_nothing_is_stored(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernels.cuda_kernel, "_nvrtc", None)
    monkeypatch.setattr(kernels.cuda_kernel, "_nvrtc_error", None)
    if kernels.cuda_kernel._compiler() is not None:
        pytest.skip("NVRTC is loaded: this is a CUDA machine")
    assert kernels.cuda_kernel.store("custom_kernel_x", "int main;") is None and not any(tmp_path.iterdir())


def _mlx_printed_source(kernel: CudaKernel, **call) -> str:
    """What MLX prints as the source it builds (`verbose=True`), read from the process's stdout."""
    import tempfile
    sys.stdout.flush()
    with tempfile.TemporaryFile() as f:
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            mx.eval(kernel._kernel(**call, verbose=True))
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        text = f.read().decode()
    return text.split("```\n", 1)[1].rsplit("\n```", 1)[0]


@gpu_only
def test_mlx_builds_the_source_this_module_hashes():
    """For each engine kernel, MLX's own generated source (printed) equals `variant_source`'s."""
    from mtp_engine.model import kernels

    w = mx.random.normal((64, 256), key=mx.random.key(3))
    q, s, b = mx.quantize(w, group_size=32, bits=4)
    x = mx.random.normal((3, 256), key=mx.random.key(4))
    kernels.qmv.simt_rows(x[:1], q, s, b, 4, 32)
    kernels.mma.quantized_rows(x, q, s, b, 4, 32)
    kernels.norm.launch(x, x, w[0], 1e-6)
    cases = [(kernels.qmv._kernel, dict(inputs=[x[:1], q, s, b], template=[("M", 1), ("R", 8), ("BITS", 4), ("GROUP", 32)],
                                    grid=(256, 1, 1), threadgroup=(128, 1, 1), output_shapes=[(1, 64)],
                                    output_dtypes=[mx.float32])),
             (kernels.mma._kernel, dict(inputs=[x, q, s, b], template=[("BITS", 4), ("GROUP", 32), ("TM", 1), ("NW", 8),
                                                                       ("ST", 3), ("SPLIT", 2), ("NT", 1)],
                                       grid=(4 * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(3, 64)],
                                       output_dtypes=[mx.float32])),
             (kernels.norm._kernel, dict(inputs=[x, x, w[0], mx.array([1e-6])], template=[("NT", 256)],
                                        grid=(3 * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[x.shape, x.shape],
                                        output_dtypes=[mx.float32, mx.float32]))]
    for kernel, call in cases:
        func, ours = kernel.variant_source(call["inputs"], call["template"], call["output_dtypes"])
        assert _mlx_printed_source(kernel, **call) == ours, kernel.name


@gpu_only
def test_mlx_runs_the_code_stored_under_its_name():
    """A decoy: code that adds 42 stored under the name of a kernel that adds 1. MLX running it
    proves the name, the folder, the kernel-names file and the code format are what MLX reads."""
    k = CudaKernel(name=f"mtp_probe_{uuid.uuid4().hex[:12]}", input_names=["x"], output_names=["out"],
                   source="out[threadIdx.x] = x[threadIdx.x] + 1.0f;")
    x = mx.arange(4, dtype=mx.float32)
    call = dict(inputs=[x], template=[], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
                output_dtypes=[mx.float32])
    func, source = k.variant_source([x], [], [mx.float32])
    nvrtc = kernels.cuda_kernel._compiler()
    assert nvrtc is not None, kernels.cuda_kernel._nvrtc_error
    code, mangled = nvrtc.compile(source.replace("+ 1.0f", "+ 42.0f"), "probe", "mlx::core::cu::" + func)
    paths = [module_path(d, f"{func}_{std_hash(source.encode()):x}") for d in kernels.cuda_kernel.mlx_cache_dirs()]
    try:
        for path in paths:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.with_suffix(".txt").write_text(f"mlx::core::cu::{func}\t{mangled}\n")
            path.write_bytes(code)
        assert k._kernel(**call)[0].tolist() == [42.0, 43.0, 44.0, 45.0]
    finally:
        for path in paths:
            path.unlink(missing_ok=True)
            path.with_suffix(".txt").unlink(missing_ok=True)


@gpu_only
def test_the_code_is_found_when_mlx_compiled_before_the_cache_folder_was_chosen(tmp_path):
    """MLX fixes its folder at its first compile; `load()` choosing one afterwards (as in a test
    suite, or a program that used MLX first) must still leave a folder MLX reads. A subprocess: the
    folder is chosen once per process."""
    import subprocess
    import textwrap
    name = f"mtp_probe_late_{uuid.uuid4().hex[:12]}"
    code = textwrap.dedent(f"""
        import os, mlx.core as mx
        mx.eval(mx.compile(lambda a: mx.sin(a) * 2 + 1)(mx.arange(3.0)))  # MLX JIT-compiles a fusion first
        os.environ["MLX_PTX_CACHE_DIR"] = {str(tmp_path)!r}
        from mtp_engine.model.kernels import cuda_kernel as kc
        k = kc.CudaKernel(name={name!r}, input_names=["x"], output_names=["out"],
                          source="out[threadIdx.x] = 3.0f * x[threadIdx.x];")
        x = mx.arange(4, dtype=mx.float32)
        func, src = k.variant_source([x], [], [mx.float32])
        # a decoy (times 5) stored where kernels.cuda_kernel stores: MLX must run it
        code, mangled = kc._compiler().compile(src.replace("3.0f", "5.0f"), "probe", "mlx::core::cu::" + func)
        paths = [kc.module_path(d, func + "_%x" % kc.std_hash(src.encode())) for d in kc.mlx_cache_dirs()]
        for p in paths:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.with_suffix(".txt").write_text("mlx::core::cu::" + func + chr(9) + mangled + chr(10))
            p.write_bytes(code)
        out = k._kernel(inputs=[x], template=[], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
                        output_dtypes=[mx.float32])[0]
        print(out.tolist())
        for p in paths:
            p.unlink(); p.with_suffix(".txt").unlink()
    """)
    env = {**os.environ}
    env.pop("MLX_PTX_CACHE_DIR", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[-2] == "[0.0, 5.0, 10.0, 15.0]", r.stdout


@gpu_only
def test_a_kernel_is_stored_once_and_then_loaded():
    k = CudaKernel(name=f"mtp_probe_{uuid.uuid4().hex[:12]}", input_names=["x"], output_names=["out"],
                   source="out[threadIdx.x] = 2.0f * x[threadIdx.x];")
    x = mx.arange(4, dtype=mx.float32)
    out = k(inputs=[x], template=[], grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
            output_dtypes=[mx.float32])[0]
    func, source = k.variant_source([x], [], [mx.float32])
    path = module_path(kernels.cuda_kernel.mlx_cache_dirs()[0], f"{func}_{std_hash(source.encode()):x}")
    try:
        assert path.is_file() and path.with_suffix(".txt").read_text().startswith(f"mlx::core::cu::{func}\t")
        assert out.tolist() == [0.0, 2.0, 4.0, 6.0]
    finally:
        path.unlink(missing_ok=True)
        path.with_suffix(".txt").unlink(missing_ok=True)
