"""What n-max auto believes about acceptance: per draft position j, the probability that draft j
is accepted given drafts 1..j-1 were, learned from the rounds it sees.

Why per position: a long draft pays only if its later positions are accepted too, and those are
tested only when the earlier ones pass; counts per position, decayed so a change of text shows
within tens of rounds, with a prior that fades like an old observation, keep a position drafted
rarely at about the estimate of the one before it instead of at a lucky or unlucky sample.
"""
from __future__ import annotations

PRIOR = (3.0, 1.0)  # Beta(accepted, rejected) of position 1: optimistic, so drafting is tried
INHERIT = 8.0  # prior strength of position j > 1 around position j-1's estimate
DECAY = 0.95  # per observation: a change of text shows within tens of rounds
STARTED = 4.0  # prior strength of a position started from an earlier run's estimate (`start`)
THIN = 32  # tests of draft 1 in this run below which its estimate is thin evidence (`optimistic`)


class PositionAcceptance:
    """Decayed accept / reject counts per draft position, 1..k_max."""

    def __init__(self, k_max: int, decay: float = DECAY, start: list[float] | None = None):
        """`start`: per position, what an earlier run on this model ended at (the stored
        calibration's), the prior's centre instead of the default's; positions past it inherit."""
        self.start = [min(max(float(a), 0.01), 0.99) for a in start or []][:k_max]
        self.acc = [0.0] * k_max  # decayed counts per draft position (prior in `alphas`)
        self.rej = [0.0] * k_max
        self.seen = [0.0] * k_max  # decayed observations per position (the prior fades with them)
        self.tested = [0] * k_max  # rounds that tested each position, undecayed (`optimistic`, `run_means`)
        self.passed = [0] * k_max  # of those, the rounds that accepted it
        self.decay = decay
        self._alphas: list[float] | None = None  # kept until the next update (asked ~150 times a choice)

    def alphas(self) -> list[float]:
        """Per position j, the probability that draft j is accepted given 1..j-1 were: the decayed
        counts, with a prior centred on position j-1's estimate (position 1: 0.75, strength 4; later
        positions strength 8), so a position drafted rarely is expected to do about as well as the
        one before it, and one unlucky round does not rule a long draft out; a position an earlier
        run measured (`start`) is centred there instead (strength 4)."""
        if self._alphas is None:
            self._alphas = self._chain(0.0)
        return list(self._alphas)

    def optimistic(self, z: float = 1.0) -> list[float]:
        """The estimates with draft 1's raised `z` standard deviations (of the Beta posterior over
        the rounds this run tested it in, the prior's weight added) while fewer than `THIN` rounds
        tested it, but never above where the run started (the prior's centre, or the stored
        estimate), the later positions' priors centred on it: what acceptance could still be after
        few rounds, not a hope beyond what was ever believed. A run that stops drafting learns
        nothing more, so stopping asks that even this does not pay: three unlucky rounds at
        acceptance 0.5 (p = 1/8) took the estimate from a stored 0.61 to 0.33 and a 128-token run
        plain, at 0.94x where drafting 2 gave 1.18x (H100, 9B shape)."""
        return self._chain(z)

    def _chain(self, z: float) -> list[float]:
        out, prior, strength = [], PRIOR[0] / sum(PRIOR), sum(PRIOR)
        for j, (a, r, seen) in enumerate(zip(self.acc, self.rej, self.seen)):
            if j < len(self.start):
                prior, strength = self.start[j], STARTED
            w = strength * self.decay ** seen  # the prior fades like an old observation
            mean = (a + w * prior) / (a + r + w)
            if j == 0 and z and self.tested[0] < THIN:
                n = self.tested[0] + w
                mean = max(mean, min(mean + z * (mean * (1.0 - mean) / (n + 1.0)) ** 0.5, prior))
            prior = mean
            out.append(mean)
            strength = INHERIT
        return out

    def run_means(self, least: int = 8) -> list[float]:
        """Per position, the share of this run's tests that accepted it (undecayed: what a next
        run on this model should start from, not the last few rounds' luck); a position tested
        fewer than `least` times keeps its estimate."""
        est = self.alphas()
        return [p / t if t >= least else e for p, t, e in zip(self.passed, self.tested, est)]

    def expected_tokens(self, k: int, alphas: list[float] | None = None) -> float:
        """Tokens a round of k drafts is expected to emit (its accepted drafts and the bonus token),
        at `alphas` (default: the estimates)."""
        e, run = 1.0, 1.0
        for a in (self.alphas() if alphas is None else alphas)[:k]:
            run *= a
            e += run
        return e

    def update(self, k: int, n: int) -> None:
        """A round drafted k and accepted n: positions 1..n were accepted, n+1 (if drafted) rejected,
        later positions were never tested: their old counts age all the same, so what a few long
        drafts once saw fades back to the estimate of the positions before them."""
        if k <= 0:
            return
        self._alphas = None
        tested = min(n + 1, k, len(self.acc))
        for i in range(len(self.acc)):
            self.acc[i] *= self.decay
            self.rej[i] *= self.decay
            self.seen[i] *= self.decay
            if i < tested:
                self.seen[i] += 1.0
                self.tested[i] += 1
                if i < n:
                    self.acc[i] += 1.0
                    self.passed[i] += 1
                else:
                    self.rej[i] += 1.0
