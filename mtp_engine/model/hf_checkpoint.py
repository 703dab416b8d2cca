"""An HF checkpoint folder, checked before any weight is read: config.json, the safetensors shards
(with `model.safetensors.index.json` when sharded) and every tensor's dtype and shape from the
shard headers. Tensors are then read one at a time, lazily, through MLX (which reads bf16
natively), so a load never holds more than the tensor in hand beside what it has built.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass

import mlx.core as mx

from ..errors import MTPEngineError
from .config import Qwen35Config
from .hf_layout import Quantized, canonical_key

# model_type / architectures values of the Qwen3.5 family we run (text part of the VLM checkpoints too)
MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                 "Qwen3_5MoeForConditionalGeneration")
INDEX_NAME = "model.safetensors.index.json"
_DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                "U16": 2, "U8": 1, "I8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
_FLOAT_DTYPES = ("F32", "F16", "BF16")
_MAX_HEADER = 100 << 20  # safetensors' own limit


@dataclass
class StoredTensor:
    file: str
    key: str  # the name inside the file
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = _DTYPE_BYTES.get(self.dtype, 4)
        for d in self.shape:
            n *= d
        return n


MAX_CONFIG_BYTES = 4 << 20  # a model's config.json is a few KB


def read_header(path: str) -> dict[str, StoredTensor]:
    """The tensors a safetensors file declares (name -> dtype, shape); reads no tensor data."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("shorter than the 8-byte header length")
            n = struct.unpack("<Q", head)[0]
            if n > min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {n} exceeds the file ({size} bytes)")
            header = json.loads(f.read(n))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        out = {}
        for k, meta in header.items():
            if k == "__metadata__":
                continue
            s, e = meta["data_offsets"]
            shape = tuple(int(d) for d in meta["shape"])
            t = StoredTensor(path, k, str(meta["dtype"]), shape)
            if t.dtype not in _DTYPE_BYTES:
                raise ValueError(f"tensor {k}: unknown dtype {t.dtype!r}")
            if e - s != t.nbytes or 8 + n + e > size:
                raise ValueError(f"tensor {k}: {e - s} bytes at offset {s} do not hold {t.dtype} {list(shape)} "
                                 f"inside the {size}-byte file")
            out[k] = t
        return out
    except MTPEngineError:
        raise
    except (OSError, ValueError, KeyError, TypeError, struct.error) as e:
        raise MTPEngineError(f"unreadable safetensors file: {e}", file=path) from None


def check_architecture(raw: dict, source: str) -> None:
    """Refuses a config.json of any other model family, naming what it found."""
    mt = raw.get("model_type")
    text_mt = (raw.get("text_config") or {}).get("model_type") if isinstance(raw.get("text_config"), dict) else None
    archs = raw.get("architectures") or []
    if mt in MODEL_TYPES or text_mt in MODEL_TYPES or any(a in ARCHITECTURES for a in archs if isinstance(a, str)):
        return
    raise MTPEngineError(f"unsupported architecture: model_type {mt!r}, architectures {archs!r:.80}; expected a "
                         f"Qwen3.5 checkpoint (model_type one of {list(MODEL_TYPES)})", file=source, field="model_type")


