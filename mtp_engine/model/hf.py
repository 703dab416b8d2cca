"""Loading an HF Qwen3.5 checkpoint folder at full size, quantizing each tensor as it is read.

Tensors are read one at a time (lazily, from the shards' memory), quantized with MLX's affine
scheme when asked (`QuantSpec`), converted to the engine's conventions (`hf_layout.to_engine`),
evaluated, and the float copy dropped before the next one is read: the load's peak is the
finished model plus the tensor in hand. Matrices that are not quantized stay in their stored
dtype (bf16 stays bf16); vectors (norms, conv, gates) become float32. Quantization is done in the
checkpoint's own (HF) order and dtype, exactly as `mtp-engine convert` writes it, so a model
quantized on load equals the same model converted and then loaded.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..errors import MTPEngineError
from ..options import EngineOptions
from .build import build_model
from .config import Qwen35Config
from .hf_checkpoint import HFCheckpoint
from .hf_layout import FUSED_GATE_UP, Quantized, hf_to_gguf_names, to_engine
from .hf_layout import quantize as quantize_tensor
from .layers import Linear
from .loader import LoadInfo
from .qwen35 import Qwen35Model

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
_SPEC = re.compile(r"^(\d+)(?:g(\d+))?$")


@dataclass(frozen=True)
class QuantSpec:
    """MLX affine quantization of the matrices: `bits` (4 or 8) per weight, one float scale and
    bias per `group_size` (32, 64 or 128) weights. `output` and `mtp` override it for the output
    head and the MTP head's matrices: a (bits, group_size) pair, or None to keep them unquantized;
    left at "same" they follow `bits`/`group_size`."""

    bits: int = 4
    group_size: int = 64
    output: tuple[int, int] | None | str = "same"
    mtp: tuple[int, int] | None | str = "same"

    def __post_init__(self):
        for what, v in (("quantize", (self.bits, self.group_size)), ("output", self.output), ("mtp", self.mtp)):
            if v is None or v == "same":
                continue
            if (not isinstance(v, tuple) or len(v) != 2 or v[0] not in BITS or v[1] not in GROUP_SIZES
                    or any(isinstance(x, bool) for x in v)):
                raise MTPEngineError(f"expected bits in {list(BITS)} and group size in {list(GROUP_SIZES)}, "
                                     f"found {v!r}", field=what)

    @classmethod
    def parse(cls, text: str | int | "QuantSpec" | None) -> "QuantSpec | None":
        """`4`, `8`, `4g32`, `8g128`, optionally `,output=8g64` / `,output=float`, `,mtp=...`;
        None/"none"/"float" -> None (no quantization)."""
        if text is None or isinstance(text, QuantSpec):
            return text
        if isinstance(text, int) and not isinstance(text, bool):
            return cls(bits=text)
        if not isinstance(text, str):
            raise MTPEngineError(f"expected a quantization like '4', '8g32' or '4g64,output=8g64', found {text!r}",
                                 field="quantize")
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if not parts or parts[0] in ("none", "float"):
            if len(parts) > 1:
                raise MTPEngineError(f"overrides need a quantization, found {text!r}", field="quantize")
            return None
        main = _pair(parts[0], "quantize")
        kw = {}
        for p in parts[1:]:
            key, _, value = p.partition("=")
            if key not in ("output", "mtp") or not value:
                raise MTPEngineError(f"expected output=BITS[gGROUP|float] or mtp=..., found {p!r}", field="quantize")
            kw[key] = None if value in ("float", "none") else _pair(value, key, default_group=main[1])
        return cls(bits=main[0], group_size=main[1], **kw)

    def for_tensor(self, gguf_name: str, n_layer: int) -> tuple[int, int] | None:
        """(bits, group_size) for the matrix `gguf_name`, or None to keep it in float. An MoE
        router (`ffn_gate_inp`: a few rows that pick the experts) gets 8 bits, group 64, as in
        mlx-lm, unless its head is kept in float."""
        role = self.output if gguf_name == "output.weight" else \
            self.mtp if gguf_name.startswith(f"blk.{n_layer}.") else "same"
        q = (self.bits, self.group_size) if role == "same" else role
        if q is not None and gguf_name.endswith("ffn_gate_inp.weight"):
            return (8, 64)
        return q

    def describe(self) -> str:
        def one(v):
            return "float" if v is None else f"{v[0]}g{v[1]}"
        s = f"{self.bits}g{self.group_size}"
        for k in ("output", "mtp"):
            if getattr(self, k) != "same":
                s += f",{k}={one(getattr(self, k))}"
        return s


def _pair(text: str, what: str, default_group: int = 64) -> tuple[int, int]:
    m = _SPEC.match(text)
    if not m:
        raise MTPEngineError(f"expected BITS or BITSgGROUP (e.g. 4, 8g32), found {text!r}", field=what)
    return int(m.group(1)), int(m.group(2) or default_group)


@dataclass
class HFLoadInfo(LoadInfo):
    """`LoadInfo` plus what a checkpoint load measured."""

    quantization: str = "none"
    largest_tensor_bytes: int = 0  # the largest stored tensor, in its stored dtype
    peak_memory_bytes: int = 0  # MLX's peak during the load, above what was held before it
    has_mtp_tensors: bool = False


def quantizable(shape: tuple, group: int) -> bool:
    """A matrix whose rows split into whole groups (MLX's quantized kernels need that)."""
    return len(shape) >= 2 and shape[-1] % group == 0


def expected_tensors(cfg: Qwen35Config, load_mtp: bool, has_tensor: Callable[[str], bool]) -> dict:
    """{GGUF name: (shape, matrix)} for every tensor the model reads, from a dry build on lazy
    zeros (never evaluated: costs no memory)."""
    seen: dict[str, tuple] = {}

    def fetch(name, shape, matrix):
        seen[name] = (tuple(shape), matrix)
        z = mx.zeros(shape)
        return Linear(z) if matrix else z

    build_model(cfg, fetch, has_tensor, load_mtp=load_mtp)
    return seen


def hf_source_names(cfg: Qwen35Config) -> dict[str, str]:
    """GGUF name -> canonical HF name (stacked experts excepted)."""
    return {g: h for h, g in hf_to_gguf_names(cfg).items() if g.startswith(("blk.", "token", "output"))
            and not g.endswith(("_exps.weight", FUSED_GATE_UP))}


class TensorSource:
    """The engine's tensors (GGUF names) read from a checkpoint one at a time: quantized as the
    spec says, in the engine's conventions; `fetch` is `build_model`'s source."""

    def __init__(self, ckpt: HFCheckpoint, spec: QuantSpec | None):
        self.ckpt, self.spec, self.cfg = ckpt, spec, ckpt.cfg
        self.names = hf_source_names(ckpt.cfg)

    def has(self, name: str) -> bool:
        if name.endswith("_exps.weight"):
            return True  # checked when read
        return name in self.names and self.ckpt.has(self.names[name])

    def check_shape(self, gguf_name: str, hf_name: str, shape: tuple, matrix: bool) -> None:
        """Compares the header's shape with the config's (quantized: packed columns unpacked)."""
        t = self.ckpt.tensors[hf_name]
        stored = t.shape
        if t.dtype == "U32" and hf_name[: -len(".weight")] + ".scales" in self.ckpt.tensors:
            stored = tuple(t.shape[:-1]) + (shape[-1],)  # the packing itself is checked when read
        want = tuple(shape)
        if gguf_name.endswith("ssm_conv1d.weight"):  # [C, 1, K] (HF), [C, K, 1] (mlx-lm) or [C, K]
            ok = len(stored) in (2, 3) and stored[0] == want[0] and math.prod(stored) == math.prod(want)
        else:
            lead = len(stored) - len(want)
            ok = stored == want or (not matrix and lead > 0 and all(n == 1 for n in stored[:lead])
                                    and stored[lead:] == want)
        if not ok:
            raise MTPEngineError(f"shape mismatch: expected {list(want)} for this config.json, found {list(stored)}",
                                 file=t.file, field=t.key)

    def _one(self, gguf_name: str, hf_name: str, shape: tuple, matrix: bool):
        self.check_shape(gguf_name, hf_name, shape, matrix)
        t = self.ckpt.tensors[hf_name]
        conv = gguf_name.endswith("ssm_conv1d.weight")
        w = self.ckpt.read(hf_name, in_features=shape[-1])
        if isinstance(w, Quantized) and self.spec is not None:
            raise MTPEngineError("this checkpoint is already quantized; load it without quantize=",
                                 file=t.file, field=t.key)
        q = self.spec.for_tensor(gguf_name, self.cfg.n_layer) if self.spec and matrix else None
        if q is not None and quantizable(shape, q[1]):
            # evaluated here, so the float source is freed before the reordering copies the codes
            holder = [w]
            del w
            w = quantize_tensor(holder, q[0], q[1])
        if isinstance(w, Quantized) and not matrix:
            w = w.dense()
        if not isinstance(w, Quantized) and not matrix:
            w = w.reshape(shape) if not conv else w
        return to_engine(gguf_name, w, self.cfg, self.ckpt.norms_offset_applied)

    def _experts(self, gguf_name: str, shape: tuple):
        """Stacked [E, out, in] experts from mlx-lm's `switch_mlp`, transformers' fused
        `gate_up_proj`/`down_proj`, or save_pretrained's per-expert matrices."""
        blk = int(gguf_name.split(".")[1])
        pre = f"model.layers.{blk}." if blk < self.cfg.n_layer else "mtp.layers.0."
        kind = gguf_name.split(".")[2].split("_")[1]  # gate / up / down
        stacked = f"{pre}mlp.switch_mlp.{kind}_proj.weight"
        if self.ckpt.has(stacked):
            return self._one(gguf_name, stacked, shape, True)
        fused = f"{pre}mlp.experts.{'down_proj' if kind == 'down' else 'gate_up_proj'}"
        if self.ckpt.has(fused):
            # transformers' in-memory layout: gate_up [E, 2F, H] = cat(gate, up), down [E, H, F]
            t = self.ckpt.tensors[fused]
            if kind == "down":
                return self._one(gguf_name, fused, shape, True)
            full = (shape[0], 2 * shape[1], shape[2])
            if t.shape != full:
                raise MTPEngineError(f"shape mismatch: expected {list(full)}, found {list(t.shape)}",
                                     file=t.file, field=t.key)
            w = self._cached_gate_up(fused)
            f = shape[1]
            part = w[:, :f] if kind == "gate" else w[:, f:]
            if kind == "up":
                self._gate_up = (None, None)  # gate and up are read one after the other
            return self._quantize_experts(gguf_name, [part[e] for e in range(shape[0])], shape)
        parts = []
        for e in range(shape[0]):
            name = f"{pre}mlp.experts.{e}.{kind}_proj.weight"
            if not self.ckpt.has(name):
                raise MTPEngineError(f"required tensor is missing (expert {e} of {shape[0]})",
                                     file=self.ckpt.directory, field=name)
            parts.append(self._one(gguf_name, name, shape[1:], True))
        return _stack(parts)

    def _cached_gate_up(self, name: str):
        if getattr(self, "_gate_up", (None,))[0] != name:
            self._gate_up = (name, self.ckpt.read(name))
        return self._gate_up[1]

    def _quantize_experts(self, gguf_name: str, parts: list, shape: tuple):
        q = self.spec.for_tensor(gguf_name, self.cfg.n_layer) if self.spec else None
        if q is not None and quantizable(shape, q[1]):
            parts = [quantize_tensor([p], q[0], q[1]) for p in parts]
        return _stack(parts)

    def fetch(self, name: str, shape: tuple, matrix: bool):
        if name.endswith("_exps.weight"):
            w = self._experts(name, tuple(shape))
        else:
            if not self.has(name):
                hf = self.names.get(name, name)
                raise MTPEngineError("required tensor is missing", file=self.ckpt.directory, field=hf)
            w = self._one(name, self.names[name], tuple(shape), matrix)
        if isinstance(w, Quantized):
            out = Linear(w.weight, w.scales.astype(mx.float32), w.biases.astype(mx.float32), w.bits, w.group_size)
            mx.eval(out.weight, out.scales, out.biases)
        elif matrix:
            out = Linear(w)
            mx.eval(out.weight)
        else:
            out = w
            mx.eval(out)
        return out


def _stack(parts: list):
    if isinstance(parts[0], Quantized):
        return Quantized(mx.stack([p.weight for p in parts]), mx.stack([p.scales for p in parts]),
                         mx.stack([p.biases for p in parts]), parts[0].bits, parts[0].group_size)
    return mx.stack(parts)


def require_output_head(ckpt: HFCheckpoint, has: Callable[[str], bool] | None = None) -> None:
    """Refuses a checkpoint whose config does not tie the output head to the embeddings but that
    stores none: the model build would fall back to the embeddings (GGUF's rule) and every logit
    would be wrong, silently (loading, `convert` to MLX and to GGUF all check it)."""
    has = has or TensorSource(ckpt, None).has
    if not ckpt.cfg.tied_embeddings and not has("output.weight"):
        raise MTPEngineError("required tensor is missing: config.json says tie_word_embeddings is false, so the "
                             "output head must be stored", file=ckpt.directory, field="lm_head.weight")


def load_checkpoint(directory: str | os.PathLike, quantize: QuantSpec | str | int | None = None,
                    load_mtp: bool = True,
                    progress: Callable[[int, int], None] | None = None,
                    options: EngineOptions | None = None) -> tuple[Qwen35Model, HFCheckpoint, HFLoadInfo]:
    """Loads an HF `Qwen3_5ForCausalLM`-family checkpoint folder (or one written by `mtp-engine
    convert` / mlx-lm), quantizing float matrices on the fly when `quantize` is given (see
    `QuantSpec.parse`). A checkpoint without `mtp.*` tensors loads without its MTP head."""
    spec = QuantSpec.parse(quantize)
    ckpt = HFCheckpoint(directory)
    src = TensorSource(ckpt, spec)
    info = HFLoadInfo(path=ckpt.directory, file_bytes=ckpt.file_bytes(), has_mtp_tensors=ckpt.has_mtp,
                      quantization=spec.describe() if spec else ("stored" if ckpt.quantized else "none"))
    for t in ckpt.tensors.values():
        if not t.key.endswith((".scales", ".biases")):
            info.tensor_types[t.dtype] = info.tensor_types.get(t.dtype, 0) + 1
    info.largest_tensor_bytes = max(t.nbytes for t in ckpt.tensors.values())
    want_mtp = load_mtp and ckpt.has_mtp
    require_output_head(ckpt, src.has)
    # every shape is checked against the headers before a byte of weights is read
    for name, (shape, matrix) in expected_tensors(ckpt.cfg, want_mtp, src.has).items():
        if name.endswith("_exps.weight"):
            continue  # stacked from several stored tensors: checked as they are read
        if not src.has(name):
            raise MTPEngineError("required tensor is missing", file=ckpt.directory, field=src.names.get(name, name))
        src.check_shape(name, src.names[name], shape, matrix)

    def fetch(name, shape, matrix):
        out = src.fetch(name, shape, matrix)
        # freed sources would otherwise stay in MLX's buffer cache, adding to the process's RSS
        mx.clear_cache()
        rep = (f"{out.bits}-bit g{out.group_size}" if out.quantized else str(out.weight.dtype).split(".")[-1]) \
            if isinstance(out, Linear) else "float32"
        info.representation[rep] = info.representation.get(rep, 0) + 1
        return out

    before = mx.get_active_memory()
    mx.reset_peak_memory()
    model = build_model(ckpt.cfg, fetch, src.has, load_mtp=want_mtp, progress=progress, options=options)
    info.peak_memory_bytes = int(mx.get_peak_memory() - before)
    sizes = model.nbytes()
    info.weight_bytes = sizes["trunk"] + sizes["mtp"]
    return model, ckpt, info


def estimate_checkpoint(ckpt: HFCheckpoint, spec: QuantSpec | None, load_mtp: bool = True) -> dict[str, int]:
    """Bytes the loaded weights will take (from the headers alone), and the load's transient: the
    largest stored tensor, held beside the model while it is converted."""
    src = TensorSource(ckpt, spec)
    weights = 0
    for name, (shape, matrix) in expected_tensors(ckpt.cfg, load_mtp and ckpt.has_mtp, src.has).items():
        n = math.prod(shape)
        t = ckpt.tensors.get(src.names.get(name, ""))
        q = spec.for_tensor(name, ckpt.cfg.n_layer) if spec and matrix else None
        if t is not None and t.dtype == "U32":  # stored quantized: codes, then float32 scales and biases
            scales = ckpt.tensors.get(src.names[name][: -len(".weight")] + ".scales")
            weights += t.nbytes + (2 * 4 * math.prod(scales.shape) if scales else 0)
        elif q is not None and quantizable(shape, q[1]):
            weights += n * q[0] // 8 + 8 * n // q[1]
        elif matrix:
            weights += n * (4 if t is not None and t.dtype == "F32" else 2)
        else:
            weights += 4 * n
    largest = max(t.nbytes for t in ckpt.tensors.values())
    return {"weights": weights, "load_transient": largest, "total": weights + largest}


def check_checkpoint_fits(directory: str | os.PathLike, quantize=None, load_mtp: bool = True,
                          options: EngineOptions | None = None) -> dict[str, int]:
    """`estimate_checkpoint`; raises MTPEngineError with both numbers when it exceeds the memory
    available (`memory.available_memory`). Context-dependent memory (KV cache, states) is not
    counted here: a checkpoint load is refused only when its weights cannot fit."""
    from .memory import available_memory

    ckpt = HFCheckpoint(directory)
    est = estimate_checkpoint(ckpt, QuantSpec.parse(quantize), load_mtp)
    limit, source = available_memory(options)
    if source != "unknown" and est["total"] > limit:
        gib = 1 << 30
        raise MTPEngineError(f"not enough memory: the weights need an estimated {est['total'] / gib:.2f} GiB "
                             f"({est['weights'] / gib:.2f} GiB held + {est['load_transient'] / gib:.2f} GiB for the "
                             f"largest tensor while it loads) but only {limit / gib:.2f} GiB ({source}) are available",
                             file=ckpt.directory, field="memory")
    return est


def load_hf(directory: str | os.PathLike, load_mtp: bool = True) -> Qwen35Model:
    """Loads an HF `Qwen3_5ForCausalLM` or `Qwen3_5MoeForCausalLM` checkpoint folder unquantized
    (bf16 matrices stay bf16); `mtp_engine.model.hf.load_checkpoint` also quantizes on load."""
    return load_checkpoint(directory, None, load_mtp)[0]
