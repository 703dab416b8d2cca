"""A simulated device and text for n-max auto: round costs per k, catch-up rows, compile on first
use of a shape, timing noise and stalls, and an acceptance process that can change mid-stream.
Deterministic (seeded), pure Python, thousands of rounds per second."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field


@dataclass
class SimDevice:
    verify: dict  # S -> V(S), in plain steps
    draft: float  # c: one draft step, in plain steps
    fixed: float = 0.05  # f: per-round overhead of a drafting round
    row: float = 0.02  # each catch-up row the first draft forward carries, in plain steps
    step_s: float = 0.01  # t(0) in seconds
    compile_s: float = 0.5  # added to the first round of each new k
    noise: float = 0.05  # lognormal sigma per round
    stall_p: float = 0.01  # share of rounds that stall (another process, GC) ...
    stall_x: float = 5.0  # ... for this many times their time
    switch: float = 0.0  # pipelined: added to a round whose k differs from the round before (a bubble)

    def round_steps(self, k: int) -> float:
        return 1.0 if k == 0 else self.verify[k + 1] + k * self.draft + self.fixed

    def seed_costs(self, off: float = 0.0) -> dict:
        """What a stored calibration would say, `off` steps wrong per round."""
        return {k: self.round_steps(k) + off for k in range(1, 9)}


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0  # without compile time
    compile: float = 0.0
    chosen: list = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def simulate(dev: SimDevice, acceptance, rounds: int, sched=None, fixed_k: int = 0, seed: int = 0,
             pipelined: bool = False) -> Run:
    """`acceptance(i)`: probability that each draft of round i is right (independent, the chain
    stops at the first miss). With `sched` it chooses k; else every round drafts `fixed_k`.
    `pipelined`: as the device-resident decoder runs them, round i+1 is chosen (queued) before
    round i is observed, and round i counts as a steady sample of t(k) only between rounds of its
    own k (`decoder.SpeculativeDecoder.step`)."""
    rng = random.Random(seed)
    seen: set = set()
    owed = 0
    run = Run()
    prev = None
    k = sched.next_k(context=0) if sched else fixed_k
    for i in range(rounds):
        n = 0
        if k:
            while n < k and rng.random() < acceptance(i):
                n += 1
        steps = dev.round_steps(k) + (owed * dev.row if k else 0.0)
        if pipelined and prev is not None and prev != k:
            steps += dev.switch
        t = dev.step_s * steps * math.exp(rng.gauss(0.0, dev.noise))
        if rng.random() < dev.stall_p:
            t *= dev.stall_x
        first = k not in seen
        seen.add(k)
        c = dev.compile_s if first else 0.0
        owed = min(owed + 1, 8) if k == 0 else n
        context = run.tokens
        run.tokens += n + 1
        run.seconds += t
        run.compile += c
        run.chosen.append(k)
        if sched:
            if pipelined:
                nxt = sched.next_k(context=run.tokens) if i + 1 < rounds else None
                sched.observe(k, n, t + c, context=context, first_use=first, steady=prev == k == nxt)
            else:
                sched.observe(k, n, t + c, context=context, first_use=first)
                nxt = sched.next_k(context=run.tokens)
        else:
            nxt = fixed_k
        prev, k = k, nxt
    return run


CPU = SimDevice(verify={s: 0.95 * s + 0.05 for s in range(1, 10)}, draft=0.3, row=0.3)  # MLX CPU backend
GPU = SimDevice(verify={s: 1.0 + 0.12 * (s - 1) for s in range(1, 10)}, draft=0.1)  # few rows ~ one
H200_9B = SimDevice(verify={1: 1.0, 2: 1.84, 3: 2.2, 4: 2.7, 5: 3.14, 6: 3.6, 7: 4.0, 8: 2.79, 9: 3.0},
                    draft=0.12)  # the 9B shape's measured curve (docs/benchmarks.md)
# an earlier H200 9B curve (bench_gpu.py --sections auto): t(k) / t(0) ~ 1.6, 1.75, 2.2, 2.25 for
# k = 1..4: a 4-draft round costs about a 3-draft one, which a linear prior does not foresee
H200_9B_S11 = SimDevice(verify={2: 1.45, 3: 1.5, 4: 1.85, 5: 1.8, 6: 2.3, 7: 2.5, 8: 2.7, 9: 2.9}, draft=0.1)
H100_9B = SimDevice(verify={2: 1.2, 3: 1.2, 4: 1.2, 5: 1.2, 6: 1.6, 7: 1.8, 8: 2.0, 9: 2.2},
                    draft=0.1)  # 9B rounds on an H100: t(k)/t(0) ~ 1.35-1.65 for k = 1..4
MOE = SimDevice(verify={1: 1.0, 2: 1.37, 3: 1.66, 4: 1.96, 5: 2.81, 6: 2.90, 7: 3.2, 8: 3.5, 9: 3.8},
                draft=0.10)  # 35B-A3B shape, measured
# later 9B rounds on an H100 (docs/benchmarks.md, auto_trace): t(k)/t(0) ~ 1.29, 1.30, 1.44,
# 1.53 for k = 1..4 (auto's steady rounds at a = 0.5 and 0.8); a round after one of another k cost
# ~0.4 step more (auto's rounds of each k against fixed n-max's, 25 changes of k in 67 rounds)
# a batch of 16 rows at the 9B shape on an H100 (bench_batch --oracle 0.8): batched draft-mtp of 4
# drafts at 0.59x of batched plain, a round ~5.7 plain steps
# a batch of 4 rows: rounds cost in proportion to the verify's extra rows (t(4) ~2.8 plain steps,
# bench_batch --oracle 0.8 at 4 streams on an H100), so a short draft is the best one there
H100_9B_B4 = SimDevice(verify={1: 1.0, **{s: 0.85 + 0.43 * (s - 1) for s in range(2, 10)}}, draft=0.1)
H100_9B_B16 = SimDevice(verify={s: 1.0 + 1.15 * (s - 1) for s in range(1, 10)}, draft=0.1)
H100_9B_S16 = SimDevice(verify={2: 1.15, 3: 1.07, 4: 1.12, 5: 1.12, 6: 1.6, 7: 1.8, 8: 2.0, 9: 2.2}, draft=0.09,
                        switch=0.4)
# 9B rounds on an H100, 2026-12-07 (bench_gpu.py --sections auto, fixed n-max at a = 0.5): t(k)/t(0)
# ~1.21, 1.29, 1.52, 1.65 for k = 1..4
H100_9B_1207 = SimDevice(verify={2: 1.06, 3: 1.04, 4: 1.17, 5: 1.2, 6: 2.0, 7: 2.2, 8: 2.4, 9: 2.6}, draft=0.1)
# 9B rounds on an H200, 2026-12-07 (bench_gpu.py --sections auto, fixed n-max; t(0) 5.33 ms):
# t(k)/t(0) ~1.37, 1.56, 1.74, 1.75 for k = 1..4 (a 4-draft round costs what a 3-draft one does);
# repeats of one setting spread by up to 20%
H200_9B_1207 = SimDevice(verify={2: 1.22, 3: 1.31, 4: 1.39, 5: 1.30, 6: 2.0, 7: 2.2, 8: 2.4, 9: 2.6}, draft=0.1,
                         switch=0.3, noise=0.08)
