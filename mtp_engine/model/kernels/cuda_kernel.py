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
kernels' self-tests (`registry`) and the GPU suite check the stored code like any other, and
`tests/model/test_kernel_cache.py` checks on a GPU that MLX loads what is stored here.

Where: `$MLX_PTX_CACHE_DIR` (api.load points it into `EngineOptions.cache_dir`), else MLX's
default `<temp>/mlx/<version>/ptx`.

Ahead: `recording` lists the variants some code would launch without launching them, and
`compile_all` compiles the missing ones at once in worker processes (`nvrtc.py`), so a first run
pays for its slowest kernel rather than their sum (`warmup` does it for a model at load).
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

from ...options import cuda_home, mlx_kernel_cache_dir
from . import nvrtc

log = logging.getLogger("mtp_engine.kernels")

_MASK = (1 << 64) - 1
_MUL = 0xC6A4A7935BD1E995
_SEED = 0xC70F6907

_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
_CUDA_TYPES = {mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t",
               mx.int64: "int64_t", mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t",
               mx.uint64: "uint64_t", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16",
               mx.float32: "float", mx.float64: "double"}


def cuda() -> bool:
    """Whether MLX runs on a CUDA GPU (the only place the custom kernels run)."""
    try:
        return mx.default_device() == mx.gpu and mx.cuda.is_available()
    except AttributeError:  # an MLX without the CUDA backend (e.g. Metal, CPU)
        return False


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
    env = mlx_kernel_cache_dir()
    return [Path(env), default] if env and Path(env) != default else [default]


def _make_compiler() -> nvrtc.Compiler:
    """The NVRTC library MLX links, for this process's GPU, with MLX's include folders."""
    lib = _loaded_library("libnvrtc")
    major, minor = nvrtc.Compiler(lib, "", []).version()
    if major < 12:  # older NVRTC may not emit this GPU's machine code (MLX then takes PTX)
        raise RuntimeError(f"NVRTC {major}.{minor} is older than 12")
    cc = _compute_capability()
    return nvrtc.Compiler(lib, f"sm_{cc[0]}{cc[1]}{'a' if cc[0] >= 9 else ''}",
                          [str(p) for p in _include_dirs(major)])


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
    home = cuda_home()
    if not (Path(home) / "include").is_dir():
        raise RuntimeError("no CUDA headers found (set CUDA_HOME)")
    return dirs + [Path(home) / "include"]


# what this process compiled and stored, and found stored (startup_breakdown.py reports it);
# "compile_wall" is the wall time of `compile_all` (its compiles overlap, so it is less than their sum)
STATS = {"compiled": 0, "compile_seconds": 0.0, "found": 0, "compile_wall": 0.0}
_nvrtc: nvrtc.Compiler | None = None
_nvrtc_error: str | None = None
_lock = threading.Lock()  # the shared state below; never held through a compile
_module_locks: dict[str, threading.Lock] = {}
_recording = threading.local()
_announced = False  # the first-run notice was given


def _compiler() -> nvrtc.Compiler | None:
    global _nvrtc, _nvrtc_error
    if _nvrtc is None and _nvrtc_error is None:
        try:
            _nvrtc = _make_compiler()
        except (OSError, RuntimeError, AttributeError) as e:
            _nvrtc_error = str(e)
            log.info("kernels are compiled in each process (%s)", e)
    return _nvrtc


def _module_files(func_name: str, source: str) -> tuple[str, list[Path]]:
    """The module name MLX gives `source` and its file in each folder MLX may read."""
    module = f"{func_name}_{std_hash(source.encode()):x}"
    return module, [module_path(d, module) for d in mlx_cache_dirs()]


def store(func_name: str, source: str) -> Path | None:
    """Compiles `source` (as MLX would) into MLX's cache folder unless it is there: the module's
    path, or None where nothing could be stored (no NVRTC, a read-only folder; MLX then compiles)."""
    module, paths = _module_files(func_name, source)
    if all(p.is_file() for p in paths):
        with _lock:
            STATS["found"] += 1
        return paths[0]
    with _lock:
        module_lock = _module_locks.setdefault(module, threading.Lock())
    # one compile of a module at a time in this process, different modules at once (NVRTC compiles
    # distinct programs concurrently and ctypes lets other threads run); another process may race:
    # renames are whole
    with module_lock:
        have = next((p for p in paths if p.is_file()), None)
        if have is not None:  # stored in one folder (or by another thread), copied to the other
            kernel, mangled = have.with_suffix(".txt").read_text().rstrip("\n").split("\t")
            code = have.read_bytes()
        else:
            _announce(paths[0].parent)
            compiler = _compiler()
            if compiler is None:
                return None
            t0 = time.perf_counter()
            kernel = "mlx::core::cu::" + func_name
            code, mangled = compiler.compile(source, module, kernel)
            with _lock:
                STATS["compiled"] += 1
                STATS["compile_seconds"] += time.perf_counter() - t0
        for p in paths:
            try:
                nvrtc.write_module([p], kernel, code, mangled)
            except OSError as e:
                log.info("could not keep compiled kernel %s in %s (%s)", module, p.parent, e)
    return paths[0]


def _announce(folder: Path) -> None:
    """Once per process: a first run on this GPU / MLX pauses to compile, and says so."""
    global _announced
    with _lock:
        first, _announced = not _announced and _compiler() is not None, True
    if first:
        log.info("compiling this model's CUDA kernels for this GPU and MLX version (first run only, a few "
                 "seconds; kept in %s)", folder)


