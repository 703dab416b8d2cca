"""Predicting the memory a model will take, so that a load that cannot fit is refused up front
with the numbers instead of ending in the OOM killer (or a frozen machine) halfway through.

The estimate is read from the checked GGUF header alone (no tensor data is touched):

* weights: per tensor, the bytes of its MLX form (`gguf.quants.mlx_nbytes`: float32 for float
  tensors and exact-mode Q6_K, else b-bit codes plus float32 scale and bias per 32 weights);
* KV cache: keys and values (`EngineOptions.kv_dtype`: 4 or 2 bytes each, a compiled step's tail
  of 256 positions included) for every attention layer (trunk and MTP head), for the
  whole context (the cache grows in steps of 256 positions up to it), plus one layer's buffers
  again for the copy a growth step makes;
* gated-delta-net state: conv window and recurrent state per layer, plus the per-position states
  a speculative verify captures;
* activations: one prefill chunk through the widest layer, attention scores included (bounded by
  `prefill_chunk_at`), and the recurrent states the chunk's delta-rule loop holds until it is
  evaluated.

The limit is MemAvailable on Linux, physical memory (capped by Metal's recommended working set
when MLX reports one) on macOS, or `EngineOptions.memory_limit` (bytes; its default from
`MTP_ENGINE_MEMORY_LIMIT`) when set.
"""
from __future__ import annotations

import math
import os
import re
import sys
from typing import Any

from ..errors import MTPEngineError
from ..gguf.quants import mlx_nbytes
from ..gguf.reader import GGUFFile, open_header
from ..gguf.validate import Header, TensorHeader
from ..options import ENV, KV_TAIL, EngineOptions

__all__ = ["estimate", "check_fits", "available_memory", "prefill_chunk_at", "ENV_LIMIT", "SCORE_POSITIONS"]

ENV_LIMIT = ENV["memory_limit"]
_F32 = 4
_KV_STEP = 256  # KVCache.step
_KV_MAX_STEP = 8192  # KVCache.max_growth: reserve grows by min(capacity, this)
_PREFILL_CHUNK = 512  # EngineOptions' prefill_chunk on the CPU (check_fits passes the options')
_DELTA_CHUNK = 64  # delta_rule.CHUNK
# A captured verify keeps the state before it (rollback rebuilds any later one from small per-token
# vectors), so one extra state per recurrent layer.
DEFAULT_CAPTURE_POSITIONS = 1
_BLOCK = re.compile(r"blk\.(\d+)\.")
# A prefill chunk is full-sized while it attends over at most this many positions (or its own
# length, when longer); past them it shrinks (`prefill_chunk_at`)
SCORE_POSITIONS = 8192
_MIN_CHUNK = 64
# products that the loader joins into one (GatedDeltaNet.fuse, MLP.fuse), by tensor suffix -> group
_FUSED = {"attn_qkv.weight": 0, "attn_gate.weight": 0, "ssm_alpha.weight": 0, "ssm_beta.weight": 0,
          "ffn_gate.weight": 1, "ffn_up.weight": 1, "ffn_gate_shexp.weight": 2, "ffn_up_shexp.weight": 2}


