"""Distributed decoding against one process: tokens/s (plain and draft-mtp n-max auto), the
collectives one decode step issues (all-reduces per block, all-gathers), bytes sent per token, and
the time those collectives take per round (each kind timed alone at its size, times its count).

CPU, N local processes over the ring backend on 127.0.0.1 (this script starts them):

    python scripts/bench/bench_distributed.py -m models/qwen35-mtp-code-Q4_K_M.gguf --ranks 2 --modes tp,pp

GPUs, random 4-bit weights at Qwen3.5-9B or 35B-A3B shape built in memory (as bench_gpu.py does),
one process per GPU started by mlx.launch over NCCL, then the same shape on one GPU:

    mlx.launch --backend nccl -n 2 -- python3 scripts/bench/bench_distributed.py --worker --backend nccl \\
        --shape a3b --modes tp --out bench-dist-a3b-2.json
    python3 scripts/bench/bench_distributed.py --worker --shape a3b --out bench-dist-a3b-1.json

Each worker run prints (rank 0) and writes one JSON object; the launcher prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]

from mtp_engine import api
from mtp_engine.distributed import build
from mtp_engine.distributed.local import spawn
from mtp_engine.distributed.runtime import Comm, init_group
from mtp_engine.model.build import build_model
from mtp_engine.model.layers import Linear

PROMPT = "def quicksort(items):\n    \"\"\"Sort a list of numbers.\"\"\"\n"


# ---- random weights in shares -------------------------------------------------------------------

def global_shapes(cfg) -> dict[str, tuple]:
    """Every tensor's shape as the builder asks for it (a build with 1-element stand-ins)."""
    shapes: dict[str, tuple] = {}

    def fetch(name, shape, matrix):
        shapes[name] = tuple(shape)
        return Linear(mx.zeros((1,) * len(shape))) if matrix else mx.zeros((1,))

    build_model(cfg, fetch, lambda n: True)
    return shapes


class RandomSource:
    """Random 4-bit group-32 weights (F32 routers, plausible recurrent parameters), made at the
    size of each rank's share only: harness.random_model's recipe, sharded."""

    def __init__(self, cfg):
        self.shapes = global_shapes(cfg)
        self.bytes_read = 0

    def shape(self, name):
        return self.shapes[name]

    def has_tensor(self, name):
        return name in self.shapes

    def read(self, name, gshape, rows, cols, matrix):
        lead = list(gshape[:-1])
        n_rows = len(rows) if rows is not None else None
        if not matrix:
            from mtp_engine.model.miniature import random_vector
            return random_vector(name, tuple([n_rows if n_rows is not None else gshape[0], *gshape[1:]]))
        total_rows = 1
        for d in lead:
            total_rows *= d
        r = n_rows if n_rows is not None else total_rows
        c = len(cols) if cols is not None else gshape[-1]
        if "ffn_gate_inp" in name:
            return Linear(mx.random.normal((r, c)) * c ** -0.5)
        w = mx.random.normal((r, c)) * gshape[-1] ** -0.5
        q = mx.quantize(w, group_size=32, bits=4)
        mx.eval(q)
        return Linear(q[0], q[1], q[2], 4, 32)


def shape_config(shape: str):
    from harness import config_9b
    from harness import config_a3b

    if shape == "smoke":  # a tiny shape: checks the script on a CPU
        from harness import smoke_config
        return smoke_config()
    return config_9b(False) if shape == "9b" else config_a3b(40)


# ---- measurements -------------------------------------------------------------------------------

def collective_latency(comm: Comm, hidden: int, vocab_rows: int, repeats: int = 50) -> dict:
    """Seconds per all-sum of one hidden vector and per all-gather of one row of local logits."""
    out = {}
    if comm.size == 1:
        return out
    for kind, fn, shape in (("all_sum", mx.distributed.all_sum, (1, hidden)),
                            ("all_gather", mx.distributed.all_gather, (vocab_rows, 1))):
        x = mx.ones(shape)
        mx.eval(fn(x, group=comm.group))
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            mx.eval(fn(x + 0, group=comm.group))
            times.append(time.perf_counter() - t)
        out[kind] = statistics.median(times)
    return out


