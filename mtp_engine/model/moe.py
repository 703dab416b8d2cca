"""The Qwen3.5-MoE feed-forward block (GGUF `qwen35moe`), as llama.cpp's qwen35moe graph computes it:

    p   = softmax(x @ router^T)                  over all experts
    sel = the k most probable experts;  w = p[sel] / sum(p[sel])
    out = sum_j w_j * expert_{sel_j}(x)  +  sigmoid(x . shared_gate) * shared(x)

Each expert and the shared expert are SwiGLU MLPs. The experts stay stacked as the GGUF stores them
([n_expert, out, in], quantized in their file type) and run through `mx.gather_qmm` (`mx.gather_mm`
for float experts): every row reads only its own k experts, and a verify batch reads each distinct
expert once, with no Python loop over experts.
"""
from __future__ import annotations

from typing import Callable

import mlx.core as mx
import mlx.nn as nn

from .expert_use import ExpertUse, Slot
from .layers import Linear, stored
from .blocks import MLP
from .qwen35 import Qwen35Model

# Below this many (row, expert) pairs, sorting rows by expert costs more than it saves (mlx-lm's
# SwitchGLU threshold): decode steps and verify batches stay unsorted, prefill chunks get sorted.
SORT_THRESHOLD = 64


class ExpertLinear(Linear):
    """`n_expert` stacked matrices W[e] of shape [out, in]: float `weight` [E, out, in], or MLX
    affine-quantized (`weight` [E, out, in*bits/32] uint32, `scales`/`biases` [E, out, in/group_size]).
    Storage, `nbytes` and `dense` are `Linear`'s; only the product gathers by expert."""

    @classmethod
    def from_linear(cls, lin: Linear) -> "ExpertLinear":
        """Takes over a `Linear` whose arrays carry a leading expert axis (what the loaders' `fetch`
        returns for a 3-D tensor)."""
        if lin.weight.ndim != 3:
            raise ValueError(f"expected stacked [n_expert, out, in] weights, found shape {lin.weight.shape}")
        return cls(lin.weight, lin.scales, lin.biases, lin.bits, lin.group_size)

    @property
    def n_expert(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """x [..., 1, in] times W[indices]^T, broadcast over the leading axes: [..., 1, out]."""
        if self.quantized:
            return mx.gather_qmm(x, self.weight, self.scales, self.biases, rhs_indices=indices, transpose=True,
                                 group_size=self.group_size, bits=self.bits, sorted_indices=sorted_indices)
        return mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)


def _sort_by_expert(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """One row per (token, slot), ordered by expert, so each expert's rows are contiguous."""
    k = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    return x.flatten(0, -3)[order // k], flat[order], mx.argsort(order)


class SwitchGLU(nn.Module):
    """The routed experts: a SwiGLU MLP per expert, applied to the experts each row picked."""

    gate, up, down = stored(3)

    def __init__(self, gate: ExpertLinear, up: ExpertLinear, down: ExpertLinear):
        super().__init__()
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """x [..., H], indices [..., k] -> each picked expert's output [..., k, H]."""
        x = mx.expand_dims(x, (-2, -3))
        sort = indices.size >= SORT_THRESHOLD
        idx, inverse = indices, None
        if sort:
            x, idx, inverse = _sort_by_expert(x, indices)
        g = self.gate(x, idx, sort)
        y = self.down(mx.sigmoid(g) * g * self.up(x, idx, sort), idx, sort)
        if sort:
            y = mx.unflatten(y[inverse], 0, indices.shape)
        return y.squeeze(-2)


class MoE(nn.Module):
    """Router, routed experts and the sigmoid-gated shared expert of one block."""

    router, experts, shared, shared_gate = stored(4)

    def __init__(self, router: Linear, experts: SwitchGLU, shared: MLP, shared_gate: mx.array, n_used: int,
                 observer: ExpertUse | None = None, slot: Slot = None):
        super().__init__()
        self.router = router  # ffn_gate_inp [E, H]
        self.experts = experts  # ffn_{gate,up,down}_exps
        self.shared = shared  # ffn_{gate,up,down}_shexp
        self.shared_gate = shared_gate  # ffn_gate_inp_shexp [H]
        self.n_used = n_used
        # the model's observer of routing (expert counts for the profiler) and this block's slot in it
        self.observer, self.slot = observer, slot
        # tests and diagnostics: when set, each forward hands it its routing (see `__call__`), and
        # forwards stay uncompiled (a trace cannot hand out every forward's values)
        self.record: Callable[[dict], None] | None = None

    def route(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(router logits [..., E], chosen experts [..., k] in no particular order, their
        renormalised weights [..., k])."""
        logits = self.router(x)
        probs = mx.softmax(logits, axis=-1, precise=True)
        k = self.n_used
        # a partial sort: with hundreds of experts a full argsort per token is wasted work
        indices = mx.argpartition(-probs, kth=k - 1, axis=-1)[..., :k]
        weights = mx.take_along_axis(probs, indices, axis=-1)
        return logits, indices, weights / weights.sum(axis=-1, keepdims=True)

    def __call__(self, x: mx.array) -> mx.array:
        logits, indices, weights = self.route(x)
        if self.observer is not None:
            self.observer.record(self.slot, indices)
        routed = (self.experts(x, indices) * weights[..., None]).sum(axis=-2)
        gate = mx.sigmoid(x @ self.shared_gate[:, None])  # one scalar per token
        if self.record is not None:
            self.record({"router_logits": logits, "experts": indices, "weights": weights,
                         "shexp_gate": gate[..., 0]})
        return routed + gate * self.shared(x)


def experts_touched(model: Qwen35Model) -> dict[str, list[int] | int | None]:
    """Distinct experts read by the last forward of each MoE block: `trunk` (one count per layer,
    empty for a dense model) and `mtp` (None without an MoE MTP head)."""
    use = model.expert_use
    if use is None:
        return {"trunk": [], "mtp": None}
    mtp = use.slots("mtp") if model.mtp is not None else []
    return {"trunk": [use.distinct(s) for s in use.slots("trunk")], "mtp": use.distinct(mtp[0]) if mtp else None}
