"""The fixture files a bare clone rebuilds (tests/fixture_rebuild.py) are llama.cpp's own files:
their recipes carry the sha256 llama.cpp's references record, the files in use hash to it, the
NumPy port of ggml's quantizers reproduces llama-quantize's vendored Q4_K_M file byte for byte, and
a recipe that no longer matches fails loudly instead of yielding a near-copy."""
from __future__ import annotations

import hashlib
import json
import shutil

import numpy as np
import pytest
from gguf import GGUFReader

from tests.conftest import FIXTURES, TINY, TINY_F32, TINY_Q4, VENDORED
from tests.fixture_rebuild import RECIPES, RebuildError, f32_tensors, rebuild
from tests.ggml_quants_ref import nearest_int, quantize

RECIPE = json.loads((VENDORED / RECIPES).read_text())


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("rel", sorted(r for r in RECIPE if r.endswith(".gguf")))
def test_recipes_name_the_files_llama_cpp_made(rel):
    ref = json.loads((VENDORED / (rel + ".ref.json")).read_text())
    dequant = json.loads((VENDORED / (rel + ".dequant.ref.json")).read_text())
    assert RECIPE[rel]["sha256"] == ref["file_sha256"] == dequant["dequantized_from_sha256"]


@pytest.mark.parametrize("rel", sorted(RECIPE))
def test_the_files_in_use_are_the_originals(rel):
    """Rebuilt (a bare clone) or from the full set: the same bytes."""
    assert _sha(FIXTURES / rel) == RECIPE[rel]["sha256"]


def test_ggml_quantizers_reproduce_llama_quantize():
    """Q4_K and Q6_K tensors of llama-quantize's Q4_K_M file (vendored as it is, so this does not
    lean on any recipe), from the f32 model: byte for byte."""
    f32 = f32_tensors(TINY_F32)
    seen = set()
    for t in GGUFReader(str(TINY_Q4)).tensors:
        kind = t.tensor_type.name
        if kind in ("Q4_K", "Q6_K") and kind not in seen:
            seen.add(kind)
            ours = quantize(f32[t.name], kind)
            assert np.array_equal(ours, np.asarray(t.data).view(np.uint8).reshape(-1)), t.name
    assert seen == {"Q4_K", "Q6_K"}


def test_nearest_int_rounds_half_to_even_like_ggml():
    assert nearest_int(np.array([0.5, 1.5, 2.5, -0.5, -1.5, 7.49], np.float32)).tolist() == [0, 2, 2, 0, -2, 7]


def test_a_recipe_that_no_longer_matches_fails_loudly(tmp_path):
    rel = next(r for r in RECIPE if r.endswith("Q8_0.gguf"))
    work = tmp_path / "fixtures"
    (work / "llamacpp").mkdir(parents=True)
    shutil.copytree(VENDORED / "rebuild", work / "rebuild")
    shutil.copyfile(TINY / "qwen35-mtp-tiny-f32.gguf", work / "llamacpp" / "qwen35-mtp-tiny-f32.gguf")
    assert [p.name for p in rebuild(work, only=rel)] == ["qwen35-mtp-tiny-Q8_0.gguf"]
    (work / rel).unlink()
    head = work / RECIPE[rel]["head"]
    blob = bytearray(head.read_bytes())
    blob[-40] ^= 1  # one bit of the metadata
    head.write_bytes(bytes(blob))
    with pytest.raises(RebuildError, match="Q8_0.gguf: rebuilt sha256"):
        rebuild(work, only=rel)
    assert not (work / rel).exists()
