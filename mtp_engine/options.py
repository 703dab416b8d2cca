"""Engine options: how a loaded model runs (compiled steps, which kernels, row padding) and where
the engine keeps what it learns (cache folder), within what memory.

One `EngineOptions` is given to `load(..., options=...)` and kept on the loaded model
(`model.options`); two models in one process may run with different options. A field left at None
takes its default from the environment (read here and nowhere else), then from the device:

| field | variable | default |
|---|---|---|
| `compile_steps` | `MTP_ENGINE_COMPILE` (`0`/`1`) | on a GPU, off on the CPU |
| `joint_read` | `MTP_ENGINE_JOINT_READ` (`0`/`1`) | off (on: where it has run on the device) |
| `kernels` | `MTP_ENGINE_QMV` (`custom`/`mlx`/a list) | `custom` (used only on a CUDA GPU) |
| `row_pad` | `MTP_ENGINE_PAD_ROWS` (an integer) | 8 on a GPU, 0 on the CPU |
| `dequant_rows` | `MTP_ENGINE_DEQUANT_ROWS` (an integer) | 256 on a GPU, 0 on the CPU |
| `prefill_chunk` | `MTP_ENGINE_PREFILL_CHUNK` (an integer) | 4096 on a GPU, 512 on the CPU |
| `draft_vocab` | `MTP_ENGINE_DRAFT_VOCAB` (an integer) | 0 (the whole vocabulary) |
| `kv_tail` | `MTP_ENGINE_KV_TAIL` (an integer) | 256 |
| `kv_dtype` | `MTP_ENGINE_KV_DTYPE` (`float32`/`float16`/`bfloat16`) | float32 |
| `cache_dir` | `MTP_ENGINE_CACHE_DIR` | `~/.cache/mtp-engine` |
| `memory_limit` | `MTP_ENGINE_MEMORY_LIMIT` (bytes) | what the machine has |
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Mapping

from .errors import MTPEngineError

ENV_MODEL = "MTP_ENGINE_MODEL"  # the file `load()` opens when given none (not an option: which model, not how)
ENV_PREPARE = "MTP_ENGINE_MLX_PREPARE_WORKERS"  # processes compiling MLX's modules ahead at load (0: none)
ENV = {"compile_steps": "MTP_ENGINE_COMPILE", "joint_read": "MTP_ENGINE_JOINT_READ", "kernels": "MTP_ENGINE_QMV",
       "row_pad": "MTP_ENGINE_PAD_ROWS", "dequant_rows": "MTP_ENGINE_DEQUANT_ROWS",
       "prefill_chunk": "MTP_ENGINE_PREFILL_CHUNK", "kv_dtype": "MTP_ENGINE_KV_DTYPE",
       "draft_vocab": "MTP_ENGINE_DRAFT_VOCAB", "kv_tail": "MTP_ENGINE_KV_TAIL", "cache_dir": "MTP_ENGINE_CACHE_DIR",
       "memory_limit": "MTP_ENGINE_MEMORY_LIMIT"}

# the custom CUDA kernels, by name: few-row quantized products, the fused gated-delta-net layer,
# the fused residual add + RMSNorm
KERNELS = ("qmv", "gdn", "norm", "attn")
DEQUANT_ROWS_GPU = 256  # `dequant_rows` on a GPU
# prompt tokens per prefill forward: on an H100 at the 9B shape a 4096-token chunk ran at 9.8k tok/s
# against 4.8k for 512 (per-operation costs spread over more rows); on the CPU rows cost what they
# compute, and a small chunk keeps the peak memory low
PREFILL_CHUNK = {"gpu": 4096, "cpu": 512}
# the attention caches' element type: decoding reads the whole cache every step (a 32k context at
# the 9B shape: 2.1 GB in float32, 1.05 GB in 16 bits, as llama.cpp's default f16 cache and
# mlx-lm's bf16 one). On an H100 a 16-bit cache changed a 32k decode step by less than the noise
# (6.64 ms float16, 6.51 float32, once compiled steps stopped copying the cache) while moving
# logits by ~1e-3, so float32 stays the default everywhere; 16 bits halve the cache's memory
KV_DTYPES = ("float32", "float16", "bfloat16")
KV_DTYPE = "float32"
# positions a compiled step's KV tail holds (`model/kv_cache.py`): a pipelined step copies the
# tail it writes (the step in flight reads it), 256 positions at the 9B shape are 16 MB a step
# over 8 layers in float32; the main buffer is written once per ~256 steps. On an H100 at 8192
# tokens of context decoding ran 1.42x faster with it, at 512 0.97x (noise)
KV_TAIL = 256
_SWITCHES = ("compile_steps", "joint_read")  # on/off fields (`0`/`1` in the environment)
_COUNTS = {"row_pad": 0, "dequant_rows": 0, "prefill_chunk": 1, "draft_vocab": 0, "kv_tail": 0}  # least values


def parse_kernels(value: str, what: str = "kernels") -> frozenset[str]:
    """"custom" (all of `KERNELS`), "mlx" (none: MLX's operations throughout) or a comma-separated
    subset of `KERNELS` (benchmarks compare them one at a time)."""
    v = value.strip().lower()
    if v == "custom":
        return frozenset(KERNELS)
    if v in ("mlx", "none", ""):
        return frozenset()
    names = {p.strip() for p in v.split(",") if p.strip()}
    bad = sorted(names - set(KERNELS))
    if bad:
        raise MTPEngineError(f"expected custom, mlx or a comma-separated subset of {','.join(KERNELS)}, "
                             f"found {value!r}", field=what)
    return frozenset(names)


def model_path_from_env(environ: Mapping[str, str] | None = None) -> str | None:
    """$MTP_ENGINE_MODEL, the model `load()` opens when given no path (None when unset)."""
    env = os.environ if environ is None else environ
    return env.get(ENV_MODEL) or None


def mlx_kernel_cache_dir() -> str | None:
    """$MLX_PTX_CACHE_DIR: where MLX's CUDA backend keeps the kernels it compiles (None: unset,
    MLX's default under the temp folder)."""
    return os.environ.get("MLX_PTX_CACHE_DIR") or None


def keep_mlx_kernels_in(folder: str | os.PathLike) -> None:
    """Points MLX's kernel cache (`$MLX_PTX_CACHE_DIR`) at `folder` unless the user chose one: MLX
    reads the variable itself, once, at its first compile, so the engine's only way to tell it is
    the environment (written here, the one module that touches it)."""
    if mlx_kernel_cache_dir() is None:
        os.environ["MLX_PTX_CACHE_DIR"] = str(folder)


def mlx_prepare_workers(environ: Mapping[str, str] | None = None) -> int | None:
    """$MTP_ENGINE_MLX_PREPARE_WORKERS: how many worker processes compile MLX's own CUDA modules
    while a model loads (`model/kernels/mlx_jit.py`; 0: none, the first run compiles them as it
    meets them; unset: the engine's choice from the machine's cores)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_PREPARE, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) > 64:
        raise MTPEngineError(f"expected a whole number of processes from 0 to 64, found {raw!r}", field=ENV_PREPARE)
    return int(raw)


def worker_environment(python_path: str, **extra: str) -> dict[str, str]:
    """This process's environment for one of the engine's worker processes: `python_path` first
    on its PYTHONPATH (it imports the package as this process does, wherever that came from),
    and `extra`."""
    path = os.pathsep.join(p for p in (python_path, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def cuda_home() -> str:
    """The CUDA toolkit folder for headers: $CUDA_HOME, else $CUDA_PATH, else /usr/local/cuda."""
    return os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"


def _on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device() == mx.gpu


@dataclass(frozen=True)
class EngineOptions:
    """How a loaded model runs. None fields are filled by `resolve` (environment, then device).

    - `compile_steps`: forwards of at most 16 rows (decode, draft, verify, catch-up) as one compiled
      graph each (`model/step.py`); measured faster on a GPU, a few percent slower on MLX's CPU.
    - `joint_read`: fresh prompts joining a batch together are read in one forward per group, each
      row computing what it computes alone (`batching.scheduler`); off: each in a forward of its own.
      Where a forward's cost is its operations' dispatch (a GPU) one forward for the group is the
      point; where it is the arithmetic (MLX's CPU) the group's first tokens all wait for the whole
      group: 8 streams of 48-token prompts took a 40% longer median time to first token there.
      Off by default on every device until its speed is measured on a GPU: there its rows compute
      as alone (`tests/batching/test_joint_read.py` passes on an H100), the time to first token it
      is meant to save is unmeasured.
    - `kernels`: "custom", "mlx" or a subset such as "qmv,norm" (see `parse_kernels`); custom
      kernels run only on a CUDA GPU and only after they pass their self-test in this process.
    - `row_pad`: quantized products of 2..row_pad-1 rows (those the custom kernel does not take)
      are padded to row_pad rows (MLX's GPU path for 2..7 rows costs more than for 8); 0: never.
    - `dequant_rows`: quantized products of at least this many tokens per sequence (prefill chunks)
      dequantize the weight and run a dense product (on a GPU several times the 4-bit product's
      rate, on the tensor cores' float32 mode); 0: never.
    - `prefill_chunk`: prompt tokens per prefill forward, fewer past 8192 positions so that a chunk's
      attention scores stay bounded (`model.memory.prefill_chunk_at`); peak memory grows with it.
    - `draft_vocab`: the MTP head drafts over the first N token ids only (a BPE vocabulary's
      earliest merges, the most frequent tokens): its output product reads N rows instead of the
      whole vocabulary at every draft step. Lossless: the verify decides every token, and a
      sampled draft's distribution is zero outside those ids. 0: the whole vocabulary.
    - `kv_tail`: positions of the tail compiled steps write new keys into (`model/kv_cache.py`:
      the whole-context buffer is then written once per ~kv_tail steps instead of copied every
      pipelined step); 0: none.
    - `kv_dtype`: the attention KV caches' element type ("float32", "float16" or "bfloat16");
      attention itself computes in float32 either way.
    - `cache_dir`: where round costs measured by earlier runs are kept (and, on CUDA, MLX's
      compiled kernels unless `MLX_PTX_CACHE_DIR` is set).
    - `memory_limit`: bytes a load may use; None: what the machine reports.
    """

    compile_steps: bool | None = None
    joint_read: bool | None = None
    kernels: str | None = None
    row_pad: int | None = None
    dequant_rows: int | None = None
    prefill_chunk: int | None = None
    draft_vocab: int | None = None
    kv_tail: int | None = None
    kv_dtype: str | None = None
    cache_dir: str | os.PathLike | None = None
    memory_limit: int | None = None
    # where each resolved value came from ("MTP_ENGINE_MEMORY_LIMIT", "argument", "device"): errors name it
    sources: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        for name in _SWITCHES:
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise MTPEngineError(f"expected True or False, found {v!r}", field=name)
        if self.kernels is not None:
            parse_kernels(self.kernels)
        for name, low in _COUNTS.items():
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
                raise MTPEngineError(f"expected an integer >= {low}, found {v!r}", field=name)
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            raise MTPEngineError(f"expected one of {', '.join(KV_DTYPES)}, found {self.kv_dtype!r}", field="kv_dtype")
        if self.memory_limit is not None and (not isinstance(self.memory_limit, int)
                                              or isinstance(self.memory_limit, bool) or self.memory_limit < 0):
            raise MTPEngineError(f"expected a number of bytes >= 0, found {self.memory_limit!r}",
                                 field="memory_limit")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> "EngineOptions":
        """The options the environment sets (others None). The only place the engine reads its
        environment variables."""
        env = os.environ if environ is None else environ
        values: dict = {}
        for name in _SWITCHES:
            raw = env.get(ENV[name])
            if raw is not None and raw != "":
                if raw not in ("0", "1"):  # "true" was once ignored without a word
                    raise MTPEngineError(f"expected 0 or 1, found {raw!r}", field=ENV[name])
                values[name] = raw == "1"
        raw = env.get(ENV["kernels"])
        if raw:
            parse_kernels(raw, ENV["kernels"])
            values["kernels"] = raw
        for name, low in _COUNTS.items():
            raw = env.get(ENV[name])
            if raw is not None and raw != "":
                if not (raw.isascii() and raw.isdigit()) or int(raw) < low:  # "-3" was once ignored
                    raise MTPEngineError(f"expected an integer >= {low}, found {raw!r}", field=ENV[name])
                values[name] = int(raw)
        raw = env.get(ENV["kv_dtype"])
        if raw:
            if raw not in KV_DTYPES:
                raise MTPEngineError(f"expected one of {', '.join(KV_DTYPES)}, found {raw!r}", field=ENV["kv_dtype"])
            values["kv_dtype"] = raw
        raw = env.get(ENV["cache_dir"])
        if raw:
            values["cache_dir"] = raw
        raw = env.get(ENV["memory_limit"])
        if raw is not None:
            try:
                limit = int(raw)
            except ValueError:
                raise MTPEngineError(f"expected a number of bytes, found {raw!r}", field=ENV["memory_limit"]) from None
            if limit < 0:
                raise MTPEngineError(f"expected a number of bytes >= 0, found {limit}", field=ENV["memory_limit"])
            values["memory_limit"] = limit
        return cls(**values, sources={k: ENV[k] for k in values})

    def resolve(self, environ: Mapping[str, str] | None = None) -> "EngineOptions":
        """Every None field filled: from the environment, then from the device. Fields set here win."""
        env = EngineOptions.from_env(environ)
        sources = dict(self.sources)
        values = {}
        for f in fields(self):
            if f.name == "sources":
                continue
            mine = getattr(self, f.name)
            if mine is not None:
                values[f.name] = mine
                sources.setdefault(f.name, "argument")
            elif getattr(env, f.name) is not None:
                values[f.name] = getattr(env, f.name)
                sources[f.name] = env.sources[f.name]
        gpu = None
        if "compile_steps" not in values:
            gpu = _on_gpu()
            values["compile_steps"], sources["compile_steps"] = gpu, "device"
        if "row_pad" not in values:
            gpu = _on_gpu() if gpu is None else gpu
            values["row_pad"], sources["row_pad"] = (8 if gpu else 0), "device"
        if "dequant_rows" not in values:
            gpu = _on_gpu() if gpu is None else gpu
            values["dequant_rows"], sources["dequant_rows"] = (DEQUANT_ROWS_GPU if gpu else 0), "device"
        if "prefill_chunk" not in values:
            gpu = _on_gpu() if gpu is None else gpu
            values["prefill_chunk"], sources["prefill_chunk"] = PREFILL_CHUNK["gpu" if gpu else "cpu"], "device"
        values.setdefault("joint_read", False)  # (off until measured on a GPU: `EngineOptions`' docstring)
        values.setdefault("draft_vocab", 0)
        values.setdefault("kv_tail", KV_TAIL)
        values.setdefault("kv_dtype", KV_DTYPE)
        values.setdefault("kernels", "custom")
        if "cache_dir" not in values:
            values["cache_dir"] = os.path.join(os.path.expanduser("~"), ".cache", "mtp-engine")
        return EngineOptions(**values, sources=sources)

    @property
    def kernel_set(self) -> frozenset[str]:
        """The custom kernels these options allow (none when `kernels` is unset or "mlx")."""
        return parse_kernels(self.kernels) if self.kernels is not None else frozenset()

    @property
    def cache_path(self) -> Path:
        """`cache_dir` as a Path (the default folder when unset)."""
        return Path(self.cache_dir if self.cache_dir is not None else self.resolve().cache_dir)

    def updated(self, **changes) -> "EngineOptions":
        """A copy with `changes` (which count as given by argument)."""
        sources = {k: v for k, v in self.sources.items() if k not in changes}
        return replace(self, **changes, sources=sources)
