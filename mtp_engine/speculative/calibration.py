"""Per model and device: what a round with k drafts costs, in plain decode steps, as measured by
earlier runs (`costs.json` in the folder `EngineOptions.cache_dir` names: the model's
`options.cache_path`), and the acceptance per draft position the last run ended at. They seed
n-max auto's estimates before the current run has measured anything (`seed_costs` completes a
stored entry from the device's prior); nothing is measured before the first token.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx

from .costmodel import Costs

MAX_K = 8  # longest draft n-max auto considers (speculative/scheduler.py's AUTO_MAX)
# stored timed rounds a run's own are weighed against, at most: a device whose costs changed is
# followed within a few runs
KEPT_SAMPLES = 32


def cache_file(folder: Path) -> Path:
    return Path(folder) / "costs.json"


def costs_key(model_path: str, model) -> str:
    """Per model file (path, size, mtime) and device: costs are properties of both."""
    try:
        st = os.stat(model_path)
        ident = f"{os.path.abspath(model_path)}:{st.st_size}:{int(st.st_mtime)}"
    except OSError:
        ident = f"{id(model)}"
    raw = f"{ident}|{mx.default_device()}|{mx.__version__}|{MAX_K}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def _read_all(folder: Path) -> dict:
    path = cache_file(folder)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def default_seed(gpu: bool | None = None, moe: bool = False) -> dict[int, float]:
    """Round costs in plain steps before anything was measured on this model and device. On a GPU a
    dense model's device-resident round costs ~1.2 + 0.12 k steps (the 9B shape on an H100:
    t(k)/t(0) 1.29-1.42, 1.39-1.53, 1.45-1.64, 1.5-1.75 for k = 1..4); an MoE model's verify rows
    reach other experts, so its rounds grow faster (~1.05 + 0.35 k: the 35B-A3B shape's verify curve
    V = 1.37, 1.66, 1.96 for 2-4 rows). MLX's CPU backend costs ~S steps for S rows and ~0.3 per draft
    step (docs/benchmarks.md), where no draft length can pay."""
    if gpu is None:
        gpu = mx.default_device() == mx.gpu
    if gpu and moe:
        return {k: 1.05 + 0.35 * k for k in range(1, MAX_K + 1)}
    if gpu:
        return {k: 1.2 + 0.12 * k for k in range(1, MAX_K + 1)}
    return {k: 0.95 * (k + 1) + 0.3 * k + 0.05 for k in range(1, MAX_K + 1)}


def load(model_path: str, model, folder: Path) -> tuple[dict[int, float] | None, list[float] | None]:
    """(`load_seed`, `load_acceptance`) of this model and device from one read of the store (what
    a run of n-max auto starts from)."""
    d = _entry(model_path, model, folder)
    return _seed_of(d), _acceptance_of(d)


def load_seed(model_path: str, model, folder: Path) -> dict[int, float] | None:
    """The stored round costs {k: steps} of this model and device, or None. Entries written by the
    old calibration pass (V(S), c, f) are converted: a round of k drafts costs V(k+1) + k c + f."""
    return _seed_of(_entry(model_path, model, folder))


def load_acceptance(model_path: str, model, folder: Path) -> list[float] | None:
    """Per draft position, the acceptance the last run on this model and device ended at, or None."""
    return _acceptance_of(_entry(model_path, model, folder))


def _entry(model_path: str, model, folder: Path) -> dict | None:
    if not model_path:
        return None
    d = _read_all(folder).get(costs_key(model_path, model))
    return d if isinstance(d, dict) else None


def _seed_of(d: dict | None) -> dict[int, float] | None:
    if d is None:
        return None
    try:
        if isinstance(d.get("round_steps"), dict):
            seed = {int(k): float(v) for k, v in d["round_steps"].items()}
        else:
            verify = {int(s): float(v) for s, v in d["verify"].items()}
            c, f = float(d.get("draft", 0.0)), float(d.get("fixed", 0.0))
            seed = {k: verify[k + 1] + k * c + f for k in range(1, MAX_K + 1) if k + 1 in verify}
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    seed = {k: v for k, v in seed.items() if 1 <= k <= MAX_K and v > 0}
    return seed or None


def _acceptance_of(d: dict | None) -> list[float] | None:
    acc = d.get("acceptance") if d is not None else None
    try:
        out = [float(a) for a in acc] if isinstance(acc, list) else None
    except (TypeError, ValueError):
        return None
    return out if out and all(0.0 <= a <= 1.0 for a in out) else None


def merge_costs(stored: dict[int, float], stored_rounds: dict[int, int], measured: dict[int, float],
                measured_rounds: dict[int, int]) -> tuple[dict[int, float], dict[int, int]]:
    """(costs, timed rounds) per draft length: a run's measured costs merged into the stored ones,
    each weighted by the rounds it was timed in (the stored by at most `KEPT_SAMPLES`; a length
    stored without a count by two): a run that timed a length in two rounds (an exploration, its
    samples beside changes of k) moves the stored cost by its share instead of replacing what many
    rounds measured, which could keep the next runs off the best length."""
    costs, rounds = dict(stored), {k: max(min(stored_rounds.get(k, 2), KEPT_SAMPLES), 0) for k in stored}
    for k, v in measured.items():
        n = max(int(measured_rounds.get(k, 1)), 1)
        old = rounds.get(k, 0)
        costs[k] = (costs.get(k, 0.0) * old + v * n) / (old + n)
        rounds[k] = old + n
    return costs, rounds


def save(model_path: str, model, round_steps: dict[int, float], step_ms: float | None, folder: Path,
         acceptance: list[float] | None = None, rounds: dict[int, int] | None = None) -> None:
    """Merges this run's measured round costs (`rounds`: the rounds each was timed in, else one
    each; `merge_costs`) and the acceptance per draft position it ended at into the store (a
    read-only home only costs the next run its seed)."""
    if not model_path or not (round_steps or acceptance):
        return
    data = _read_all(folder)
    key = costs_key(model_path, model)
    entry = data.get(key) if isinstance(data.get(key), dict) else {}
    try:
        old = {int(k): float(v) for k, v in entry.get("round_steps", {}).items()}
        old_rounds = {int(k): int(v) for k, v in entry.get("round_rounds", {}).items()}
    except (AttributeError, TypeError, ValueError):  # another program's entry: replaced
        old, old_rounds = {}, {}
    merged, merged_rounds = merge_costs(old, old_rounds, {int(k): float(v) for k, v in round_steps.items()},
                                        rounds or {})
    entry["round_steps"] = {str(k): round(v, 4) for k, v in sorted(merged.items())}
    entry["round_rounds"] = {str(k): n for k, n in sorted(merged_rounds.items())}
    if step_ms:
        entry["step_ms"] = round(step_ms, 4)
    if acceptance:
        entry["acceptance"] = [round(float(a), 4) for a in acceptance]
    data[key] = entry
    try:
        path = cache_file(folder)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)  # concurrent runs: one of them wins, none sees a half-written file
    except OSError:
        pass


def seed_costs(costs: Costs | dict | None, prior: dict[int, float]) -> dict[int, float]:
    """Round costs {k: plain steps} a run starts from: the stored ones (or the old calibration's
    `Costs`), every length they lack taken from `prior` (`_complete`); the prior when none."""
    if costs is None:
        return dict(prior)
    if isinstance(costs, Costs):
        seed = {k: costs.verify[k + 1] + k * costs.draft + costs.fixed for k in range(1, MAX_K + 1)
                if k + 1 in costs.verify}
    else:
        seed = {int(k): float(v) for k, v in costs.items() if 1 <= int(k) <= MAX_K}
    return _complete(seed, prior) if seed else dict(prior)


def _complete(seed: dict[int, float], prior: dict[int, float]) -> dict[int, float]:
    """A stored entry holds only the draft lengths a run measured ({2: .., 4: ..}): the others take
    the device prior moved by the nearest stored length's error against it, so every k has a cost
    (a missing one crashed the first round's choice) and an unmeasured longer draft stays in reach."""
    out = dict(seed)
    for k in range(1, MAX_K + 1):
        if k not in out and k in prior:
            near = min(seed, key=lambda kk: (abs(kk - k), kk))
            out[k] = max(prior[k] + seed[near] - prior.get(near, seed[near]), 1.0)
    return dict(sorted(out.items()))
