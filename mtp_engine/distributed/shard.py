"""Which part of each tensor a rank holds, and reading only that part from the GGUF memory map.

Tensor parallel splits every block along units that keep the math local to a rank:

- attention: KV-head groups (a KV head and the query heads that read it); `attn_q/k/v` rows and
  `attn_output` columns follow;
- gated delta net: key heads and, with them, the value heads that read them (tiled order: value
  head h reads key head h % Kh, so key heads [a, b) own value heads j*Kh + [a, b) for every j, and
  the local heads keep the same tiling); `attn_qkv`, `ssm_conv1d`, `attn_gate`, `ssm_alpha/beta`,
  `ssm_a`, `ssm_dt` rows and `ssm_out` columns follow;
- FFN (dense, each routed expert, the shared expert): intermediate columns in groups of 32 (MLX's
  quantization group): `gate`/`up` rows, `down` columns;
- output head: vocabulary rows.

Units are dealt out as evenly as possible (earlier ranks take one more); a rank may get none of a
kind when there are fewer units than ranks (the tiny fixtures have one KV head): its part of that
sub-block is then zero and the all-reduce adds nothing from it.

Rows are read by indexing the memory-mapped tensor (only those rows' bytes are touched);
columns by slicing each row's bytes at the GGUF block boundaries around the wanted range, then
repacking and cutting at MLX's 32-wide groups, which is exact: GGUF blocks repack into whole
32-wide groups. No rank reads or holds another rank's rows.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import gguf
import mlx.core as mx
import numpy as np

from ..errors import MTPEngineError
from ..gguf.quants import GROUP_SIZE, QuantizedWeight, mlx_nbytes, repack, repack_float
from ..gguf.reader import GGUFFile
from ..model.config import Qwen35Config
from ..model.layers import Linear

_FLOAT = (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16)


def split(n_units: int, size: int, rank: int) -> tuple[int, int]:
    """Units [start, stop) of `rank` when `n_units` are dealt out over `size` ranks."""
    base, extra = divmod(n_units, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _ranges(idx: np.ndarray) -> list[tuple[int, int]]:
    """Sorted indices as maximal contiguous [start, stop) ranges."""
    out: list[tuple[int, int]] = []
    for i in idx.tolist():
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


@dataclass(frozen=True)
class TPPlan:
    """One rank's share of every tensor-parallel unit (see the module docstring)."""

    cfg: Qwen35Config
    rank: int
    size: int

    # ---- units -------------------------------------------------------------------------------
    @property
    def kv_heads(self) -> tuple[int, int]:
        return split(self.cfg.n_head_kv, self.size, self.rank)

    @property
    def key_heads(self) -> tuple[int, int]:
        return split(self.cfg.ssm_key_heads, self.size, self.rank)

    def ffn_cols(self, f: int) -> tuple[int, int]:
        g0, g1 = split(f // GROUP_SIZE, self.size, self.rank)
        return g0 * GROUP_SIZE, g1 * GROUP_SIZE

    @property
    def vocab(self) -> tuple[int, int]:
        """Rows of the output head; every rank gets ceil(V / size) but the last (gather pads)."""
        per = -(-self.cfg.vocab_size // self.size)
        return min(self.rank * per, self.cfg.vocab_size), min((self.rank + 1) * per, self.cfg.vocab_size)

    # ---- indices into the global tensors ------------------------------------------------------
    def q_heads(self) -> np.ndarray:
        c = self.cfg
        per = c.n_head // c.n_head_kv
        g0, g1 = self.kv_heads
        return np.arange(g0 * per, g1 * per)

    def value_heads(self) -> np.ndarray:
        c = self.cfg
        a, b = self.key_heads
        return np.array([j * c.ssm_key_heads + i for j in range(c.ssm_value_heads // c.ssm_key_heads)
                         for i in range(a, b)], dtype=np.int64)

    def conv_channels(self) -> np.ndarray:
        c = self.cfg
        a, b = self.key_heads
        kd, vd, kh = c.ssm_key_dim, c.ssm_value_dim, c.ssm_key_heads
        q = np.arange(a * kd, b * kd)
        return np.concatenate([q, kh * kd + q, 2 * kh * kd + _heads(self.value_heads(), vd)])

    def local_cfg(self) -> "ShareConfig":
        """The config one rank's blocks are built with: its heads and FFN width."""
        c = self.cfg
        g0, g1 = self.kv_heads
        a, b = self.key_heads
        vh = (b - a) * (c.ssm_value_heads // c.ssm_key_heads)
        width = lambda f: (lambda r: r[1] - r[0])(self.ffn_cols(f))  # noqa: E731
        values = {f.name: getattr(c, f.name) for f in fields(c)}
        values.update(n_head=(g1 - g0) * (c.n_head // c.n_head_kv), n_head_kv=g1 - g0,
                      ssm_key_heads=b - a, ssm_value_heads=vh, ssm_inner=vh * c.ssm_value_dim,
                      ffn_size=[width(f) for f in c.ffn_size], expert_ffn_size=width(c.expert_ffn_size),
                      shared_ffn_size=width(c.shared_ffn_size), rope_sections=list(c.rope_sections),
                      recurrent=list(c.recurrent))
        return ShareConfig(**values, value_dim=c.ssm_value_dim)

    def selection(self, name: str, shape: tuple) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(rows, columns) of the global tensor `name` (numpy shape `shape`; stacked experts as
        E*out rows) this rank holds; None = all of them."""
        c = self.cfg
        leaf = name.split(".", 2)[-1] if name.startswith("blk.") else name
        leaf = leaf.replace("nextn.", "")
        d = c.head_dim
        if leaf == "output.weight":
            return np.arange(*self.vocab), None
        if leaf == "attn_q.weight":
            return _heads(self.q_heads(), 2 * d), None
        if leaf in ("attn_k.weight", "attn_v.weight"):
            return _heads(np.arange(*self.kv_heads), d), None
        if leaf == "attn_output.weight":
            return None, _heads(self.q_heads(), d)
        if leaf in ("attn_qkv.weight", "ssm_conv1d.weight"):
            return self.conv_channels(), None
        if leaf == "attn_gate.weight":
            return _heads(self.value_heads(), c.ssm_value_dim), None
        if leaf in ("ssm_alpha.weight", "ssm_beta.weight", "ssm_a", "ssm_dt.bias"):
            return self.value_heads(), None
        if leaf == "ssm_out.weight":
            return None, _heads(self.value_heads(), c.ssm_value_dim)
        if leaf.startswith(("ffn_gate", "ffn_up", "ffn_down")) and not leaf.startswith("ffn_gate_inp"):
            experts = "_exps" in leaf
            f = shape[-1] if "down" in leaf else shape[-2]
            cols = np.arange(*self.ffn_cols(f))
            if "down" in leaf:
                return None, cols
            if experts:
                return (np.arange(shape[0])[:, None] * f + cols[None, :]).reshape(-1), None
            return cols, None
        return None, None  # norms, embeddings, router, eh_proj: every rank holds them whole


@dataclass
class ShareConfig(Qwen35Config):
    """One rank's config: its head counts and widths; the value head dim stays the model's even
    when the rank holds no value heads."""

    value_dim: int = 0

    @property
    def ssm_value_dim(self) -> int:
        return self.value_dim


def _heads(heads: np.ndarray, width: int) -> np.ndarray:
    """Rows (or columns) [h*width, (h+1)*width) of each head h, in the heads' order."""
    return (np.asarray(heads)[:, None] * width + np.arange(width)[None, :]).reshape(-1)


class ShardReader:
    """Reads tensors (or the rows / columns a plan selects) from a GGUF file into MLX form."""

    def __init__(self, gf: GGUFFile, exact: bool = False):
        self.gf, self.exact = gf, exact
        self.bytes_read = 0  # raw tensor bytes touched: the measure that no rank reads it all

    def read(self, name: str, shape: tuple, rows: np.ndarray | None, cols: np.ndarray | None,
             matrix: bool) -> Linear | mx.array:
        from ..model.loader import _stored_shape

        t = self.gf.tensor(name, _stored_shape(self.gf, name, shape))
        n_rows = int(np.prod(t.shape[:-1], dtype=np.int64))
        n_cols = int(t.shape[-1])
        data = t.data.reshape(n_rows, -1)
        if not matrix:  # vectors: [N] or [N, K] (conv), rows select along the first axis
            arr = repack_float(np.ascontiguousarray(data), t.qtype, (n_rows, n_cols), name=name).reshape(shape)
            if rows is not None:
                arr = arr[rows]
            self.bytes_read += arr.nbytes
            return mx.array(np.ascontiguousarray(arr))
        row_idx = np.arange(n_rows) if rows is None else np.asarray(rows, dtype=np.int64)
        if cols is None:
            raw = data if rows is None else data[row_idx]
            self.bytes_read += raw.nbytes
            w = self._repack(raw, t.qtype, (len(row_idx), n_cols), name)
            return _linear(w)
        parts = [self._columns(data, row_idx, t.qtype, n_cols, c0, c1, name) for c0, c1 in _ranges(cols)]
        if not parts:
            return Linear(mx.zeros((len(row_idx), 0)))
        if isinstance(parts[0], QuantizedWeight):
            p0 = parts[0]
            return Linear(mx.array(np.concatenate([p.weight for p in parts], 1)),
                          mx.array(np.concatenate([p.scales for p in parts], 1)),
                          mx.array(np.concatenate([p.biases for p in parts], 1)), p0.bits, p0.group_size)
        return Linear(mx.array(np.concatenate(parts, 1)))

    def _repack(self, raw, qtype, shape, name):
        if qtype in _FLOAT:
            return repack_float(np.ascontiguousarray(raw), qtype, shape, name=name)
        return repack(raw, qtype, shape, q6k_mode="f32" if self.exact else "q8", name=name)

    def _columns(self, data: np.ndarray, row_idx: np.ndarray, qtype, n_cols: int, c0: int, c1: int, name: str):
        """Columns [c0, c1) of the selected rows, from the bytes of the blocks around them."""
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        if qtype in _FLOAT:
            item = data.shape[1] // n_cols
            raw = data[row_idx][:, c0 * item:c1 * item]
            self.bytes_read += raw.nbytes
            return repack_float(np.ascontiguousarray(raw), qtype, (len(row_idx), c1 - c0), name=name)
        b0, b1 = c0 // block, -(-c1 // block)
        raw = np.ascontiguousarray(data[row_idx][:, b0 * type_size:b1 * type_size])
        self.bytes_read += raw.nbytes
        w = self._repack(raw, qtype, (len(row_idx), (b1 - b0) * block), name)
        lo, hi = c0 - b0 * block, c1 - b0 * block
        if isinstance(w, np.ndarray):  # Q6_K exact: float32
            return w[:, lo:hi]
        if lo % w.group_size or hi % w.group_size:
            raise MTPEngineError(f"columns [{c0}, {c1}) do not fall on {w.group_size}-wide groups",
                                 file=self.gf.path, field=name)
        return QuantizedWeight(w.weight[:, lo * w.bits // 32:hi * w.bits // 32],
                               w.scales[:, lo // w.group_size:hi // w.group_size],
                               w.biases[:, lo // w.group_size:hi // w.group_size], w.bits, w.group_size,
                               (len(row_idx), hi - lo))


class GGUFSource:
    """Global tensors of a GGUF file, read in shares (`tp.build_tp`, `pp.build_pp` take any object
    with these methods: `bench_distributed.py` passes random weights)."""

    def __init__(self, gf: GGUFFile, exact: bool = False):
        self.gf, self.reader = gf, ShardReader(gf, exact)

    def shape(self, name: str) -> tuple:
        return self.gf.numpy_shape(name)

    def has_tensor(self, name: str) -> bool:
        return self.gf.has_tensor(name)

    def read(self, name: str, shape: tuple, rows, cols, matrix: bool):
        return self.reader.read(name, shape, rows, cols, matrix)

    @property
    def bytes_read(self) -> int:
        return self.reader.bytes_read


def _linear(w) -> Linear:
    if isinstance(w, QuantizedWeight):
        return Linear(mx.array(w.weight), mx.array(w.scales), mx.array(w.biases), w.bits, w.group_size)
    return Linear(mx.array(np.ascontiguousarray(w, dtype=np.float32)))


def shard_weight_bytes(gf: GGUFFile, selection, exact: bool = False) -> int:
    """Bytes of MLX weights one rank will hold: each tensor's selected elements in its MLX form.
    `selection(name, shape)` gives (rows, cols) as `TPPlan.selection`, or None to skip a tensor."""
    total = 0
    for name in gf.tensor_names:
        shape = gf.numpy_shape(name)
        sel = selection(name, shape)
        if sel is None:
            continue
        rows, cols = sel
        n_rows = int(np.prod(shape[:-1], dtype=np.int64)) if rows is None else len(rows)
        n_cols = int(shape[-1]) if cols is None else len(cols)
        t = gf.tensor(name)
        n = mlx_nbytes(t.qtype, n_rows * n_cols, q6k_mode="f32" if exact else "q8")
        total += n if n is not None else 4 * n_rows * n_cols
    return total