def step_collectives(model, comm: Comm | None) -> dict:
    """Collectives one uncompiled 1-token decode step (trunk + output head) issues."""
    if comm is None:
        return {}
    cache = model.make_cache()
    compiled, model.compile_steps = model.compile_steps, False
    mx.eval(model.forward(mx.array([[1, 2, 3]]), cache))
    comm.reset_counts()
    h = model.forward(mx.array([[4]]), cache)
    mx.eval(model.logits(h[0, -1]))
    model.compile_steps = compiled
    n_layer = len(model.global_cfg.recurrent) if hasattr(model, "global_cfg") else model.cfg.n_layer
    return {"counts": dict(comm.counts), "bytes": dict(comm.bytes),
            "all_sum_per_block": comm.counts.get("all_sum", 0) / n_layer,
            "bytes_per_token": sum(comm.bytes.values())}


def gguf_runs(model, tokens: int, repeats: int) -> dict:
    out = {}
    for name, kw in (("plain", {"spec": "none"}), ("draft-mtp auto", {"spec": "draft-mtp", "n_max": "auto"})):
        api.generate(PROMPT, model, max_tokens=8, ignore_eos=True, **kw)  # warm-up: first shapes
        runs = [api.generate(PROMPT, model, max_tokens=tokens, ignore_eos=True, **kw).stats for _ in range(repeats)]
        tps = sorted(s["decode_tokens_per_second"] for s in runs)
        out[name] = {"tok_s": statistics.median(tps), "all_tok_s": [round(t, 2) for t in tps]}
    return out


def random_runs(model, comm: Comm | None, tokens: int, oracle: float) -> dict:
    from harness import NullTokenizer

    from mtp_engine.generation.decode import PlainDecoder
    from mtp_engine.generation.loop import run
    from mtp_engine.generation.sampling import Sampler, SamplerConfig
    from mtp_engine.speculative.ablations import ablation_decoder
    from mtp_engine.speculative.config import DraftParams
    from mtp_engine.speculative.scheduler import COMPILED_AUTO_MAX, DraftLengthScheduler

    prompt = list(range(100, 164))
    out = {}
    for name in ("plain", "draft-mtp auto"):
        tps = []
        for _ in range(2):  # the first run compiles every shape
            sampler = Sampler(SamplerConfig(seed=0))
            if name == "plain":
                dec = PlainDecoder(model, sampler)
            else:
                # ranks draft rank 0's lengths, as `api` builds a distributed run's scheduler
                agree = comm.broadcast_int if comm is not None and comm.size > 1 else None
                dec = ablation_decoder(model, sampler, DraftParams("auto"), oracle_acceptance=oracle,
                                       scheduler=DraftLengthScheduler(None, k_max=COMPILED_AUTO_MAX, agree=agree))
            chunks = run(dec, NullTokenizer(), prompt, tokens, ignore_eos=True)
            if comm is not None:
                chunks = comm.guard(chunks)
            for last in chunks:
                pass
            tps.append(last.stats["decode_tokens_per_second"])
        out[name] = {"tok_s": tps[-1], "oracle_acceptance": oracle if name != "plain" else None}
    return out


