"""What a run measured of its rounds' times, for `n-max auto` (speculative/scheduler.py).

A round's time t(k) is the wall time between consecutive rounds' host reads, kept per context
range and k (the last `WINDOW`; the median is robust to stalls). Costs are in plain steps,
t(k) / t(0): measured where possible, else the seed (stored costs or the prior) corrected by what
the measured lengths say of it. One-draft probes are kept apart (their rounds carry a plain
stretch's catch-up rows), as are rounds that first used a shape (a compile, reported as such) and
rounds beside a change of k (the change's cost).
"""
from __future__ import annotations

import statistics
from collections import deque

MIN_SAMPLES = 2  # timed rounds before a k's measured time replaces its seed
WINDOW = 32  # timed rounds kept per (context range, k)
_SWITCH_SAMPLES = 4  # rounds beside a change of k timed before its cost is believed


class RoundTimes:
    """Timed rounds per (context bucket, k), and the costs they imply. `seed`: {k: plain steps}
    for k in 1..k_max, what a k costs before this run timed it."""

    def __init__(self, seed: dict[int, float], k_max: int):
        self.seed, self.k_max = seed, k_max
        self._times: dict[tuple[int, int], deque] = {}  # (context bucket, k) -> seconds per round
        self._probes: deque = deque(maxlen=WINDOW)  # one-draft probes (they carry catch-up rows)
        self._first_use: list[tuple[int, int, float]] = []  # (bucket, k, seconds) of untimed rounds
        self._beside_change = [0.0, 0]  # rounds beside a change of k: summed excess (plain steps), count
        # a choice asks for the same medians ~150 times: kept until the next observation changes
        # them (the choice runs on the host every round)
        self._medians: dict[tuple[int, int, bool], float | None] = {}

    # ---- recording ----------------------------------------------------------------------------
    def record(self, b: int, k: int, seconds: float, steady: bool) -> None:
        """A warm round of k in context bucket b; `steady` False: queued beside a change of k
        (its interval carries its neighbours' work): a sample of the change's cost, not of t(k)."""
        self._medians.clear()
        if steady:
            self._times.setdefault((b, k), deque(maxlen=WINDOW)).append(seconds)
        elif (m := self.median(k, b, True)) is not None and (t0 := self.step_seconds(b)):
            # excess clipped to [-0.5, 1] step: a stall is not a change's cost
            self._beside_change[0] += min(max((seconds - m) / t0, -0.5), 1.0)
            self._beside_change[1] += 1

    def record_probe(self, seconds: float) -> None:
        """A one-draft probe's time (kept apart: it carries a plain stretch's catch-up rows)."""
        self._medians.clear()
        self._probes.append(seconds)

    def record_first_use(self, b: int, k: int, seconds: float) -> None:
        """A round that first used a shape (its time includes compiling: `compile_seconds`)."""
        self._first_use.append((b, k, seconds))

    # ---- what they say ------------------------------------------------------------------------
    def median(self, k: int, b: int, steady: bool = False) -> float | None:
        """Median seconds of a k-round in context range b, or the nearest range that has enough;
        `steady` False lets probes stand in for k = 1 (an upper bound)."""
        key = (k, b, steady)
        if key not in self._medians:
            self._medians[key] = self._measure_median(k, b, steady)
        return self._medians[key]

    def _measure_median(self, k: int, b: int, steady: bool) -> float | None:
        d = self._timed(k, b)
        if not d:
            if k == 1 and not steady and len(self._probes) >= 1:  # only probes measured it: an upper bound
                return statistics.median(self._probes)
            return None
        # two samples: the smaller (a stall only ever adds time); more: the median
        return min(d) if len(d) < 3 else statistics.median(d)

    def _timed(self, k: int, b: int) -> deque:
        """The timed k-rounds of context range b, or of the nearest range with enough of them
        (empty: none has)."""
        found = [(abs(bb - b), bb) for (bb, kk), d in self._times.items() if kk == k and len(d) >= MIN_SAMPLES]
        return self._times[(min(found)[1], k)] if found else deque()

    def probe_median(self) -> float | None:
        """What probes took here (their catch-up rows included), once one was timed."""
        return statistics.median(self._probes) if self._probes else None

    def samples(self) -> int:
        """Warm rounds timed (probes and rounds beside a change apart)."""
        return sum(len(d) for d in self._times.values())

    def plain_unmeasured(self) -> bool:
        """Whether no context range has timed enough plain rounds yet."""
        return not any(k == 0 and len(d) >= MIN_SAMPLES for (_, k), d in self._times.items())

    def drafting_measured(self) -> bool:
        """Whether some drafting length (or a probe) was timed."""
        return any(k > 0 and len(d) >= MIN_SAMPLES for (_, k), d in self._times.items()) or bool(self._probes)

    def step_seconds(self, b: int) -> float | None:
        """Measured t(0), or derived from the best-measured drafting k and its seed ratio."""
        t0 = self.median(0, b)
        if t0 is not None:
            return t0
        for k in range(1, self.k_max + 1):
            m = self.median(k, b)
            if m is not None:
                return m / self.seed[k]
        return None

    def round_steps(self, k: int, b: int) -> float:
        """t(k) / t(0): measured where possible; else the seed plus the measured k's errors against
        their seeds (interpolated between the nearest measured k's, extrapolated with their trend
        beyond them): a seed off by 0.3 steps is corrected by one measured k, one with the wrong
        slope by two, and the seed's shape (e.g. a cheap 8-row verify) is kept. A length shorter
        than the one measured length scales with it instead (its cost beyond a plain step in the
        seed's proportion)."""
        if k == 0:
            return 1.0
        t0 = self.step_seconds(b)
        m = self.median(k, b)
        if t0 is None:
            return self.seed[k]
        if m is not None and self.median(k, b, True) is not None:
            return m / t0
        measured = [kk for kk in range(1, self.k_max + 1) if kk != k and self.median(kk, b, True) is not None]
        if not measured:
            return self.seed[k] if m is None else max(self.seed[k], m / t0)  # probes: an upper bound
        r = {kk: self.median(kk, b, True) / t0 for kk in measured}
        err = {kk: r[kk] - self.seed[kk] for kk in measured}
        below = [kk for kk in measured if kk < k]
        above = [kk for kk in measured if kk > k]
        if below and above:  # interpolate the error between the nearest measured k's
            lo, hi = below[-1], above[0]
            w = (k - lo) / (hi - lo)
            return self.seed[k] + (1 - w) * err[lo] + w * err[hi]
        side = below[-2:] if below else above[:2]
        near = side[-1] if below else side[0]
        if len(side) == 2:
            slope = (err[side[-1]] - err[side[0]]) / (side[-1] - side[0])
            est = self.seed[k] + err[near] + slope * (k - near)
        elif k < near and self.seed[near] > 1.0:
            # one measured length, a shorter one asked: a round's cost beyond a plain step scales
            # with its rows (a batch's verify of B (k+1) rows: at 4 rows an H100 round of 4 drafts
            # cost 2.7 steps where the alone prior said 1.7; a shift by that error made 2 drafts
            # look like 2.5 steps and the batch never tried them)
            est = 1.0 + (self.seed[k] - 1.0) * (r[near] - 1.0) / (self.seed[near] - 1.0)
        else:
            est = self.seed[k] + err[near]
        # a longer draft than one measured costs at least as much (and a shorter one at most)
        return max(est, r[near]) if k > near else min(max(est, 1.0), r[near])

    def switch_steps(self) -> float:
        """What a change of draft length costs, in plain steps: pipelined rounds beside a change
        (the one before it and the one after, `steady` False) against their k's steady median, the
        mean excess of such a round times the two rounds a change touches (on an H100 ~0.4 step a
        change; synchronous rounds are all steady: 0). 0 until _SWITCH_SAMPLES were timed."""
        total, n = self._beside_change
        return max(2.0 * total / n, 0.0) if n >= _SWITCH_SAMPLES else 0.0

    def compile_seconds(self) -> float:
        """Time of first-use rounds beyond what the same round measured once warm."""
        total = 0.0
        for b, k, s in self._first_use:
            t0 = self.step_seconds(b)
            if t0 is not None:
                total += max(s - self.round_steps(k, b) * t0, 0.0)
        return total

    def measured(self) -> dict[int, float]:
        """{k: t(k)/t(0)} for the k's this run timed (in the context range timed most)."""
        b = self._most_timed()
        if b is None:
            return {}
        t0 = self.median(0, b)  # measured: one derived from the seed would store the seed back as measured
        if t0 is None:
            return {}
        # steady rounds only: a probe's time carries the catch-up of a plain stretch
        return {k: self.median(k, b, True) / t0 for k in range(1, self.k_max + 1)
                if self.median(k, b, True) is not None}

    def measured_rounds(self) -> dict[int, int]:
        """{k: rounds timed} behind `measured`'s costs (the fewer of k's and the plain step's, from
        the context ranges their medians came from)."""
        b = self._most_timed()
        plain = len(self._timed(0, b)) if b is not None else 0
        return {k: min(len(self._timed(k, b)), plain) for k in self.measured()}

    def _most_timed(self) -> int | None:
        """The context range with the most timed rounds (None: none timed)."""
        counts: dict[int, int] = {}
        for (b, _), d in self._times.items():
            counts[b] = counts.get(b, 0) + len(d)
        return max(counts, key=counts.get) if counts else None
