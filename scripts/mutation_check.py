"""Deliberate bugs against the test suite: each mutation is applied to a copy of
the repository, the tests that should catch it run there as a bare clone would run them
(`MTP_FIXTURES` = the vendored set), and the mutation is reported caught (a test failed) or missed.

    python scripts/mutation_check.py [--only NAME ...] [--tests "tests/x.py tests/y.py"]

Prints a markdown table (docs/testing.md records the last one). Each mutation must match its
source text exactly once: a refactor that moves the text fails the script loudly, not silently.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (name, file, source text, mutated text)
MUTATIONS = [
    ("greedy acceptance: last draft never accepted (device)", "mtp_engine/speculative/round.py",
     "return ((drafts == target[:, :-1]) & live).astype(mx.int32)",
     "return ((drafts == target[:, :-1]) & live & (mx.arange(drafts.shape[1]) < drafts.shape[1] - 1)).astype(mx.int32)"),
    ("greedy acceptance: token after the accepted ones off by one (device)", "mtp_engine/speculative/round.py",
     "mx.take_along_axis(target, n[:, None], axis=1)[:, 0])",
     "mx.take_along_axis(target, mx.maximum(n - 1, 0)[:, None], axis=1)[:, 0])"),
    ("p-min flipped (device rounds)", "mtp_engine/speculative/mtp_drafter.py",
     "top = mx.max(mx.softmax(mx.topk(logits, min(10, logits.shape[-1])))) >= p_min",
     "top = mx.max(mx.softmax(mx.topk(logits, min(10, logits.shape[-1])))) < p_min"),
    ("n-min ignored (device rounds)", "mtp_engine/speculative/round.py",
     "if n_min > 1:", "if False:"),
    ("temperature ignored", "mtp_engine/generation/sampling.py",
     "return mx.softmax(logits / cfg.temperature, axis=-1)", "return mx.softmax(logits, axis=-1)"),
    ("rejection sampler: residual not subtracted (device)", "mtp_engine/speculative/round.py",
     "residual = mx.maximum(p - q_live, 0.0)", "residual = p"),
    ("MTP head cache one row short after a block", "mtp_engine/speculative/mtp_drafter.py",
     "cache.offset, cache.bound = base + b.valid, bound + w",
     "cache.offset, cache.bound = base + b.valid - 1, bound + w"),
    ("top-k off by one", "mtp_engine/generation/sampling.py",
     "kth = mx.sort(logits, axis=-1)[..., -cfg.top_k][..., None]",
     "kth = mx.sort(logits, axis=-1)[..., -cfg.top_k - 1][..., None]"),
    ("min-p flipped", "mtp_engine/generation/sampling.py",
     "logits = mx.where(probs < cfg.min_p * probs.max(axis=-1, keepdims=True), neg, logits)",
     "logits = mx.where(probs > cfg.min_p * probs.max(axis=-1, keepdims=True), neg, logits)"),
    ("prompt cache reuses a state whose last token differs", "mtp_engine/generation/prompt_cache.py",
     "and prefix[:n] == k.tokens):", "and prefix[:n - 1] == k.tokens[:-1]):"),
]

TESTS = ("tests/generation/test_sampling_oracle.py tests/speculative/test_spec.py tests/generation/test_pipeline.py tests/generation/test_prompt_cache.py "
         "tests/speculative/test_drafters.py tests/generation/test_penalties.py")
# the trained model's 20-prompt parity takes minutes per mutation; the rest catches what it would
DESELECT = "not trained_model_20_prompts"


def copy_repo(dst: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split("\n")
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", help="substrings of mutation names to run")
    ap.add_argument("--tests", default=TESTS)
    a = ap.parse_args()
    todo = [m for m in MUTATIONS if not a.only or any(s in m[0] for s in a.only)]
    rows, missed = [], 0
    with tempfile.TemporaryDirectory(prefix="mtp-mutation-") as tmp:
        work = Path(tmp)
        copy_repo(work)
        env = dict(os.environ, MTP_FIXTURES=str(work / "tests" / "fixtures"), PYTHONPATH=str(work))
        for i, (name, rel, old, new) in enumerate(todo, 1):
            path = work / rel
            text = path.read_text()
            if text.count(old) != 1:
                print(f"mutation {name!r}: its source text occurs {text.count(old)} times in {rel}", file=sys.stderr)
                return 2
            path.write_text(text.replace(old, new))
            t = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-n", "2", "-p", "no:cacheprovider",
                                "-k", DESELECT, *a.tests.split()], cwd=work, env=env, capture_output=True, text=True)
            path.write_text(text)
            failed = next((ln.split(" ")[1] for ln in r.stdout.splitlines() if ln.startswith("FAILED ")), "")
            caught = bool(failed)  # (with -x, xdist reports the stop as an interruption: exit code 2)
            if not failed and r.returncode != 0:
                print(r.stdout[-2000:], r.stderr[-2000:], file=sys.stderr)
            missed += not caught
            rows.append((name, "caught" if caught else "**missed**", failed.split("::")[-1][:70]))
            print(f"[{i}/{len(todo)}] {name}: {'caught' if caught else 'MISSED'} ({time.perf_counter() - t:.0f} s) "
                  f"{failed}", file=sys.stderr, flush=True)
    print("| mutation | result | first failing test |\n|---|---|---|")
    for name, res, test in rows:
        print(f"| {name} | {res} | {test} |")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