def prefill_chunk_at(chunk: int, offset: int) -> int:
    """Tokens of the prefill chunk that starts after `offset` positions, of at most `chunk`: fewer
    once the positions it attends to pass max(chunk, SCORE_POSITIONS), so that its attention scores
    (per head, its tokens x the positions they attend to) stay within those of a full chunk over
    that many. A long prompt's peak memory then stops growing with its length: at the 9B shape
    4096-token chunks at 32k positions held 8.6 GB of scores per copy, 8192-token ones ran out of
    memory. Multiples of 64 tokens keep the shapes few."""
    limit = chunk * max(chunk, SCORE_POSITIONS)
    if chunk * (offset + chunk) <= limit:
        return chunk
    fits = int((math.sqrt(offset * offset + 4 * limit) - offset) / 2)  # fits * (offset + fits) <= limit
    return max(min(_MIN_CHUNK, chunk), fits // _MIN_CHUNK * _MIN_CHUNK)


def _header(gguf_file: GGUFFile | Header | str | os.PathLike) -> Header:
    if isinstance(gguf_file, Header):
        return gguf_file
    if isinstance(gguf_file, GGUFFile):
        return gguf_file.header
    return open_header(gguf_file)


def _count(h: Header, key: str, default: int = 0) -> int:
    """A non-negative integer from the header, or `default` when absent or malformed: the config
    check that follows names bad values precisely; the estimate must only never fail on them."""
    v = h.value(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        return default
    return v


def _loaded_tensors(h: Header, load_mtp: bool) -> list[TensorHeader]:
    """The tensors a load reads: all but the MTP blocks (those holding `nextn.` tensors), of which
    only the first is read, and only with `load_mtp`."""
    mtp_blocks = sorted({int(m.group(1)) for t in h.tensors if (m := _BLOCK.match(t.name)) and ".nextn." in t.name})
    skip = set(mtp_blocks[1:] if load_mtp else mtp_blocks)
    return [t for t in h.tensors if not ((m := _BLOCK.match(t.name)) and int(m.group(1)) in skip)]


def estimate(gguf_file: GGUFFile | Header | str | os.PathLike, exact: bool = False,
             context: int | None = None, *, load_mtp: bool = True,
             capture_positions: int = DEFAULT_CAPTURE_POSITIONS, prefill_chunk: int = _PREFILL_CHUNK,
             kv_bytes: int = _F32, kv_tail: int = KV_TAIL) -> dict[str, Any]:
    """Bytes the model of `gguf_file` will take once loaded with `exact` (Q6_K as float32) and run
    with up to `context` positions (default: the model's context_length), `kv_bytes` per cached
    key or value element, compiled steps' KV tails of `kv_tail` positions.

    Sizes come from the tensors' own shapes (which the file cannot misstate without failing the
    load) rather than from metadata counts such as block_count; only the context length and the
    recurrent key dimension are read from metadata. Returns a dict with `weights`, `kv_cache`,
    `recurrent_state`, `activations`, `load_transient` (joining products at load), `total` (bytes) and `context` (the positions assumed)."""
    h = _header(gguf_file)
    arch = h.value("general.architecture")
    p = f"{arch}." if isinstance(arch, str) else "\0"
    tensors = _loaded_tensors(h, load_mtp)
    weights, load_transient, dense = _weights(tensors, "f32" if exact else "q8")
    ctx = _count(h, p + "context_length", 4096) if context is None else int(context)
    if ctx < 0:
        raise MTPEngineError(f"expected a context of at least 0 positions, found {ctx}", field="context")
    # growth overshoots the context by at most min(context, _KV_MAX_STEP), rounded up to a step
    capacity = -(-min(2 * ctx, ctx + _KV_MAX_STEP) // _KV_STEP) * _KV_STEP
    by_suffix: dict[str, list[TensorHeader]] = {}
    for t in tensors:
        by_suffix.setdefault(t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name, []).append(t)

    def rows(suffix: str) -> list[int]:
        return [t.shape[0] for t in by_suffix.get(suffix, [])]

    # keys and values of n_kv * head_dim floats per position per attention layer; one layer again
    # for the moment a growth step holds the old and the new buffers
    kv_rows = rows("attn_k.weight")
    kv_cache = sum(2 * r * (capacity + kv_tail) * kv_bytes for r in kv_rows) + \
        (2 * max(kv_rows) * capacity * kv_bytes if kv_rows else 0)
    recurrent_state, channels_max, state_max = _recurrent(by_suffix, _count(h, p + "ssm.state_size"),
                                                          capture_positions)
    embd = by_suffix.get("token_embd.weight", [])
    vocab, hidden = embd[0].shape[:2] if embd and len(embd[0].shape) == 2 else (0, 0)
    head_dim = max((t.n_elements for t in by_suffix.get("attn_k_norm.weight", [])), default=0)
    n_head = max(rows("attn_q.weight"), default=0) // (2 * head_dim) if head_dim else 0
    ffn = max(rows("ffn_up.weight") + rows("ffn_up_shexp.weight"), default=0)
    for t in by_suffix.get("ffn_up_exps.weight", []):
        if len(t.shape) == 3:
            ffn = max(ffn, min(_count(h, p + "expert_used_count", 8), t.shape[0]) * t.shape[1])
    chunk = min(prefill_chunk, max(ctx, 1))
    # on the CPU the gated-delta-net's input preparation runs unfused (fused.py): its conv taps and
    # norms hold about two more rows of channels per token (+1.9 MB of peak for a 512-token chunk of
    # the tiny model, measured)
    width = 6 * hidden + 4 * channels_max + 3 * ffn
    # The chunked delta rule creates one state per delta-rule chunk of a prefill chunk before the
    # prefill chunk is evaluated, plus the input and output states.
    states_alive = -(-chunk // _DELTA_CHUNK) + 2
    # attention scores and their softmax, per head a chunk's tokens x the positions they attend to
    # (`prefill_chunk_at`'s bound, or its smallest chunk over the whole context where that is more)
    scores = 2 * n_head * max(chunk * min(capacity, max(chunk, SCORE_POSITIONS)), min(_MIN_CHUNK, chunk) * capacity)
    # a prefill chunk's products on a GPU (EngineOptions.dequant_rows): the weight dequantized to
    # float32 and its transposed copy, one product at a time
    activations = (chunk * width + scores + vocab + states_alive * state_max) * _F32 + 2 * dense * _F32
    total = weights + kv_cache + recurrent_state + activations + load_transient
    return {"weights": int(weights), "kv_cache": int(kv_cache), "recurrent_state": int(recurrent_state),
            "activations": int(activations), "load_transient": int(load_transient), "total": int(total), "context": int(ctx)}


def _weights(tensors: list[TensorHeader], q6k_mode: str) -> tuple[int, int, int]:
    """Bytes of the loaded weights, the load's transient (joining a block's input products,
    model/layers.concat_outputs, briefly holds both copies) and the elements of the largest trunk
    product (joined), which a prefill chunk dequantizes."""
    weights = 0
    fused: dict[tuple[str, int], int] = {}  # (block, group) -> bytes of the products joined at load
    fused_elems: dict[tuple[str, int], int] = {}
    dense = 0
    for t in tensors:
        size = mlx_nbytes(t.qtype, t.n_elements, q6k_mode=q6k_mode)
        size = t.n_bytes if size is None else size  # unsupported types are refused at load
        weights += size
        group = _FUSED.get(t.name.split(".", 2)[-1]) if t.name.startswith("blk.") else None
        if group is not None:
            key = (t.name.split(".")[1], group)
            fused[key] = fused.get(key, 0) + size
            fused_elems[key] = fused_elems.get(key, 0) + t.n_elements
        elif t.name.startswith("blk.") and len(t.shape) == 2:
            dense = max(dense, t.n_elements)
    return weights, max(fused.values(), default=0), max([dense, *fused_elems.values()])


def _recurrent(by_suffix: dict[str, list[TensorHeader]], key_dim: int, capture_positions: int) -> tuple[int, int, int]:
    """Bytes of the gated delta nets' state (per layer: conv window (kernel-1) x channels, state
    Vh x Kd x Vd, captured for `capture_positions` more), the widest layer's channels and its
    largest state's elements."""
    recurrent_state = channels_max = state_max = 0
    for conv in by_suffix.get("ssm_conv1d.weight", []):
        if len(conv.shape) != 2:
            continue
        channels, kernel = conv.shape
        channels_max = max(channels_max, channels)
        block = conv.name.split(".", 2)[1]
        inner = sum(t.n_elements for t in by_suffix.get("ssm_norm.weight", []) if t.name.split(".")[1] == block)
        heads = sum(t.n_elements for t in by_suffix.get("ssm_a", []) if t.name.split(".")[1] == block)
        state = heads * inner * min(key_dim, channels)
        state_max = max(state_max, state)
        recurrent_state += ((kernel - 1) * channels + state * (1 + capture_positions)) * _F32
    return recurrent_state, channels_max, state_max


def available_memory(options: EngineOptions | None = None) -> tuple[int, str]:
    """(bytes the model may take, where that number came from): `options.memory_limit` when set
    (None options: the environment's, `EngineOptions.from_env`), else what the machine reports."""
    opts = options if options is not None else EngineOptions.from_env()
    if opts.memory_limit is not None:
        return opts.memory_limit, opts.sources.get("memory_limit", "memory_limit")
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
        except (OSError, ValueError, IndexError):
            pass
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 0, "unknown"
    source = "physical memory (hw.memsize)" if sys.platform == "darwin" else "physical memory"
    working_set = _metal_working_set()
    if working_set and working_set < total:
        return working_set, "Metal's recommended working set"
    return total, source


def _metal_working_set() -> int:
    if sys.platform != "darwin":
        return 0
    try:
        import mlx.core as mx

        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        return int(info.get("max_recommended_working_set_size", 0))
    except Exception:  # no Metal device or an MLX without the call: fall back to physical memory
        return 0


def check_fits(gguf_file: GGUFFile | Header | str | os.PathLike, exact: bool = False,
               context: int | None = None, *, load_mtp: bool = True,
               options: EngineOptions | None = None) -> dict[str, Any]:
    """The `estimate` of `gguf_file`; raises `MTPEngineError` with both numbers when it exceeds
    the available memory (`available_memory(options)`; unknown available memory is not a reason to
    refuse)."""
    h = _header(gguf_file)
    chunk = options.prefill_chunk if options is not None and options.prefill_chunk else _PREFILL_CHUNK
    kv_bytes = 2 if options is not None and options.kv_dtype in ("float16", "bfloat16") else _F32
    tail = options.kv_tail if options is not None and options.kv_tail is not None else KV_TAIL
    est = estimate(h, exact, context, load_mtp=load_mtp, prefill_chunk=chunk, kv_bytes=kv_bytes, kv_tail=tail)
    limit, source = available_memory(options)
    if source != "unknown" and est["total"] > limit:
        gib = 1 << 30
        parts = ", ".join(f"{k.replace('_', ' ')} {est[k] / gib:.2f}" for k in
                          ("weights", "kv_cache", "recurrent_state", "activations"))
        raise MTPEngineError(
            f"not enough memory: the model needs an estimated {est['total']} bytes ({est['total'] / gib:.2f} GiB: "
            f"{parts} GiB, for a context of {est['context']} positions) but only {limit} bytes "
            f"({limit / gib:.2f} GiB, {source}) are available", file=h.path, field="memory")
    return est
