"""The engine's entry to a sharded load: `api.load(..., distributed=...)` lands here."""
from __future__ import annotations

import time
from pathlib import Path

from ..errors import MTPEngineError
from ..model.loaded import Model
from ..model.loader import LoadInfo
from ..model.memory import estimate
from ..threads import evaluate_all, release_at_exit
from ..tokenizer.tokenizer import Tokenizer
from . import load_sharded


def load_model(p: Path, mode: str, group, timeout: float, exact: bool, load_mtp: bool,
               max_context: int | None, default_context: int, t0: float):
    """A `Model` holding this rank's share of the GGUF model at `p`."""
    if p.is_dir():
        raise MTPEngineError("distributed loading reads GGUF files; convert the checkpoint folder to GGUF first",
                             file=str(p), field="distributed")
    ctx = min(estimate(p, exact, load_mtp=load_mtp)["context"], max_context or default_context)
    sl = load_sharded(p, mode, group=group, timeout=timeout, exact=exact, load_mtp=load_mtp, context=ctx)
    model = sl.model
    model.cfg.context_length = min(model.cfg.context_length, ctx)
    evaluate_all(model)
    release_at_exit()
    info = _info(sl)
    return Model(model, Tokenizer.from_gguf(sl.gf.reader, sl.gf.path), info, sl.gf.path, time.perf_counter() - t0,
                 comm=sl.comm)


def _info(sl):
    sizes = sl.model.nbytes()
    info = LoadInfo(path=sl.gf.path, file_bytes=sl.gf.file_size(), weight_bytes=sizes["trunk"] + sizes["mtp"])
    info.distributed = {"mode": sl.comm.mode, "rank": sl.comm.rank, "size": sl.comm.size,
                        "bytes_read": sl.bytes_read, "estimate": sl.estimate}
    return info
