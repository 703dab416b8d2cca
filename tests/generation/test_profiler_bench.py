"""Stage profiler (precise and round modes), profile export, the cost model and `mtp-engine bench`."""
from __future__ import annotations

import csv
import json

import pytest

from tests.conftest import TINY, TINY_Q4, need
from mtp_engine import generate
from mtp_engine.cli.bench import BenchConfig, run_bench
from mtp_engine.cli.main import main
from mtp_engine.speculative.costmodel import Costs, expected_tokens, measure, predict_speedup

IDS = [349, 220, 451, 72, 389]


@pytest.fixture(scope="module")
def tiny(tiny_any):
    return tiny_any


@pytest.mark.parametrize("spec", [None, "draft-mtp"])
def test_precise_stages_add_up_to_wall_time(tiny, spec):
    r = generate(IDS, tiny, max_tokens=40, ignore_eos=True, spec=spec, n_max=3, profile="precise")
    prof = r.stats["profile"]
    stages = prof["stages"]
    named = sum(v["seconds"] for k, v in stages.items() if k != "other")
    assert prof["wall_seconds"] > 0
    # the rest is the loop's own bookkeeping between stages: a few percent of a CPU run, and about
    # 0.2 ms a round where a tiny model's round takes 3 ms on a GPU
    slack = max(0.05 * prof["wall_seconds"], 3e-4 * stages["emit"]["count"])
    assert abs(named - prof["wall_seconds"]) < slack, stages
    expected = {"prefill", "decode", "sync", "emit"} if spec is None else \
        {"prefill", "draft", "verify", "sample", "sync", "accept", "rollback", "catch_up", "emit"}
    assert expected <= set(stages)
    if spec:
        # one draft stage entry per draft step, one verify per round
        assert stages["draft"]["count"] == r.stats["drafted"]
        assert stages["verify"]["count"] == r.stats["rounds"]


def test_a_precise_profile_times_the_device_round_itself(tiny):
    """A precise profile does not switch draft-mtp to another round: the device-resident round
    runs, each stage evaluated at its end (the head's block as catch-up, each chained step as a
    draft), and its output is plain decoding's."""
    from mtp_engine.generation.loop import run
    from mtp_engine.generation.profiler import Profiler
    from mtp_engine.generation.sampling import Sampler, SamplerConfig
    from mtp_engine.speculative.config import DraftParams
    from mtp_engine.speculative.draft_mtp import DraftMTPDecoder

    prof = Profiler("precise")
    dec = DraftMTPDecoder(tiny.model, Sampler(SamplerConfig()), DraftParams(2), prof)
    got = [t for ch in run(dec, tiny.tokenizer, IDS, 24, ignore_eos=True, profiler=prof) for t in ch.token_ids]
    assert dec.drafting
    assert got == generate(IDS, tiny, max_tokens=24, ignore_eos=True).token_ids
    counts = prof.report()["stages"]
    assert counts["catch_up"]["count"] == counts["verify"]["count"] == dec.stats()["rounds"]
    assert counts["draft"]["count"] == 2 * counts["verify"]["count"]


def test_round_mode_and_off_mode(tiny):
    r = generate(IDS, tiny, max_tokens=20, ignore_eos=True, spec="draft-mtp", profile="round")
    assert r.stats["profile"]["mode"] == "round"
    assert "profile" not in generate(IDS, tiny, max_tokens=5, ignore_eos=True).stats


def test_profile_export(tmp_path):
    p = need(TINY / "qwen35-mtp-tiny-f32.gguf")
    js, cs = tmp_path / "p.json", tmp_path / "p.csv"
    assert main(["generate", "-m", str(p), "-p", "To be", "-n", "8", "--spec-type", "draft-mtp", "--spec-draft-n-max", "2",
                 "--profile", "--profile-out", str(js)]) == 0
    rep = json.loads(js.read_text())
    assert rep["mode"] == "precise" and "verify" in rep["stages"]
    assert main(["generate", "-m", str(p), "-p", "To be", "-n", "8", "--profile-out", str(cs), "--json"]) == 0
    rows = list(csv.reader(cs.open()))
    assert rows[0] == ["stage", "seconds", "count", "share_of_wall"] and any(r[0] == "decode" for r in rows)


def test_cost_model(tiny):
    c = measure(tiny.model, max_verify=3, context=16, repeats=3)
    assert c.step_ms > 0 and set(c.verify) == {1, 2, 3} and c.draft > 0
    assert all(v > 0 for v in c.verify.values())
    # arithmetic: a = 1 everywhere, free verify and drafts -> speedup = k + 1
    ideal = Costs(step_ms=1.0, verify={1: 1.0, 2: 1.0, 3: 1.0}, draft=0.0, fixed=0.0)
    assert predict_speedup(ideal, [1.0, 1.0], 2) == pytest.approx(3.0)
    assert expected_tokens([0.8, 0.5, None], 3) == pytest.approx(2.3)
    assert predict_speedup(Costs(1.0, {2: 1.5}, 0.25, 0.1), [0.9], 1) == pytest.approx(1.9 / 1.85)


