"""Tensor parallel: every rank holds its share of every block (`shard.TPPlan`) and the blocks'
partial outputs are summed across ranks, one all-reduce after the mixer and one after the FFN: 2
all-reduces of hidden-size vectors per block and token. The output head is split by vocabulary
and its logits all-gathered. The embedding, the norms, the router and the MTP head's `eh_proj`
are held whole by every rank (small next to the blocks).

Every rank then holds the same hidden states and the same logits, so the decoders run unchanged
on top and decide identically.
"""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import MTPEngineError
from ..model.build import build_model
from ..model.cache import RecurrentCache, TrunkCache
from ..model.kv_cache import KVCache
from ..model.config import Qwen35Config
from ..model.layers import Linear
from ..model.blocks import DecoderLayer
from ..model.qwen35 import Qwen35Model
from .runtime import Comm
from .shard import TPPlan


class NullMixer(nn.Module):
    """The mixer of a rank that holds none of a block's heads: it adds nothing to the sum."""

    def __call__(self, x: mx.array, cache) -> mx.array:
        return mx.zeros_like(x)


class NullKVCache(KVCache):
    """The cache of a `NullMixer` attention block: never written, so nothing to move back."""

    def truncate(self, length: int) -> None:
        self.offset = 0

    def state(self) -> tuple:
        return ()


class NullRecurrentCache(RecurrentCache):
    def rollback(self, n_keep: int) -> None:
        self.release()


class SummedMixer(nn.Module):
    """A mixer whose per-rank partial output is all-reduced."""

    def __init__(self, inner: nn.Module, comm: Comm):
        super().__init__()
        self.inner, self.comm = inner, comm

    def __call__(self, x: mx.array, cache) -> mx.array:
        return self.comm.all_sum(self.inner(x, cache))


class SummedFFN(nn.Module):
    """An FFN (dense or MoE) whose per-rank partial output is all-reduced: each rank computes
    its intermediate columns, and both the routed experts' weighted sum and the gated shared
    expert are linear in those."""

    def __init__(self, inner: nn.Module, comm: Comm):
        super().__init__()
        self.inner, self.comm = inner, comm

    def __call__(self, x: mx.array) -> mx.array:
        return self.comm.all_sum(self.inner(x))

    @property
    def record(self):  # a routing recorder on the inner MoE keeps steps uncompiled, as before
        return getattr(self.inner, "record", None)


