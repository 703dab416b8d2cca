"""Adaptive draft length (`n-max auto`): each round drafts the k that maximises expected tokens
per second, from what the current run measures.

Expected tokens of a round with k drafts: E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j, alpha_j the
online probability that draft j is accepted given drafts 1..j-1 were. The time of a round, t(k), is
measured by the caller (wall time between consecutive rounds' host reads) and kept per k and
context range; t(0) is a plain step. A k is chosen while E(k) / t(k) beats 1 / t(0), with a margin
in both directions (hysteresis). Stored costs from earlier runs (speculative/calibration.py) only seed
the k's this run has not measured yet, scaled by what it has measured.

Rounds that first used a shape (a graph compile or kernel JIT) are not timed: their excess is
reported as compile time. While plain steps win, one-draft probes notice a return of predictable
text; their extra time is held to `PROBE_BUDGET` of the decode time.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from .acceptance_estimate import PositionAcceptance
from .round_times import MIN_SAMPLES, RoundTimes
from .calibration import MAX_K, default_seed, seed_costs
from .costmodel import Costs

AUTO_MAX = MAX_K  # longest draft auto considers
# with compiled steps (the GPU default) every new draft length is new graphs to trace and compile
# (verify of k+1 rows, catch-up rows), seconds each at 9B shape: on the H200 an auto run at oracle
# acceptance 0.9 that reached k = 8 spent 70x its decode time compiling (docs/benchmarks.md), so
# auto stops at 4 there; fixed n-max up to 64 is still the user's to ask for
COMPILED_AUTO_MAX = 4
PROBE_BUDGET = 0.01  # probes' extra time <= 1% of the decode time so far
MARGIN = (0.02, 0.005)  # hysteresis: drafting starts above 1.02x plain's rate, stops below 0.995x
_PROBE_EVERY = 16  # plain rounds between probes at least (the budget usually spaces them more)
_EXPLORE_AFTER = 8  # drafting rounds before a longer draft is explored (a probe's luck is no evidence)
_SURE_WIN = 1.5  # expected rate over plain's above which measuring t(0) is deferred ...
_DEFER_T0 = 64  # ... to this round (a 128-token run at high acceptance is ~45 rounds)
_STAY_ROUNDS = 4  # rounds a draft length is expected to be kept, over which a change's cost is spread
_EXPLORE_RUN = 4  # rounds in a row that try an unmeasured k (a pipelined round is timed only between
# rounds of its own k: four give MIN_SAMPLES timed ones)


def auto_k_max(model) -> int:
    """The longest draft auto considers for `model`: COMPILED_AUTO_MAX under compiled steps."""
    return COMPILED_AUTO_MAX if getattr(model, "compile_steps", False) else AUTO_MAX


def context_bucket(context: int) -> int:
    """Context ranges [0, 512), [512, 1024), [1024, 2048), ...: attention cost grows with context."""
    return max(0, int(context).bit_length() - 9)


class DraftLengthScheduler:
    """Chooses k each round; learns acceptance per draft position and time per round from the rounds
    it observes. `costs`: stored round costs {k: plain steps}, the old calibration's `Costs`, or None
    (the prior). `prior`: round costs before any measurement (`calibration.default_seed` of this
    device and model kind when None); it also fills the lengths a stored entry lacks."""

    @classmethod
    def for_model(cls, model, costs: Costs | dict[int, float] | None = None,
                  agree: Callable[[int], int] | None = None,
                  acceptance: list[float] | None = None) -> "DraftLengthScheduler":
        """The scheduler a run of `model` starts with: its draft-length cap (`auto_k_max`), the
        prior of this device and model kind (dense or MoE), and what earlier runs stored (`costs`,
        and per draft position the `acceptance` the last one ended at)."""
        cfg = getattr(model, "cfg", None)
        return cls(costs, k_max=auto_k_max(model), prior=default_seed(moe=bool(cfg and cfg.is_moe)), agree=agree,
                   acceptance=acceptance)

    def __init__(self, costs: Costs | dict[int, float] | None = None, k_max: int = AUTO_MAX,
                 budget: float = PROBE_BUDGET, prior: dict[int, float] | None = None,
                 agree: Callable[[int], int] | None = None, defer_t0: bool = True,
                 acceptance: list[float] | None = None):
        """`agree`: makes a choice common where several processes decode one sequence (a
        distributed rank's broadcast of rank 0's); the scheduler then records the common choice.
        `defer_t0`: whether a choice far above plain's rate may put off measuring a plain round's
        time (`_SURE_WIN`): right where the prior is close (a sequence alone), wrong where it is a
        guess (a batch's rows: at 16 rows on an H100 a batch kept drafting 4 at 0.59x of plain,
        its t(0) never measured). `acceptance`: per draft position, where an earlier run's estimate
        ended (`PositionAcceptance`'s start)."""
        self.agree = agree
        self.defer_t0 = defer_t0
        self.seed = seed_costs(costs, prior or default_seed())
        # the lengths an earlier run on this device timed (a store's; every one for the old `Costs`)
        self.stored = set(self.seed) if isinstance(costs, Costs) else \
            {int(k) for k in (costs or {}) if int(k) in self.seed}
        self.k_max = min(k_max, max(self.seed))
        self.budget = budget
        self.acceptance = PositionAcceptance(self.k_max, start=acceptance)
        self.rounds = 0  # choices made
        self.drafting_rounds = 0  # choices of k > 0 that were not probes
        self._queue: deque = deque()  # (k, probe) chosen but not yet observed
        self.times = RoundTimes(self.seed, self.k_max)
        self._bucket = 0
        self._last_k = 0
        self._plain_streak = 0
        self._forced_plain = 0  # plain rounds still owed to a measurement of t(0)
        self._exploring: list[int] = []  # draft lengths still owed to the exploration of an unmeasured k
        self._explored: set[tuple[int, int]] = set()  # (context bucket, k) explored
        self.decode_seconds = 0.0
        self.probes = 0
        self.plain_why = {"measuring": 0, "no_gain": 0}  # plain rounds by reason (probes apart)
        self._no_gain = [0.0, 0.0]  # over the no-gain rounds: summed best expected rate, draft 1's acceptance
        self.probe_seconds = 0.0  # probes' time beyond the plain step each replaced

    # ---- estimates --------------------------------------------------------------------------
    def alphas(self) -> list[float]:
        """Per draft position, the estimated probability of acceptance (`PositionAcceptance`)."""
        return self.acceptance.alphas()

    def expected_tokens(self, k: int) -> float:
        return self.acceptance.expected_tokens(k)

    def step_seconds(self, b: int | None = None) -> float | None:
        """Measured t(0), or derived from the best-measured drafting k and its seed ratio."""
        return self.times.step_seconds(self._bucket if b is None else b)

    def round_steps(self, k: int, b: int | None = None) -> float:
        """t(k) / t(0) (`RoundTimes.round_steps`) in context bucket b (default: the current one)."""
        return self.times.round_steps(k, self._bucket if b is None else b)

    def expected_rate(self, k: int) -> float:
        """Expected tokens per plain-step of time for a round with k drafts (plain: 1)."""
        return self.expected_tokens(k) / self.round_steps(k)

    @property
    def can_win(self) -> bool:
        """Whether fully accepted drafts would beat plain steps at some k (else drafting only costs)."""
        return any((k + 1) / self.round_steps(k) > 1.0 + MARGIN[0] for k in range(1, self.k_max + 1))

    def switch_steps(self) -> float:
        """What a change of draft length costs, in plain steps (`RoundTimes.switch_steps`)."""
        return self.times.switch_steps()

    # ---- the choice -------------------------------------------------------------------------
    def next_k(self, context: int = 0) -> int:
        self._bucket = context_bucket(context)
        rates = [self.expected_rate(k) for k in range(self.k_max + 1)]
        best = max(range(1, self.k_max + 1), key=lambda k: rates[k])
        last = self._last_k
        if 0 < last <= self.k_max and best != last and rates[last] > 1.0 + MARGIN[0]:
            # leaving the current length pays the measured change cost once, spread over the rounds a
            # length is usually kept: near-equal lengths no longer trade places with every estimate
            sw = self.switch_steps()
            if sw and self.expected_tokens(best) / (self.round_steps(best) + sw / _STAY_ROUNDS) <= rates[last]:
                best = last
        threshold = 1.0 + MARGIN[0] if last == 0 else 1.0 - MARGIN[1]
        k = best if rates[best] > threshold else 0
        if not k and not self._forced_plain and self.can_win:  # (a measuring round is plain whatever)
            k = self._unsure(threshold)
        why = "no_gain"
        if self._forced_plain:
            k, self._forced_plain, why = 0, self._forced_plain - 1, "measuring"
        elif self._exploring and k:
            k = self._exploring.pop()
        elif k and (kk := self._worth_exploring(rates[best])):
            self._exploring = [kk] * (_EXPLORE_RUN - 1)
            self._explored.add((self._bucket, kk))
            k = kk
        elif k and self.times.plain_unmeasured() and self.rounds % 8 == 3 and (
                rates[best] < _SURE_WIN or self.rounds >= _DEFER_T0 or not self.defer_t0):
            # every rate is relative to a plain step's time: measure it, whatever the seed says; a
            # pipelined round times cleanly only between rounds of its own k, so MIN_SAMPLES + 2 in a
            # row give MIN_SAMPLES samples at once (three gave one, and a second stretch followed).
            # A choice far above plain's rate does not hang on t(0): in a short run its measurement
            # would cost more than it could change, so it waits for a longer one
            k, self._forced_plain, why = 0, MIN_SAMPLES + 1, "measuring"
        probe = False
        if k == 0:
            self._plain_streak += 1
            if self._plain_streak >= _PROBE_EVERY and self._probe_allowed():
                k, probe = 1, True
                self._plain_streak = 0
                self.probes += 1
        else:
            self._plain_streak = 0
        if self.agree is not None:  # each rank chose from its own clock: rank 0's choice holds
            agreed = self.agree(k)
            probe, k = probe and agreed == k, agreed
        self._last_k = 0 if probe else k
        if k == 0:  # why it is plain: a plain step's time measured, or no draft length expected to pay
            self.plain_why[why] += 1
            if why == "no_gain":
                self._no_gain[0] += rates[best]
                self._no_gain[1] += self.alphas()[0]
        self.rounds += 1
        self.drafting_rounds += int(k > 0 and not probe)
        self._queue.append((k, probe))
        return k

    def _unsure(self, threshold: float) -> int:
        """Where the estimates say no draft pays: the k timed here or by an earlier run that would pay
        were acceptance one standard deviation above its estimate (`PositionAcceptance.optimistic`),
        else 0 (a length never timed is the exploration's to try, on firm acceptance). Plain rounds teach
        nothing of acceptance, so a stop on thin evidence would last the run; drafting on until the
        evidence is firm costs a few rounds where acceptance is truly low."""
        measured = [k for k in range(1, self.k_max + 1)
                    if k in self.stored or self.times.median(k, self._bucket, True) is not None]
        if not measured:
            return 0
        up = self.acceptance.optimistic(1.0)
        rates = {k: self.acceptance.expected_tokens(k, up) / self.round_steps(k) for k in measured}
        k = max(rates, key=rates.get)
        return k if rates[k] > threshold else 0

    def _worth_exploring(self, best_rate: float) -> int:
        """A draft length longer than every measured one that could beat the best estimate, else
        0. Estimates beyond the measured k's extrapolate the seed's shape, which can hide a cheap
        long draft (on the H200 a 5-row verify costs less than a 4-row one, and auto drafted 2 where
        4 was 8% faster): k is tried once, for a few rounds, when even at the cost of the longest
        measured draft it would beat the best. (Between measured k's the interpolation holds; a
        length an earlier run on this device timed is no extrapolation: its stored cost stands.)
        Where a single length is timed and a plain step is not, the one below it is tried."""
        b = self._bucket
        t0 = self.step_seconds(b)
        if t0 is None or self.drafting_rounds < _EXPLORE_AFTER:  # acceptance learned first
            return 0
        measured = {j: self.times.median(j, b, True) / t0 for j in range(1, self.k_max + 1)
                    if self.times.median(j, b, True) is not None}
        if not measured:
            return 0
        longest = max(measured)
        for k in range(self.k_max, longest, -1):
            if (b, k) in self._explored or k in self.stored:
                continue
            if self.expected_tokens(k) / measured[longest] > best_rate * (1.0 + MARGIN[0]):
                return k
        shorter = longest - 1
        if len(measured) == 1 and self.times.plain_unmeasured() and shorter >= 1 and shorter not in self.stored and \
                (b, shorter) not in self._explored:
            # one length timed and no plain step: every cost is the seed's shape scaled to that one
            # length, and a seed that underrates it (the MoE shape's 5-row verify: 3.3 steps where
            # the prior says 2.5) keeps the run there; the length below it, timed, gives the slope
            return shorter
        return 0

    def _probe_allowed(self) -> bool:
        """A probe costs about t(1) - t(0) (plus its catch-up rows: once probes were timed, their
        median extra time is the estimate); allowed while probes' extra time stays within the budget
        share of the decode time so far, so it can exceed it by at most the first probe's excess
        over its estimate. Never once drafting was measured unable to pay even at full acceptance."""
        if self.times.drafting_measured() and not self.can_win:
            return False
        t0 = self.step_seconds()
        if t0 is None:
            return False
        cost = max(self.round_steps(1) - 1.0, 0.0) * t0
        if (probed := self.times.probe_median()) is not None:  # what probes really cost here
            cost = max(cost, probed - t0)
        return self.probe_seconds + cost <= self.budget * self.decode_seconds

    # ---- observations -----------------------------------------------------------------------
    def update(self, k: int, n: int) -> None:
        """A round drafted k and accepted n (`PositionAcceptance.update`)."""
        self.acceptance.update(k, n)

    def forget_pending(self) -> None:
        """Rounds chosen but never to be observed (a batch dropped them) leave the queue."""
        self._queue.clear()

    def observe(self, drafted: int, n: int | list[int], seconds: float | None, context: int = 0,
                first_use: bool = False, steady: bool = True) -> None:
        """One finished round: `drafted` drafts (after p-min/n-min), n accepted (a batch's round:
        one count per drafting row, each a sample of acceptance), `seconds` of wall time since the
        previous round's host read (None: no sample of its time, e.g. a batch whose rows changed
        since the round before); `first_use` when it ran a shape for the first
        time (its time includes compiling and is not a sample of t(k)); `steady` False when its
        neighbours drafted otherwise: with device-resident rounds the host queues round r+1 before
        it reads round r and `mx.async_eval` waits for the device, so a round's interval carries its
        neighbours' work (a plain round between drafting rounds timed like one, and auto saw
        drafting as free at acceptance 0.5 on the H200)."""
        k, probe = self._queue.popleft() if self._queue else (drafted, False)
        for each in (n if isinstance(n, list) else [n]):
            self.update(drafted, each)
        if seconds is None:
            return
        b = context_bucket(context)
        if not first_use:  # the probe budget is a share of decode time, compiles excluded
            self.decode_seconds += seconds
        if first_use:
            self.times.record_first_use(b, k, seconds)
            if probe:  # its compile is reported as compile time; the budget is charged the estimate
                t0 = self.step_seconds(b)
                self.probe_seconds += max(self.round_steps(1, b) - 1.0, 0.0) * (t0 or 0.0)
            return
        if probe:
            t0 = self.step_seconds(b)
            self.probe_seconds += max(seconds - (t0 or seconds), 0.0)
            self.times.record_probe(seconds)
            return
        self.times.record(b, k, seconds, steady)

    # ---- reporting --------------------------------------------------------------------------
    def compile_seconds(self) -> float:
        """Time of first-use rounds beyond what the same round measured once warm."""
        return self.times.compile_seconds()

    def measured_round_steps(self) -> dict[int, float]:
        """{k: t(k)/t(0)} for the k's this run timed (in the context range timed most)."""
        return self.times.measured()

    def measured_rounds(self) -> dict[int, int]:
        """{k: rounds timed} behind `measured_round_steps` (what the store weighs them by)."""
        return self.times.measured_rounds()

    def measured_acceptance(self) -> list[float] | None:
        """Per draft position, the acceptance this run saw (its share of accepted tests, where tested
        often enough), worth storing for the next run once it drafted `_EXPLORE_AFTER` rounds or
        more (else None: the prior still speaks)."""
        return [round(a, 4) for a in self.acceptance.run_means()] if self.drafting_rounds >= _EXPLORE_AFTER else None

    def message(self) -> str | None:
        """Why auto did not draft, when it did not (shown once, in the stats)."""
        if self.drafting_rounds or not (self.rounds or not self.can_win):
            return None
        r1 = self.round_steps(1)
        if not self.can_win:  # a run decided not to draft at all (`SpeculativeDecoder.drafting`)
            how = "measured" if self.times.drafting_measured() else "stored/default estimate"
            return (f"auto: drafting cannot pay on this device: a round with one draft (2-token verify + draft "
                    f"step) costs {r1:.2f} plain steps ({how}), more than the 2 tokens it can yield")
        return (f"auto: drafts were not accepted often enough to pay (draft 1 accepted with p ~ "
                f"{self.alphas()[0]:.2f}; a one-draft round costs {r1:.2f} plain steps)")

    def stats(self) -> dict:
        n = self.plain_why["no_gain"]
        why = {"auto_plain_rounds": dict(self.plain_why)}
        if n:  # what auto believed in those rounds: drafting's best rate over plain's, draft 1's acceptance
            why["auto_no_gain_rate"] = round(self._no_gain[0] / n, 3)
            why["auto_no_gain_acceptance"] = round(self._no_gain[1] / n, 3)
        return {**why, "auto_round_steps": {str(k): round(v, 3) for k, v in self.measured_round_steps().items()},
                "auto_probes": self.probes, "auto_probe_seconds": self.probe_seconds,
                "auto_probe_share": self.probe_seconds / self.decode_seconds if self.decode_seconds else 0.0}
