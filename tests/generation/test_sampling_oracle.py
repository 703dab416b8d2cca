"""Independent oracles for sampling and acceptance: a float64 NumPy statement of
llama.cpp's filter chain that `sampling.distribution` must match, the rejection samplers (host and
device) checked against the exact target distribution rather than against plain sampling, and
acceptance counted on hand-built rounds (all k accepted, the first rejected, one in the middle)."""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mtp_engine.generation.sampling import SamplerConfig, distribution
from mtp_engine.speculative.round import accept_greedy_device, accept_sampling_device
from tests.sampling_reference import reference_distribution


CONFIGS = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=1.5, top_k=5),
           dict(temperature=0.8, top_p=0.9), dict(temperature=1.0, top_p=0.5), dict(temperature=1.0, min_p=0.05),
           dict(temperature=0.6, min_p=0.2), dict(temperature=1.2, top_k=40, top_p=0.95, min_p=0.05),
           dict(temperature=1.0, top_k=1), dict(temperature=0.9, top_p=1e-6), dict(temperature=2.0, top_k=3, min_p=0.3)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_distribution_matches_the_float64_reference(cfg):
    rng = np.random.default_rng(0)
    for scale in (0.5, 3.0, 12.0):  # flat, typical and peaked logits
        logits = (rng.standard_normal((4, 97)) * scale).astype(np.float32)
        got = np.array(distribution(mx.array(logits), SamplerConfig(**cfg)))
        for row, g in zip(logits, got):
            ref = reference_distribution(row, **cfg)
            # the same tokens survive the filters (a float32 probability may underflow to 0)
            assert np.all(ref[g > 0] > 0) and np.all(ref[g == 0] < 1e-37), (cfg, scale)
            np.testing.assert_allclose(g, ref, atol=2e-6, rtol=2e-5)


