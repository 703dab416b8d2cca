"""Compiles every custom CUDA kernel's source for an H100/H200 (sm_90a) on a machine without a GPU:
the exact source MLX would build for each launch (`kernel_cache.CudaKernel.variant_source`), for
the 9B shape and the fixtures' shapes, through NVRTC from NVIDIA's pip wheels. It catches what a
GPU session would otherwise spend its minutes on (a typo, an undeclared name, a wrong type), not
wrong numbers: those are the GPU tests' and each kernel's self-test.

    pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12
    python scripts/kernel_compile_check.py [--arch sm_90a]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mtp_engine.model import attn_kernel, gdn, gdn_kernel, kernel_cache, kernels, mma_kernel, norm_kernel  # noqa: E402

CAPTURED: dict[str, str] = {}  # module name -> source


def _capture() -> None:
    """CudaKernel without MLX's CUDA back-end: a call records its source and returns zeros."""
    def init(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True):
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.source, self.header = source, header

    def call(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **kw):
        func, src = self.variant_source(inputs, template, output_dtypes)
        CAPTURED[func] = src
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

    kernel_cache.CudaKernel.__init__ = init
    kernel_cache.CudaKernel.__call__ = call


def _launch_all() -> None:
    """Every kernel's wrapper at the shapes the engine runs (sources depend on template values)."""
    for d in (gdn.Dims(2, 64, 4, 64, 4, 1e-6), gdn.Dims(16, 128, 32, 128, 4, 1e-6)):
        for batch, s, cap, earlier in ((1, 1, False, 0), (8, 4, True, 0), (3, 2, False, 4)):
            gdn_kernel.max_error(d, s, capture=cap, earlier=earlier, batch=batch)
    for shape in ((4, 2, 64, 16), (16, 4, 256, 64)):
        attn_kernel.max_error(*shape, 1, 9)
        attn_kernel.max_error(*shape, 2, [4, 0, 11])
    w, sc, bi = mx.quantize(mx.random.normal((256, 512)), group_size=32, bits=4)
    for rows in (1, 4, 8):
        x = mx.random.normal((rows, 512))
        kernels.simt_rows(x, w, sc, bi, 4, 32)
        if rows > 1:
            mma_kernel.quantized_rows(x, w, sc, bi, 4, 32)
    norm_kernel._fused(mx.ones((2, 256)), mx.ones((2, 256)), mx.ones((256,)), 1e-6)


class Compiler(kernel_cache.NVRTC):
    """kernel_cache's NVRTC, from the pip wheels, for a named architecture (no GPU asked)."""

    def __init__(self, arch: str):
        import nvidia.cuda_nvrtc
        import nvidia.cuda_runtime
        root = Path(nvidia.cuda_nvrtc.__path__[0])
        lib = sorted((root / "lib").glob("libnvrtc.so*"))[0]
        self.lib = ctypes.CDLL(str(lib))
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.arch = f"--gpu-architecture={arch}"
        inc = [Path(nvidia.cuda_runtime.__path__[0]) / "include"]
        try:
            import nvidia.cuda_cccl
            inc.insert(0, Path(nvidia.cuda_cccl.__path__[0]) / "include")
        except ImportError:
            pass
        # MLX's own headers bring INFINITY in on the device; the wheels' headers alone do not
        self.includes = [f"--include-path={p}" for p in inc] + ["-DINFINITY=__int_as_float(0x7f800000)"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90a")
    a = ap.parse_args()
    _capture()
    _launch_all()
    try:
        nvrtc = Compiler(a.arch)
    except (ImportError, IndexError, OSError) as e:
        print(f"NVRTC not found ({e}); pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 "
              "nvidia-cuda-cccl-cu12", file=sys.stderr)
        return 2
    failed = 0
    for func, src in sorted(CAPTURED.items()):
        try:
            nvrtc.compile(src, func, "mlx::core::cu::" + func)
            print(f"ok      {func}")
        except RuntimeError as e:
            failed += 1
            print(f"FAILED  {func}\n{e}")
    print(f"{len(CAPTURED) - failed} of {len(CAPTURED)} kernel variants compile for {a.arch}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
