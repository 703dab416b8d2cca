"""Weight containers shared by the trunk and the MTP head: linear maps (float or affine-quantized)
and token embeddings that stay quantized in memory."""
from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import kernels
from .kernels import mma, qmv

# a dequantized product's operands: float32 (on an H100 MLX runs it on the tensor cores, 118-298
# TFLOP/s for 512-4096 rows, against 51-410 in bf16 and 23 for the 4-bit product of float32 rows)
DEQUANT_DTYPE = mx.float32
# products of up to this many tokens per sequence (a batch's steps and verifies: B rows of 1 or
# k+1; short prompts) run the custom kernel in slabs of its most rows, each reading the weights
# once: MLX's 4-bit product of 12-16 float32 rows took ~14 ms a row at the 9B shape on an H100 (a
# 16-stream step 220 ms; in slabs 16 streams decode at 419 tok/s)
SLAB_ROWS = 64
# up to this many tokens per sequence a product is a step's or a verify's (n-max 7 and below);
# more, a prompt's
STEP_TOKENS = 8
# MLX 0.32.4's CUDA quantized product of more rows than this at group 128 fails to launch
# ("cuGraphAddKernelNode ... invalid argument", any shape, 33 to 300 rows tried; groups 32 and 64
# run): those products take the dequantized one
CUDA_G128_MAX_ROWS = 32


