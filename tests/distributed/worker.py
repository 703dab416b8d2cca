"""One rank of a distributed test run: loads a model sharded (tp / pp) and generates; rank 0
writes the tokens as JSON. `--die-rank R --die-after N`: rank R exits abruptly (or, with `--hang`,
stops) after N streamed chunks."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from mtp_engine import api
from mtp_engine.errors import MTPEngineError


def run_keywords(run: str) -> dict:
    """A run's `generate` keywords from "spec[:n-max[:temperature]]" (sampled runs with seed 3)."""
    spec, n_max, temperature = (run.split(":") + ["", ""])[:3]
    kw: dict = {"spec": spec}
    if spec != "none":
        kw["n_max"] = n_max if n_max == "auto" else int(n_max)
    if temperature:
        kw.update(temperature=float(temperature), seed=3)
    return kw


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--mode", choices=["tp", "pp"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--die-rank", type=int, default=-1)
    ap.add_argument("--die-after", type=int, default=3)
    ap.add_argument("--hang", action="store_true", help="the dying rank stops (SIGSTOP) instead of exiting")
    ap.add_argument("--runs", default="none,draft-mtp:2,draft-mtp:auto", help="spec[:n-max[:temperature]], ...")
    ap.add_argument("--prompt", type=int, nargs="+", default=[1, 5, 9, 2, 7, 3])
    a = ap.parse_args()
    try:
        m = api.load(a.model, distributed=a.mode, distributed_timeout=a.timeout)
        rank = m.comm.rank
        out = {"size": m.comm.size, "weight_bytes": m.info.weight_bytes,
               "bytes_read": m.info.distributed["bytes_read"]}
        for run in a.runs.split(","):
            toks = []
            for i, chunk in enumerate(api.stream_generate(a.prompt, m, max_tokens=a.max_tokens, ignore_eos=True,
                                                          **run_keywords(run))):
                toks += chunk.token_ids
                if rank == a.die_rank and i + 1 >= a.die_after:
                    if a.hang:  # alive but silent: its sockets stay open
                        os.kill(os.getpid(), signal.SIGSTOP)
                    os._exit(9)
            out[run] = toks
    except MTPEngineError as e:
        print(f"rank error: {e}", file=sys.stderr, flush=True)
        return 3
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
