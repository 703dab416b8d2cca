"""qwen35moe: loading, the MoE block against a float64 NumPy reference, and the whole model against
llama.cpp on the tiny Qwen3.5-MoE fixture (../shared/fixtures/llamacpp-moe, see its README).

The fixture's Q4_K_M file is compared with the references of its exact-dequantized twin
(`.dequant.*`): in exact mode every weight equals llama.cpp's dequantization, so logits, routing,
the MTP head, greedy output and draft-mtp rounds must match as tightly as for the f32 dense model.
Run with `pytest -s` to see the measured errors.
"""
from __future__ import annotations

import json

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from tests.conftest import FIXTURES, MODELS, copy_metadata, need
from mtp_engine import MTPEngineError, load
from mtp_engine import generate
from mtp_engine.model.layers import Linear
from mtp_engine.model.hf import load_hf
from mtp_engine.model.expert_use import ExpertUse
from mtp_engine.model.moe import SORT_THRESHOLD, ExpertLinear, MoE, SwitchGLU, experts_touched
from mtp_engine.model.blocks import MLP
from mtp_engine.generation.sampling import Sampler, SamplerConfig
from mtp_engine.speculative.draft_mtp import DraftMTPDecoder, DraftParams
from tests.reference_numpy import RefModel, load_gguf_weights, moe_ffn


MOE = FIXTURES / "llamacpp-moe"
Q4KM = MOE / "qwen35moe-mtp-tiny-Q4_K_M.gguf"
TOL = 1e-3  # logits (std ~13)
HIDDEN_TOL = 1e-4  # RMS-normalised hidden states
ROUTE_TOL = 1e-4  # router logits (std ~2) and renormalised expert weights


def _report(what: str, err: float) -> None:
    print(f"\n  {what}: max |diff| {err:.3g}", end="")


def _load(exact: bool = True):
    return MODELS(Q4KM, exact=exact)  # loaded once per session (conftest)


@pytest.fixture(scope="module")
def ref():
    return np.load(need(MOE / "qwen35moe-mtp-tiny-Q4_K_M.dequant.logits.npz"))


def _ref_json(kind: str) -> dict:
    return json.loads(need(MOE / f"qwen35moe-mtp-tiny-Q4_K_M.gguf.dequant.{kind}.json").read_text())


def _moe_layers(model) -> list[MoE]:
    return [layer.mlp for layer in model.layers]


