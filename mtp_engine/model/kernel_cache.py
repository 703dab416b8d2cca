"""The custom CUDA kernels compiled once per GPU, MLX version and source, not once per process.

Why: `mx.fast.cuda_kernel` compiles each kernel variant with NVRTC at its first launch in every
process (~1 s each; a second process on an H100 spent 16.7 s before its first token, most of it
here) and, unlike MLX's own kernels, never writes the result to MLX's PTX cache folder. It does
read that folder first, under the same name as its own kernels: `<name>_<std::hash(source):x>.ptx`
with a `.txt` of kernel names beside it. So `CudaKernel` builds the source MLX will build, compiles
it with the NVRTC library MLX itself links (through ctypes, which lets other threads run), and
writes the two files where MLX looks; from then on every process loads the stored code.

Safe by construction: a file is written only under the name MLX derives from the exact source it
would compile, so a different MLX (another source layout or hash) simply finds nothing and compiles
as before; files are written whole (a temporary, then a rename), the names before the code. The
kernels' self-tests (qwen35._checked) and the GPU suite check the stored code like any other, and
`tests/model/test_kernel_cache.py` checks on a GPU that MLX loads what is stored here.

Where: `$MLX_PTX_CACHE_DIR` (api.load points it into `EngineOptions.cache_dir`), else MLX's
default `<temp>/mlx/<version>/ptx`.
"""
from __future__ import annotations

import ctypes
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

log = logging.getLogger("mtp_engine.kernels")

_MASK = (1 << 64) - 1
_MUL = 0xC6A4A7935BD1E995
_SEED = 0xC70F6907

# what `#include "mlx/backend/cuda/device/utils.cuh"` must provide to the kernels' signatures (the
# header itself lives inside libmlx.so): the same types, so arguments are laid out as MLX passes them
_UTILS_HEADER = """#pragma once
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
_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
_CUDA_TYPES = {mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
               mx.int64: "int64_t", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
               mx.uint64: "uint64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
               mx.float32: "float", mx.float64: "double"}


def std_hash(data: bytes) -> int:
    """libstdc++'s `std::hash<std::string>` on 64-bit (`_Hash_bytes`, seed 0xc70f6907): how MLX
    names a kernel's module."""
    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    h = (_SEED ^ (n * _MUL)) & _MASK
    aligned = n & ~7
    for word in memoryview(data[:aligned]).cast("Q"):
        h = ((h ^ ((shift_mix((word * _MUL) & _MASK) * _MUL) & _MASK)) * _MUL) & _MASK
    if n & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * _MUL) & _MASK
    return shift_mix((shift_mix(h) * _MUL) & _MASK)


def template_suffix(template: list[tuple[str, object]]) -> str:
    out = ""
    for _, v in template:
        if isinstance(v, bool):
            out += "_t" if v else "_f"
        elif isinstance(v, int):
            out += f"_{v}"
        else:
            out += "_" + _CUDA_TYPES[v]
    return out


def build_source(func_name: str, header: str, source: str, input_names: list[str], inputs_meta: list[tuple],
                 output_names: list[str], output_dtypes: list, template: list[tuple[str, object]]) -> str:
    """The kernel source `mx.fast.cuda_kernel` builds for one launch (MLX's `build_kernel`):
    `inputs_meta` [(dtype, ndim)], shapes/strides/ndim parameters for the names the body uses."""
    s = _DEFAULT_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    s += f"__global__ void {func_name}(\n"
    for name, (dtype, ndim) in zip(input_names, inputs_meta):
        s += f"    const {_CUDA_TYPES[dtype]}* {name},\n"
        if ndim > 0:
            if f"{name}_shape" in source:
                s += f"    const __grid_constant__ Shape {name}_shape,\n"
            if f"{name}_strides" in source:
                s += f"    const __grid_constant__ Strides {name}_strides,\n"
            if f"{name}_ndim" in source:
                s += f"    const __grid_constant__ int {name}_ndim,\n"
    for i, (name, dtype) in enumerate(zip(output_names, output_dtypes)):
        s += f"    {_CUDA_TYPES[dtype]}* {name}" + (",\n" if i < len(output_names) - 1 else ") {\n")
    if template:
        for name, v in template:
            if isinstance(v, bool):
                s += f"  constexpr bool {name} = {'true' if v else 'false'};\n"
            elif isinstance(v, int):
                s += f"  constexpr int {name} = {v};\n"
            else:
                s += f"  using {name} = {_CUDA_TYPES[v]};\n"
        s += "\n"
    return s + source + "\n}\n\n} // namespace mlx::core::cu\n"


