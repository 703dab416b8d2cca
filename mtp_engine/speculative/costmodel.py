"""The speculative-decoding cost model, measured on the loaded model and device.

With a plain decode step costing 1, V(S) is the cost of a trunk forward over S tokens (a verify of
S-1 drafts), c the cost of one draft step (MTP layer plus output head) and f the fixed per-round
cost (sampling, the host sync, acceptance, rollback, bookkeeping). For per-position acceptance
a_i (the probability that the first i drafts are all accepted), a round emits E = 1 + sum a_i
tokens, and draft-mtp's speedup over plain decoding is E / (V(k+1) + k*c + f).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import mlx.core as mx

from ..model.qwen35 import Qwen35Model
from ..model.step import Pass


@dataclass
class Costs:
    """Measured costs; `step_ms` in milliseconds, everything else relative to it."""

    step_ms: float
    verify: dict[int, float] = field(default_factory=dict)  # S -> V(S)
    draft: float = 0.0  # c
    fixed: float = 0.0  # f

    def to_json(self) -> dict:
        d = asdict(self)
        d["verify"] = {str(k): v for k, v in self.verify.items()}
        return d


def expected_tokens(acceptance_per_position: list[float | None], k: int) -> float:
    """E = 1 + sum of the probabilities that the first i drafts survive, i = 1..k."""
    return 1.0 + sum(a or 0.0 for a in acceptance_per_position[:k])


def predict_speedup(costs: Costs, acceptance_per_position: list[float | None], k: int) -> float:
    """E(a, k) / (V(k+1) + k*c + f); k = 0 is plain decoding (1.0)."""
    if k == 0:
        return 1.0
    v = costs.verify.get(k + 1)
    if v is None:
        raise ValueError(f"V({k + 1}) was not measured")
    return expected_tokens(acceptance_per_position, k) / (v + k * costs.draft + costs.fixed)


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up (first-use allocation, kernel selection)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(model: Qwen35Model, max_verify: int, context: int = 64, repeats: int = 10,
            fixed_ms: float | None = None) -> Costs:
    """Measures step time, V(1..max_verify) and c on `model` at a context of `context` tokens.
    `fixed_ms` (per-round overhead, e.g. from a profiled run) sets f when given."""
    cache = model.make_cache()
    # varied token ids: on MoE models a batch of identical tokens would route to one expert set
    # and understate what a verify really reads
    ids_all = mx.random.randint(0, model.cfg.vocab_size, (1, context + max_verify + 1), key=mx.random.key(7))
    mx.eval(model.forward(ids_all[:, :context], cache), *cache.arrays())
    tok = ids_all[:, context:context + 1]

    def step():  # a plain decode step: no capture
        snap = cache.snapshot()
        h = model.forward(tok, cache)
        lg = model.logits(h[0, -1])
        mx.eval(lg, *cache.arrays())
        cache.restore(snap)

    step_ms = _median_ms(step, repeats)
    costs = Costs(step_ms=step_ms)
    for s in range(1, max_verify + 1):
        ids = ids_all[:, context:context + s]

        def verify():
            h = model.forward(ids, cache, Pass.VERIFY)
            lg = model.logits(h[0])
            mx.eval(lg, *cache.arrays())
            cache.rollback(0)

        costs.verify[s] = _median_ms(verify, repeats) / step_ms
    if model.mtp is not None:
        mcache = model.mtp.make_cache()
        h = mx.zeros((1, 1, model.cfg.hidden_size))
        mx.eval(model.mtp(model.embed_tokens(ids_all[:, :context]),
                          mx.zeros((1, context, model.cfg.hidden_size)), mcache))

        def draft():
            hm = model.mtp(model.embed_tokens(tok), h, mcache)
            d = mx.argmax(model.draft_logits(hm[0, 0]), axis=-1)
            mx.eval(d, *mcache.state())
            mcache.truncate(mcache.offset - 1)

        costs.draft = _median_ms(draft, repeats) / step_ms
    if fixed_ms is not None:
        costs.fixed = fixed_ms / step_ms
    return costs
