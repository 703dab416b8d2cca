"""The model as an `mlx.nn.Module` tree: parameters, modules, fast array attributes, one `Pass`."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mtp_engine.model.blocks import DecoderLayer, GatedAttention, GatedDeltaNet
from mtp_engine.model.layers import Linear
from mtp_engine.model.step import Pass


def test_the_model_is_a_module_tree_whose_parameters_are_its_weights(tiny_q4):
    model = tiny_q4.model
    assert isinstance(model, nn.Module) and isinstance(model.mtp, nn.Module)
    params = dict(tree_flatten(model.parameters()))
    # every array of the tree once, by name, and nothing that is not a weight (the draft head's
    # rows are a view of the output head's, routing records and graphs are not arrays)
    assert "layers.0.attn_norm" in params and "mtp.eh_proj.weight" in params
    assert all(isinstance(a, mx.array) for a in params.values())
    # the MTP head's own bytes are its subtree's (the estimate in memory.py checks the total)
    head = {id(a): a for k, a in params.items() if k.startswith("mtp.")}
    assert model.nbytes()["mtp"] == sum(a.nbytes for a in head.values()) > 0
    kinds = {type(m) for m in model.modules()}
    assert {Linear, DecoderLayer, GatedAttention, GatedDeltaNet} <= kinds
    assert len(model.linears()) == len({id(m) for m in model.modules() if isinstance(m, Linear)})


def test_array_attributes_live_in_the_module_dict_and_none_takes_them_out():
    w = mx.ones((4, 8))
    lin = Linear(w)
    assert lin.scales is None and not lin.quantized and list(lin.keys()) == ["weight"]
    q, s, b = mx.quantize(mx.ones((32, 64)), group_size=32, bits=4)
    lin = Linear(q, s, b, 4, 32)
    assert lin.quantized and set(lin.keys()) == {"weight", "scales", "biases"}
    lin.update({"scales": s * 2})  # what load_weights does: the dict, read back through the attribute
    assert mx.array_equal(lin.scales, s * 2).item()
    lin.scales = None
    assert "scales" not in lin and lin.scales is None
    with pytest.raises(TypeError, match="scales"):
        lin.scales = 3


def test_a_forward_says_what_it_is_for(tiny_q4):
    model = tiny_q4.model
    assert Pass.VERIFY.capture and Pass.ROUND_VERIFY.capture and Pass.ROUND_VERIFY.resident
    assert not Pass.PREFILL.capture and not Pass.STEP.resident
    ids = mx.array([[5, 6, 7, 8]])
    cache = model.make_cache()
    h = model.forward(ids, cache, Pass.PREFILL)
    assert cache.offset == 4
    again = model.make_cache()
    np.testing.assert_allclose(np.array(model.forward(ids, again)), np.array(h), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="rollback"):
        model.mtp(model.embed_tokens(ids), h, model.mtp.make_cache(), Pass.VERIFY)
