"""NVRTC through ctypes, and the worker process that compiles kernels beside the engine.

Why a process: NVRTC serialises much of a compile inside one process (measured on this repo's 11
kernel variants, 2 cores: serial 28.6 s, 2 threads 24.0 s, 2 processes 15.8 s), so compiling a
model's kernels at once needs processes. The worker is this file run as a script by
`cuda_kernel.compile_all`: standard library only (no MLX, no CUDA context, so it starts in tens of
milliseconds), told which NVRTC library, architecture and include folders to use, compiling jobs
from standard input and writing each module as MLX reads it (names first, then the code, each
file whole). It prints one JSON line per job.

    python nvrtc.py < {"compiler": {...}, "jobs": [{"module", "kernel", "source", "paths"}]}
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import threading
import time
from pathlib import Path

# what `#include "mlx/backend/cuda/device/utils.cuh"` must provide to the kernels' signatures (the
# header itself lives inside libmlx.so): the same types, so arguments are laid out as MLX passes them
UTILS_HEADER = """#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/cstdint>
#include <cuda/std/limits>
#define MAX_NDIM 10
#define WARP_SIZE 32
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
"""


class Compiler:
    """One NVRTC library (`lib`: its path) compiling for `arch` ("sm_90a") with `includes` (folders),
    as MLX compiles its kernels."""

    def __init__(self, lib: str, arch: str, includes: list[str], defines: tuple[str, ...] = ()):
        self.spec = {"lib": lib, "arch": arch, "includes": list(includes), "defines": list(defines)}
        self.lib = ctypes.CDLL(lib)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        self.options = [b"--device-as-default-execution-space", f"--gpu-architecture={arch}".encode(),
                        *(f"--include-path={p}".encode() for p in includes), *(d.encode() for d in defines)]

    def version(self) -> tuple[int, int]:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        return major.value, minor.value

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: {self.lib.nvrtcGetErrorString(rc).decode(errors='replace')}")

    def compile(self, source: str, name: str, kernel: str) -> tuple[bytes, str]:
        """(cubin, mangled name of `kernel`) for `source`."""
        lib, prog = self.lib, ctypes.c_void_p()
        headers = (ctypes.c_char_p * 1)(UTILS_HEADER.encode())
        names = (ctypes.c_char_p * 1)(b"mlx/backend/cuda/device/utils.cuh")
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 1,
                                           headers, names), "nvrtcCreateProgram")
        try:
            self._check(lib.nvrtcAddNameExpression(prog, kernel.encode()), "nvrtcAddNameExpression")
            opts = self.options
            rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            if rc != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                text = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, text)
                raise RuntimeError(f"NVRTC could not compile {name}: {text.value.decode(errors='replace')[:2000]}")
            mangled = ctypes.c_char_p()
            self._check(lib.nvrtcGetLoweredName(prog, kernel.encode(), ctypes.byref(mangled)), "nvrtcGetLoweredName")
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            code = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, code), "nvrtcGetCUBIN")
            return code.raw, mangled.value.decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def write_module(paths: list[Path], kernel: str, code: bytes, mangled: str) -> None:
    """The module as MLX reads it, in each folder that lacks it: the kernel names (`.txt`) before the
    code (`.ptx`; MLX reading code without names fails), each written whole (a rename)."""
    names = f"{kernel}\t{mangled}\n".encode()
    for p in paths:
        if p.is_file():
            continue
        p.parent.mkdir(parents=True, exist_ok=True)
        write_whole(p.with_suffix(".txt"), names)
        write_whole(p, code)


def write_whole(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _stand_in(path: str):
    """A compiler defined in a Python file (`compile(source, name, kernel) -> (bytes, str)`): the
    tests' stand-in for NVRTC on machines without one."""
    scope: dict = {"__file__": path}
    exec(compile(Path(path).read_text(), path, "exec"), scope)
    return scope["Compiler"]()


def worker(stdin=sys.stdin, stdout=sys.stdout) -> int:
    """Compiles the jobs read from `stdin` (the module doc's JSON), one JSON line each on `stdout`:
    {"module", "ok", "compiled" (False: found stored), "seconds"} and, when it failed, "error"."""
    request = json.loads(stdin.read())
    spec = request["compiler"]
    try:
        nvrtc = _stand_in(spec["stand_in"]) if "stand_in" in spec else Compiler(
            spec["lib"], spec["arch"], spec["includes"], tuple(spec.get("defines", ())))
    except Exception as e:  # every job fails the same way: said once per job, the caller falls back
        for job in request["jobs"]:
            print(json.dumps({"module": job["module"], "ok": False, "compiled": False, "seconds": 0.0,
                              "error": str(e)}), file=stdout)
        return 1
    for job in request["jobs"]:
        t0 = time.perf_counter()
        paths = [Path(p) for p in job["paths"]]
        try:
            compiled = not all(p.is_file() for p in paths)  # another process may have stored it meanwhile
            if compiled:
                code, mangled = nvrtc.compile(job["source"], job["module"], job["kernel"])
                write_module(paths, job["kernel"], code, mangled)
            out = {"module": job["module"], "ok": True, "compiled": compiled}
        except Exception as e:
            out = {"module": job["module"], "ok": False, "compiled": False, "error": str(e)[:2000]}
        out["seconds"] = time.perf_counter() - t0
        print(json.dumps(out), file=stdout, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(worker())
