"""Compiles every custom CUDA kernel's source for an H100/H200 (sm_90a) on a machine without a GPU:
the exact source MLX would build for each launch (`kernels.cuda_kernel.CudaKernel.variant_source`), for
the 9B shape and the fixtures' shapes, through NVRTC from NVIDIA's pip wheels. It catches what a
GPU session would otherwise spend its minutes on (a typo, an undeclared name, a wrong type), not
wrong numbers: those are the GPU tests' and each kernel's self-test.

    pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 nvidia-cuda-cccl-cu12
    python scripts/kernel_compile_check.py [--arch sm_90a]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx


from mtp_engine.model import gdn, kernels
from mtp_engine.model.kernels import nvrtc


def _launch_all() -> None:
    """Every kernel's wrapper at the shapes the engine runs (sources depend on template values)."""
    for d in (gdn.Dims(2, 64, 4, 64, 4, 1e-6), gdn.Dims(16, 128, 32, 128, 4, 1e-6)):
        for batch, s, cap, earlier in ((1, 1, False, 0), (8, 4, True, 0), (3, 2, False, 4)):
            kernels.gdn.max_error(d, s, capture=cap, earlier=earlier, batch=batch)
    for shape in ((4, 2, 64, 16), (16, 4, 256, 64)):
        kernels.attn.max_error(*shape, 1, 9)
        kernels.attn.max_error(*shape, 2, [4, 0, 11])
    w, sc, bi = mx.quantize(mx.random.normal((256, 512)), group_size=32, bits=4)
    for rows in (1, 4, 8):
        kernels.qmv.simt_rows(mx.random.normal((rows, 512)), w, sc, bi, 4, 32)
    for rows in (4, 12, 32):  # the tensor-core kernel's 1, 2 and 4 column tiles, x in 2 and 3 parts
        for split in (2, 3):
            kernels.mma.quantized_rows(mx.random.normal((rows, 512)), w, sc, bi, 4, 32, split=split)
    kernels.norm.launch(mx.ones((2, 256)), mx.ones((2, 256)), mx.ones((256,)), 1e-6)


def pip_compiler(arch: str) -> nvrtc.Compiler:
    """NVRTC from NVIDIA's pip wheels, for a named architecture (no GPU asked)."""
    import nvidia.cuda_nvrtc
    import nvidia.cuda_runtime
    root = Path(nvidia.cuda_nvrtc.__path__[0])
    lib = sorted((root / "lib").glob("libnvrtc.so*"))[0]
    inc = [Path(nvidia.cuda_runtime.__path__[0]) / "include"]
    try:
        import nvidia.cuda_cccl
        inc.insert(0, Path(nvidia.cuda_cccl.__path__[0]) / "include")
    except ImportError:
        pass
    # the engine's ahead compiler (kernels.cuda_kernel) has no more than these: no math macros either
    return nvrtc.Compiler(str(lib), arch, [str(p) for p in inc])


def in_workers(compiler: nvrtc.Compiler, captured: dict[str, str], workers: int) -> tuple[float, list[dict]]:
    """The variants compiled by `workers` of kernels.cuda_kernel's NVRTC processes (the engine's first-run
    path), into a temporary folder: (wall seconds, their result lines)."""
    import tempfile
    import time
    from concurrent.futures import ThreadPoolExecutor
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [{"module": f, "kernel": "mlx::core::cu::" + f, "source": s, "paths": [str(Path(tmp) / f"{f}.ptx")]}
                for f, s in sorted(captured.items())]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            out = [r for rs in pool.map(lambda share: kernels.cuda_kernel._run_worker(compiler.spec, share, 600),
                                        [jobs[i::workers] for i in range(workers)]) for r in rs]
        return time.perf_counter() - t0, out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--workers", type=int, default=0,
                    help="also compile them in this many worker processes, as a first run does, and time both")
    a = ap.parse_args()
    with kernels.cuda_kernel.recording() as rec:  # launches nothing: each call records the source MLX would build
        _launch_all()
    captured = rec.variants
    try:
        compiler = pip_compiler(a.arch)
    except (ImportError, IndexError, OSError) as e:
        print(f"NVRTC not found ({e}); pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12 "
              "nvidia-cuda-cccl-cu12", file=sys.stderr)
        return 2
    failed = 0
    t0 = time.perf_counter()
    for func, src in sorted(captured.items()):
        try:
            compiler.compile(src, func, "mlx::core::cu::" + func)
            print(f"ok      {func}")
        except RuntimeError as e:
            failed += 1
            print(f"FAILED  {func}\n{e}")
    serial = time.perf_counter() - t0
    print(f"{len(captured) - failed} of {len(captured)} kernel variants compile for {a.arch} ({serial:.1f} s one by one)")
    if a.workers:
        wall, results = in_workers(compiler, captured, a.workers)
        bad = [r["module"] for r in results if not r.get("ok")]
        print(f"in {a.workers} worker processes: {wall:.1f} s ({serial / wall:.2f}x); "
              f"{len(results) - len(bad)} compiled" + (f", failed: {bad}" if bad else ""))
        failed += len(bad)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
