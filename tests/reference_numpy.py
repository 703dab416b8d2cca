"""Independent float64 NumPy reference of the Qwen3.5 forward pass (trunk + MTP head), dense
(``qwen35``) or mixture-of-experts (``qwen35moe``, see ``moe_ffn``).

This module is a test oracle for the MLX engine. It is written directly from the model
math (see ../shared/reference/qwen35-gguf.md), deliberately simple and slow: every
token is processed on its own, in float64, with the model state kept explicit so that a
test can step token by token and inspect it.

It shares no code with ``mtp_engine``; the only dependency besides NumPy is the ``gguf``
package (``GGUFReader`` to read the file and ``gguf.quants.dequantize`` for quantized
tensors).

Conventions (as stored by llama.cpp's converter):
- every RMSNorm weight except ``ssm_norm`` already includes the +1 offset, so all norms are
  applied as ``x / sqrt(mean(x^2) + eps) * w``;
- ``ssm_a`` holds ``-exp(A_log)``; ``ssm_conv1d.weight`` is ``[channels, kernel]``;
- gated-delta-net value head ``h`` uses key head ``h % Kh`` (tiled order);
- MoE experts are stacked ``[n_expert, out, in]``; the shared-expert gate may be stored as
  ``[H]`` or ``[1, H]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import gguf


# ---------------------------------------------------------------------------
# GGUF loading
# ---------------------------------------------------------------------------

def _field_value(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def load_gguf_weights(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """Reads a GGUF with gguf.GGUFReader; returns (hparams, tensors).

    ``tensors`` maps GGUF tensor names to float64 arrays in numpy shape (reversed GGUF
    ``ne``), dequantized with ``gguf.quants.dequantize`` for quantized types.

    ``hparams`` keys: n_vocab, hidden, n_layer (trunk layers, excluding MTP), n_mtp,
    n_head, n_head_kv, head_dim, n_rot, rope_base, eps, ffn (int, or a per-layer list if
    the file stores an array), conv_kernel, ssm_d_state (key head dim), ssm_n_group (key
    heads), ssm_dt_rank (value heads), ssm_d_inner, recurrent (list[bool] per trunk layer),
    n_expert and n_expert_used (0 for a dense model; ffn is then None for an MoE model).
    """
    reader = gguf.GGUFReader(path)
    arch = _field_value(reader, "general.architecture")
    if arch not in ("qwen35", "qwen35moe"):
        raise ValueError(f"{path}: unsupported architecture {arch!r} (expected 'qwen35' or 'qwen35moe')")
    p = arch + "."

    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(list(t.shape)))
        arr = gguf.quants.dequantize(t.data, t.tensor_type)
        tensors[t.name] = np.asarray(arr, dtype=np.float64).reshape(shape)

    def get(key, default=None):
        return _field_value(reader, p + key, default)

    block_count = int(get("block_count"))
    n_mtp = int(get("nextn_predict_layers", 0))
    n_layer = block_count - n_mtp
    hidden = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_head_kv = int(get("attention.head_count_kv", n_head))
    head_dim = int(get("attention.key_length", hidden // n_head))
    n_rot = int(get("rope.dimension_count", head_dim))
    ffn = get("feed_forward_length")
    ffn = [int(v) for v in ffn] if isinstance(ffn, list) else (None if ffn is None else int(ffn))

    rec_flags = get("attention.recurrent_layers")
    if rec_flags is not None:
        recurrent = [bool(v) for v in rec_flags][:n_layer]
    else:
        interval = int(get("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n_layer)]

    n_vocab = tensors["token_embd.weight"].shape[0]

    hparams = dict(
        n_vocab=int(n_vocab),
        hidden=hidden,
        n_layer=n_layer,
        n_mtp=n_mtp,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_rot=n_rot,
        rope_base=float(get("rope.freq_base", 10000.0)),
        eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        ffn=ffn,
        conv_kernel=int(get("ssm.conv_kernel", 4)),
        ssm_d_state=int(get("ssm.state_size", 0)),
        ssm_n_group=int(get("ssm.group_count", 0)),
        ssm_dt_rank=int(get("ssm.time_step_rank", 0)),
        ssm_d_inner=int(get("ssm.inner_size", 0)),
        recurrent=recurrent,
        n_expert=int(get("expert_count", 0)),
        n_expert_used=int(get("expert_used_count", 0)),
    )
    return hparams, tensors


# ---------------------------------------------------------------------------
# Elementary functions (float64)
# ---------------------------------------------------------------------------

def rms_norm(x: np.ndarray, w: np.ndarray | None, eps: float) -> np.ndarray:
    """RMSNorm over the last axis: x / sqrt(mean(x^2) + eps) * w."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    """llama.cpp ggml_l2_norm over the last axis: x / max(||x||, eps)."""
    n = np.sqrt(np.sum(x * x, axis=-1, keepdims=True))
    return x / np.maximum(n, eps)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / np.sum(e)


def moe_ffn(y: np.ndarray, router: np.ndarray, gate_exps: np.ndarray, up_exps: np.ndarray,
            down_exps: np.ndarray, gate_shexp: np.ndarray, up_shexp: np.ndarray, down_shexp: np.ndarray,
            shexp_gate: np.ndarray, n_used: int) -> tuple[np.ndarray, dict]:
    """Qwen3.5-MoE FFN for one token y [H] (llama.cpp's qwen35moe graph, transformers'
    Qwen3_5MoeSparseMoeBlock): softmax over all router logits, the n_used most probable experts
    (best first), their probabilities renormalised to sum 1, SwiGLU experts, plus the shared
    SwiGLU expert scaled by sigmoid(y . shexp_gate).

    Experts are stacked [n_expert, out, in]. Returns (output [H], routing) with routing keys
    router_logits [E], experts [n_used], weights [n_used] and shexp_gate (a float)."""
    logits = router @ y
    p = softmax(logits)
    chosen = np.argsort(-p, kind="stable")[:n_used]
    w = p[chosen] / np.sum(p[chosen])
    out = np.zeros_like(y)
    for e, we in zip(chosen, w):
        out += we * (down_exps[e] @ (silu(gate_exps[e] @ y) * (up_exps[e] @ y)))
    g = float(sigmoid(np.dot(np.reshape(shexp_gate, -1), y)))
    out += g * (down_shexp @ (silu(gate_shexp @ y) * (up_shexp @ y)))
    return out, dict(router_logits=logits, experts=chosen, weights=w, shexp_gate=g)


def rope_neox(x: np.ndarray, pos: int, n_rot: int, base: float) -> np.ndarray:
    """NEOX rotary embedding of the first n_rot dims of each head; x: [heads, Dh].

    Pairs (j, j + n_rot/2) for j < n_rot/2, rotated by theta_j = pos * base^(-2j/n_rot).
    """
    half = n_rot // 2
    j = np.arange(half, dtype=np.float64)
    theta = pos * base ** (-2.0 * j / n_rot)
    c, s = np.cos(theta), np.sin(theta)
    x1 = x[:, :half]
    x2 = x[:, half:n_rot]
    out = x.copy()
    out[:, :half] = x1 * c - x2 * s
    out[:, half:n_rot] = x2 * c + x1 * s
    return out


# ---------------------------------------------------------------------------
# Explicit state
# ---------------------------------------------------------------------------

@dataclass
class KVCache:
    """Per full-attention layer: one [n_head_kv, Dh] entry per processed position."""
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.keys)


@dataclass
class GDNState:
    """Per gated-delta-net layer: conv window (previous kernel-1 inputs) and S per value head."""
    conv: np.ndarray  # [kernel-1, channels]
    S: np.ndarray  # [Vh, Kd, Vd]


@dataclass
class TrunkState:
    layers: list  # KVCache or GDNState per trunk layer
    pos: int = 0  # number of tokens processed = position of the next token


@dataclass
class MTPState:
    kv: KVCache = field(default_factory=KVCache)
    pos: int = 0


# ---------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------

class RefModel:
    """Float64 token-by-token Qwen3.5 trunk + MTP head."""

    def __init__(self, hparams: dict, tensors: dict[str, np.ndarray]):
        self.hp = hparams
        self.t = tensors
        self.H = hparams["hidden"]
        self.eps = hparams["eps"]
        self.n_layer = hparams["n_layer"]
        self.n_head = hparams["n_head"]
        self.n_head_kv = hparams["n_head_kv"]
        self.Dh = hparams["head_dim"]
        self.n_rot = hparams["n_rot"]
        self.rope_base = hparams["rope_base"]
        self.Kh = hparams["ssm_n_group"]
        self.Kd = hparams["ssm_d_state"]
        self.Vh = hparams["ssm_dt_rank"]
        self.Vd = hparams["ssm_d_inner"] // max(self.Vh, 1)
        self.kernel = hparams["conv_kernel"]
        self.recurrent = list(hparams["recurrent"])
        self.embed = tensors["token_embd.weight"]
        self.out_w = tensors.get("output.weight", self.embed)  # tied if absent
        self.mtp_blk = f"blk.{self.n_layer}"  # first (only) MTP block
        self.n_expert_used = int(hparams.get("n_expert_used", 0))
        # when a list, every MoE FFN evaluation appends (block name, routing dict)
        self.routing_log: list | None = None

    # -- state --------------------------------------------------------------
    def new_state(self) -> TrunkState:
        layers = []
        for i in range(self.n_layer):
            if self.recurrent[i]:
                channels = self.t[f"blk.{i}.ssm_conv1d.weight"].shape[0]
                layers.append(GDNState(
                    conv=np.zeros((self.kernel - 1, channels)),
                    S=np.zeros((self.Vh, self.Kd, self.Vd)),
                ))
            else:
                layers.append(KVCache())
        return TrunkState(layers=layers, pos=0)

    def new_mtp_state(self) -> MTPState:
        return MTPState()

    # -- blocks ---------------------------------------------------------------
    def _w(self, name: str) -> np.ndarray:
        return self.t[name]

    def attention(self, blk: str, x: np.ndarray, cache: KVCache, pos: int) -> np.ndarray:
        """Gated full attention for one token x [H] at position pos; appends to cache."""
        nh, nkv, Dh = self.n_head, self.n_head_kv, self.Dh
        qg = (self._w(f"{blk}.attn_q.weight") @ x).reshape(nh, 2 * Dh)
        q, gate = qg[:, :Dh], qg[:, Dh:]
        k = (self._w(f"{blk}.attn_k.weight") @ x).reshape(nkv, Dh)
        v = (self._w(f"{blk}.attn_v.weight") @ x).reshape(nkv, Dh)
        q = rms_norm(q, self._w(f"{blk}.attn_q_norm.weight"), self.eps)
        k = rms_norm(k, self._w(f"{blk}.attn_k_norm.weight"), self.eps)
        q = rope_neox(q, pos, self.n_rot, self.rope_base)
        k = rope_neox(k, pos, self.n_rot, self.rope_base)
        cache.keys.append(k)
        cache.values.append(v)
        K = np.stack(cache.keys)  # [L, nkv, Dh]
        V = np.stack(cache.values)
        group = nh // nkv
        out = np.empty((nh, Dh))
        for h in range(nh):
            kvh = h // group
            scores = K[:, kvh, :] @ q[h] / np.sqrt(Dh)  # all cached positions are <= pos
            out[h] = softmax(scores) @ V[:, kvh, :]
        out = out * sigmoid(gate)
        return self._w(f"{blk}.attn_output.weight") @ out.reshape(-1)

    def gated_delta_net(self, blk: str, x: np.ndarray, st: GDNState) -> np.ndarray:
        """Gated delta net for one token x [H]; updates st in place."""
        Kh, Kd, Vh, Vd, eps = self.Kh, self.Kd, self.Vh, self.Vd, self.eps
        qkv = self._w(f"{blk}.attn_qkv.weight") @ x  # [C]
        window = np.concatenate([st.conv, qkv[None, :]], axis=0)  # [kernel, C], oldest first
        conv_w = self._w(f"{blk}.ssm_conv1d.weight")  # [C, kernel]
        conv = np.sum(conv_w * window.T, axis=1)
        st.conv = window[1:].copy()
        a = silu(conv)
        q = a[: Kh * Kd].reshape(Kh, Kd)
        k = a[Kh * Kd: 2 * Kh * Kd].reshape(Kh, Kd)
        v = a[2 * Kh * Kd:].reshape(Vh, Vd)
        q = l2_norm(q, eps) / np.sqrt(Kd)
        k = l2_norm(k, eps)

        z = (self._w(f"{blk}.attn_gate.weight") @ x).reshape(Vh, Vd)
        alpha = self._w(f"{blk}.ssm_alpha.weight") @ x
        g = softplus(alpha + self._w(f"{blk}.ssm_dt.bias")) * self._w(f"{blk}.ssm_a")  # [Vh], <= 0
        beta = sigmoid(self._w(f"{blk}.ssm_beta.weight") @ x)  # [Vh]

        o = np.empty((Vh, Vd))
        for h in range(Vh):
            kh = h % Kh  # tiled order
            S = st.S[h] * np.exp(g[h])
            d = beta[h] * (v[h] - S.T @ k[kh])
            S = S + np.outer(k[kh], d)
            o[h] = S.T @ q[kh]
            st.S[h] = S
        out = rms_norm(o, self._w(f"{blk}.ssm_norm.weight"), eps) * silu(z)
        return self._w(f"{blk}.ssm_out.weight") @ out.reshape(-1)

    def ffn(self, blk: str, y: np.ndarray) -> np.ndarray:
        if f"{blk}.ffn_gate_inp.weight" in self.t:
            out, routing = moe_ffn(y, *(self._w(f"{blk}.{n}.weight") for n in (
                "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp",
                "ffn_up_shexp", "ffn_down_shexp", "ffn_gate_inp_shexp")), self.n_expert_used)
            if self.routing_log is not None:
                self.routing_log.append((blk, routing))
            return out
        gate = self._w(f"{blk}.ffn_gate.weight") @ y
        up = self._w(f"{blk}.ffn_up.weight") @ y
        return self._w(f"{blk}.ffn_down.weight") @ (silu(gate) * up)

    def layer(self, blk: str, x: np.ndarray, state, pos: int) -> np.ndarray:
        """One decoder layer (pre-norm mixer + SwiGLU FFN, both residual)."""
        xn = rms_norm(x, self._w(f"{blk}.attn_norm.weight"), self.eps)
        if isinstance(state, GDNState):
            h = x + self.gated_delta_net(blk, xn, state)
        else:
            h = x + self.attention(blk, xn, state, pos)
        y = rms_norm(h, self._w(f"{blk}.post_attention_norm.weight"), self.eps)
        return h + self.ffn(blk, y)

    # -- trunk ----------------------------------------------------------------
    def step(self, state: TrunkState, token: int) -> tuple[np.ndarray, np.ndarray]:
        """Processes one token at position state.pos; returns (logits [vocab], hidden [H])."""
        x = self.embed[int(token)].copy()
        for i in range(self.n_layer):
            x = self.layer(f"blk.{i}", x, state.layers[i], state.pos)
        state.pos += 1
        hidden = rms_norm(x, self._w("output_norm.weight"), self.eps)
        return self.out_w @ hidden, hidden

    def forward(self, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Runs the trunk over tokens from an empty state; returns (logits [T, vocab],
        hidden [T, H]) with hidden taken after output_norm."""
        state = self.new_state()
        logits, hidden = [], []
        for tok in tokens:
            lg, hd = self.step(state, tok)
            logits.append(lg)
            hidden.append(hd)
        return np.stack(logits), np.stack(hidden)

    # -- MTP head ---------------------------------------------------------------
    def mtp_step(self, mstate: MTPState, token: int, h_prev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One MTP row at position mstate.pos: input (token, h_prev) where h_prev is a trunk
        (after output_norm) or MTP (after shared_head_norm) hidden state.
        Returns (logits [vocab], mtp_hidden [H])."""
        blk = self.mtp_blk
        e = rms_norm(self.embed[int(token)], self._w(f"{blk}.nextn.enorm.weight"), self.eps)
        hn = rms_norm(np.asarray(h_prev, dtype=np.float64), self._w(f"{blk}.nextn.hnorm.weight"), self.eps)
        x = self._w(f"{blk}.nextn.eh_proj.weight") @ np.concatenate([e, hn])  # embedding first
        x = self.layer(blk, x, mstate.kv, mstate.pos)
        mstate.pos += 1
        mh = rms_norm(x, self._w(f"{blk}.nextn.shared_head_norm.weight"), self.eps)
        return self.out_w @ mh, mh

    def _mtp_teacher_forced(self, mstate: MTPState, tokens, hidden) -> tuple[np.ndarray, np.ndarray]:
        logits, mhid = [], []
        for t, tok in enumerate(tokens):
            h_prev = hidden[t - 1] if t > 0 else np.zeros(self.H)
            lg, mh = self.mtp_step(mstate, tok, h_prev)
            logits.append(lg)
            mhid.append(mh)
        return np.stack(logits), np.stack(mhid)

    def mtp_forward(self, tokens: list[int], hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Teacher-forced MTP head over all T rows with its own KV cache from empty: row t input
        is (token t, hidden[t-1]) with zeros for t=0; returns (mtp_logits [T, vocab],
        mtp_hidden [T, H]) with mtp_hidden after nextn.shared_head_norm."""
        return self._mtp_teacher_forced(self.new_mtp_state(), tokens, hidden)

    def draft_chain(self, tokens: list[int], hidden: np.ndarray, first_token: int,
                    n_steps: int) -> tuple[list[int], np.ndarray, np.ndarray]:
        """MTP KV holds teacher-forced rows 0..n-1 (n = len(tokens)); step 1 input is
        (first_token, hidden[n-1]) at position n; step i > 1 input is (draft_ids[i-2],
        draft_hidden[i-2]) at position n+i-1. Greedy drafts.
        Returns (draft_ids, draft_logits [n_steps, vocab], draft_hidden [n_steps, H])."""
        n = len(tokens)
        mstate = self.new_mtp_state()
        self._mtp_teacher_forced(mstate, tokens, hidden)
        ids, logits, mhid = [], [], []
        tok, h_prev = int(first_token), hidden[n - 1]
        for _ in range(n_steps):
            lg, mh = self.mtp_step(mstate, tok, h_prev)
            tok = int(np.argmax(lg))
            ids.append(tok)
            logits.append(lg)
            mhid.append(mh)
            h_prev = mh
        return ids, np.stack(logits), np.stack(mhid)
