"""Round statistics (speculative/stats.py) against counts worked out by hand."""
from __future__ import annotations

from mtp_engine.speculative.stats import RoundCounts


def test_known_rounds_give_known_statistics():
    c = RoundCounts()
    for k, n in [(3, 3), (3, 0), (2, 1), (0, 0)]:  # all accepted, first rejected, one of two, plain
        c.record(k, n)
    s = c.stats(4)
    assert (s["rounds"], s["drafting_rounds"], s["drafted"], s["accepted"]) == (4, 3, 8, 4)
    assert s["acceptance_rate"] == 4 / 8
    assert s["mean_accepted_length"] == 4 / 4
    assert s["tokens_per_round"] == (4 + 4) / 4
    # position 1: drafted in 3 rounds, accepted in 2; position 2: 3 and 1; position 3: 2 and 1
    assert s["acceptance_per_position"] == [2 / 3, 1 / 3, 1 / 2, None]
    assert s["accepted_length_histogram"] == {"0": 2, "1": 1, "2": 0, "3": 1, "4": 0}


def test_positions_default_to_the_longest_draft_seen():
    c = RoundCounts()
    assert c.stats()["acceptance_per_position"] == [] and c.stats()["mean_accepted_length"] == 0.0
    c.record(2, 2)
    assert c.stats()["acceptance_per_position"] == [1.0, 1.0]
