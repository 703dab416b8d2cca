"""What a sequence's speculative rounds drafted and accepted: one count for the decoder alone
(`decoder.SpeculativeDecoder`) and for a sequence in a batch (`batching.scheduler.Sequence`), so
both report the same statistics under the same keys."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class RoundCounts:
    """Counts of rounds, drafts and acceptances, per draft position too."""

    rounds: int = 0
    drafting_rounds: int = 0  # rounds that drafted at least one token (auto and p-min make others)
    drafted: int = 0
    accepted: int = 0
    position_drafted: list[int] = field(default_factory=list)  # per draft position: rounds that drafted it ...
    position_accepted: list[int] = field(default_factory=list)  # ... and accepted it
    histogram: Counter = field(default_factory=Counter)  # accepted drafts per round

    def record(self, k: int, n: int) -> None:
        """A round drafted k tokens and n of them were accepted."""
        self.rounds += 1
        self.drafting_rounds += int(k > 0)
        self.drafted += k
        self.accepted += n
        if k > len(self.position_drafted):
            grow = k - len(self.position_drafted)
            self.position_drafted += [0] * grow
            self.position_accepted += [0] * grow
        for i in range(k):
            self.position_drafted[i] += 1
            self.position_accepted[i] += int(i < n)
        self.histogram[n] += 1

    def stats(self, k_max: int | None = None) -> dict:
        """The statistics keys of `--json` and the API (`k_max`: positions reported, and the
        histogram's range; default: the longest draft seen)."""
        r = max(self.rounds, 1)
        positions = len(self.position_drafted) if k_max is None else k_max
        drafted = (self.position_drafted + [0] * positions)[:positions]
        accepted = (self.position_accepted + [0] * positions)[:positions]
        return {
            "rounds": self.rounds,
            "drafting_rounds": self.drafting_rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            # nothing drafted: no rate (0.0 read as "every draft rejected")
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "mean_accepted_length": self.accepted / r,
            "tokens_per_round": (self.accepted + self.rounds) / r,
            "acceptance_per_position": [a / d if d else None for a, d in zip(accepted, drafted)],
            "drafted_per_position": drafted,
            "accepted_per_position": accepted,
            "accepted_length_histogram": {str(i): self.histogram.get(i, 0) for i in range(positions + 1)},
        }