def test_bench_writes_table_csv_json_png(tmp_path):
    out = tmp_path / "b"
    res = run_bench(BenchConfig(model=str(need(TINY / "qwen35-mtp-tiny-f32.gguf")), n_max=(0, 1, 2, "auto"),
                                tokens=8, repeats=1, prompts=["To be, or", "Once upon"], out=str(out)))
    rows = json.loads((out / "bench.json").read_text())
    assert isinstance(rows, list) and [r["n_max"] for r in rows] == [0, 0, 1, 2, "auto"]
    auto = rows.pop()
    assert sum(auto["draft_length_histogram"].values()) > 0 and "auto chose" in auto["explanation"]
    assert rows[0]["spec"] == "none" and rows[0]["speedup"] == pytest.approx(1.0)
    for r in rows[1:]:
        for k in ("tok_s", "acceptance", "mean_accepted_length", "predicted_speedup", "stage_ms_per_token",
                  "explanation"):
            assert k in r
    assert (out / "bench.png").stat().st_size > 1000
    assert "| plain |" in (out / "bench.md").read_text()
    assert len(list(csv.reader((out / "bench.csv").open()))) == 6
    assert res["costs"]["verify"]


def test_moe_bench_reports_distinct_experts(tmp_path):
    path = need(TINY.parent / "llamacpp-moe" / "qwen35moe-mtp-tiny-Q4_K_M.gguf")
    res = run_bench(BenchConfig(model=str(path), n_max=(3,), tokens=8, repeats=1, prompts=["To be, or"],
                                out=str(tmp_path)))
    plain, spec = res["rows"]
    # a single step reads top-k experts per layer; a 4-token verify reads more, up to 4 x top-k
    assert plain["moe_experts_per_step"] > 0
    assert spec["moe_experts_per_verify"] > plain["moe_experts_per_step"]
    assert "MoE experts/layer" in (tmp_path / "bench.md").read_text()


def test_bench_at_a_chosen_prompt_length(tmp_path, capsys):
    """`bench --prompt-tokens N`: one synthetic prompt of exactly N tokens (TTFT then measures a
    prefill of N), said in the table; refused beside --prompts, before the model loads."""
    from mtp_engine.cli.bench import synthetic_prompt
    from mtp_engine.cli.main import main
    from mtp_engine import load

    path = str(need(TINY_Q4))
    tok = load(path).tokenizer
    assert len(synthetic_prompt(tok, 700)) == 700 and synthetic_prompt(tok, 5) == synthetic_prompt(tok, 700)[:5]
    res = run_bench(BenchConfig(model=path, n_max=(2,), tokens=4, repeats=1, prompt_tokens=300, out=str(tmp_path)))
    assert res["prompt_tokens"] == 300 and res["prompts"] == 1
    assert "a 300-token prompt x 4 tokens" in (tmp_path / "bench.md").read_text()
    f = tmp_path / "p.txt"
    f.write_text("x")
    assert main(["bench", "-m", path, "--prompt-tokens", "10", "--prompts", str(f)]) == 2
    assert "--prompts or --prompt-tokens" in capsys.readouterr().err


def test_the_plot_marks_noisy_rows_as_the_table_does():
    from mtp_engine.cli.bench_report import bar_labels
    rows = [{"spec": "none", "n_max": 0, "p_min": 0.0, "profile_overhead": 1.02},
            {"spec": "draft-mtp", "n_max": 3, "p_min": 0.0, "profile_overhead": 3.1, "profiled_tok_s": 9.0},
            {"spec": "draft-mtp", "n_max": 2, "p_min": 0.5}]
    assert bar_labels(rows) == ["plain", "3/0 (noisy)", "2/0.5"]


def test_a_speedup_that_says_nothing_is_marked():
    """The bench table's speedup cell says when its ratio is noise: a draft-mtp run that drafted in
    no round decoded plainly, and a ratio inside plain's spread over the repeats is within noise."""
    from mtp_engine.cli.bench_report import _within_noise

    plain = {"spec": "none", "speedup": 1.0, "tok_s_all": [100.0, 104.0]}
    assert _within_noise(plain, plain) == ""
    assert "no round drafted" in _within_noise({"spec": "draft-mtp", "speedup": 1.03, "drafted": 0}, plain)
    assert "within plain's spread of 4%" in _within_noise({"spec": "draft-mtp", "speedup": 0.97, "drafted": 9}, plain)
    assert _within_noise({"spec": "draft-mtp", "speedup": 1.3, "drafted": 9}, plain) == ""
