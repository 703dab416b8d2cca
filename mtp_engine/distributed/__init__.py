"""One model over several processes through `mx.distributed` (ring over TCP, MPI, NCCL, JACCL:
whatever `mlx.launch` started): tensor parallel (`tp.py`) or pipeline parallel (`pp.py`), each
rank reading only its share of the GGUF (`shard.py`), with a bounded wait on peers (`runtime.py`).

The decoders (plain, draft-mtp with its MTP head, rollback, n-max auto) run unchanged on every
rank: the sharded model hands every rank the same hidden states and logits, samplers share one
seed, and the per-round draft length of n-max auto (chosen from each rank's own clock) is rank
0's, broadcast (the scheduler is built with `Comm.broadcast_int` as its `agree`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import MTPEngineError
from ..gguf.reader import GGUFFile
from ..model.config import Qwen35Config
from ..model.memory import available_memory, estimate
from .runtime import DEFAULT_TIMEOUT, Comm, check_mode, check_timeout, init_group, peer_error
from .shard import GGUFSource, TPPlan, shard_weight_bytes

__all__ = ["Comm", "DEFAULT_TIMEOUT", "load_sharded", "common_seed", "rank_estimate"]


def rank_estimate(gf: GGUFFile, mode: str, rank: int, size: int, exact: bool, context: int,
                  load_mtp: bool = True) -> dict:
    """`memory.estimate` for one rank: its weights counted tensor by tensor from its share, its
    caches as its share of the whole model's (heads under tp, layers under pp)."""
    from .pp import pp_selection
    from .shard import split

    cfg = Qwen35Config.from_gguf(gf)
    full = estimate(gf, exact, context, load_mtp=load_mtp)
    if mode == "tp":
        plan = TPPlan(cfg, rank, size)
        sel = plan.selection
        kv = (plan.kv_heads[1] - plan.kv_heads[0]) / cfg.n_head_kv
        rec = (plan.key_heads[1] - plan.key_heads[0]) / cfg.ssm_key_heads
    else:
        sel = pp_selection(cfg, rank, size)
        l0, l1 = split(cfg.n_layer, size, rank)
        kv = rec = (l1 - l0) / cfg.n_layer

    def held(name, shape):
        if not load_mtp and name.startswith(f"blk.{cfg.n_layer}."):
            return None
        return sel(name, shape)

    out = dict(full)
    out["weights"] = shard_weight_bytes(gf, held, exact)
    out["kv_cache"] = int(full["kv_cache"] * kv)
    out["recurrent_state"] = int(full["recurrent_state"] * rec)
    out["total"] = sum(int(out[k]) for k in ("weights", "kv_cache", "recurrent_state", "activations",
                                             "load_transient") if k in out)
    return out


def check_rank_fits(gf: GGUFFile, mode: str, comm: Comm, exact: bool, context: int, load_mtp: bool) -> dict:
    est = rank_estimate(gf, mode, comm.rank, comm.size, exact, context, load_mtp)
    limit, source = available_memory()
    if source != "unknown" and est["total"] > limit:
        raise MTPEngineError(f"not enough memory on rank {comm.rank}: its share ({mode}, {comm.size} ranks) needs "
                             f"an estimated {est['total']} bytes, {limit} available ({source})", file=gf.path)
    return est


@dataclass
class ShardedLoad:
    model: object
    gf: GGUFFile
    comm: Comm
    estimate: dict
    bytes_read: int


def load_sharded(path: str | os.PathLike, mode: str, group=None, timeout: float = DEFAULT_TIMEOUT,
                 exact: bool = False, load_mtp: bool = True, context: int | None = None,
                 backend: str = "any") -> ShardedLoad:
    """This rank's share of the GGUF model at `path` (`mode` "tp" or "pp"), over `group` (default:
    the processes `mlx.launch` started). Checks this rank's memory before reading any weight."""
    mode = check_mode(mode)
    timeout = check_timeout(timeout)
    if group is None:
        group = init_group(backend, timeout)
    comm = Comm(group, mode, timeout)
    gf = GGUFFile(path)
    with comm.watchdog.armed("loading"):
        est = check_rank_fits(gf, mode, comm, exact, context or estimate(gf, exact)["context"], load_mtp)
        source = GGUFSource(gf, exact)
        model = build(Qwen35Config.from_gguf(gf), source, comm, load_mtp)
    comm.barrier("waiting for every rank to load")
    return ShardedLoad(model, gf, comm, est, source.bytes_read)


def build(cfg, source, comm: Comm, load_mtp: bool = True):
    """This rank's share (`comm.mode`) of the model whose global tensors `source` reads."""
    if comm.mode == "tp":
        from .tp import build_tp
        return build_tp(cfg, source, comm, load_mtp)
    from .pp import build_pp
    return build_pp(cfg, source, comm, load_mtp)


def common_seed(comm: Comm, seed: int | None) -> int | None:
    """The sampling seed every rank uses: the caller's, or one rank 0 drew (same random state
    everywhere, so sampled acceptance agrees)."""
    if comm.size == 1:
        return seed
    if seed is None:
        seed = int.from_bytes(os.urandom(3), "little")
    return comm.broadcast_int(seed)


__all__ += ["peer_error", "build", "ShardedLoad"]