def _best_first(experts: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Our top-k comes unordered; llama.cpp's references list the chosen experts best first."""
    order = np.argsort(-weights, axis=-1, kind="stable")
    return np.take_along_axis(experts, order, -1), np.take_along_axis(weights, order, -1)


def _check_routing(rec: dict, ref_logits, ref_experts, ref_weights, ref_gate, what: str) -> None:
    experts, weights = _best_first(np.array(rec["experts"][0]), np.array(rec["weights"][0]))
    assert (experts == ref_experts).all(), what
    errs = {"router logits": np.abs(np.array(rec["router_logits"][0]) - ref_logits).max(),
            "expert weights": np.abs(weights - ref_weights).max(),
            "shared-expert gate": np.abs(np.array(rec["shexp_gate"][0]) - ref_gate).max()}
    for name, err in errs.items():
        _report(f"{what} {name}", err)
        assert err < ROUTE_TOL, (what, name)


# ---- config and loader ----------------------------------------------------------------------

def test_config_reads_expert_keys():
    cfg = _load().model.cfg
    assert (cfg.arch, cfg.is_moe, cfg.ffn_size) == ("qwen35moe", True, [])
    assert (cfg.n_expert, cfg.n_expert_used, cfg.expert_ffn_size, cfg.shared_ffn_size) == (8, 2, 256, 256)
    assert (cfg.n_layer, cfg.n_mtp) == (4, 1)
    assert all(isinstance(m, MoE) for m in _moe_layers(_load().model))
    assert isinstance(_load().model.mtp.layer.mlp, MoE)


def _rewrite(dst, *, set_keys: dict | None = None, drop_keys=(), tensors: dict | None = None):
    """A copy of the Q4_K_M fixture with metadata or float tensors replaced."""
    src = GGUFReader(need(Q4KM))
    w = GGUFWriter(dst, "qwen35moe")
    set_keys, tensors = copy_metadata(src, w, set_keys, drop_keys), dict(tensors or {})
    for t in src.tensors:
        if t.name in tensors:
            w.add_tensor(t.name, tensors.pop(t.name))
        elif t.tensor_type == gguf.GGMLQuantizationType.F32:
            w.add_tensor(t.name, np.asarray(t.data))
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    assert not set_keys and not tensors
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("change, field", [
    ({"drop_keys": ("qwen35moe.expert_count",)}, "qwen35moe.expert_count"),
    ({"drop_keys": ("qwen35moe.expert_feed_forward_length",)}, "qwen35moe.expert_feed_forward_length"),
    ({"set_keys": {"qwen35moe.expert_used_count": (9, gguf.GGUFValueType.UINT32, None)}},
     "qwen35moe.expert_used_count"),
    ({"set_keys": {"qwen35moe.expert_count": (0, gguf.GGUFValueType.UINT32, None)}}, "qwen35moe.expert_count"),
])
def test_bad_expert_metadata_names_the_key(tmp_path, change, field):
    with pytest.raises(MTPEngineError) as e:
        load(_rewrite(tmp_path / "bad.gguf", **change))
    assert field in str(e.value)


def test_experts_stay_quantized_and_stack_as_stored():
    """Expert e of the stacked tensor is the numpy view [e] of gguf's dequantization, bit for bit
    for Q4_K (4-bit MLX), and for Q6_K in exact mode (float32); default mode keeps Q6_K at 8 bits."""
    reader = GGUFReader(need(Q4KM))
    raw = {t.name: t for t in reader.tensors}
    exact, default = _moe_layers(_load(True).model), _moe_layers(_load(False).model)

    def want(name):
        t = raw[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).reshape(8, 256, 256)

    gate = exact[0].experts.gate
    assert (gate.bits, gate.weight.shape, gate.weight.dtype) == (4, (8, 256, 32), mx.uint32)
    assert np.array_equal(np.array(gate.dense()), want("blk.0.ffn_gate_exps.weight"))
    assert np.array_equal(np.array(exact[0].experts.down.dense()), want("blk.0.ffn_down_exps.weight"))
    q6 = want("blk.2.ffn_down_exps.weight")
    assert not exact[2].experts.down.quantized
    assert np.array_equal(np.array(exact[2].experts.down.dense()), q6)
    d = default[2].experts.down
    assert d.quantized and d.bits == 8
    assert np.abs(np.array(d.dense()) - q6).max() <= np.abs(q6).max() / 255 * 1.01
    assert np.array_equal(np.array(exact[1].shared_gate), raw["blk.1.ffn_gate_inp_shexp.weight"].data)
    m = _load(False)
    assert m.info.weight_bytes < 2.0 * m.info.file_bytes  # no float expansion of the experts


def test_shared_gate_accepted_in_both_stored_shapes(tmp_path, ref):
    """The converter writes ffn_gate_inp_shexp as ne [H, 1] (numpy [1, H]), llama-quantize as [H]."""
    reader = GGUFReader(need(Q4KM))
    gates = {t.name: np.asarray(t.data).reshape(1, -1) for t in reader.tensors
             if t.name.endswith("ffn_gate_inp_shexp.weight")}
    assert len(gates) == 5
    path = _rewrite(tmp_path / "gate2d.gguf", tensors=gates)
    stored = {t.name: [int(n) for n in t.shape] for t in GGUFReader(path).tensors}
    assert stored["blk.4.ffn_gate_inp_shexp.weight"] == [256, 1]  # GGUF ne order
    two_d = load(path, exact=True)
    tokens = mx.array(ref["tokens_p1"][None])
    a = _load().model.forward(tokens, _load().model.make_cache())
    b = two_d.model.forward(tokens, two_d.model.make_cache())
    assert np.array_equal(np.array(a), np.array(b))
    bad = {"blk.0.ffn_gate_inp_shexp.weight": np.zeros((2, 128), np.float32)}
    with pytest.raises(MTPEngineError, match="blk.0.ffn_gate_inp_shexp.weight"):
        load(_rewrite(tmp_path / "gate_bad.gguf", tensors=bad))


def _untile(x: np.ndarray, axis: int, per_head: int, kh: int, vh: int) -> np.ndarray:
    """GGUF's tiled value-head order back to HF's grouped order."""
    x = np.moveaxis(x, axis, 0)
    rest = x.shape[1:]
    x = x.reshape(vh // kh, kh, per_head, *rest).transpose(1, 0, 2, *range(3, 3 + len(rest)))
    return np.moveaxis(x.reshape(vh * per_head, *rest), 0, axis)


def _hf_checkpoint(directory, cfg, fused: bool) -> None:
    """The Q4_K_M fixture's exact weights as an HF Qwen3_5MoeForCausalLM checkpoint. The MoE tensors
    are named from the fixture README; the others by inverting the (separately tested) dense mapping."""
    from safetensors.numpy import save_file

    from mtp_engine.model.hf_layout import hf_to_gguf_names

    reader = GGUFReader(need(Q4KM))
    gg = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(
        [int(n) for n in reversed(list(t.shape))]) for t in reader.tensors}
    kh, vh, vd, nqk = cfg.ssm_key_heads, cfg.ssm_value_heads, cfg.ssm_value_dim, 2 * cfg.ssm_key_heads * cfg.ssm_key_dim
    hf = {}
    for hf_name, name in hf_to_gguf_names(cfg).items():
        if "ffn_" in name or name not in gg:
            continue
        w, base = gg[name], name.split(".", 2)[-1]
        if name.endswith("norm.weight") and base != "ssm_norm.weight":
            w = w - 1.0
        elif base == "ssm_a":
            w = np.log(-_untile(w, 0, 1, kh, vh))
        elif base in ("ssm_conv1d.weight", "attn_qkv.weight"):
            w = np.concatenate([w[:nqk], _untile(w[nqk:], 0, vd, kh, vh)])
            w = w[:, None, :] if base == "ssm_conv1d.weight" else w
        elif base == "attn_gate.weight":
            w = _untile(w, 0, vd, kh, vh)
        elif base in ("ssm_alpha.weight", "ssm_beta.weight", "ssm_dt.bias"):
            w = _untile(w, 0, 1, kh, vh)
        elif base == "ssm_out.weight":
            w = _untile(w, 1, vd, kh, vh)
        hf[hf_name] = np.ascontiguousarray(w)
    for i in range(cfg.n_layer + 1):
        pre, blk = (f"model.layers.{i}." if i < cfg.n_layer else "mtp.layers.0."), f"blk.{i}."
        hf[pre + "mlp.gate.weight"] = gg[blk + "ffn_gate_inp.weight"]
        hf[pre + "mlp.shared_expert_gate.weight"] = gg[blk + "ffn_gate_inp_shexp.weight"].reshape(1, -1)
        for kind in ("gate", "up", "down"):
            hf[pre + f"mlp.shared_expert.{kind}_proj.weight"] = gg[blk + f"ffn_{kind}_shexp.weight"]
            if not fused:
                stacked = gg[blk + f"ffn_{kind}_exps.weight"]
                for e in range(cfg.n_expert):
                    hf[pre + f"mlp.experts.{e}.{kind}_proj.weight"] = np.ascontiguousarray(stacked[e])
        if fused:
            hf[pre + "mlp.experts.gate_up_proj"] = np.concatenate(
                [gg[blk + "ffn_gate_exps.weight"], gg[blk + "ffn_up_exps.weight"]], axis=1)
            hf[pre + "mlp.experts.down_proj"] = gg[blk + "ffn_down_exps.weight"]
    save_file(hf, str(directory / "model.safetensors"))
    (directory / "config.json").write_text((need(MOE / "hf" / "qwen35moe-mtp-tiny" / "config.json")).read_text())


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_hf_checkpoint_equals_gguf(tmp_path, ref, fused):
    m = _load()
    _hf_checkpoint(tmp_path, m.model.cfg, fused)
    hf = load_hf(tmp_path)
    fields = ("arch", "n_expert", "n_expert_used", "expert_ffn_size", "shared_ffn_size", "ffn_size")
    assert [getattr(hf.cfg, f) for f in fields] == [getattr(m.model.cfg, f) for f in fields]
    tokens = mx.array(ref["tokens_p2"][None])
    h_gguf = m.model.forward(tokens, m.model.make_cache())
    h_hf = hf.forward(tokens, hf.make_cache())
    err = np.abs(np.array(hf.logits(h_hf)) - np.array(m.model.logits(h_gguf))).max()
    e = m.model.embed_tokens(tokens)
    a = m.model.logits(m.model.mtp(e, h_gguf, m.model.mtp.make_cache()))
    b = hf.logits(hf.mtp(hf.embed_tokens(tokens), h_hf, hf.mtp.make_cache()))
    mtp_err = np.abs(np.array(a) - np.array(b)).max()
    _report("HF vs GGUF trunk logits", err)
    _report("HF vs GGUF MTP logits", mtp_err)
    assert err < TOL and mtp_err < TOL  # float matmuls here, quantized kernels there


# ---- the MoE block against the float64 reference, random weights ----------------------------

def _random_moe(rng, h: int, f: int, e: int, k: int, quantized: bool):
    """An MLX MoE and the float64 weights it really holds (after quantization)."""
    def stack(out, inp):
        w = rng.normal(0, inp ** -0.5, (e, out, inp)).astype(np.float32)
        if not quantized:
            return ExpertLinear(mx.array(w)), w.astype(np.float64)
        q, s, b = mx.quantize(mx.array(w.reshape(e * out, inp)), group_size=32, bits=4)
        lin = ExpertLinear(q.reshape(e, out, -1), s.reshape(e, out, -1), b.reshape(e, out, -1), 4, 32)
        return lin, np.array(lin.dense(), np.float64)

    def mat(out, inp):
        w = rng.normal(0, inp ** -0.5, (out, inp)).astype(np.float32)
        return Linear(mx.array(w)), w.astype(np.float64)

    (gate, g64), (up, u64), (down, d64) = stack(f, h), stack(f, h), stack(h, f)
    (sg, sg64), (su, su64), (sd, sd64) = mat(f, h), mat(f, h), mat(h, f)
    router = rng.normal(0, 2 * h ** -0.5, (e, h)).astype(np.float32)
    shexp_gate = rng.normal(0, h ** -0.5, h).astype(np.float32)
    block = MoE(Linear(mx.array(router)), SwitchGLU(gate, up, down), MLP(sg, su, sd), mx.array(shexp_gate), k)
    weights64 = (router.astype(np.float64), g64, u64, d64, sg64, su64, sd64, shexp_gate.astype(np.float64))
    return block, weights64


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "4bit"])
@pytest.mark.parametrize("e, k", [(8, 2), (16, 4)])
@pytest.mark.parametrize("rows", [1, 4, 40])
def test_moe_block_matches_float64_reference(quantized, e, k, rows):
    """1 row (decode), 4 (a verify batch) and 40 (rows*k >= 64: the sorted path)."""
    rng = np.random.default_rng(1000 * e + rows)
    h, f = 64, 96
    block, w64 = _random_moe(rng, h, f, e, k, quantized)
    x = rng.normal(0, 1, (1, rows, h)).astype(np.float32)
    records: list[dict] = []
    block.record = records.append
    out = np.array(block(mx.array(x))[0], np.float64)
    rec = records[0]
    experts, weights = _best_first(np.array(rec["experts"][0]), np.array(rec["weights"][0]))
    for r in range(rows):
        want, routing = moe_ffn(x[0, r].astype(np.float64), *w64, k)
        logits = np.sort(routing["router_logits"])[::-1]
        assert logits[k - 1] - logits[k] > 1e-3  # no near-tie: float32 must pick the same experts
        assert list(experts[r]) == list(routing["experts"])
        assert np.abs(weights[r] - routing["weights"]).max() < 1e-5
        assert abs(float(rec["shexp_gate"][0, r]) - routing["shexp_gate"]) < 1e-6
        assert np.abs(out[r] - want).max() < 1e-4 * max(1.0, np.abs(want).max())
    assert (rows * k >= SORT_THRESHOLD) == (rows == 40)