def module_path(cache_dir: Path, module_name: str) -> Path:
    """Where MLX looks for a module (its `get_ptx_path`: names over 245 characters become folders)."""
    limit = 245
    if len(module_name) <= limit:
        return cache_dir / (module_name + ".ptx")
    p, off = cache_dir, 0
    while len(module_name) - off > limit:
        p, off = p / module_name[off:off + limit], off + limit
    return p / (module_name[off:] + ".ptx")


def mlx_cache_dirs() -> list[Path]:
    """The folders MLX's CUDA backend may read compiled modules from: `$MLX_PTX_CACHE_DIR`, and
    its default. Both, because MLX reads the variable once, at its first compile: one before
    `load()` (any MLX work on the GPU, a test before it) leaves MLX on the default folder whatever
    the variable says afterwards, and a process cannot ask MLX which it took."""
    default = Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"
    env = os.environ.get("MLX_PTX_CACHE_DIR")
    return [Path(env), default] if env and Path(env) != default else [default]


class NVRTC:
    """The NVRTC library MLX links, driven through ctypes, for this process's GPU."""

    def __init__(self):
        self.lib = ctypes.CDLL(_loaded_library("libnvrtc"))
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        if major.value < 12:  # older NVRTC may not emit this GPU's machine code (MLX then takes PTX)
            raise RuntimeError(f"NVRTC {major.value}.{minor.value} is older than 12")
        cc = _compute_capability()
        self.arch = f"--gpu-architecture=sm_{cc[0]}{cc[1]}{'a' if cc[0] >= 9 else ''}"
        self.includes = [f"--include-path={p}" for p in _include_dirs(major.value)]

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: {self.lib.nvrtcGetErrorString(rc).decode(errors='replace')}")

    def compile(self, source: str, name: str, kernel: str) -> tuple[bytes, str]:
        """(cubin, mangled name of `kernel`) for `source`, as MLX compiles it."""
        lib, prog = self.lib, ctypes.c_void_p()
        headers = (ctypes.c_char_p * 1)(_UTILS_HEADER.encode())
        names = (ctypes.c_char_p * 1)(b"mlx/backend/cuda/device/utils.cuh")
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 1,
                                           headers, names), "nvrtcCreateProgram")
        try:
            self._check(lib.nvrtcAddNameExpression(prog, kernel.encode()), "nvrtcAddNameExpression")
            opts = [b"--device-as-default-execution-space", self.arch.encode(), *(i.encode() for i in self.includes)]
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