def worker(a) -> int:
    results = []
    for mode in a.modes.split(","):
        t0 = time.perf_counter()
        distributed = os.environ.get("MLX_RANK") is not None or a.backend == "nccl"
        comm = None
        if a.model:
            m = api.load(a.model, **({"distributed": mode, "distributed_timeout": a.timeout} if distributed else {}))
            model, comm = m.model, m.comm
            hidden, vocab = m.model.cfg.hidden_size, m.model.cfg.vocab_size
        else:
            cfg = shape_config(a.shape)
            group = init_group(a.backend if distributed else "any", a.timeout)
            comm = Comm(group, mode, a.timeout)
            mx.random.seed(comm.rank)
            model = build(cfg, RandomSource(cfg), comm)
            hidden, vocab = cfg.hidden_size, cfg.vocab_size
        load_s = time.perf_counter() - t0
        if comm is not None:
            comm.barrier("waiting for every rank to finish loading")  # the tokenizer loads after the shards
        row = {"mode": mode if comm is not None and comm.size > 1 else "single", "ranks": comm.size if comm else 1,
               "device": str(mx.default_device()), "load_s": round(load_s, 2),
               "weight_bytes_rank0": sum(model.nbytes().values())}
        row["step"] = step_collectives(model, comm)
        if comm is not None:
            row["latency_s"] = collective_latency(comm, hidden, -(-vocab // comm.size))
            lat, counts = row["latency_s"], row["step"].get("counts", {})
            row["comm_ms_per_step"] = round(1e3 * sum(counts.get(k, 0) * lat.get(k, 0.0) for k in lat), 3)
        row["runs"] = gguf_runs(m, a.tokens, a.repeats) if a.model else random_runs(model, comm, a.tokens, a.oracle)
        results.append(row)
        if comm is None or comm.size == 1:
            break  # one process: the modes are the same model
    if comm is None or comm.rank == 0:
        text = json.dumps(results, indent=1)
        print(text)
        if a.out:
            Path(a.out).write_text(text)
    return 0


def launcher(a) -> int:
    """CPU: one process, then N local ranks per mode; prints a markdown table."""
    here = [sys.executable, str(Path(__file__).resolve()), "--worker", "--tokens", str(a.tokens),
            "--repeats", str(a.repeats)]
    here += ["-m", a.model] if a.model else ["--shape", a.shape]
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    single = json.loads(subprocess.run(here + ["--modes", "tp"], env=env, check=True, capture_output=True,
                                       text=True).stdout)
    rows = list(single)
    procs, hostfile = spawn(a.ranks, here + ["--modes", a.modes, "--timeout", str(a.timeout)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:
        os.unlink(hostfile)
    if procs[0].returncode != 0:
        sys.stderr.write(outs[0][1][-3000:])
        return 1
    rows += json.loads(outs[0][0])
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1))
    print(table(rows))
    return 0


def table(rows: list[dict]) -> str:
    base = {k: v["tok_s"] for k, v in rows[0]["runs"].items()}
    lines = ["| run | ranks | plain tok/s | auto draft-mtp tok/s | vs 1 process (plain / auto) | all-reduces per "
             "block | collectives per step | bytes sent per token | comm ms per step (est.) | weights on rank 0 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        p, d = r["runs"]["plain"]["tok_s"], r["runs"]["draft-mtp auto"]["tok_s"]
        st = r.get("step", {})
        lines.append(f"| {r['mode']} | {r['ranks']} | {p:.1f} | {d:.1f} | {p / base['plain']:.2f}x / "
                     f"{d / base['draft-mtp auto']:.2f}x | {st.get('all_sum_per_block', 0):g} | "
                     f"{st.get('counts', {})} | {st.get('bytes_per_token', 0)} | {r.get('comm_ms_per_step', 0)} | "
                     f"{r['weight_bytes_rank0'] / 2**20:.0f} MiB |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="GGUF file")
    ap.add_argument("--shape", choices=["9b", "a3b", "smoke"], help="random weights at this shape instead of a file")
    ap.add_argument("--ranks", type=int, default=2, help="local processes (CPU launcher)")
    ap.add_argument("--modes", default="tp,pp")
    ap.add_argument("--backend", default="ring", choices=["ring", "nccl", "mpi", "any"])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed generations per run (median)")
    ap.add_argument("--oracle", type=float, default=0.8, help="draft acceptance for random weights")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help="run as one rank (mlx.launch starts these)")
    a = ap.parse_args()
    if (a.model is None) == (a.shape is None):
        ap.error("give exactly one of -m FILE or --shape 9b|a3b")
    if a.worker:
        return worker(a)
    return launcher(a)


if __name__ == "__main__":
    sys.exit(main())