def test_batch_equals_rows_one_at_a_time():
    """Sorting rows by expert (prefill) and per-row gathers (decode) give the same numbers."""
    rng = np.random.default_rng(7)
    block, _ = _random_moe(rng, 64, 96, 8, 2, quantized=True)
    x = mx.array(rng.normal(0, 1, (1, 48, 64)).astype(np.float32))
    batch = np.array(block(x))
    single = np.concatenate([np.array(block(x[:, i:i + 1])) for i in range(48)], axis=1)
    assert np.abs(batch - single).max() < 1e-5


def test_distinct_experts_counts_what_a_batch_reads(ref):
    """A verify-sized batch reads the union of its rows' experts, once each (as in the references);
    a decode step reads n_used."""
    m = _load().model
    tokens = ref["tokens_p0"]
    n = len(_ref_json("ref")["prompts"][0]["prompt_ids"])
    cache = m.make_cache()
    m.forward(mx.array(tokens[None, :n]), cache)
    m.forward(mx.array(tokens[None, n:n + 4]), cache)
    want = [len(set(ref["experts_p0"][i, n:n + 4].ravel())) for i in range(4)]
    assert experts_touched(m)["trunk"] == want
    assert max(want) > 2  # the batch really spans more experts than one token does
    m.forward(mx.array(tokens[None, n + 4:n + 5]), cache)
    assert experts_touched(m)["trunk"] == [2, 2, 2, 2]


