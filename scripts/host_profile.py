"""Where the host's time goes while it queues rounds: run one part (a plain step, a verify of k+1
rows, a whole device-resident round of k drafts) back to back for some seconds, to be sampled by
`py-spy record --native` (MLX's C++ frames included), at the 9B shape with random 4-bit weights.

Usage (GPU): py-spy record --native -r 400 -f raw -o host.txt -- python3 scripts/host_profile.py [--parts plain,verify,round]
             python3 scripts/host_profile.py --summary host.txt   (per part: top frames, self and total)
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def run_parts(parts: list[str], k: int, seconds: float, small: bool, tiny: bool) -> None:
    import mlx.core as mx
    from bench_9b_oracle import config_9b, random_model
    from round_burst import _decoder
    from round_nodes import tiny_config

    model = random_model(tiny_config() if tiny else config_9b(small))
    prompt = list(range(100, 164))
    for part in parts:
        dec = _decoder(model, k, 0.8, prompt, room=int(seconds * 1000 / 3) * (k + 2) + 4096)
        ids = mx.zeros((1, k + 1), dtype=mx.int32)

        def launch(part=part, dec=dec, ids=ids):
            if part == "plain":
                return dec._launch_resident_plain().round.emitted
            if part == "round":
                return dec._launch_resident(k).round.emitted
            # verify: captured, rolled back (as in a round); verify_norb: captured, not rolled back;
            # verify_nocap: neither (a plain forward of k+1 rows)
            post, _ = model.forward(ids, dec.cache, capture=part != "verify_nocap", return_prenorm=True,
                                    resident=True)
            t = mx.argmax(model.logits(post[0]), axis=-1)
            if part == "verify":
                dec.cache.rollback_lazy(mx.array(k + 1))
            mx.async_eval(t)
            return t

        for _ in range(3):  # warm-up: the graphs traced
            mx.eval([launch() for _ in range(4)])
        LOOPS[part](launch, seconds, 16, f"{part} k={k}")


def timed_loop(launch, seconds: float, burst: int, name: str) -> None:
    import mlx.core as mx
    t0, n, host = time.perf_counter(), 0, 0.0
    while time.perf_counter() - t0 < seconds:
        t = time.perf_counter()
        outs = [launch() for _ in range(burst)]
        host += time.perf_counter() - t
        mx.eval(outs)
        n += burst
    dt = time.perf_counter() - t0
    print(f"{name}: {n} launches, {dt * 1e3 / n:.3f} ms each, host {host * 1e3 / n:.3f} ms", file=sys.stderr,
          flush=True)


# one function per part, so that `--summary --part P` finds P's samples by its frame name
def timed_plain(*a):
    timed_loop(*a)


def timed_verify(*a):
    timed_loop(*a)


def timed_round(*a):
    timed_loop(*a)


def timed_verify_norb(*a):
    timed_loop(*a)


def timed_verify_nocap(*a):
    timed_loop(*a)


LOOPS = {"plain": timed_plain, "verify": timed_verify, "round": timed_round, "verify_norb": timed_verify_norb,
         "verify_nocap": timed_verify_nocap}


def summary(path: str, top: int, part: str) -> None:
    """py-spy's raw (collapsed) stacks: the frames holding the most samples, self and total."""
    total: collections.Counter = collections.Counter()
    self_: collections.Counter = collections.Counter()
    libs: collections.Counter = collections.Counter()
    n = 0
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        c = int(count)
        frames = stack.split(";")
        if not any(f.startswith(f"timed_{part} ") for f in frames):
            continue
        n += c
        lib = frames[-1].rpartition("(")[2].rstrip(")")
        libs[lib if lib.endswith((".so", ".so.6")) or ".so." in lib else "python"] += c
        for f in set(frames):
            total[f] += c
        self_[frames[-1]] += c
    print(f"{path}: {n} samples in timed_{part}; self time by library: "
          + ", ".join(f"{k} {100 * v / n:.0f}%" for k, v in libs.most_common(8)))
    for title, ctr in (("self", self_), ("total", total)):
        print(f"-- {title}")
        for f, c in ctr.most_common(top):
            print(f"{100 * c / n:6.1f}%  {f[:160]}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="plain,verify,round,verify_norb,verify_nocap")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="32 layers at tiny widths (a CPU check)")
    ap.add_argument("--summary", help="summarise a py-spy raw file instead")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    if a.summary:
        for part in a.parts.split(","):
            summary(a.summary, a.top, part)
    else:
        run_parts(a.parts.split(","), a.k, a.seconds, a.small, a.tiny)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