class VocabShardHead(nn.Module):
    """The output head split by vocabulary rows: local logits, then an all-gather (the last rank's
    share is padded to the common size, then cut off)."""

    def __init__(self, local: Linear, vocab: int, comm: Comm):
        super().__init__()
        self.local, self.vocab, self.comm = local, vocab, comm
        self.per = -(-vocab // comm.size)

    def __call__(self, h: mx.array) -> mx.array:
        lead = h.shape[:-1]
        y = self.local(h).reshape(-1, self.local.out_features)
        if self.local.out_features < self.per:
            y = mx.pad(y, [(0, 0), (0, self.per - self.local.out_features)])
        full = self.comm.all_gather(y.T)  # [size * per, rows]: all_gather stacks along axis 0
        return full[: self.vocab].T.reshape(*lead, self.vocab)

    def nbytes(self) -> int:
        return self.local.nbytes()

    @property
    def out_features(self) -> int:
        return self.vocab


class TPModel(Qwen35Model):
    """A `Qwen35Model` whose blocks hold one rank's share; caches follow the local heads."""

    def __init__(self, local: Qwen35Config, embed: Linear, layers: list, output_norm: mx.array, lm_head,
                 mtp, *, comm: Comm, global_cfg: Qwen35Config, compiled: bool = True, expert_use=None):
        """A rank's share: `local` its configuration (its heads and widths), `global_cfg` the
        model's; `compiled` False where zero-width shares or null caches would meet traced shapes
        the compiled steps were not written for."""
        super().__init__(local, embed, layers, output_norm, lm_head, mtp, expert_use=expert_use)
        self.comm, self.global_cfg = comm, global_cfg
        if not compiled:
            self.compile_steps = False

    def make_cache(self) -> TrunkCache:
        c = self.cfg
        caches = []
        for layer, rec in zip(self.layers, c.recurrent):
            null = isinstance(layer.mixer.inner, NullMixer)
            if rec:
                cls = NullRecurrentCache if null else RecurrentCache
                caches.append(cls(c.conv_kernel, c.conv_channels, c.ssm_value_heads, c.ssm_key_dim, c.ssm_value_dim))
            else:
                caches.append((NullKVCache if null else KVCache)(c.n_head_kv, c.head_dim))
        return TrunkCache(caches)


def _wrap_layer(layer: DecoderLayer, null_mixer: bool, comm: Comm) -> None:
    layer.mixer = SummedMixer(NullMixer() if null_mixer else layer.mixer, comm)
    layer.mlp = SummedFFN(layer.mlp, comm)


def build_tp(cfg: Qwen35Config, source, comm: Comm, load_mtp: bool = True) -> TPModel:
    """Builds this rank's share of the model whose global tensors `source` reads in shares
    (`shard.GGUFSource`: only this rank's rows and columns are read)."""
    plan = TPPlan(cfg, comm.rank, comm.size)
    local = plan.local_cfg()

    def fetch(name: str, shape: tuple, matrix: bool):
        stored = source.shape(name)
        gshape = tuple(stored[len(stored) - len(shape):])
        rows, cols = plan.selection(name, gshape)
        if (rows is not None and len(rows) == 0) or (cols is not None and len(cols) == 0):
            zeros = mx.zeros(shape)  # a share with no units: zero width, zero contribution
            return Linear(zeros) if matrix else zeros
        out = source.read(name, gshape, rows, cols, matrix)
        if matrix and len(shape) == 3:
            out = Linear(*(a.reshape(shape[0], shape[1], -1) for a in (out.weight, out.scales, out.biases)
                           if a is not None), bits=out.bits, group_size=out.group_size)
        if name != "output.weight":
            w = out.weight if matrix else None
            got = (int(np.prod(w.shape[:-1])), w.shape[-1] * 32 // out.bits if out.quantized else w.shape[-1]) \
                if matrix else tuple(out.shape)
            want = (int(np.prod(shape[:-1])), shape[-1]) if matrix else tuple(shape)
            if got != want:
                raise MTPEngineError(f"shard of shape {got}, expected {want}", field=name)
        mx.eval(out.weight if matrix else out)
        return out

    no_attn = plan.kv_heads[0] == plan.kv_heads[1]
    no_gdn = plan.key_heads[0] == plan.key_heads[1]

    def make(local: Qwen35Config, embed: Linear, layers: list, output_norm: mx.array, head: Linear, mtp,
             options=None, expert_use=None) -> TPModel:
        """The rank's model from its shares: blocks summed across ranks, the head split by rows."""
        for layer, rec in zip(layers, local.recurrent):
            _wrap_layer(layer, no_gdn if rec else no_attn, comm)
        if mtp is not None:
            _wrap_layer(mtp.layer, no_attn, comm)
            if no_attn:
                mtp.make_cache = lambda: NullKVCache(local.n_head_kv, local.head_dim)
        v0, v1 = plan.vocab
        if head is embed:  # tied: this rank's rows of the embedding table
            head = Linear(*(a[v0:v1] if a is not None else None for a in (head.weight, head.scales, head.biases)),
                          bits=head.bits, group_size=head.group_size)
        # the vocabulary-split head is no `Linear`: no draft head over the first N rows (rank 0's), so
        # drafts score the whole vocabulary here
        return TPModel(local, embed, layers, output_norm, VocabShardHead(head, cfg.vocab_size, comm), mtp,
                       comm=comm, global_cfg=cfg, compiled=not (no_attn or no_gdn), expert_use=expert_use)

    return build_model(local, fetch, source.has_tensor, load_mtp=load_mtp, make=make)