class HFCheckpoint:
    """A checked HF (or mlx-lm) Qwen3.5 checkpoint folder; tensors by their canonical HF names."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = str(directory)
        if not os.path.isdir(self.directory):
            raise MTPEngineError("expected a checkpoint folder", file=self.directory)
        self.config_path = os.path.join(self.directory, "config.json")
        if not os.path.isfile(self.config_path):
            raise MTPEngineError("missing config.json: an HF checkpoint folder needs one", file=self.config_path)
        try:
            if os.path.getsize(self.config_path) > MAX_CONFIG_BYTES:
                raise MTPEngineError(f"larger than {MAX_CONFIG_BYTES >> 20} MiB: not a model's config",
                                     file=self.config_path)
            with open(self.config_path, encoding="utf-8") as f:
                self.raw_config = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as e:  # ValueError: bad JSON, 4300+ digit integers
            raise MTPEngineError(f"unreadable JSON: {e}", file=self.config_path) from None
        except RecursionError:
            raise MTPEngineError("unreadable JSON: nested too deep", file=self.config_path) from None
        if not isinstance(self.raw_config, dict):
            raise MTPEngineError("expected a JSON object", file=self.config_path)
        check_architecture(self.raw_config, self.config_path)
        try:
            self.cfg = Qwen35Config.from_hf(self.raw_config, self.config_path)
        except (TypeError, ValueError, AttributeError, OverflowError, RecursionError) as e:
            if isinstance(e, MTPEngineError):
                raise
            raise MTPEngineError(f"malformed value: {type(e).__name__}: {str(e)[:200]}", file=self.config_path) from None
        self.tensors: dict[str, StoredTensor] = {}
        for path in self._shards():
            for key, t in read_header(path).items():
                name = canonical_key(key)
                if name is not None:
                    self.tensors[name] = t
        if not self.tensors:
            raise MTPEngineError("the safetensors files hold no tensors", file=self.directory)
        self.quantized = any(n.endswith(".scales") for n in self.tensors)
        # mlx-lm's converted layout stores conv weights as [C, K, 1] and norms with the 1 added
        convs = [t.shape for n, t in self.tensors.items() if n.endswith("conv1d.weight")]
        self.norms_offset_applied = bool(convs) and len(convs[0]) == 3 and convs[0][1] != 1
        self.has_mtp = any(n.startswith("mtp.") for n in self.tensors)
        self._open: dict[str, dict[str, mx.array]] = {}

    def _shards(self) -> list[str]:
        index = os.path.join(self.directory, INDEX_NAME)
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
                raise MTPEngineError(f"malformed index (expected a 'weight_map' of tensor -> file): "
                                     f"{type(e).__name__}: {str(e)[:200]}", file=index) from None
            paths = []
            for fn in files:
                path = os.path.join(self.directory, str(fn))
                if os.path.basename(str(fn)) != str(fn) or not os.path.isfile(path):
                    raise MTPEngineError(f"missing shard {fn!r} named by the index", file=path)
                paths.append(path)
            declared = {}
            for p in paths:
                declared.update({k: p for k in read_header(p)})
            for key, fn in weight_map.items():
                if declared.get(key) != os.path.join(self.directory, fn):
                    raise MTPEngineError(f"tensor {key!r} is listed for this shard but not stored in it",
                                         file=os.path.join(self.directory, fn))
            return paths
        files = sorted(f for f in os.listdir(self.directory) if f.endswith(".safetensors"))
        if not files:
            raise MTPEngineError("no *.safetensors files (and no model.safetensors.index.json)",
                                 file=self.directory)
        return [os.path.join(self.directory, f) for f in files]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def file_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in {t.file for t in self.tensors.values()})

    def _lazy(self, name: str) -> mx.array:
        """The stored array, lazily (read when evaluated). It is taken out of the shard's table, so
        once the caller has used and dropped it nothing here keeps its data alive."""
        t = self.tensors[name]
        if t.file not in self._open:
            try:
                self._open[t.file] = mx.load(t.file)
            except Exception as e:  # MLX reports unreadable files and dtypes as RuntimeError/ValueError
                raise MTPEngineError(f"unreadable safetensors file: {e}", file=t.file) from None
        arr = self._open[t.file].pop(t.key, None)
        if arr is None:
            raise MTPEngineError("tensor already read or absent", file=t.file, field=t.key)
        return arr

    def read(self, name: str, in_features: int | None = None) -> mx.array | Quantized:
        """Tensor `name` (canonical, e.g. `model.layers.0.mlp.up_proj.weight`): a lazy float array,
        or `Quantized` when the folder stores it quantized (`in_features` then recovers bits and
        group size from the packed shapes, as mlx-lm does)."""
        t = self.tensors[name]
        base = name[: -len(".weight")] if name.endswith(".weight") else name
        if base + ".scales" in self.tensors:
            scales_t, biases_t = self.tensors[base + ".scales"], self.tensors.get(base + ".biases")
            if biases_t is None or in_features is None or t.dtype != "U32":
                raise MTPEngineError("expected an affine-quantized tensor (uint32 weight, scales, biases)",
                                     file=t.file, field=t.key)
            bits = t.shape[-1] * 32 // in_features
            group = in_features // max(scales_t.shape[-1], 1)
            if bits not in (2, 3, 4, 5, 6, 8) or group not in (32, 64, 128) or group * scales_t.shape[-1] != \
                    in_features or bits * in_features != 32 * t.shape[-1]:
                raise MTPEngineError(f"packed shape {list(t.shape)} with scales {list(scales_t.shape)} does not "
                                     f"hold {in_features} inputs at 2-8 bits in groups of 32/64/128",
                                     file=t.file, field=t.key)
            return Quantized(self._lazy(name), self._lazy(base + ".scales"), self._lazy(base + ".biases"),
                             bits, group)
        if t.dtype not in _FLOAT_DTYPES:
            raise MTPEngineError(f"unsupported dtype {t.dtype}: expected one of {list(_FLOAT_DTYPES)}",
                                 file=t.file, field=t.key)
        return self._lazy(name)
