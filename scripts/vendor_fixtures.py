"""Vendors the part of the shared fixture set (`../shared/fixtures` or --full) that the tests need
into tests/fixtures: the tiny MoE model and its references as they are, the tiny dense model's
other file types and HF weights as rebuild recipes (tests/fixture_rebuild.py: header bytes, tensor
table, sha256), and every file type's llama.cpp references. Run it after the shared set changes:

    python -m scripts.vendor_fixtures            # writes tests/fixtures, then rebuilds and checks
    python -m scripts.vendor_fixtures --check    # rebuilds into a temporary copy and checks only

(as a module from the checkout's root: it shares the rebuild recipes' reader with the tests)
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

from tests.fixture_rebuild import RECIPES, f32_tensors, rebuild, unpack

ROOT = Path(__file__).resolve().parent.parent

TINY = "qwen35-mtp-tiny"
REBUILT_TYPES = ("f16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_0")
HF = f"llamacpp/hf/{TINY}"
# copied as they are (relative to the fixture root)
COPIED = ([f"llamacpp/{TINY}-{t}.{suffix}" for t in REBUILT_TYPES
           for suffix in ("gguf.ref.json", "gguf.dequant.ref.json", "dequant.logits.npz", "dequant.logits.npz.meta.json")]
          + [f"{HF}/{n}" for n in ("config.json", "tokenizer.json", "tokenizer_config.json")]
          + [f"llamacpp-moe/qwen35moe-mtp-tiny-Q4_K_M.{s}" for s in
             ("gguf", "gguf.dequant.ref.json", "gguf.dequant.spec.json", "dequant.logits.npz",
              "dequant.logits.npz.meta.json")]
          + [f"llamacpp-moe/hf/qwen35moe-mtp-tiny/{n}" for n in ("config.json", "tokenizer.json", "tokenizer_config.json")])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def gguf_recipe(full: Path, rel: str, out: Path) -> dict:
    from gguf import GGUFReader
    path = full / rel
    reader = GGUFReader(str(path))
    head = f"rebuild/{Path(rel).name}.head"
    (out / head).write_bytes(path.read_bytes()[:reader.data_offset])
    return {"kind": "gguf", "source": f"llamacpp/{TINY}-f32.gguf", "head": head, "size": path.stat().st_size,
            "sha256": sha256(path),
            "tensors": [[t.name, t.tensor_type.name, int(t.data_offset)] for t in reader.tensors]}


def _row_perm(target: np.ndarray, candidate: np.ndarray) -> list[int] | None | bool:
    """perm with candidate[perm] == target (None: identity); False when none exists."""
    if target.shape != candidate.shape:
        return False
    index = {row.tobytes(): i for i, row in enumerate(candidate)}
    if len(index) != len(candidate):
        return False
    try:
        perm = [index[row.tobytes()] for row in target]
    except KeyError:
        return False
    return None if perm == list(range(len(perm))) else perm


def safetensors_recipe(full: Path, f32: dict[str, np.ndarray], out: Path) -> dict:
    path = full / HF / "model.safetensors"
    blob = path.read_bytes()
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    head = "rebuild/model.safetensors.head"
    (out / head).write_bytes(blob[:8 + n])
    tensors, raw = {}, {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] != "BF16":
            raise SystemExit(f"{name}: {info['dtype']}, the recipe handles BF16 only")
        a, b = info["data_offsets"]
        bits = np.frombuffer(blob[8 + n + a:8 + n + b], "<u2")
        values = (bits.astype(np.uint32) << 16).view(np.float32).reshape(info["shape"][0], -1)
        found = None
        if len(info["shape"]) > 1:
            for src, w in f32.items():
                if w.size != values.size:
                    continue
                w2 = w.reshape(values.shape)
                for axis, (t, c) in (("rows", (values, w2)), ("cols", (values.T, w2.T))):
                    perm = _row_perm(np.ascontiguousarray(t), np.ascontiguousarray(c))
                    if perm is not False:
                        found = [src, axis, perm]
                        break
                if found:
                    break
        if found:
            tensors[name] = found
        else:
            raw[name] = bits
    np.savez_compressed(out / "rebuild/model.safetensors.raw.npz", **raw)
    print(f"HF weights: {len(tensors)} tensors derived from the f32 GGUF, {len(raw)} stored ({sorted(raw)[:3]}...)")
    return {"kind": "safetensors", "source": f"llamacpp/{TINY}-f32.gguf", "head": head,
            "raw": "rebuild/model.safetensors.raw.npz", "size": len(blob), "sha256": sha256(path), "tensors": tensors}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", type=Path, default=ROOT.parent / "shared" / "fixtures")
    ap.add_argument("--check", action="store_true", help="rebuild into a temporary copy and compare only")
    args = ap.parse_args()
    vendored = ROOT / "tests" / "fixtures"
    if not args.check:
        (vendored / "rebuild").mkdir(exist_ok=True)
        recipes = {f"llamacpp/{TINY}-{t}.gguf": gguf_recipe(args.full, f"llamacpp/{TINY}-{t}.gguf", vendored)
                   for t in REBUILT_TYPES}
        f32 = f32_tensors(args.full / f"llamacpp/{TINY}-f32.gguf")
        recipes[f"{HF}/model.safetensors"] = safetensors_recipe(args.full, f32, vendored)
        (vendored / RECIPES).write_text(json.dumps(recipes, indent=1) + "\n")
        for rel in COPIED:
            (vendored / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(args.full / rel, vendored / rel)
        print(f"copied {len(COPIED)} files, {sum((vendored / r).stat().st_size for r in COPIED) / 1e6:.1f} MB")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "fixtures"
        shutil.copytree(vendored, work, ignore=shutil.ignore_patterns(*[Path(r).name for r in json.loads(
            (vendored / RECIPES).read_text())]))
        unpack(work / "llamacpp" / f"{TINY}-f32.gguf.xz")
        for path in rebuild(work):
            rel = path.relative_to(work)
            same = sha256(path) == sha256(args.full / rel)
            print(f"rebuilt {rel}: {'identical to' if same else 'DIFFERENT from'} the full set's")
            if not same:
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