def test_blocks_report_routing_to_the_observer_they_are_given():
    """Expert counts travel through an explicit `ExpertUse` observer (no private attributes): a
    block reports its last forward's experts under its slot; an unobserved block reports nothing."""
    rng = np.random.default_rng(3)
    block, _ = _random_moe(rng, 64, 96, 8, 2, quantized=False)
    block(mx.array(rng.normal(0, 1, (1, 1, 64)).astype(np.float32)))  # no observer: nothing to record
    use = ExpertUse()
    block.observer, block.slot = use, use.register(("trunk", 0))
    assert use.slots("trunk") == [("trunk", 0)] and use.slots("mtp") == []
    assert use.distinct(("trunk", 0)) == 0  # before any forward
    block(mx.array(rng.normal(0, 1, (1, 1, 64)).astype(np.float32)))
    assert use.distinct(("trunk", 0)) == 2
    block(mx.array(rng.normal(0, 1, (1, 16, 64)).astype(np.float32)))
    assert 2 < use.distinct(("trunk", 0)) <= 8
    side, set_side = use.graph_outputs(use.slots("trunk"))
    set_side([mx.array([[[1, 1]]])])  # what a compiled step hands back
    assert use.distinct(("trunk", 0)) == 1 and len(side()) == 1
    assert use.graph_outputs([]) == (None, None)


