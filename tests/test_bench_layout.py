"""The benchmarks' random 9B shape in a llama.cpp Q4_K_M file's layout: which matrices its rule
keeps in Q6_K (loaded as 8-bit) is checked against llama.cpp's own Q4_K_M files, so a
"q4_k_m" benchmark reads what a user's file would make the engine read."""
from __future__ import annotations

import gguf
import pytest

from tests.conftest import MOE_Q4, SHIPPED, TINY_Q4, load_script, need


@pytest.mark.parametrize("path", [SHIPPED, TINY_Q4, MOE_Q4], ids=["shipped", "tiny", "moe"])
def test_the_q4_k_m_rule_is_llama_cpps(path):
    harness = load_script("bench/harness")
    reader = gguf.GGUFReader(str(need(path)))
    n_blocks = 1 + max(int(t.name.split(".")[1]) for t in reader.tensors if t.name.startswith("blk."))
    kinds = {"Q4_K": 4, "Q6_K": 8}
    checked = 0
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind in kinds and t.name not in ("token_embd.weight",):
            assert harness.q4_k_m_bits(t.name, n_blocks) == kinds[kind], (t.name, kind)
            checked += 1
    assert checked > 10


def test_mlx_lm_paths_name_the_gguf_tensors():
    harness = load_script("bench/harness")
    peer = __import__("sys").modules["peer"]
    assert peer.gguf_name("lm_head") == "output.weight"
    assert peer.gguf_name("model.layers.3.self_attn.v_proj") == "blk.3.attn_v.weight"
    assert peer.gguf_name("model.layers.2.linear_attn.in_proj_qkv") == "blk.2.attn_qkv.weight"
    assert peer.gguf_name("model.layers.7.mlp.down_proj") == "blk.7.ffn_down.weight"
    assert peer.gguf_name("model.layers.7.mlp.switch_mlp.down_proj") == "blk.7.ffn_down_exps.weight"
    assert peer.gguf_name("model.layers.7.mlp.up_proj") == "model.layers.7.mlp.up_proj"
    with pytest.raises(ValueError, match="layout"):
        harness.random_model(harness.smoke_config(), "q5")
