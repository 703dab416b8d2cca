"""`mtp-engine convert`: an HF Qwen3.5 checkpoint to a quantized MLX folder that keeps the MTP head,
or to a GGUF file.

The MLX folder is in mlx-lm's layout: config.json (model_type `qwen3_5`/`qwen3_5_moe` and a
`quantization` entry with per-path overrides), `model-0000i-of-0000n.safetensors` shards with their
`model.safetensors.index.json`, and the tokenizer files. Quantized matrices are stored as
`<name>.weight` (uint32 codes), `<name>.scales`, `<name>.biases` from `mx.quantize` (float32 scales
by default, the checkpoint's dtype with `scales="source"` as `mlx_lm.convert`). Everything else keeps the HF form (norms without
the +1, conv [C, 1, K], A_log), which mlx-lm's `sanitize` turns into its own at load time; it also
drops the `mtp.*` tensors, so mlx-lm runs the trunk and mtp-engine runs trunk and MTP head from
the same folder. Tensors are read, quantized and written one at a time.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from typing import Callable

import mlx.core as mx

from ..errors import MTPEngineError
from ..model.hf import QuantSpec, expected_tensors, hf_source_names, quantizable, require_output_head
from ..model.hf_checkpoint import INDEX_NAME, HFCheckpoint
from ..model.hf_layout import Quantized, quantize
from ..output_files import staging_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "generation_config.json", "vocab.json", "merges.txt")
_MLX_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}
DEFAULT_SHARD_BYTES = 2 << 30


@dataclass
class ConvertReport:
    """What a conversion wrote."""

    out: str
    tensors: int = 0
    quantized: int = 0
    bytes_written: int = 0
    mtp_tensors: int = 0
    peak_memory_bytes: int = 0


def _prepare_out(out: str, overwrite: bool) -> None:
    if os.path.exists(out) and (not os.path.isdir(out) or os.listdir(out)) and not overwrite:
        raise MTPEngineError("output exists and is not an empty folder (pass overwrite=True / --force)", file=out)
    os.makedirs(out, exist_ok=True)


_EXPERT = re.compile(r"^(model\.layers\.\d+\.|mtp\.layers\.0\.)mlp\.experts\.(?:(\d+)\.(gate|up|down)_proj\.weight|"
                     r"(gate_up_proj|down_proj))$")


def _tensors(ckpt: HFCheckpoint):
    """(name to write, GGUF name when the engine multiplies by it, lazy float array or, for experts
    stored one by one, the list of them), one tensor at a time. MoE experts are written stacked as
    mlx-lm's `mlp.switch_mlp.{gate,up,down}_proj.weight` [E, out, in], whether stored per expert
    (save_pretrained) or fused (transformers' `gate_up_proj` / `down_proj`)."""
    names = hf_source_names(ckpt.cfg)
    shapes = expected_tensors(ckpt.cfg, True, lambda n: n in names and ckpt.has(names[n]))
    roles = {names[g]: g for g, (_, matrix) in shapes.items() if matrix and g in names}
    done = set()
    for name in list(ckpt.tensors):
        m = _EXPERT.match(name)
        if not m:
            yield name, roles.get(name), ckpt.read(name)
            continue
        prefix, index, kind, fused = m.groups()
        blk = prefix.split(".")[2] if prefix.startswith("model.") else str(ckpt.cfg.n_layer)

        def out(k: str) -> tuple[str, str]:
            return f"{prefix}mlp.switch_mlp.{k}_proj.weight", f"blk.{blk}.ffn_{k}_exps.weight"

        if fused == "gate_up_proj":
            w = ckpt.read(name)
            f = w.shape[1] // 2
            yield *out("gate"), w[:, :f]
            yield *out("up"), w[:, f:]
        elif fused == "down_proj":
            yield *out("down"), ckpt.read(name)
        elif (prefix, kind) not in done:
            done.add((prefix, kind))
            experts = []
            while ckpt.has(f"{prefix}mlp.experts.{len(experts)}.{kind}_proj.weight"):
                experts.append(ckpt.read(f"{prefix}mlp.experts.{len(experts)}.{kind}_proj.weight"))
            yield *out(kind), experts


def mlx_config(raw: dict, spec: QuantSpec | None) -> dict:
    """config.json for the MLX folder: mlx-lm's model_type, and its `quantization` entry (with
    per-module overrides for the output head, and `False` where a head is kept in float)."""
    cfg = dict(raw)
    if cfg.get("model_type") in _MLX_MODEL_TYPES:
        cfg["model_type"] = _MLX_MODEL_TYPES[cfg["model_type"]]
    if spec is not None:
        q: dict = {"group_size": spec.group_size, "bits": spec.bits, "mode": "affine"}
        if spec.output != "same":
            q["language_model.lm_head"] = False if spec.output is None else \
                {"group_size": spec.output[1], "bits": spec.output[0], "mode": "affine"}
        # mlx-lm never builds the MTP head; the entry records how it was stored, for readers that do
        if spec.mtp != "same":
            q["mtp"] = False if spec.mtp is None else {"group_size": spec.mtp[1], "bits": spec.mtp[0], "mode": "affine"}
        cfg["quantization"] = q
        cfg["quantization_config"] = dict(q)
    return cfg


def convert_to_mlx(src: str | os.PathLike, out: str | os.PathLike, quant: QuantSpec | str | int | None = 4,
                   *, scales: str = "float32", shard_bytes: int = DEFAULT_SHARD_BYTES, overwrite: bool = False,
                   progress: Callable[[int, int], None] | None = None) -> ConvertReport:
    """Writes `out`: checkpoint `src` quantized per `quant` (see `QuantSpec.parse`; None copies
    the floats), MTP tensors included. `scales="float32"` (default) stores what `load(src,
    quantize=quant)` holds, bit for bit; `scales="source"` quantizes in the checkpoint's dtype
    (bf16 scales and biases), exactly as `mlx_lm.convert` does: smaller and native to mlx-lm, but
    less accurate at 8 bits (see docs/quantization.md)."""
    if scales not in ("float32", "source"):
        raise MTPEngineError(f"expected 'float32' or 'source', found {scales!r}", field="scales")
    spec = QuantSpec.parse(quant)
    ckpt = HFCheckpoint(src)
    if ckpt.quantized or ckpt.norms_offset_applied:
        raise MTPEngineError("expected an HF float checkpoint; this folder is already in MLX form", file=ckpt.directory)
    require_output_head(ckpt)
    final = str(out)
    _prepare_out(final, overwrite)
    # built in a hidden sibling folder and moved in when complete: a failed or interrupted run
    # leaves no half-written model where `load` would find it (and a --force target as it was)
    staging = str(staging_path(final))
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        report = _write_folder(ckpt, spec, staging, scales, shard_bytes, progress)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _move_in(staging, final)
    report.out = final
    return report


def _move_in(staging: str, final: str) -> None:
    """Replaces folder `final` (empty, or --force) by `staging`."""
    old = f"{staging}.old"
    os.rename(final, old)
    os.rename(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def _write_folder(ckpt: HFCheckpoint, spec: QuantSpec | None, out: str, scales: str, shard_bytes: int,
                  progress: Callable[[int, int], None] | None) -> ConvertReport:
    """The MLX folder's files, written into `out`."""
    report = ConvertReport(out=out)
    shard: dict[str, mx.array] = {}
    shard_size = 0
    written: list[tuple[str, list[str]]] = []
    before = mx.get_active_memory()
    mx.reset_peak_memory()

    def flush():
        nonlocal shard, shard_size
        if not shard:
            return
        tmp = os.path.join(out, f"model-part{len(written) + 1:05d}.safetensors")
        mx.save_safetensors(tmp, shard, metadata={"format": "mlx"})
        written.append((tmp, list(shard)))
        report.bytes_written += os.path.getsize(tmp)
        shard, shard_size = {}, 0

    n_stored = sum(not n.endswith((".scales", ".biases")) for n in ckpt.tensors)
    for name, role, w in _tensors(ckpt):
        parts = w if isinstance(w, list) else [w]  # experts one by one are quantized one by one
        del w
        q = spec.for_tensor(role, ckpt.cfg.n_layer) if spec and role else None
        if q is not None and quantizable(parts[0].shape, q[1]):
            qs = [quantize([parts.pop(0)], q[0], q[1], scales) for _ in range(len(parts))]
            qw = qs[0] if len(qs) == 1 else Quantized(*(mx.stack([getattr(x, k) for x in qs]) for k in
                                                         ("weight", "scales", "biases")), q[0], q[1])
            del qs
            stem = name[: -len(".weight")]
            arrays = {stem + ".weight": qw.weight, stem + ".scales": qw.scales, stem + ".biases": qw.biases}
            report.quantized += 1
        else:
            arrays = {name: parts.pop() if len(parts) == 1 else mx.stack(parts)}
        mx.eval(list(arrays.values()))
        mx.clear_cache()
        report.tensors += 1
        report.mtp_tensors += name.startswith("mtp.")
        size = sum(a.nbytes for a in arrays.values())
        if shard and shard_size + size > shard_bytes:
            flush()
        shard.update(arrays)
        shard_size += size
        if progress:
            progress(min(report.tensors, n_stored), n_stored)
    flush()
    weight_map = {}
    for k, (tmp, keys) in enumerate(written):
        final = f"model-{k + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(tmp, os.path.join(out, final))
        weight_map.update({key: final for key in keys})
    with open(os.path.join(out, INDEX_NAME), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": report.bytes_written}, "weight_map": dict(sorted(weight_map.items()))},
                  f, indent=2)
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(mlx_config(ckpt.raw_config, spec), f, indent=2)
    copy_tokenizer(ckpt.directory, out)
    report.peak_memory_bytes = int(mx.get_peak_memory() - before)
    return report


def copy_tokenizer(src: str, out: str) -> list[str]:
    copied = []
    for fn in TOKENIZER_FILES:
        p = os.path.join(src, fn)
        if os.path.isfile(p):
            shutil.copyfile(p, os.path.join(out, fn))
            copied.append(fn)
    return copied
