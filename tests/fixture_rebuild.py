"""Fixture files a bare clone rebuilds instead of carrying: the tiny model's f16/Q8_0/Q6_K/Q5_K_M/
Q4_0 GGUFs and its HF checkpoint's weights, all made by llama.cpp's tools (or transformers) from
the same weights as the vendored f32 GGUF. Vendored per file (`tests/fixtures/rebuild/`): its
header bytes (GGUF metadata and tensor table, or the safetensors JSON header), where each tensor
sits, how it derives from an f32 tensor (a quantization type; for the HF file a row or column
permutation and bf16, with 1-D tensors stored as they are), its size and sha256.

A rebuilt file is used only when its sha256 equals the original's: it is then the very file
llama.cpp's references were computed on, not an approximation (the recipes' sha256 are checked
against the ones llama.cpp's `.ref.json` files record, in tests/test_fixture_rebuild.py).
`scripts/vendor_fixtures.py` writes the recipes from a full fixture set.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

RECIPES = "rebuild/recipes.json"


class RebuildError(RuntimeError):
    pass


def unpack(packed: Path) -> None:
    """A vendored `.xz` file next to itself, once (its name without .xz; atomic, so concurrent
    test workers may race)."""
    import lzma

    out = packed.with_suffix("")
    if out.exists() or not packed.exists():
        return
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with lzma.open(packed) as src, open(tmp, "wb") as dst:
        while chunk := src.read(1 << 20):
            dst.write(chunk)
    os.replace(tmp, out)


def f32_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of an all-F32 GGUF file, by name, in numpy's shape (GGUF's reversed)."""
    from gguf import GGUFReader
    reader = GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        if t.tensor_type.name != "F32":
            raise RebuildError(f"{path}: {t.name} is {t.tensor_type.name}, a rebuild source must be all F32")
        out[t.name] = np.asarray(t.data, dtype=np.float32).reshape([int(n) for n in reversed(list(t.shape))])
    return out


def _gguf_bytes(recipe: dict, root: Path, source: dict[str, np.ndarray]) -> bytearray:
    from tests.ggml_quants_ref import quantize
    head = (root / recipe["head"]).read_bytes()
    out = bytearray(recipe["size"])
    out[:len(head)] = head
    for name, type_name, offset in recipe["tensors"]:
        data = quantize(source[name], type_name).tobytes()
        out[offset:offset + len(data)] = data
    return out


def _bf16(values: np.ndarray, name: str) -> bytes:
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    if np.any(bits & 0xFFFF):
        raise RebuildError(f"{name}: the f32 source holds values that are not bf16; this recipe cannot apply")
    return (bits >> 16).astype("<u2").tobytes()


def _safetensors_bytes(recipe: dict, root: Path, source: dict[str, np.ndarray]) -> bytearray:
    head = (root / recipe["head"]).read_bytes()
    header = json.loads(head[8:])
    base = len(head)
    out = bytearray(recipe["size"])
    out[:base] = head
    raw = np.load(root / recipe["raw"])
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if name in recipe["tensors"]:
            src, axis, perm = recipe["tensors"][name]
            m = source[src].reshape(info["shape"][0], -1)  # the HF tensor's rows
            if perm is not None:
                m = m[np.asarray(perm)] if axis == "rows" else m[:, np.asarray(perm)]
            data = _bf16(m, name)
        else:
            data = raw[name].astype("<u2").tobytes()
        if len(data) != end - start:
            raise RebuildError(f"{name}: {len(data)} bytes rebuilt, the header says {end - start}")
        out[base + start:base + end] = data
    return out


def rebuild(root: Path, only: str | None = None) -> list[Path]:
    """Writes every recipe's file under `root` (the vendored fixture folder) that is missing;
    returns the files written. Atomic per file, so concurrent test workers may race; a file whose
    sha256 differs from the recipe's raises RebuildError (and is not written)."""
    recipes = json.loads((root / RECIPES).read_text())
    written, sources = [], {}
    for rel, recipe in recipes.items():
        target = root / rel
        if (only and rel != only) or target.exists():
            continue
        src_path = root / recipe["source"]
        if src_path not in sources:
            sources[src_path] = f32_tensors(src_path)
        build = _gguf_bytes if recipe["kind"] == "gguf" else _safetensors_bytes
        data = build(recipe, root, sources[src_path])
        digest = hashlib.sha256(data).hexdigest()
        if digest != recipe["sha256"]:
            raise RebuildError(f"{rel}: rebuilt sha256 {digest[:16]}... differs from the original's "
                               f"{recipe['sha256'][:16]}... (tests/fixture_rebuild.py)")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)
        written.append(target)
    return written
