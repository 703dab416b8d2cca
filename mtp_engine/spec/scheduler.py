"""Adaptive draft length (`n-max auto`): each round drafts the k that maximises expected tokens
per second, from the device's measured costs and the acceptance tracked online.

Expected tokens of a round with k drafts: E(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_j, with alpha_j
the probability that draft j is accepted given drafts 1..j-1 were. Cost in decode steps:
V(k+1) + k*c + f for k >= 1; k = 0 is a plain step (cost 1, no MTP work at all).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx

from ..costmodel import Costs, measure
from ..model.qwen35 import Qwen35Model

AUTO_MAX = 8  # longest draft auto considers; V(S) is measured up to AUTO_MAX + 1
_PRIOR = (3.0, 1.0)  # Beta(accepted, rejected) prior per position: optimistic, so drafting is tried
_PROBE_EVERY = 24  # plain rounds before the first probe while k = 0, so a change in the text is noticed
_PROBE_MAX = 384  # probes that confirm k = 0 double the interval up to this: each costs a catch-up
_costs_memo: dict[str, Costs] = {}


def _cache_file() -> Path:
    base = os.environ.get("MTP_ENGINE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "mtp-engine")
    return Path(base) / "costs.json"


def costs_key(model_path: str, model: Qwen35Model) -> str:
    """Per model file (path, size, mtime) and device: costs are properties of both."""
    try:
        st = os.stat(model_path)
        ident = f"{os.path.abspath(model_path)}:{st.st_size}:{int(st.st_mtime)}"
    except OSError:
        ident = f"{id(model)}"
    raw = f"{ident}|{mx.default_device()}|{mx.__version__}|{AUTO_MAX}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def device_costs(model: Qwen35Model, model_path: str = "") -> Costs:
    """The model's costs on this device: from memory, else from the on-disk cache, else measured
    (a few seconds) and stored."""
    key = costs_key(model_path, model) if model_path else f"mem-{id(model)}|{mx.default_device()}"
    if key in _costs_memo:
        return _costs_memo[key]
    path = _cache_file()
    stored = {}
    if model_path and path.exists():
        try:
            stored = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            stored = {}
    if key in stored:
        d = stored[key]
        costs = Costs(d["step_ms"], {int(k): v for k, v in d["verify"].items()}, d["draft"], d["fixed"])
    else:
        costs = measure(model, max_verify=AUTO_MAX + 1, repeats=5)
        costs.fixed = 0.05  # sampling, sync, acceptance, rollback: measured ~2-5% of a step (docs/benchmarks.md)
        if model_path:
            stored[key] = costs.to_json()
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(stored, indent=1))
            except OSError:
                pass  # a read-only home only costs a re-measurement next time
    _costs_memo[key] = costs
    return costs


class DraftLengthScheduler:
    """Chooses k each round; learns acceptance per draft position from the rounds it sees."""

    def __init__(self, costs: Costs, k_max: int = AUTO_MAX):
        self.costs = costs
        self.k_max = min(k_max, max(costs.verify) - 1)
        self.acc = [_PRIOR[0]] * self.k_max
        self.rej = [_PRIOR[1]] * self.k_max
        self.decay = 0.98  # forget old rounds: acceptance changes with the text
        self._plain_streak = 0
        self._probe_every = _PROBE_EVERY
        self._probing = False
        self.chosen: list[int] = []
        # if even fully accepted drafts cannot beat a plain step on this device (a verify of S rows
        # costs about S steps, as on MLX's CPU backend), drafting and its probes only cost time
        self.can_win = any((k + 1) / (costs.verify[k + 1] + k * costs.draft + costs.fixed) > 1.0
                           for k in range(1, self.k_max + 1))

    def alphas(self) -> list[float]:
        return [a / (a + r) for a, r in zip(self.acc, self.rej)]

    def expected_rate(self, k: int) -> float:
        """Expected tokens per decode-step of time for a round with k drafts."""
        if k == 0:
            return 1.0
        e, run = 1.0, 1.0
        for a in self.alphas()[:k]:
            run *= a
            e += run
        c = self.costs
        return e / (c.verify[k + 1] + k * c.draft + c.fixed)

    def next_k(self) -> int:
        if not self.can_win:
            self.chosen.append(0)
            return 0
        k = max(range(self.k_max + 1), key=self.expected_rate)
        if self._probing:  # the last round was a probe: judge it
            self._probing = False
            self._probe_every = min(self._probe_every * 2, _PROBE_MAX) if k == 0 else _PROBE_EVERY
        if k == 0:
            self._plain_streak += 1
            if self._plain_streak >= self._probe_every:
                self._plain_streak = 0
                self._probing = True
                k = 1
        else:
            self._plain_streak = 0
        self.chosen.append(k)
        return k

    def update(self, k: int, n: int) -> None:
        """A round drafted k and accepted n: positions 1..n were accepted, n+1 (if drafted) rejected,
        later positions were never tested."""
        for i in range(min(n + 1, k)):
            self.acc[i] *= self.decay
            self.rej[i] *= self.decay
            if i < n:
                self.acc[i] += 1.0
            else:
                self.rej[i] += 1.0
