"""Validates the float64 NumPy reference (tests/reference_numpy.py) against llama.cpp.

References: ../shared/fixtures/llamacpp (see its README). The f32 file is compared with
qwen35-mtp-tiny-f32.logits.npz (trunk, teacher-forced MTP and the 3-step draft chain); the
Q4_K_M file with its exact-dequantized reference qwen35-mtp-tiny-Q4_K_M.dequant.logits.npz.
Run with ``pytest -s`` to see the max errors.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

try:
    from tests.reference_numpy import GDNState, KVCache, RefModel, load_gguf_weights
except ImportError:  # imported as a package module
    from tests.reference_numpy import GDNState, KVCache, RefModel, load_gguf_weights

from tests.conftest import FIXTURES, TRAINED_GGUF  # noqa: E402
LLAMACPP = FIXTURES / "llamacpp"
F32_GGUF = LLAMACPP / "qwen35-mtp-tiny-f32.gguf"
F32_NPZ = LLAMACPP / "qwen35-mtp-tiny-f32.logits.npz"
F32_META = LLAMACPP / "qwen35-mtp-tiny-f32.logits.npz.meta.json"
Q4KM_GGUF = LLAMACPP / "qwen35-mtp-tiny-Q4_K_M.gguf"
Q4KM_NPZ = LLAMACPP / "qwen35-mtp-tiny-Q4_K_M.dequant.logits.npz"
Q4KM_META = LLAMACPP / "qwen35-mtp-tiny-Q4_K_M.dequant.logits.npz.meta.json"

PROMPTS = [0, 1, 2, 3]  # the whole reference runs in well under a second per prompt
LOGIT_TOL = 1e-3  # logits have std ~16; observed max error ~6e-5
HIDDEN_TOL = 1e-4  # hidden states are RMS-normalised (~1); observed max error ~3e-6


def _need(*paths: Path) -> None:
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        pytest.skip(f"fixtures missing: {missing}")


def _maxerr(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _n_prompt(meta_path: Path, k: int) -> int:
    meta = json.loads(meta_path.read_text())
    return int(meta["prompts"][k]["n_prompt"])


@pytest.fixture(scope="module")
def f32():
    _need(F32_GGUF, F32_NPZ, F32_META)
    hp, tensors = load_gguf_weights(str(F32_GGUF))
    return hp, tensors, RefModel(hp, tensors), np.load(F32_NPZ)


@pytest.fixture(scope="module")
def f32_trunk(f32):
    """Trunk outputs per prompt, computed once."""
    _, _, model, ref = f32
    return {k: model.forward(ref[f"tokens_p{k}"].tolist()) for k in PROMPTS}


# ---------------------------------------------------------------------------
# Loader
# ---------------------------------------------------------------------------

def test_hparams_tiny(f32):
    hp, tensors, _, _ = f32
    assert hp["n_vocab"] == 512 and hp["hidden"] == 256
    assert hp["n_layer"] == 4 and hp["n_mtp"] == 1
    assert hp["n_head"] == 2 and hp["n_head_kv"] == 1 and hp["head_dim"] == 128
    assert hp["n_rot"] == 32 and hp["rope_base"] == 1e7
    assert abs(hp["eps"] - 1e-6) < 1e-12
    assert hp["ffn"] == 512 and hp["conv_kernel"] == 4
    assert (hp["ssm_d_state"], hp["ssm_n_group"], hp["ssm_dt_rank"], hp["ssm_d_inner"]) == (64, 2, 4, 256)
    assert hp["recurrent"] == [True, True, True, False]
    assert len(tensors) == 71
    assert all(a.dtype == np.float64 for a in tensors.values())
    assert tensors["token_embd.weight"].shape == (512, 256)
    assert tensors["blk.0.attn_qkv.weight"].shape == (512, 256)
    assert tensors["blk.0.ssm_conv1d.weight"].shape == (512, 4)
    assert tensors["blk.3.attn_q.weight"].shape == (512, 256)
    assert tensors["blk.4.nextn.eh_proj.weight"].shape == (256, 512)
    assert np.all(tensors["blk.0.ssm_a"] < 0)


def test_trained_model_loads():
    _need(TRAINED_GGUF)
    hp, tensors = load_gguf_weights(str(TRAINED_GGUF))
    assert hp["hidden"] == 512 and hp["n_vocab"] == 8192
    assert hp["n_mtp"] == 1 and len(hp["recurrent"]) == hp["n_layer"]
    H, V = hp["hidden"], hp["n_vocab"]
    assert tensors["token_embd.weight"].shape == (V, H)
    assert tensors["output.weight"].shape == (V, H)
    mtp = f"blk.{hp['n_layer']}"
    assert tensors[f"{mtp}.nextn.eh_proj.weight"].shape == (H, 2 * H)
    assert all(a.dtype == np.float64 and np.all(np.isfinite(a)) for a in tensors.values())
    # And the reference runs on it (a few tokens through trunk and MTP head).
    model = RefModel(hp, tensors)
    logits, hidden = model.forward([1, 2, 3])
    mlogits, _ = model.mtp_forward([1, 2, 3], hidden)
    assert logits.shape == (3, V) and mlogits.shape == (3, V)
    assert np.all(np.isfinite(logits)) and np.all(np.isfinite(mlogits))


# ---------------------------------------------------------------------------
# f32 file against llama.cpp
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("k", PROMPTS)
def test_trunk_f32(f32, f32_trunk, k):
    _, _, _, ref = f32
    logits, hidden = f32_trunk[k]
    el = _maxerr(logits, ref[f"logits_p{k}"])
    eh = _maxerr(hidden, ref[f"hidden_p{k}"])
    print(f"\n[f32 p{k}] trunk logits max abs err {el:.3g}, hidden {eh:.3g}")
    assert el < LOGIT_TOL
    assert eh < HIDDEN_TOL
    # Greedy rows (n_prompt-1 onwards) reproduce llama.cpp's greedy continuation.
    n = _n_prompt(F32_META, k)
    toks = ref[f"tokens_p{k}"]
    assert np.array_equal(np.argmax(logits[n - 1:-1], axis=-1), toks[n:])


@pytest.mark.parametrize("k", PROMPTS)
def test_mtp_teacher_forced_f32(f32, f32_trunk, k):
    _, _, model, ref = f32
    _, hidden = f32_trunk[k]
    mlogits, mhidden = model.mtp_forward(ref[f"tokens_p{k}"].tolist(), hidden)
    el = _maxerr(mlogits, ref[f"mtp_logits_p{k}"])
    eh = _maxerr(mhidden, ref[f"mtp_hidden_p{k}"])
    print(f"\n[f32 p{k}] MTP logits max abs err {el:.3g}, mtp_hidden {eh:.3g}")
    assert el < LOGIT_TOL
    assert eh < HIDDEN_TOL


@pytest.mark.parametrize("k", PROMPTS)
def test_draft_chain_f32(f32, f32_trunk, k):
    _, _, model, ref = f32
    _, hidden = f32_trunk[k]
    n = _n_prompt(F32_META, k)
    toks = ref[f"tokens_p{k}"].tolist()
    first = int(ref[f"draft_input_ids_p{k}"][0])
    assert first == toks[n]  # step 1 input is generated_ids[0]
    ids, dlogits, dhidden = model.draft_chain(toks[:n], hidden[:n], first, 3)
    el = _maxerr(dlogits, ref[f"draft_logits_p{k}"])
    eh = _maxerr(dhidden, ref[f"draft_hidden_p{k}"])
    print(f"\n[f32 p{k}] draft chain ids {ids}, logits max abs err {el:.3g}, hidden {eh:.3g}")
    assert ids == ref[f"draft_ids_p{k}"].tolist()
    assert [first] + ids[:-1] == ref[f"draft_input_ids_p{k}"].tolist()
    assert el < LOGIT_TOL
    assert eh < HIDDEN_TOL


def test_draft_step1_equals_teacher_forced_row(f32, f32_trunk):
    """Draft step 1 is exactly the teacher-forced MTP row n (same inputs, same KV)."""
    _, _, model, ref = f32
    k = 0
    _, hidden = f32_trunk[k]
    n = _n_prompt(F32_META, k)
    toks = ref[f"tokens_p{k}"].tolist()
    mlogits, mhidden = model.mtp_forward(toks[: n + 1], hidden[: n + 1])
    _, dlogits, dhidden = model.draft_chain(toks[:n], hidden[:n], toks[n], 1)
    assert _maxerr(dlogits[0], mlogits[n]) < 1e-10
    assert _maxerr(dhidden[0], mhidden[n]) < 1e-10


def test_explicit_state_stepping(f32, f32_trunk):
    """Token-by-token stepping with explicit state reproduces forward(); state has the
    expected shapes."""
    hp, _, model, ref = f32
    k = 1
    toks = ref[f"tokens_p{k}"].tolist()[:10]
    state = model.new_state()
    rows = [model.step(state, t) for t in toks]
    logits_full, _ = f32_trunk[k]
    assert _maxerr(np.stack([r[0] for r in rows]), logits_full[:10]) < 1e-10
    assert state.pos == 10
    for i, st in enumerate(state.layers):
        if hp["recurrent"][i]:
            assert isinstance(st, GDNState)
            assert st.conv.shape == (hp["conv_kernel"] - 1, 512)
            assert st.S.shape == (4, 64, 64)
        else:
            assert isinstance(st, KVCache) and len(st) == 10


# ---------------------------------------------------------------------------
# Quantized file against its exact-dequantized llama.cpp reference
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def q4km():
    _need(Q4KM_GGUF, Q4KM_NPZ, Q4KM_META)
    hp, tensors = load_gguf_weights(str(Q4KM_GGUF))
    return RefModel(hp, tensors), np.load(Q4KM_NPZ)


@pytest.mark.parametrize("k", PROMPTS)
def test_trunk_q4km_dequant(q4km, k):
    model, ref = q4km
    toks = ref[f"tokens_p{k}"].tolist()
    logits, hidden = model.forward(toks)
    el = _maxerr(logits, ref[f"logits_p{k}"])
    n = _n_prompt(Q4KM_META, k)
    ids, dlogits, dhidden = model.draft_chain(toks[:n], hidden[:n], toks[n], 3)
    edl = _maxerr(dlogits, ref[f"draft_logits_p{k}"])
    edh = _maxerr(dhidden, ref[f"draft_hidden_p{k}"])
    print(f"\n[Q4_K_M p{k}] trunk logits max abs err {el:.3g}; draft ids {ids}, "
          f"logits {edl:.3g}, hidden {edh:.3g}")
    assert el < LOGIT_TOL
    assert ids == ref[f"draft_ids_p{k}"].tolist()
    assert edl < LOGIT_TOL
    assert edh < HIDDEN_TOL