def _loaded_library(stem: str) -> str:
    """The path of a shared library this process has loaded (MLX's own NVRTC and driver)."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.rstrip("\n").split(" ")[-1]
            if os.path.basename(path).startswith(stem + ".so"):
                return path
    raise RuntimeError(f"{stem} is not loaded in this process")


def _compute_capability() -> tuple[int, int]:
    cuda = ctypes.CDLL(_loaded_library("libcuda"))
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(dev), 0):
        raise RuntimeError("the CUDA driver did not answer")
    cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev)  # CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR
    cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)
    return major.value, minor.value


def _include_dirs(nvrtc_major: int) -> list[Path]:
    """MLX's include paths for NVRTC: its bundled CCCL, then the CUDA runtime headers (the pip
    package beside MLX first, then CUDA_HOME / CUDA_PATH / /usr/local/cuda)."""
    root = Path(mx.__file__).resolve().parent
    dirs = [d for d in (root / "include", root / "include" / "cccl") if d.is_dir()]
    pip = root.parent / "nvidia" / ("cu13" if nvrtc_major >= 13 else "cuda_runtime") / "include"
    if pip.is_dir():
        return dirs + [pip]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    if not (Path(home) / "include").is_dir():
        raise RuntimeError("no CUDA headers found (set CUDA_HOME)")
    return dirs + [Path(home) / "include"]


# what this process compiled and stored, and found stored (startup_breakdown.py reports it)
STATS = {"compiled": 0, "compile_seconds": 0.0, "found": 0}
_nvrtc: NVRTC | None = None
_nvrtc_error: str | None = None
_lock = threading.Lock()


def _compiler() -> NVRTC | None:
    global _nvrtc, _nvrtc_error
    if _nvrtc is None and _nvrtc_error is None:
        try:
            _nvrtc = NVRTC()
        except (OSError, RuntimeError, AttributeError) as e:
            _nvrtc_error = str(e)
            log.info("kernels are compiled in each process (%s)", e)
    return _nvrtc


def store(func_name: str, source: str) -> Path | None:
    """Compiles `source` (as MLX would) into MLX's cache folder unless it is there: the module's
    path, or None where nothing could be stored (no NVRTC, a read-only folder; MLX then compiles)."""
    module = f"{func_name}_{std_hash(source.encode()):x}"
    paths = [module_path(d, module) for d in mlx_cache_dirs()]
    if all(p.is_file() for p in paths):
        STATS["found"] += 1
        return paths[0]
    with _lock:  # one compile of a module at a time in this process; another process may race: renames are whole
        have = next((p for p in paths if p.is_file()), None)
        if have is not None:  # stored in one folder, copied to the other
            names, code = have.with_suffix(".txt").read_bytes(), have.read_bytes()
        else:
            nvrtc = _compiler()
            if nvrtc is None:
                return None
            if STATS["compiled"] == 0:  # once per process: a first run on this GPU / MLX pauses here
                log.info("compiling this model's CUDA kernels for this GPU and MLX version (first run only, "
                         "~2 s each, a dozen at most; kept in %s)", paths[0].parent)
            t0 = time.perf_counter()
            kernel = "mlx::core::cu::" + func_name
            code, mangled = nvrtc.compile(source, module, kernel)
            names = f"{kernel}\t{mangled}\n".encode()
            STATS["compiled"] += 1
            STATS["compile_seconds"] += time.perf_counter() - t0
        for p in paths:
            if p.is_file():
                continue
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
                _write(p.with_suffix(".txt"), names)  # the names first: MLX reading code without them fails
                _write(p, code)
            except OSError as e:
                log.info("could not keep compiled kernel %s in %s (%s)", module, p.parent, e)
    return paths[0]


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class CudaKernel:
    """`mx.fast.cuda_kernel` whose compiled variants are kept on disk across processes (see the
    module's doc). Called like MLX's kernel; on anything but a CUDA GPU it is MLX's kernel alone."""

    def __init__(self, name: str, input_names: list[str], output_names: list[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True):
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.source, self.header = source, header
        self._kernel = mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names,
                                           source=source, header=header, ensure_row_contiguous=ensure_row_contiguous)
        self._stored: set = set()  # variants already looked up in this process

    def variant_source(self, inputs: list[mx.array], template: list, output_dtypes: list) -> tuple[str, str]:
        """(kernel name, source) MLX builds for these inputs and template arguments."""
        func = "custom_kernel_" + self.name + template_suffix(template)
        meta = [(x.dtype, x.ndim) for x in inputs]
        return func, build_source(func, self.header, self.source, self.input_names, meta, self.output_names,
                                  output_dtypes, template)

    def __call__(self, *, inputs: list[mx.array], template: list, grid, threadgroup, output_shapes,
                 output_dtypes, **kw) -> list[mx.array]:
        key = (tuple(template), tuple((x.dtype, x.ndim) for x in inputs), tuple(output_dtypes))
        if key not in self._stored:
            self._stored.add(key)
            try:
                store(*self.variant_source(inputs, template, output_dtypes))
            except (RuntimeError, OSError, KeyError) as e:  # MLX compiles it itself, as before
                log.info("kernel %s not kept across processes: %s", self.name, e)
        return self._kernel(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                            output_shapes=output_shapes, output_dtypes=output_dtypes, **kw)
