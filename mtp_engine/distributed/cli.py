"""`mtp-engine generate --distributed [tp|pp]`: the flags and what the CLI does per rank."""
from __future__ import annotations

import argparse

from .runtime import DEFAULT_TIMEOUT, MODES


def add_distributed_flags(g) -> None:
    g.add_argument("--distributed", nargs="?", const="tp", default=None, choices=list(MODES),
                   help="run one model over the processes mlx.launch started: tp (tensor parallel, the "
                        "default) or pp (pipeline parallel, for slow links); rank 0 prints")
    g.add_argument("--distributed-timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help="end the run with an error when a peer makes no progress for this long")


def distributed_kwargs(args: argparse.Namespace) -> dict:
    if getattr(args, "distributed", None) is None:
        return {}
    return {"distributed": args.distributed, "distributed_timeout": args.distributed_timeout}


def quiet_rank(model) -> bool:
    """Whether this process is a rank other than 0 (it generates but prints nothing)."""
    comm = getattr(model, "comm", None)
    return comm is not None and comm.rank != 0
