"""The GGUF fuzzer (scripts/fuzz/fuzz_gguf.py): a fast subset of its cases must end in a clean
MTPEngineError or a model with finite logits, never a crash, hang or other exception; and the
harness itself must see crashes, hangs and exceptions when they happen (else a clean run means
nothing)."""
from __future__ import annotations

import pytest

from tests.conftest import TINY, load_script, need

fuzz_gguf = load_script("fuzz/fuzz_gguf")

N_CASES = 200


@pytest.fixture(scope="module")
def fixtures():
    for name in fuzz_gguf.SEED_NAMES:
        need(TINY / name)
    return TINY


@pytest.fixture(scope="module")
def subset(fixtures) -> fuzz_gguf.Report:
    return fuzz_gguf.fuzz(N_CASES, run_seed=12345, workers=1, timeout=5.0, fixtures=fixtures)


def _listing(r: fuzz_gguf.Report, kinds) -> str:
    return "\n".join(f"case {f['case']}: {f['outcome']}: {f['mutation']}: {f.get('detail', '')}"
                     for f in r.failures if f["outcome"] in kinds)


def test_fuzz_subset_never_crashes_hangs_or_raises_other_errors(subset):
    r = subset
    assert r.cases == N_CASES
    bad = ("crash", "hang", "unexpected")
    assert not any(r.outcomes[k] for k in bad), f"{dict(r.outcomes)}\n{_listing(r, bad)}"
    # the subset must exercise both sides: refusals and models that load and generate
    assert r.outcomes["clean_error"] >= N_CASES // 2
    assert r.outcomes["loaded"] >= 5
    # every refusal came from our checks, not from GGUFReader's exception wrapped as a fallback
    assert r.fallback_errors == 0
    assert r.peak_rss < 2 << 30


def test_fuzz_subset_never_generates_from_nan_logits(subset):
    """Finite but huge weights (e.g. 2.7e36 in an F32 norm) overflow to NaN logits; the samplers
    refuse them instead of taking an argmax of NaN."""
    assert subset.outcomes["nonfinite"] == 0, _listing(subset, ("nonfinite",))


def test_cases_are_reproducible(fixtures):
    seeds = [fuzz_gguf.Seed(n, (fixtures / n).read_bytes(), fuzz_gguf.validate_header(fixtures / n))
             for n in fuzz_gguf.SEED_NAMES[:2]]
    a = fuzz_gguf.make_case(seeds, 7, 42)
    assert a == fuzz_gguf.make_case(seeds, 7, 42)
    assert a != fuzz_gguf.make_case(seeds, 7, 43)


def test_harness_detects_crash_hang_and_exception(tmp_path, fixtures):
    w = fuzz_gguf.Worker(str(tmp_path / "worker.log"))
    try:
        out = w.ask({"op": "segv", "path": ""}, timeout=20)
        assert out["outcome"] == "crash" and "SIGSEGV" in out["detail"]
    finally:
        w.close()
    w = fuzz_gguf.Worker(str(tmp_path / "worker.log"))
    try:
        out = w.ask({"op": "sleep", "seconds": 30, "path": ""}, timeout=1)
        assert out["outcome"] == "hang"
        assert w.proc.poll() is not None  # the stuck worker was killed
    finally:
        w.close()
    w = fuzz_gguf.Worker(str(tmp_path / "worker.log"))
    try:
        out = w.ask({"path": str(fixtures / fuzz_gguf.SEED_NAMES[0])}, timeout=20)
        assert out["outcome"] == "loaded", out
        out = w.ask({"op": "raise", "path": ""}, timeout=20)  # a TypeError inside a case: "unexpected", not clean
        assert out["outcome"] == "unexpected" and "TypeError" in out["detail"]
    finally:
        w.close()