class Stored:
    """A module's array (or submodule) attribute read straight from the module's dict, where
    `nn.Module` keeps it: a plain read first misses and falls back to `nn.Module.__getattr__`, ~2 us
    (a step reads hundreds). Absent reads as None; writes still go through `nn.Module.__setattr__`
    (an array into the dict; None takes it out)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        return self if obj is None else obj.get(self.name)

    def __set__(self, obj, value) -> None:  # reached for values nn.Module keeps outside its dict: None
        if value is not None:
            raise TypeError(f"{self.name}: expected an array or a module, found {type(value).__name__}")
        obj.pop(self.name, None)

    def __delete__(self, obj) -> None:
        obj.pop(self.name, None)


def stored(n: int) -> list[Stored]:
    """`n` `Stored` attributes, for one line of a class body (`q, k, v = stored(3)`)."""
    return [Stored() for _ in range(n)]


class Linear(nn.Module):
    """y = x @ W^T with W either a float matrix or MLX affine-quantized (`weight`, `scales`, `biases`).

    How products run comes from the model's options when it is built (`Qwen35Model.use`):
    `custom_kernel`, the custom few-row CUDA kernel where it applies; else 2..row_pad-1 rows padded
    to `row_pad` (MLX's GPU path for 2..7 rows costs more than its 8-row one; on the CPU every row
    costs the same); products of at least `dequant_rows` tokens per sequence (a prefill chunk)
    dequantize W for a dense product (DEQUANT_DTYPE): on a GPU several times the 4-bit product's
    rate (0: never)."""

    weight, scales, biases = stored(3)

    def __init__(self, weight: mx.array, scales: mx.array | None = None, biases: mx.array | None = None,
                 bits: int = 0, group_size: int = 0, custom_kernel: bool = False, row_pad: int = 0,
                 dequant_rows: int = 0):
        super().__init__()
        self.weight = weight
        self.scales = scales
        self.biases = biases
        self.bits, self.group_size = bits, group_size
        self.custom_kernel, self.row_pad, self.dequant_rows = custom_kernel, row_pad, dequant_rows

    @property
    def quantized(self) -> bool:
        return self.scales is not None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        if self.quantized:
            return int(self.weight.shape[1]) * 32 // self.bits
        return int(self.weight.shape[1])

    def product_path(self, tokens: int, rows: int) -> str:
        """How a product of `rows` rows, `tokens` per sequence, runs: "dense" (dequantized W),
        "slabs" or "slabs, prompt" (the custom kernel at a step's or a prompt's precision),
        "padded" (MLX's product over `row_pad` rows), "mlx", or
        "float" (an unquantized W). A row's arithmetic depends on this path only, not on the rows
        beside it; decided by the tokens per sequence, so a prompt read beside others takes the
        path it takes alone, but for the padded one and MLX's CUDA group-128 limit, which count
        all rows."""
        if not self.quantized:
            return "float"
        if self.dequant_rows and tokens >= self.dequant_rows:
            return "dense"
        # slabs decided by the tokens per sequence too (the tensor-core kernel's rows do not mix)
        if self.custom_kernel and tokens <= SLAB_ROWS and \
                qmv.supports(self.weight, self.scales, self.bits, self.group_size, min(rows, qmv.SLAB)):
            # a prompt's tokens take x in float32's precision on the tensor cores, as MLX's product
            # they stand in for; a step's and a verify's rows the faster ~17 bits
            return "slabs, prompt" if tokens > STEP_TOKENS else "slabs"
        if 1 < rows < self.row_pad:
            return "padded"
        if self.group_size == 128 and rows > CUDA_G128_MAX_ROWS and kernels.cuda():
            return "dense"
        return "mlx"

    def __call__(self, x: mx.array) -> mx.array:
        if x.ndim == 1:  # MLX's CUDA quantized matmul rejects vector inputs
            return self(x[None])[0]
        rows = x.size // x.shape[-1]
        path = self.product_path(int(x.shape[-2]), rows)
        if path == "float":
            return x @ self.weight.T
        if path == "dense":
            return self._dense_product(x)
        if path.startswith("slabs"):
            flat, slab = x.reshape(rows, x.shape[-1]), qmv.SLAB
            if rows > slab and rows % slab == 1:  # a last slab of one row would take the one-row
                flat = mx.pad(flat, [(0, 1), (0, 0)])  # kernel: every row of a product takes one arithmetic
            split = 3 if path == "slabs, prompt" else mma.SPLIT
            parts = [qmv.quantized_rows(flat[i:i + slab], self.weight, self.scales, self.biases, self.bits,
                                        self.group_size, split=split) for i in range(0, flat.shape[0], slab)]
            y = parts[0] if len(parts) == 1 else mx.concatenate(parts)[:rows]
            return y.reshape(*x.shape[:-1], y.shape[-1])
        if path == "padded":
            flat = mx.pad(x.reshape(rows, x.shape[-1]), [(0, self.row_pad - rows), (0, 0)])
            y = mx.quantized_matmul(flat, self.weight, self.scales, self.biases, transpose=True,
                                    group_size=self.group_size, bits=self.bits)
            return y[:rows].reshape(*x.shape[:-1], y.shape[-1])
        return mx.quantized_matmul(x, self.weight, self.scales, self.biases, transpose=True,
                                   group_size=self.group_size, bits=self.bits)

    def _dense_product(self, x: mx.array) -> mx.array:
        w = mx.dequantize(self.weight, self.scales, self.biases, group_size=self.group_size,
                          bits=self.bits).astype(DEQUANT_DTYPE)
        return (x.astype(DEQUANT_DTYPE) @ w.T).astype(x.dtype)

    def rows(self, ids: mx.array) -> mx.array:
        """Rows `ids` of W as floats: an embedding lookup that never dequantizes the whole table."""
        if self.quantized:
            return mx.dequantize(self.weight[ids], self.scales[ids], self.biases[ids],
                                 group_size=self.group_size, bits=self.bits)
        rows = self.weight[ids]
        # a bf16 table (HF checkpoints keep bf16) must not turn the float32 hidden stream into bf16
        return rows if rows.dtype == mx.float32 else rows.astype(mx.float32)

    def first_outputs(self, n: int) -> "Linear":
        """The product's first `n` output rows alone (the same arrays, sliced: no copy), run the
        way this one runs."""
        sub = lambda a: None if a is None else a[:n]  # noqa: E731
        return Linear(self.weight[:n], sub(self.scales), sub(self.biases), self.bits, self.group_size,
                      self.custom_kernel, self.row_pad, self.dequant_rows)

    def nbytes(self) -> int:
        n = self.weight.nbytes
        if self.quantized:
            n += self.scales.nbytes + self.biases.nbytes
        return int(n)

    def dense(self) -> mx.array:
        """W as a float matrix (tests and diagnostics only)."""
        if self.quantized:
            return mx.dequantize(self.weight, self.scales, self.biases, group_size=self.group_size, bits=self.bits)
        return self.weight


def concat_outputs(parts: list[Linear]) -> Linear | None:
    """One Linear whose output is the parts' outputs side by side (one product instead of several:
    on a GPU each product is a kernel launch), or None when the parts are not stored alike. Each
    output row is computed exactly as before."""
    first = parts[0]
    if any(type(p) is not Linear or p.weight.ndim != 2 or p.bits != first.bits or p.group_size != first.group_size
           or p.quantized != first.quantized or p.weight.dtype != first.weight.dtype
           or p.in_features != first.in_features for p in parts):
        return None
    cat = lambda name: mx.concatenate([getattr(p, name) for p in parts], axis=0)  # noqa: E731
    if first.quantized:
        return Linear(cat("weight"), cat("scales"), cat("biases"), first.bits, first.group_size,
                      first.custom_kernel, first.row_pad, first.dequant_rows)
    return Linear(cat("weight"), custom_kernel=first.custom_kernel, row_pad=first.row_pad)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)
