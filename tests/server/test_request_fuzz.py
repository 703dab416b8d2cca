"""Property tests for the server's request parsing: whatever JSON a client sends, and
whatever bytes, the answer is a parsed request or a 4xx `APIError` naming the problem, in bounded
time; never another exception (a 500) and never a hang. Bodies are random JSON, and valid
requests with one field replaced by random JSON (the mutations a fuzzer would make)."""
from __future__ import annotations

import json
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mtp_engine.server.schemas import APIError, GenRequest, ServerDefaults, parse_chat, parse_completion, parse_json

_scalars = (st.none() | st.booleans() | st.integers(min_value=-(10 ** 30), max_value=10 ** 30)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40))
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=5)
                     | st.dictionaries(st.text(max_size=12), inner, max_size=5), max_leaves=30)

_FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
           "seed", "stop", "stream", "stream_options", "logprobs", "top_logprobs", "presence_penalty",
           "frequency_penalty", "repeat_penalty", "response_format", "tools", "tool_choice", "spec_type",
           "spec_draft_n_max", "spec_draft_n_min", "spec_draft_p_min", "n", "ignore_eos", "mtp_trace"]
_VALID = {"completion": {"prompt": "Hello", "max_tokens": 4},
          "chat": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}}


def _answer(parse, body) -> None:
    t = time.perf_counter()
    try:
        out = parse(body, ServerDefaults())
    except APIError as e:
        assert 400 <= e.status < 500 and e.message, (body, e.status, e.message)
        assert len(e.message) < 2000
    else:
        assert isinstance(out, GenRequest)
    assert time.perf_counter() - t < 5.0


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.dictionaries(st.sampled_from(_FIELDS) | st.text(max_size=10), _json, max_size=8),
       chat=st.booleans())
def test_any_json_object_is_a_request_or_a_4xx(body, chat):
    _answer(parse_chat if chat else parse_completion, body)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field=st.sampled_from(_FIELDS), value=_json, chat=st.booleans())
def test_a_valid_request_with_one_field_mutated_is_a_request_or_a_4xx(field, value, chat):
    body = dict(_VALID["chat" if chat else "completion"])
    body[field] = value
    _answer(parse_chat if chat else parse_completion, body)


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=200) | _json.map(lambda v: json.dumps(v).encode()))
def test_any_bytes_are_an_object_or_a_4xx(raw):
    try:
        body = parse_json(raw)
    except APIError as e:
        assert 400 <= e.status < 500
    else:
        assert isinstance(body, dict)


def test_live_server_survives_hostile_traffic(tmp_path):
    """scripts/fuzz/fuzz_requests.py in small: random and mutated bodies, raw bytes, clients that leave
    mid-header, mid-body or mid-answer, 4 at once; no 5xx, the server alive, its file descriptors
    back (docs/benchmarks.md has the 10k-request run)."""
    import subprocess
    import sys

    from tests.conftest import ROOT, TINY_Q4
    out = tmp_path / "fuzz.json"
    # as a module from the checkout's root: the fuzzer drives the tests' live-server helper
    p = subprocess.run([sys.executable, "-m", "scripts.fuzz.fuzz_requests", "-m", str(TINY_Q4),
                        "--requests", "120", "--workers", "4", "--warm-requests", "40", "--blocks", "2",
                        "--rss-slack-mib", "24", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    summary = json.loads(out.read_text())
    assert p.returncode == 0 and all(summary["checks"].values()), p.stdout[-2000:] + p.stderr[-2000:]
    assert summary["statuses"].get("200", 0) > 0 and summary["statuses"].get("400", 0) > 0
