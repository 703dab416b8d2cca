"""The MLX forward (float32) against the float64 NumPy reference on random tiny models.

Each shape below is a random Qwen3.5+MTP model built in memory, with tensors in GGUF naming and
conventions (norm weights already +1, `ssm_a` = -exp(A_log), conv `[channels, kernel]`, value heads in
tiled order). The MLX model is assembled with `build_model`; `tests/reference_numpy.RefModel` gets the
same tensors as float64. Covered: value heads != key heads and equal heads, GQA/MQA/MHA, head_dim 32 and
64, partial and full rope, conv kernels 3 and 4, several recurrent/attention layer patterns, per-layer
FFN sizes and tied embeddings. Compared: trunk logits and hidden states (one forward, token by token,
chunks of 5), the teacher-forced MTP head, a 3-step draft chain, and cache rollback after a captured
forward.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mtp_engine.model.step import Pass
import numpy as np
import pytest

from mtp_engine.model.build import build_model
from mtp_engine.model.cache import RecurrentCache
from mtp_engine.model.kv_cache import KVCache
from mtp_engine.model.config import Qwen35Config
from mtp_engine.model.layers import Linear

try:
    from tests.reference_numpy import RefModel
except ImportError:  # imported as a package module
    from tests.reference_numpy import RefModel

REL_TOL = 1e-4  # max abs err / max abs ref
CACHE_ATOL = 1e-5
SEQ_LEN = 12
CHUNK = 5
N_DRAFT = 3


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    conv_kernel: int
    kh: int  # ssm key heads (group_count)
    kd: int  # ssm key head dim (state_size)
    vh: int  # ssm value heads (time_step_rank)
    vd: int  # ssm value head dim
    recurrent: tuple
    ffn: tuple  # per block: trunk layers then the MTP block
    tied: bool = False
    rope_base: float = 10000.0
    eps: float = 1e-6
    seed: int = 0

    @property
    def n_layer(self) -> int:
        return len(self.recurrent)

    @property
    def channels(self) -> int:
        return 2 * self.kh * self.kd + self.vh * self.vd


T, F = True, False
SHAPES = [
    # value heads = 2 x key heads; GQA 4/2; partial rope; kernel 4; one GDN + one attention layer
    Shape("vh4kh2-gqa4x2-d32-rot16-k4", hidden=64, vocab=96, n_head=4, n_head_kv=2, head_dim=32, n_rot=16,
          conv_kernel=4, kh=2, kd=16, vh=4, vd=16, recurrent=(T, F), ffn=(96, 96, 96), seed=1),
    # value heads = 3 x one key head; MQA 4/1; full rope on head_dim 64; kernel 3; Qwen3.5's 3:1 pattern;
    # per-layer FFN sizes; tied embeddings
    Shape("vh3kh1-mqa4x1-d64-rotfull-k3-tied", hidden=48, vocab=80, n_head=4, n_head_kv=1, head_dim=64, n_rot=64,
          conv_kernel=3, kh=1, kd=32, vh=3, vd=16, recurrent=(T, T, T, F), ffn=(80, 64, 48, 112, 72), tied=True,
          rope_base=1e7, seed=2),
    # equal heads; MHA 2/2; full rope on head_dim 32; attention first
    Shape("vh2kh2-mha2x2-d32-rotfull-k4", hidden=64, vocab=72, n_head=2, n_head_kv=2, head_dim=32, n_rot=32,
          conv_kernel=4, kh=2, kd=32, vh=2, vd=32, recurrent=(F, T), ffn=(128, 64, 96), seed=3),
    # value heads = 3 x key heads; GQA 2/1; partial rope 24 of 64; kernel 3; mixed deeper stack
    Shape("vh6kh2-gqa2x1-d64-rot24-k3", hidden=32, vocab=64, n_head=2, n_head_kv=1, head_dim=64, n_rot=24,
          conv_kernel=3, kh=2, kd=8, vh=6, vd=8, recurrent=(F, T, T, F, T), ffn=(40, 56, 48, 64, 32, 48),
          rope_base=1e6, seed=4),
    # equal heads with one head each; only recurrent trunk layers (attention only in the MTP block)
    Shape("vh1kh1-gqa4x2-d32-rot8-k4-allgdn", hidden=40, vocab=56, n_head=4, n_head_kv=2, head_dim=32, n_rot=8,
          conv_kernel=4, kh=1, kd=16, vh=1, vd=24, recurrent=(T, T), ffn=(64, 64, 64), tied=True, seed=5),
]


# ---- random model ---------------------------------------------------------------------------------

def _attention_tensors(rng, p: str, s: Shape, out: dict) -> None:
    h, d = s.hidden, s.head_dim
    out[p + "attn_q.weight"] = _mat(rng, s.n_head * 2 * d, h)
    out[p + "attn_k.weight"] = _mat(rng, s.n_head_kv * d, h)
    out[p + "attn_v.weight"] = _mat(rng, s.n_head_kv * d, h)
    out[p + "attn_output.weight"] = _mat(rng, h, s.n_head * d)
    out[p + "attn_q_norm.weight"] = _norm(rng, d)
    out[p + "attn_k_norm.weight"] = _norm(rng, d)


def _gdn_tensors(rng, p: str, s: Shape, out: dict) -> None:
    h = s.hidden
    out[p + "attn_qkv.weight"] = _mat(rng, s.channels, h)
    out[p + "attn_gate.weight"] = _mat(rng, s.vh * s.vd, h)
    out[p + "ssm_alpha.weight"] = _mat(rng, s.vh, h)
    out[p + "ssm_beta.weight"] = _mat(rng, s.vh, h)
    out[p + "ssm_conv1d.weight"] = rng.normal(0.0, 0.25, (s.channels, s.conv_kernel)).astype(np.float32)
    out[p + "ssm_a"] = (-np.exp(np.log(rng.uniform(0.05, 1.0, s.vh)))).astype(np.float32)
    out[p + "ssm_dt.bias"] = rng.uniform(-1.0, 0.0, s.vh).astype(np.float32)
    out[p + "ssm_norm.weight"] = rng.normal(1.0, 0.1, s.vd).astype(np.float32)
    out[p + "ssm_out.weight"] = _mat(rng, h, s.vh * s.vd)


def _mat(rng, rows: int, cols: int) -> np.ndarray:
    return rng.normal(0.0, np.sqrt(1.0 / cols), (rows, cols)).astype(np.float32)


def _norm(rng, n: int) -> np.ndarray:
    return (1.0 + rng.normal(0.0, 0.1, n)).astype(np.float32)


def random_tensors(s: Shape) -> dict[str, np.ndarray]:
    """Random float32 tensors of a Qwen3.5+MTP model, named and laid out as in a GGUF file (numpy order)."""
    rng = np.random.default_rng(s.seed)
    h = s.hidden
    t: dict[str, np.ndarray] = {"token_embd.weight": rng.normal(0.0, 1.0, (s.vocab, h)).astype(np.float32),
                                "output_norm.weight": _norm(rng, h)}
    if not s.tied:
        t["output.weight"] = rng.normal(0.0, 1.0, (s.vocab, h)).astype(np.float32)
    for i in range(s.n_layer + 1):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = _norm(rng, h)
        t[p + "post_attention_norm.weight"] = _norm(rng, h)
        if i < s.n_layer and s.recurrent[i]:
            _gdn_tensors(rng, p, s, t)
        else:
            _attention_tensors(rng, p, s, t)
        f = s.ffn[i]
        t[p + "ffn_gate.weight"] = _mat(rng, f, h)
        t[p + "ffn_up.weight"] = _mat(rng, f, h)
        t[p + "ffn_down.weight"] = _mat(rng, h, f)
    p = f"blk.{s.n_layer}.nextn."
    t[p + "eh_proj.weight"] = _mat(rng, h, 2 * h)
    t[p + "enorm.weight"] = _norm(rng, h)
    t[p + "hnorm.weight"] = _norm(rng, h)
    t[p + "shared_head_norm.weight"] = _norm(rng, h)
    return t


def make_config(s: Shape) -> Qwen35Config:
    cfg = Qwen35Config(
        vocab_size=s.vocab, hidden_size=s.hidden, n_layer=s.n_layer, n_mtp=1, ffn_size=list(s.ffn),
        n_head=s.n_head, n_head_kv=s.n_head_kv, head_dim=s.head_dim, n_rot=s.n_rot, rope_base=s.rope_base,
        eps=s.eps, conv_kernel=s.conv_kernel, ssm_key_dim=s.kd, ssm_key_heads=s.kh, ssm_value_heads=s.vh,
        ssm_inner=s.vh * s.vd, recurrent=list(s.recurrent), tied_embeddings=s.tied)
    cfg.validate("random")
    return cfg


def ref_hparams(s: Shape) -> dict:
    return dict(n_vocab=s.vocab, hidden=s.hidden, n_layer=s.n_layer, n_mtp=1, n_head=s.n_head,
                n_head_kv=s.n_head_kv, head_dim=s.head_dim, n_rot=s.n_rot, rope_base=s.rope_base, eps=s.eps,
                ffn=list(s.ffn), conv_kernel=s.conv_kernel, ssm_d_state=s.kd, ssm_n_group=s.kh, ssm_dt_rank=s.vh,
                ssm_d_inner=s.vh * s.vd, recurrent=list(s.recurrent))


def build_mlx(s: Shape, tensors: dict[str, np.ndarray]):
    """The MLX model from `tensors`; also returns the names `build_model` fetched."""
    fetched: list[str] = []

    def fetch(name: str, shape: tuple, matrix: bool):
        assert name in tensors, f"build_model asked for {name}, which a GGUF of this shape would not hold"
        w = tensors[name]
        assert tuple(w.shape) == tuple(shape), f"{name}: build_model expects {shape}, GGUF layout is {w.shape}"
        assert w.ndim == 2 or not matrix, f"{name}: matrix with ndim={w.ndim}"
        fetched.append(name)
        return Linear(mx.array(w)) if matrix else mx.array(w)

    model = build_model(make_config(s), fetch, lambda n: n in tensors)
    return model, fetched


@dataclass
class Case:
    shape: Shape
    tensors: dict
    model: object
    fetched: list
    ref: RefModel
    tokens: list
    ref_logits: np.ndarray
    ref_hidden: np.ndarray
    extra: dict = field(default_factory=dict)


@pytest.fixture(scope="module", params=SHAPES, ids=[s.name for s in SHAPES])
def case(request) -> Case:
    s: Shape = request.param
    tensors = random_tensors(s)
    model, fetched = build_mlx(s, tensors)
    ref = RefModel(ref_hparams(s), {k: v.astype(np.float64) for k, v in tensors.items()})
    rng = np.random.default_rng(100 + s.seed)
    tokens = [int(x) for x in rng.integers(0, s.vocab, SEQ_LEN)]
    logits, hidden = ref.forward(tokens)
    return Case(s, tensors, model, fetched, ref, tokens, logits, hidden)


# ---- helpers --------------------------------------------------------------------------------------

def rel_err(got, ref) -> float:
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert np.all(np.isfinite(got)), "non-finite values"
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def ids(tokens) -> mx.array:
    return mx.array(np.asarray(tokens, dtype=np.int32)[None])


def run_chunks(model, tokens, sizes) -> mx.array:
    """Trunk hidden [1, S, H] from forwards over consecutive chunks of `sizes` with one cache."""
    cache = model.make_cache()
    outs, at = [], 0
    for n in sizes:
        h = model.forward(ids(tokens[at:at + n]), cache)
        mx.eval(h, *cache.arrays())
        outs.append(h)
        at += n
    assert at == len(tokens) and cache.offset == len(tokens)
    return mx.concatenate(outs, axis=1)


def check_trunk(c: Case, h: mx.array) -> None:
    logits = np.array(c.model.logits(h)[0])
    e_h = rel_err(np.array(h[0]), c.ref_hidden)
    e_l = rel_err(logits, c.ref_logits)
    assert e_h < REL_TOL, f"hidden rel err {e_h:.2e}"
    assert e_l < REL_TOL, f"logits rel err {e_l:.2e}"


def trunk_hidden(c: Case) -> mx.array:
    if "h" not in c.extra:
        c.extra["h"] = run_chunks(c.model, c.tokens, [len(c.tokens)])
    return c.extra["h"]


# ---- build ----------------------------------------------------------------------------------------

def test_build_reads_every_tensor_once(case):
    assert sorted(case.fetched) == sorted(case.tensors), "build_model fetched a different set of tensors"
    assert len(set(case.fetched)) == len(case.fetched)
    m = case.model
    assert (m.lm_head is m.embed) == case.shape.tied
    assert m.mtp is not None and len(m.layers) == case.shape.n_layer


# ---- trunk ----------------------------------------------------------------------------------------

def test_trunk_one_forward(case):
    check_trunk(case, trunk_hidden(case))


def test_trunk_token_by_token(case):
    check_trunk(case, run_chunks(case.model, case.tokens, [1] * len(case.tokens)))


def test_trunk_chunks_of_5(case):
    n = len(case.tokens)
    sizes = [CHUNK] * (n // CHUNK) + ([n % CHUNK] if n % CHUNK else [])
    check_trunk(case, run_chunks(case.model, case.tokens, sizes))


# ---- MTP head -------------------------------------------------------------------------------------

def mtp_teacher_forced(model, tokens, h):
    """Row t reads (token t, trunk hidden t-1), zeros for t=0; returns (logits, hidden, cache)."""
    h_prev = mx.concatenate([mx.zeros_like(h[:, :1]), h[:, :-1]], axis=1)
    cache = model.mtp.make_cache()
    hm = model.mtp(model.embed_tokens(ids(tokens)), h_prev, cache)
    mx.eval(hm)
    return np.array(model.logits(hm)[0]), np.array(hm[0]), cache


def test_mtp_teacher_forced(case):
    h = trunk_hidden(case)
    logits, hidden, cache = mtp_teacher_forced(case.model, case.tokens, h)
    assert cache.offset == len(case.tokens)
    ref_logits, ref_hidden = case.ref.mtp_forward(case.tokens, case.ref_hidden)
    e_h, e_l = rel_err(hidden, ref_hidden), rel_err(logits, ref_logits)
    assert e_h < REL_TOL, f"MTP hidden rel err {e_h:.2e}"
    assert e_l < REL_TOL, f"MTP logits rel err {e_l:.2e}"


@pytest.mark.parametrize("n", [1, 8])
def test_mtp_draft_chain(case, n):
    """MTP KV holds teacher-forced rows 0..n-1; step 1 reads (token n, trunk hidden n-1) at position n,
    step i > 1 reads (draft i-1, head hidden i-1)."""
    h = trunk_hidden(case)
    first = case.tokens[n]
    ref_ids, ref_logits, ref_hidden = case.ref.draft_chain(case.tokens[:n], case.ref_hidden[:n], first, N_DRAFT)
    _, _, cache = mtp_teacher_forced(case.model, case.tokens[:n], h[:, :n])
    tok, hp = first, h[:, n - 1:n]
    got_ids, logits, hidden = [], [], []
    for i in range(N_DRAFT):
        hm = case.model.mtp(case.model.embed_tokens(ids([tok])), hp, cache)
        lg = np.array(case.model.logits(hm)[0, 0])
        got_ids.append(int(np.argmax(lg)))
        logits.append(lg)
        hidden.append(np.array(hm[0, 0]))
        # follow the reference's drafts so one near-tie cannot derail the rest of the chain
        tok, hp = ref_ids[i], hm
    assert cache.offset == n + N_DRAFT
    logits, hidden = np.stack(logits), np.stack(hidden)
    e_h, e_l = rel_err(hidden, ref_hidden), rel_err(logits, ref_logits)
    assert e_h < REL_TOL, f"draft hidden rel err {e_h:.2e}"
    assert e_l < REL_TOL, f"draft logits rel err {e_l:.2e}"
    for i, (g, r) in enumerate(zip(got_ids, ref_ids)):
        top2 = np.sort(ref_logits[i])[-2:]
        if top2[1] - top2[0] > 1e-3 * np.max(np.abs(ref_logits[i])):
            assert g == r, f"draft step {i + 1}: MLX chose {g}, reference {r}"


# ---- rollback -------------------------------------------------------------------------------------

def assert_caches_equal(got, want, what: str) -> None:
    assert got.offset == want.offset, f"{what}: trunk offset {got.offset} != {want.offset}"
    for i, (a, b) in enumerate(zip(got.layers, want.layers)):
        assert type(a) is type(b)
        where = f"{what}, layer {i} ({type(a).__name__})"
        if isinstance(a, KVCache):
            assert a.offset == b.offset, f"{where}: offset {a.offset} != {b.offset}"
            if b.offset:
                ka, va = a.state()
                kb, vb = b.state()
                np.testing.assert_allclose(np.array(ka), np.array(kb), rtol=0, atol=CACHE_ATOL, err_msg=where)
                np.testing.assert_allclose(np.array(va), np.array(vb), rtol=0, atol=CACHE_ATOL, err_msg=where)
        else:
            assert isinstance(a, RecurrentCache)
            assert a.conv.shape == b.conv.shape and a.state.shape == b.state.shape, where
            np.testing.assert_allclose(np.array(a.conv), np.array(b.conv), rtol=0, atol=CACHE_ATOL,
                                       err_msg=where + " conv")
            np.testing.assert_allclose(np.array(a.state), np.array(b.state), rtol=0, atol=CACHE_ATOL,
                                       err_msg=where + " state")


ROLLBACK_S = 6
AFTER = 3


@pytest.mark.parametrize("prefix", [0, 3])
def test_rollback_equals_fresh_cache(case, prefix):
    """forward(Pass.VERIFY) over S tokens then rollback(n) == a fresh cache fed only prefix + n tokens,
    for every n in 0..S; forwards after the rollback match too."""
    model, toks = case.model, case.tokens
    S = ROLLBACK_S
    assert prefix + S + AFTER <= len(toks)
    for n in range(S + 1):
        cache = model.make_cache()
        if prefix:
            model.forward(ids(toks[:prefix]), cache)
        h_cap = model.forward(ids(toks[prefix:prefix + S]), cache, Pass.VERIFY)
        mx.eval(h_cap, *cache.arrays())
        cache.rollback(n)
        mx.eval(*cache.arrays())

        fresh = model.make_cache()
        if prefix + n:
            h_fresh = model.forward(ids(toks[:prefix + n]), fresh)
            mx.eval(h_fresh)
            # the captured forward's own outputs for the kept rows are the fresh ones
            if n:
                np.testing.assert_allclose(np.array(h_cap[0, :n]), np.array(h_fresh[0, prefix:]), rtol=0,
                                           atol=CACHE_ATOL)
        assert_caches_equal(cache, fresh, f"prefix {prefix}, rollback to {n} of {S}")

        nxt = toks[prefix + n:prefix + n + AFTER]
        h_a = model.forward(ids(nxt), cache)
        h_b = model.forward(ids(nxt), fresh)
        mx.eval(h_a, h_b)
        np.testing.assert_allclose(np.array(h_a), np.array(h_b), rtol=0, atol=CACHE_ATOL,
                                   err_msg=f"forward after rollback to {n}")
        assert_caches_equal(cache, fresh, f"prefix {prefix}, rollback to {n} then {AFTER} more")
        # and against the reference: the trunk is where a fresh run over the same tokens would be
        e = rel_err(np.array(h_a[0]), case.ref_hidden[prefix + n:prefix + n + AFTER])
        assert e < REL_TOL, f"hidden after rollback to {n}: rel err {e:.2e}"


def test_repeated_capture_rollback_rounds(case):
    """Speculative-decoding pattern: rounds of captured forwards, each rolled back to a different n,
    end where one forward over the kept tokens ends."""
    model, toks = case.model, case.tokens
    cache = model.make_cache()
    kept: list[int] = []
    at = 0
    for size, keep in [(4, 2), (3, 3), (4, 0), (2, 1), (3, 2)]:
        chunk = toks[at:at + size]
        h = model.forward(ids(chunk), cache, Pass.VERIFY)
        mx.eval(h, *cache.arrays())
        cache.rollback(keep)
        kept += chunk[:keep]
        at += keep
    assert cache.offset == len(kept) == at
    fresh = model.make_cache()
    model.forward(ids(kept), fresh)
    assert_caches_equal(cache, fresh, "after rounds")
    h = model.forward(ids(toks[at:at + 2]), cache)
    e = rel_err(np.array(h[0]), case.ref_hidden[at:at + 2])
    assert e < REL_TOL, f"hidden after rounds: rel err {e:.2e}"


def test_rollback_past_capture_raises(case):
    cache = case.model.make_cache()
    case.model.forward(ids(case.tokens[:3]), cache, Pass.VERIFY)
    with pytest.raises(ValueError):
        cache.rollback(4)
