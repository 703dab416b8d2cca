"""n-max auto: the draft-length choice follows the cost model, learns acceptance online, never
changes greedy output, and caches the device's measured costs."""
from __future__ import annotations

import json

import pytest

from conftest import TINY, need
from mtp_engine import generate, load
from mtp_engine.cli import main
from mtp_engine.costmodel import Costs
from mtp_engine.spec import scheduler as sch
from mtp_engine.spec.scheduler import DraftLengthScheduler


def _costs(v, c=0.1, f=0.05, k=8):
    return Costs(step_ms=1.0, verify={s: v(s) for s in range(1, k + 2)}, draft=c, fixed=f)


def test_cheap_verify_and_high_acceptance_draft_long():
    s = DraftLengthScheduler(_costs(lambda n: 1.0 + 0.02 * n, c=0.02))
    for _ in range(50):
        s.update(8, 8)
    assert s.next_k() >= 6


def test_linear_verify_cost_means_plain_steps():
    # a CPU-like device: verifying S tokens costs S steps; drafting can never pay
    s = DraftLengthScheduler(_costs(lambda n: float(n), c=0.3))
    for _ in range(10):
        s.update(3, 1)
    assert s.next_k() == 0


def test_no_probes_where_even_perfect_drafts_cannot_win():
    """V(2) + c >= 2 (measured on the 2-core CPU: 1.76 + 0.29): no k beats plain even at acceptance
    1, so the scheduler never drafts, not even a probe, however long it runs."""
    s = DraftLengthScheduler(_costs(lambda n: 0.9 * n, c=0.29))
    assert not s.can_win
    assert all(s.next_k() == 0 for _ in range(1000))
    assert DraftLengthScheduler(_costs(lambda n: 0.8 * n, c=0.1)).can_win


def test_falling_acceptance_shortens_drafts_and_probes_while_plain():
    s = DraftLengthScheduler(_costs(lambda n: 1.0 + 0.15 * n, c=0.15))
    for _ in range(40):
        s.update(4, 4)
    long_k = s.next_k()
    for _ in range(200):
        s.update(1, 0)
    assert s.next_k() < long_k
    chosen = [s.next_k() for _ in range(sch._PROBE_EVERY + 1)]
    assert 0 in chosen and 1 in chosen  # plain rounds, and a probe to notice when drafts recover


def test_update_counts_only_tested_positions():
    s = DraftLengthScheduler(_costs(lambda n: float(n)))
    before = s.alphas()
    s.update(4, 1)  # position 1 accepted, 2 rejected, 3-4 untested
    after = s.alphas()
    assert after[0] > before[0] and after[1] < before[1] and after[2:] == before[2:]


@pytest.fixture(scope="module")
def tiny():
    return load(need(TINY / "qwen35-mtp-tiny-f32.gguf"))


def test_auto_is_lossless_and_reports_its_choices(tiny):
    ref = json.loads(need(TINY / "qwen35-mtp-tiny-f32.gguf.ref.json").read_text())
    for p in ref["prompts"][:2]:
        base = generate(p["prompt_ids"], tiny, max_tokens=32, ignore_eos=True)
        auto = generate(p["prompt_ids"], tiny, max_tokens=32, ignore_eos=True, spec="draft-mtp")
        assert auto.token_ids == base.token_ids
        st = auto.stats
        assert st["n_max"] == "auto" and sum(st["draft_length_histogram"].values()) == st["rounds"]
        assert len(st["acceptance_per_position"]) == sch.AUTO_MAX


def test_costs_are_measured_once_and_cached_on_disk(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("MTP_ENGINE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sch, "_costs_memo", {})
    calls = []
    real = sch.measure

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(sch, "measure", counting)
    c1 = sch.device_costs(tiny.model, tiny.path)
    monkeypatch.setattr(sch, "_costs_memo", {})
    c2 = sch.device_costs(tiny.model, tiny.path)  # from the file this time
    assert len(calls) == 1 and c1.verify == c2.verify
    stored = json.loads((tmp_path / "costs.json").read_text())
    assert len(stored) == 1 and set(next(iter(stored.values()))) >= {"step_ms", "verify", "draft", "fixed"}


def test_cli_accepts_auto_and_rejects_words(capsys):
    p = str(need(TINY / "qwen35-mtp-tiny-f32.gguf"))
    assert main(["generate", "-m", p, "-p", "To be", "-n", "6", "--spec-type", "draft-mtp",
                 "--spec-draft-n-max", "auto", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["n_max"] == "auto"
    with pytest.raises(SystemExit) as e:
        main(["generate", "-m", p, "-p", "x", "--spec-type", "draft-mtp", "--spec-draft-n-max", "many"])
    assert e.value.code == 2


def test_probes_back_off_while_plain_steps_stay_right():
    # drafting could win at high acceptance, but every draft is rejected
    s = DraftLengthScheduler(_costs(lambda n: 1.0 + 0.3 * n, c=0.1))
    for _ in range(10):
        s.update(3, 0)
    probes = []
    for i in range(2000):
        k = s.next_k()
        if k:
            probes.append(i)
            s.update(k, 0)  # each probe is rejected
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[0] < gaps[-1] <= sch._PROBE_MAX + 1 and len(probes) < 2000 / sch._PROBE_EVERY / 2