# ---- the whole model against llama.cpp ------------------------------------------------------

def _mtp_teacher_forced(m, tokens, h):
    h_prev = mx.concatenate([mx.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
    cache = m.model.mtp.make_cache()
    hm = m.model.mtp(m.model.embed_tokens(mx.array(tokens[None])), h_prev, cache)
    return np.array(m.model.logits(hm)[0]), np.array(hm[0]), cache


@pytest.mark.parametrize("k", range(4))
def test_trunk_routing_and_mtp_match_llamacpp(ref, k):
    m = _load()
    tokens = ref[f"tokens_p{k}"]
    layers = _moe_layers(m.model)
    records: list[list[dict]] = [[] for _ in layers]
    for layer, rec in zip(layers, records):
        layer.record = rec.append
    try:
        h = m.model.forward(mx.array(tokens[None]), m.model.make_cache())
        logits = np.array(m.model.logits(h)[0])
        for i, layer in enumerate(layers):
            _check_routing(records[i][0], ref[f"router_logits_p{k}"][i], ref[f"experts_p{k}"][i],
                           ref[f"expert_weights_p{k}"][i], ref[f"shexp_gate_p{k}"][i], f"p{k} blk.{i}")
    finally:
        for layer in layers:
            layer.record = None
    err, herr = np.abs(logits - ref[f"logits_p{k}"]).max(), np.abs(np.array(h[0]) - ref[f"hidden_p{k}"]).max()
    _report(f"p{k} trunk logits", err)
    _report(f"p{k} trunk hidden", herr)
    assert err < TOL and herr < HIDDEN_TOL

    mtp = m.model.mtp.layer.mlp
    mtp_records: list[dict] = []
    mtp.record = mtp_records.append
    try:
        mtp_logits, mtp_hidden, _ = _mtp_teacher_forced(m, tokens, h)
        _check_routing(mtp_records[0], ref[f"mtp_router_logits_p{k}"], ref[f"mtp_experts_p{k}"],
                       ref[f"mtp_expert_weights_p{k}"], ref[f"mtp_shexp_gate_p{k}"], f"p{k} MTP")
    finally:
        mtp.record = None
    err, herr = np.abs(mtp_logits - ref[f"mtp_logits_p{k}"]).max(), np.abs(mtp_hidden - ref[f"mtp_hidden_p{k}"]).max()
    _report(f"p{k} MTP logits", err)
    _report(f"p{k} MTP hidden", herr)
    assert err < TOL and herr < HIDDEN_TOL

    # the 3-step draft chain after the prompt: step 1 reads (generated[0], hidden[n-1])
    n = len(_ref_json("ref")["prompts"][k]["prompt_ids"])
    _, _, cache = _mtp_teacher_forced(m, tokens[:n], h[:, :n])
    tok, hp = mx.array([[int(ref[f"draft_input_ids_p{k}"][0])]]), h[:, n - 1:n]
    ids, dl = [], []
    for _ in range(3):
        hp = m.model.mtp(m.model.embed_tokens(tok), hp, cache)
        lg = m.model.logits(hp)[0, 0]
        ids.append(int(mx.argmax(lg).item()))
        dl.append(np.array(lg))
        tok = mx.array([[ids[-1]]])
    assert ids == list(ref[f"draft_ids_p{k}"])
    err = np.abs(np.stack(dl) - ref[f"draft_logits_p{k}"]).max()
    _report(f"p{k} draft chain logits", err)
    assert err < TOL


def test_float64_reference_matches_llamacpp(ref):
    """The NumPy oracle's own MoE path, checked once against llama.cpp (prompt 3)."""
    hp, tensors = load_gguf_weights(str(need(Q4KM)))
    model = RefModel(hp, tensors)
    model.routing_log = []
    tokens = ref["tokens_p3"].tolist()
    logits, hidden = model.forward(tokens)
    chosen = np.array([r["experts"] for _, r in model.routing_log]).reshape(len(tokens), 4, 2)
    assert (chosen.transpose(1, 0, 2) == ref["experts_p3"]).all()
    mtp_logits, _ = model.mtp_forward(tokens, hidden)
    _report("float64 reference trunk logits", np.abs(logits - ref["logits_p3"]).max())
    _report("float64 reference MTP logits", np.abs(mtp_logits - ref["mtp_logits_p3"]).max())
    assert np.abs(logits - ref["logits_p3"]).max() < TOL
    assert np.abs(mtp_logits - ref["mtp_logits_p3"]).max() < TOL


def test_greedy_continuations_equal_llamacpp():
    m = _load()
    for p in _ref_json("ref")["prompts"]:
        assert m.tokenizer.encode(p["prompt"]) == p["prompt_ids"]
        r = generate(p["prompt_ids"], m, max_tokens=len(p["generated_ids"]), ignore_eos=True)
        assert r.token_ids == p["generated_ids"], p["prompt"]


def test_rounds_equal_llamacpp_speculative_simple():
    """Draft tokens, acceptances and emitted tokens round by round as llama-speculative-simple
    (n-max 3, -n 64) on the exact-dequantized twin, and so its n_drafted / n_accept summary.
    llama.cpp shortens its last drafts to fit -n; those rounds run with the same shorter n-max."""
    m = _load()
    for p in _ref_json("spec")["prompts"]:
        dec = DraftMTPDecoder(m.model, Sampler(SamplerConfig()), DraftParams(3, 0, 0.0), trace=[])
        dec.prefill(p["prompt_ids"])
        for want in p["rounds"]:
            dec.params = DraftParams(len(want["draft"]), 0, 0.0)
            dec.step()
            ours = dec.trace[-1]
            assert ours["draft"] == [d["id"] for d in want["draft"]]
            assert ours["n_accepted"] == want["n_accepted"]
            assert ours["emitted"] == want["emitted_ids"]
        assert sum(len(r["draft"]) for r in dec.trace) == p["n_drafted"]
        assert sum(r["n_accepted"] for r in dec.trace) == p["n_accept"]
        assert [t for r in dec.trace for t in r["emitted"]] == p["spec_generated_ids"]
        assert sum(len(r["draft"]) == 3 for r in dec.trace) >= 50


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "default"])
def test_draft_mtp_equals_plain_greedy(exact):
    """n-max 1..4, one per prompt to stay fast (the rounds test above also runs n-max 3 on every
    prompt, over 64 tokens); the default mode runs the longest drafts."""
    m = _load(exact)
    prompts = [p["prompt_ids"] for p in _ref_json("ref")["prompts"]]
    for i, ids in enumerate(prompts if exact else prompts[:1]):
        base = generate(ids, m, max_tokens=32, ignore_eos=True).token_ids
        for n_max in ((i + 1,) if exact else (4,)):
            r = generate(ids, m, max_tokens=32, spec="draft-mtp", n_max=n_max, ignore_eos=True)
            assert r.token_ids == base, (i, n_max)


# Default mode requantizes the Q6_K tensors (output, 2 expert and 2 shared-expert down matrices)
# to 8 bits; measured max |logit error| against the exact-dequantized reference: see -s output.
DEFAULT_MODE_BOUND = 1.0


def test_default_mode_error_is_bounded(ref):
    m = _load(False)
    err = max(np.abs(np.array(m.model.logits(m.model.forward(mx.array(ref[f"tokens_p{k}"][None]),
                                                              m.model.make_cache()))[0])
                     - ref[f"logits_p{k}"]).max() for k in range(4))
    _report("default mode (Q6_K -> 8-bit) logits", err)
    assert err < DEFAULT_MODE_BOUND