class recording:
    """Within this context (this thread only) a `CudaKernel` call launches nothing: it records the
    variant MLX would compile for it (`variants`: module function name -> source) and returns zeros
    of the output shapes. It lists what a piece of code will launch (a model's self-tests, its
    products at every row count) so that `compile_all` can compile it all at once, before any of it
    runs; nothing recorded may be evaluated for its values."""

    def __init__(self) -> None:
        self.variants: dict[str, str] = {}

    def __enter__(self) -> "recording":
        self._outer = getattr(_recording, "active", None)
        _recording.active = self
        return self

    def __exit__(self, *exc) -> None:
        _recording.active = self._outer


def compile_all(variants: dict[str, str], workers: int | None = None, timeout: float = 600.0) -> int:
    """Compiles and stores every variant not stored yet, in `workers` processes at once (default:
    one per core, at most one per variant; `nvrtc.py` says why processes): a first run on a GPU pays
    for its slowest kernel instead of the sum of them all. Returns how many were compiled; one that
    fails or times out is left to its first launch, which MLX then compiles as it always did."""
    jobs, copies = [], []
    for func, source in sorted(variants.items()):
        module, paths = _module_files(func, source)
        if all(p.is_file() for p in paths):
            with _lock:
                STATS["found"] += 1
        elif any(p.is_file() for p in paths):
            copies.append((func, source))  # stored in one folder: `store` copies it
        else:
            jobs.append({"module": module, "kernel": "mlx::core::cu::" + func, "source": source,
                         "paths": [str(p) for p in paths]})
    for item in copies:
        store(*item)
    compiler = _compiler() if jobs else None
    if compiler is None:
        return 0
    _announce(Path(jobs[0]["paths"][0]).parent)
    n = max(1, min(len(jobs), workers or os.cpu_count() or 1))
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n, thread_name_prefix="mtp-nvrtc") as pool:  # each thread waits on one process
        results = [r for rs in pool.map(lambda share: _run_worker(compiler.spec, share, timeout),
                                        [jobs[i::n] for i in range(n)]) for r in rs]
    done = [r for r in results if r.get("ok")]
    for r in results:
        if not r.get("ok"):
            log.info("kernel %s not compiled ahead (its first launch compiles it): %s", r["module"], r.get("error"))
    compiled = [r for r in done if r.get("compiled")]
    with _lock:
        STATS["compiled"] += len(compiled)
        STATS["compile_seconds"] += sum(r.get("seconds", 0.0) for r in compiled)
        STATS["compile_wall"] += time.perf_counter() - t0
    return len(compiled)


def _run_worker(spec: dict, jobs: list[dict], timeout: float) -> list[dict]:
    """One `nvrtc.py` process compiling `jobs`: its result lines (a failed process: every job failed)."""
    try:
        proc = subprocess.run([sys.executable, "-I", nvrtc.__file__], input=json.dumps({"compiler": spec, "jobs": jobs}),
                              capture_output=True, text=True, timeout=timeout)
        results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        error = proc.stderr.strip()[-500:] or f"exit status {proc.returncode}"
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        results, error = [], str(e)
    seen = {r.get("module") for r in results}
    return results + [{"module": j["module"], "ok": False, "error": error} for j in jobs if j["module"] not in seen]


class CudaKernel:
    """`mx.fast.cuda_kernel` whose compiled variants are kept on disk across processes (see the
    module's doc). Called like MLX's kernel; on anything but a CUDA GPU it is MLX's kernel alone."""

    def __init__(self, name: str, input_names: list[str], output_names: list[str], source: str,
                 header: str = "", ensure_row_contiguous: bool = True):
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.source, self.header = source, header
        self._contiguous = ensure_row_contiguous
        self._mlx_kernel = None  # built at the first launch: a `recording` needs none (nor a CUDA back-end)
        self._stored: set = set()  # variants already looked up in this process

    @property
    def _kernel(self):
        if self._mlx_kernel is None:
            self._mlx_kernel = mx.fast.cuda_kernel(name=self.name, input_names=self.input_names,
                                                   output_names=self.output_names, source=self.source,
                                                   header=self.header, ensure_row_contiguous=self._contiguous)
        return self._mlx_kernel

    def variant_source(self, inputs: list[mx.array], template: list, output_dtypes: list) -> tuple[str, str]:
        """(kernel name, source) MLX builds for these inputs and template arguments."""
        func = "custom_kernel_" + self.name + template_suffix(template)
        meta = [(x.dtype, x.ndim) for x in inputs]
        return func, build_source(func, self.header, self.source, self.input_names, meta, self.output_names,
                                  output_dtypes, template)

    def __call__(self, *, inputs: list[mx.array], template: list, grid, threadgroup, output_shapes,
                 output_dtypes, **kw) -> list[mx.array]:
        rec = getattr(_recording, "active", None)
        if rec is not None:
            func, source = self.variant_source(inputs, template, output_dtypes)
            rec.variants[func] = source
            return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        key = (tuple(template), tuple((x.dtype, x.ndim) for x in inputs), tuple(output_dtypes))
        if key not in self._stored:
            self._stored.add(key)
            try:
                store(*self.variant_source(inputs, template, output_dtypes))
            except (RuntimeError, OSError, KeyError) as e:  # MLX compiles it itself, as before
                log.info("kernel %s not kept across processes: %s", self.name, e)
        return self._kernel(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                            output_shapes=output_shapes, output_dtypes=output_dtypes, **kw)