def test_the_reference_itself_on_hand_computed_cases():
    """The oracle pinned by hand: probabilities 0.5, 0.3, 0.15, 0.05 (logits their logs)."""
    logits = np.log([0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(reference_distribution(logits, 1.0), [0.5, 0.3, 0.15, 0.05])
    np.testing.assert_allclose(reference_distribution(logits, 1.0, top_p=0.79), [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    np.testing.assert_allclose(reference_distribution(logits, 1.0, top_p=0.81), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    np.testing.assert_allclose(reference_distribution(logits, 1.0, min_p=0.3), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    np.testing.assert_allclose(reference_distribution(logits, 1.0, min_p=0.31), [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    np.testing.assert_allclose(reference_distribution(logits, 1.0, top_k=2), [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    t = reference_distribution(logits, 0.5)  # p^(1/T) renormalised
    np.testing.assert_allclose(t, np.array([0.5, 0.3, 0.15, 0.05]) ** 2 / np.sum(np.array([0.5, 0.3, 0.15, 0.05]) ** 2))


# ---- rejection sampling against the exact target ------------------------------------------------
P = np.array([[0.40, 0.30, 0.20, 0.10, 0.00],   # target rows: after the context, after d1, after d1 d2
              [0.05, 0.15, 0.50, 0.20, 0.10],
              [0.25, 0.25, 0.25, 0.15, 0.10]])
Q = np.array([[0.10, 0.60, 0.10, 0.10, 0.10],   # the drafter's rows (a poor, overconfident drafter)
              [0.00, 0.10, 0.80, 0.10, 0.00]])
TRIALS = 6000


def _chi2_ok(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Pearson chi-square goodness of fit at p > 1e-4 (a wrong sampler fails by hundreds of sigma)."""
    n = counts.sum()
    m = probs > 0
    assert counts[~m].sum() == 0, "a token of probability 0 was emitted"
    stat = float(np.sum((counts[m] - n * probs[m]) ** 2 / (n * probs[m])))
    dof = int(m.sum()) - 1
    # Wilson-Hilferty: chi2(dof) quantile at 1 - 1e-4
    z = 3.719
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < crit


def _draws(sample_round) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """First emitted token's counts, second emitted token's counts given d1 was accepted, and how
    many drafts were accepted, over TRIALS rounds whose drafts are drawn from Q."""
    rng = np.random.default_rng(1)
    first, second, accepted = np.zeros(5), np.zeros(5), np.zeros(3)
    for t in range(TRIALS):
        drafts = np.array([rng.choice(5, p=Q[0]), rng.choice(5, p=Q[1])])
        n, emitted = sample_round(drafts, t)
        accepted[n] += 1
        first[emitted[0]] += 1
        if n >= 1:
            second[emitted[1]] += 1
    return first, second, accepted


def test_rejection_sampling_emits_the_target_distribution():
    """Lossless: whatever the drafter, the first emitted token is distributed as P[0] and, once d1
    is kept, the next as P[1]; a draft is kept with probability sum(min(P, Q)) (0.5 for row 0)."""
    p, q = mx.array(P, mx.float32)[None], mx.array(Q, mx.float32)[None]  # a round of one row
    live = mx.array([[True, True]])

    def round_(drafts, t):
        n, emitted = accept_sampling_device(mx.array(drafts, mx.int32)[None], p, q, live, mx.random.key(t))
        return n.item(), np.array(emitted)[0].tolist()
    first, second, accepted = _draws(round_)
    assert _chi2_ok(first, P[0]), first / TRIALS
    assert _chi2_ok(second, P[1]), second / second.sum()
    keep1 = np.minimum(P[0], Q[0]).sum()  # 0.5
    assert abs(accepted[1:].sum() / TRIALS - keep1) < 4 * math.sqrt(keep1 * (1 - keep1) / TRIALS)


# ---- greedy acceptance on hand-built rounds ------------------------------------------------------
ROUNDS = [  # drafts, the target's argmax per verify row, accepted, emitted
    ([5, 6, 7], [5, 6, 7, 9], 3, [5, 6, 7, 9]),   # every draft accepted: the bonus token follows
    ([5, 6, 7], [1, 6, 7, 9], 0, [1]),            # the first rejected
    ([5, 6, 7], [5, 2, 7, 9], 1, [5, 2]),         # one in the middle
    ([5, 6, 7], [5, 6, 3, 9], 2, [5, 6, 3]),      # the last rejected
    ([4], [4, 8], 1, [4, 8]),
]


@pytest.mark.parametrize("drafts,target,n,emitted", ROUNDS)
def test_greedy_acceptance_on_hand_built_rounds(drafts, target, n, emitted):
    v = 16
    scored = mx.array(np.eye(v, dtype=np.float32)[target])  # row i's argmax is target[i]
    k = len(drafts)
    d = mx.array(drafts, mx.int32)[None]  # a round of one row
    got_n, got = accept_greedy_device(d, scored[None], mx.ones((1, k), mx.bool_))
    assert got_n.tolist() == [n] and np.array(got)[0].tolist()[:n + 1] == emitted
    # drafts that do not count (p-min, n-min) are never accepted, even when they match
    cut_n, cut = accept_greedy_device(d, scored[None], (mx.arange(k) < min(n, 1))[None])
    assert cut_n.tolist() == [min(n, 1)] and np.array(cut)[0].tolist()[min(n, 1)] == target[min(n, 1)]


def test_acceptance_over_rows_is_each_rows_alone():
    """A batch's round accepts every row by its own drafts, targets and live drafts: the rows of
    one call equal each row's round of one (greedy and sampled, same key per row count)."""
    rows = [r for r in ROUNDS if len(r[0]) == 3]
    v = 16
    drafts = mx.array([r[0] for r in rows], mx.int32)
    scored = mx.array(np.stack([np.eye(v, dtype=np.float32)[r[1]] for r in rows]))
    live = mx.array([[True, True, True], [True, True, True], [True, False, False], [False, False, False]])
    n, emitted = accept_greedy_device(drafts, scored, live)
    for b in range(len(rows)):
        n1, e1 = accept_greedy_device(drafts[b:b + 1], scored[b:b + 1], live[b:b + 1])
        assert n[b].item() == n1.item() and emitted[b].tolist() == e1[0].tolist()
    assert n.tolist() == [3, 0, 1, 0]
    # sampled: every row lossless on its own, whatever the others hold
    p = mx.array(np.broadcast_to(P, (2, *P.shape)).copy(), mx.float32)
    q = mx.array(np.broadcast_to(Q, (2, *Q.shape)).copy(), mx.float32)
    n, emitted = accept_sampling_device(mx.array([[0, 1], [2, 2]], mx.int32), p, q,
                                        mx.array([[True, True], [False, False]]), mx.random.key(1))
    assert emitted.shape == (2, 3) and n[1].item() == 0  # a row whose drafts do not count keeps none


def test_rows_with_their_own_keys_draw_what_each_row_draws_alone():
    """A key per row [B, 2]: row b's acceptance and token are its round of one with key b, whatever
    the other rows hold, and each row stays lossless (the first emitted token distributed as P[0])."""
    p = mx.array(np.broadcast_to(P, (3, *P.shape)).copy(), mx.float32)
    q = mx.array(np.broadcast_to(Q, (3, *Q.shape)).copy(), mx.float32)
    drafts = mx.array([[0, 1], [2, 2], [1, 0]], mx.int32)
    live = mx.array([[True, True], [True, False], [True, True]])
    keys = mx.stack([mx.random.key(s) for s in (11, 12, 13)])
    n, emitted = accept_sampling_device(drafts, p, q, live, keys)
    for b in range(3):
        n1, e1 = accept_sampling_device(drafts[b:b + 1], p[:1], q[:1], live[b:b + 1], keys[b])
        assert n[b].item() == n1.item() and emitted[b].tolist() == e1[0].tolist()

    def round_(d, t):  # row 1 of three, each row with its own key
        ks = mx.stack([mx.random.key(3 * t + i) for i in range(3)])
        dd = mx.array([[4, 4], [int(x) for x in d], [3, 3]], mx.int32)
        n, emitted = accept_sampling_device(dd, p, q, mx.ones((3, 2), mx.bool_), ks)
        return n[1].item(), np.array(emitted)[1].tolist()
    first, _, _ = _draws(round_)
    assert _chi2_ok(first, P[0]), first / TRIALS


def test_row_sampling_mixes_greedy_and_sampling_rows():
    """`RowSampling`: a greedy row takes the greedy rule and its argmax, a sampling row the rejection
    sampler over its own distribution and keys; the draws a row takes are its sampler's
    (`Sampler.draws`), in the order a sequence alone takes them."""
    from mtp_engine.generation.sampling import Sampler, SamplerConfig, distribution
    from mtp_engine.speculative.row_sampling import RowSampling

    cfgs = [SamplerConfig(), SamplerConfig(temperature=0.7, top_k=3, seed=5), SamplerConfig(temperature=1.2, min_p=0.1,
                                                                                            seed=6)]
    samplers = [Sampler(c) for c in cfgs]
    rule = RowSampling(cfgs, [s.draws if not c.greedy else None for s, c in zip(samplers, cfgs)])
    logits = mx.random.normal((3, 4, 16), key=mx.random.key(2)) * 2
    drafts = mx.array([[1, 2, 3], [4, 5, 6], [7, 8, 9]], mx.int32)
    scored = rule.score(drafts, logits)
    assert mx.array_equal(scored[0], logits[0]).item()
    assert mx.allclose(scored[1], distribution(logits[1], cfgs[1])).item()
    head = mx.random.normal((3, 16), key=mx.random.key(4))
    d, qd, _ = rule.draft_pick(head, [])
    assert d[0].item() == int(mx.argmax(head[0]).item()) and qd.shape == (3, 16)
    assert all(qd[b, d[b]].item() > 0 for b in (1, 2))  # a drawn draft is one its distribution allows
    q = mx.stack([qd] * 3, axis=1)
    live = mx.ones((3, 3), mx.bool_)
    n, emitted = rule.accept(drafts, scored, q, live)
    n0, e0 = accept_greedy_device(drafts[:1], logits[:1], live[:1])
    assert n[0].item() == n0.item() and emitted[0].tolist() == e0[0].tolist()
    # the same draws through a sequence's own samplers, alone: the same tokens
    again = [Sampler(c) for c in cfgs]
    for b in (1, 2):
        key = again[b].draws
        key.next()  # the draft step's
        n1, e1 = accept_sampling_device(drafts[b:b + 1], scored[b:b + 1], q[b:b + 1], live[b:b + 1], key.next())
        assert n[b].item() == n1.item() and emitted[b].tolist() == e1[0].tolist()


# ---- the prompt cache's reuse rule at every boundary ---------------------------
class _Trunk:
    def snapshot(self) -> list:
        return []

    def fork(self, snap: list) -> "_Trunk":
        return _Trunk()

    def nbytes(self) -> int:
        return 0


@pytest.mark.parametrize("prefix,reused", [
    ([1, 2, 3], True),        # equal
    ([1, 2, 3, 4], True),     # one longer: the kept state is a prefix
    ([1, 2], False),          # one shorter: the kept state went past it
    ([1, 2, 4], False),       # differs only in the last token
    ([0, 2, 3], False),       # differs in the first
    ([], False),
])
def test_prompt_cache_reuses_only_an_exact_prefix(prefix, reused):
    from mtp_engine.generation.prompt_cache import PromptCache

    model = object()
    pc = PromptCache(slots=2)
    t = _Trunk()
    pc.keep(model, [1, 2, 3], t, "mtp")
    # while the generation that kept it runs, a taker gets its own fork and the state stays kept
    assert (pc.take(model, prefix, "mtp") is not None) == reused
    assert (pc.take(model, prefix, "mtp") is not None) == reused
    pc.release(t)  # that generation ended
    taken = pc.take(model, prefix, "mtp")
    assert (taken is not None) == reused
    if reused:  # taken: handed to one generation (its own caches), no longer kept
        assert taken.trunk is t and pc.take(model, prefix, "mtp") is None


def test_prompt_cache_needs_the_same_model_and_drafter():
    from mtp_engine.generation.prompt_cache import PromptCache

    a, b = object(), object()
    pc = PromptCache(slots=4)
    t = _Trunk()
    pc.keep(a, [1, 2, 3], t, "mtp")
    pc.release(t)
    assert pc.take(b, [1, 2, 3], None) is None  # another model
    assert pc.take(a, [1, 2, 3], "ngram") is None  # a drafter whose state was not kept
    assert pc.take(a, [1, 2, 3], None) is not None  # plain decoding needs only the trunk's
    for n in (2, 4):
        t = _Trunk()
        pc.keep(a, list(range(1, n + 1)), t, "mtp")
        pc.release(t)
    assert pc.take(a, [1, 2, 3, 4, 5], "mtp").tokens == [1, 2, 3, 4]  # the longest that fits
