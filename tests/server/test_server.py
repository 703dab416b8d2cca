"""`mtp-engine serve` against a live server process on 127.0.0.1 (tiny fixture model, short
generations): the official `openai` client (chat and completions, streaming and not), greedy output
equal to `generate()`'s, 16 concurrent streams, a disconnect mid-stream, 400 and 503 answers."""
from __future__ import annotations

import http.client
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import TINY, TINY_Q8, need
from mtp_engine import generate
from mtp_engine import load
from tests.server_helpers import LiveServer, sse_events

openai = pytest.importorskip("openai", reason="the server tests need the openai client (pip install -e '.[test]')")
pytest.importorskip("starlette", reason="the server needs starlette and uvicorn (pip install -e .)")

MODEL = TINY_Q8  # the full set's Q8_0, else the vendored Q4_K_M
PROMPT = "To be"


@pytest.fixture(scope="module")
def server():
    s = LiveServer(need(MODEL), "--spec-draft-n-max", "3", "--queue-size", "32")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tiny():
    from mtp_engine.chat.template import CHATML

    m = load(need(MODEL))
    m.tokenizer.chat_template = CHATML  # what the server falls back to for this template-less model
    return m


def _chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_models_health_and_page(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL.name]
    h = server.health()
    assert h["status"] == "ok" and h["queue_size"] == 32
    status, page = server.request("GET", "/")
    assert status == 200 and "<html" in page.lower() and "/v1/chat/completions" in page
    assert server.request("GET", "/nope")[0] == 404
    status, err = server.request("GET", "/v1/completions")  # a route that takes POST only
    assert status == 405 and err["error"]["type"] == "invalid_request_error"
    assert "ChatML" in "".join(server.stderr)  # the fallback template is said once in the log
    assert "".join(server.stderr).count("ChatML") == 1


def test_chat_equals_generate_stream_and_not(client, tiny):
    ref = generate(messages=_chat("Hello there"), model=tiny, max_tokens=12)
    r = client.chat.completions.create(model="x", messages=_chat("Hello there"), max_tokens=12, temperature=0)
    assert r.choices[0].message.content == ref.text
    assert r.choices[0].finish_reason == ref.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 12)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12
    extra = r.usage.model_extra
    assert extra["timings"]["draft_n"] >= extra["timings"]["draft_n_accepted"] >= 0
    sd = extra["spec_decode"]
    assert sd["num_draft_tokens"] == 3 * sd["num_drafts"] and 0 <= sd["draft_acceptance_rate"] <= 1
    assert sd["decode_tokens_per_second"] > 0
    parts, chunks = [], []
    for c in client.chat.completions.create(model="x", messages=_chat("Hello there"), max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}):
        chunks.append(c)
        if c.choices and c.choices[0].delta.content:
            parts.append(c.choices[0].delta.content)
    assert "".join(parts) == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert "mtp" not in (chunks[1].model_extra or {})  # the extension only when asked for


def test_completions_with_penalties_and_logprobs_equal_generate(client, tiny):
    kw = dict(repeat_penalty=0.5, repeat_last_n=4, presence_penalty=0.3)
    ref = generate(PROMPT, tiny, max_tokens=10, logprobs=2, **kw)
    assert ref.text != generate(PROMPT, tiny, max_tokens=10).text
    r = client.completions.create(model="x", prompt=PROMPT, max_tokens=10, logprobs=2, extra_body=kw)
    assert r.choices[0].text == ref.text
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e["logprob"] for e in ref.logprobs], abs=1e-3)
    assert "".join(lp.tokens) == ref.text and all(len(t) == 2 for t in lp.top_logprobs)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model="x", prompt=PROMPT, max_tokens=10, stream=True, extra_body={**kw, "spec_type": "none"}))
    assert text == ref.text
    # per-request draft settings: plain decoding has no draft figures
    r0 = client.completions.create(model="x", prompt=PROMPT, max_tokens=4, extra_body={"spec_type": "none"})
    assert "spec_decode" not in r0.usage.model_extra


def test_stream_trace_reports_provenance(server, tiny):
    ref = generate(PROMPT, tiny, max_tokens=24, spec="draft-mtp", n_max=3, repeat_penalty=0.5, repeat_last_n=4)
    c, resp = server.open_stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "mtp_trace": True,
                                                     "repeat_penalty": 0.5, "repeat_last_n": 4})
    events = sse_events(resp)
    c.close()
    assert events[-1] == "[DONE]"
    tokens = [t for e in events[:-1] for t in e["mtp"]["tokens"]]
    assert "".join(t["text"] for t in tokens) == ref.text
    assert [t["id"] for t in tokens] == ref.token_ids
    assert sum(t["drafted"] for t in tokens) > 0 and not all(t["drafted"] for t in tokens)
    final = events[-2]
    assert final["choices"][0]["finish_reason"] == "length"
    assert final["timings"]["draft_n_accepted"] == ref.stats["accepted"]
    assert final["mtp"]["usage"]["spec_decode"]["num_accepted_tokens"] == ref.stats["accepted"]


def test_16_concurrent_streaming_clients(client, tiny):
    """Sampled (seed per client) so that the 16 answers differ and a mix-up would show."""
    prompts = [f"Client {i} says" for i in range(16)]
    expected = [generate(messages=_chat(p), model=tiny, max_tokens=16, temperature=3.0, seed=i, spec="draft-mtp",
                         n_max=3).text for i, p in enumerate(prompts)]
    assert len(set(expected)) == 16

    def one(i):
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="x", messages=_chat(prompts[i]), max_tokens=16, temperature=3.0, seed=i, stream=True) if c.choices)

    with ThreadPoolExecutor(16) as ex:
        got = list(ex.map(one, range(16)))
    assert got == expected


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_a_client_that_leaves_stops_its_generation(server, client, tiny, stream):
    """The client closes its connection while its answer is generated: the generation stops within
    about a poll interval (a non-streamed one once ran to max_tokens: its chunks kept coming, and
    the client was checked only when they stalled)."""
    import http.client

    before = server.wait_idle()["completed"]
    body = {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True}
    if stream:
        c, resp = server.open_stream("/v1/completions", body)
        assert resp.status == 200
        resp.fp.readline()  # the first event has arrived: the generation runs
    else:
        c = http.client.HTTPConnection(server.host, server.port, timeout=60)
        c.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                  headers={"Content-Type": "application/json"})
        deadline = time.monotonic() + 20
        while not server.health()["busy"] and time.monotonic() < deadline:  # the generation runs
            time.sleep(0.02)
        time.sleep(0.3)
    t0 = time.monotonic()
    c.sock.close()
    c.close()
    h = server.wait_idle(timeout=20)
    # 3000 tokens take ~40 s here: finishing this soon means the generation stopped
    assert time.monotonic() - t0 < 15 and h["completed"] == before + 1
    # the generation left early leaves nothing behind: the next answer is still generate()'s
    r = client.completions.create(model="x", prompt=PROMPT, max_tokens=6)
    assert r.choices[0].text == generate(PROMPT, tiny, max_tokens=6).text


@pytest.mark.parametrize("raw,param", [
    (b'{"prompt": "x", ', None),
    (b'[1, 2]', None),
    (b'{"prompt": "x", "max_tokens": "6"}', "max_tokens"),
    (b'{"prompt": "x", "temperature": "hot"}', "temperature"),
    (b'{"prompt": "x", "top_p": 0}', "top_p"),
    (b'{"prompt": "x", "stop": 5}', "stop"),
    (b'{"prompt": "x", "n": 2}', "n"),
    (b'{"prompt": "x", "seed": 1.5}', "seed"),
    (b'{"prompt": "x", "presence_penalty": 3}', "presence_penalty"),
    (b'{"prompt": "x", "spec_type": "eagle"}', "spec_type"),
    (b'{"prompt": "x", "spec_draft_n_max": "many"}', "spec_draft_n_max"),
    (b'{"prompt": "x", "stream": "yes"}', "stream"),
    (b'{"prompt": [600]}', "prompt"),
    (b'{"prompt": ""}', "prompt"),
    (b'{"prompt": "x", "max_tokens": 5000}', "max_tokens"),
    (b'{"prompt": "a\\ud800b"}', "prompt"),  # a lone surrogate (valid JSON, not valid Unicode)
    (b'{"prompt": "a\\ud800b", "stream": true}', "prompt"),
    (b'{"prompt": "x", "stop": ["\\udfff"]}', "stop[0]"),
])
def test_bad_completion_requests_answer_400(server, raw, param):
    status, body = server.request("POST", "/v1/completions", raw=raw)
    assert status == 400, body
    err = body["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param


def test_bad_chat_requests_and_over_context(server, client):
    for body, param in [({"messages": "hi"}, "messages"), ({"messages": [{"role": "user"}]}, "messages"),
                        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
                        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools")]:
        status, out = server.request("POST", "/v1/chat/completions", body)
        assert status == 400 and out["error"]["param"] == param, out
    with pytest.raises(openai.BadRequestError, match="n = 1"):
        client.chat.completions.create(model="x", messages=_chat("x"), n=2)
    long = "word " * 5000  # > 4096 tokens of context
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=_chat(long), max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="x", prompt=long, max_tokens=4, stream=True)
    assert client.completions.create(model="x", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_full_queue_answers_503():
    s = LiveServer(need(MODEL), "--queue-size", "1", "--spec-type", "none")
    try:
        running, resp = s.open_stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 3000, "ignore_eos": True})
        resp.fp.readline()  # it generates: the worker is busy
        waiting = threading.Thread(target=lambda: s.request("POST", "/v1/completions",
                                                            {"prompt": PROMPT, "max_tokens": 2}), daemon=True)
        waiting.start()
        deadline = time.monotonic() + 10
        while s.health()["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        c = http.client.HTTPConnection(s.host, s.port, timeout=30)
        c.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 2}))
        r = c.getresponse()
        body = json.loads(r.read())
        c.close()
        assert r.status == 503 and body["error"]["code"] == "queue_full" and "--queue-size" in body["error"]["message"]
        assert int(r.getheader("Retry-After")) >= 1
        running.sock.close()
        running.close()
        waiting.join(20)  # the queued one runs once the first is cancelled
        assert not waiting.is_alive()
        assert s.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})[0] == 200
    finally:
        s.stop()


def test_default_settings_serve_draft_mtp_auto():
    """`mtp-engine serve` with no flags (draft-mtp, n-max auto): it warms up with those settings
    before saying it is ready, and its spec_decode figures count only the rounds that drafted."""
    s = LiveServer(need(MODEL))
    try:
        assert re.search(r"warmed up in \d+\.\d s\)$", s.banner), s.banner
        status, body = s.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True})
        assert status == 200, body
        sd = body["usage"]["spec_decode"]
        assert sd["num_drafts"] <= sd["num_draft_tokens"] <= 8 * sd["num_drafts"]
        if sd["num_drafts"]:
            assert sd["mean_acceptance_length"] == pytest.approx(1 + sd["num_accepted_tokens"] / sd["num_drafts"])
    finally:
        s.stop()


def test_spec_decode_counts_drafting_rounds_as_drafts():
    from mtp_engine.server.responses import usage

    stats = {"rounds": 10, "drafting_rounds": 4, "drafted": 8, "accepted": 6, "acceptance_rate": 0.75,
             "mean_accepted_length": 0.6, "acceptance_per_position": [1.0, 0.5]}
    sd = usage(stats, 5, 16)["spec_decode"]
    assert (sd["num_drafts"], sd["num_draft_tokens"], sd["num_accepted_tokens"]) == (4, 8, 6)
    assert sd["mean_acceptance_length"] == 2.5 and sd["mean_accepted_length"] == 0.6
    assert usage({**stats, "drafting_rounds": 0, "drafted": 0, "accepted": 0}, 5, 10)["spec_decode"][
        "mean_acceptance_length"] == 0.0


def test_interrupt_ends_open_streams_cleanly():
    """Ctrl-C while a stream runs and another request waits: the stream ends with a "shutting
    down" error event, the waiting request gets a 503, the process exits within seconds, and no
    traceback is printed (uvicorn used to cancel the open stream after its grace period)."""
    import signal

    s = LiveServer(need(MODEL), "--spec-type", "none")
    try:
        c, resp = s.open_stream("/v1/completions", {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True})
        assert resp.readline().startswith(b"data: ")  # it generates
        box = {}
        waiting = threading.Thread(target=lambda: box.update(r=s.request("POST", "/v1/completions",
                                                                         {"prompt": PROMPT, "max_tokens": 2})),
                                   daemon=True)
        waiting.start()
        deadline = time.monotonic() + 10
        while s.health()["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        s.proc.send_signal(signal.SIGINT)
        events = sse_events(resp)
        assert events and events[-1]["error"]["code"] == "shutting_down", events[-3:]
        waiting.join(10)
        status, body = box["r"]
        assert status == 503 and body["error"]["code"] == "shutting_down"
        s.proc.wait(10)
        assert "Traceback" not in "".join(s.stderr), "".join(s.stderr)[-2000:]
    finally:
        s.stop()


def test_tools_reach_the_template_and_calls_come_back(tmp_path):
    """A model whose template renders tools (Qwen3.5's): the request's tools and an earlier call
    and its result are rendered into the prompt exactly as the template renders them in-process
    (the answer equals `generate` on that text); tool_choice "none" leaves them out; a model
    without such a template (ChatML fallback) refuses tools by name."""
    from pathlib import Path as P

    from mtp_engine.chat.tool_calls import message_tool_calls
    from tests.server_helpers import with_chat_template
    from tests.chat.test_tool_calls import TOOLS

    template = (P(__file__).resolve().parent.parent / "fixtures" / "chat_templates" / "Qwen3.5-4B.jinja").read_text()
    path = with_chat_template(need(TINY / "qwen35-mtp-tiny-Q4_K_M.gguf"), tmp_path / "tools.gguf", template)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    msgs = [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    m = load(str(path))
    rendered = [dict(msgs[0]), {"role": "assistant", "content": "", "tool_calls": message_tool_calls(1, [call])},
                {"role": "tool", "content": "18C", "tool_call_id": "call_1"}]
    text = m.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tools=TOOLS)
    assert "<function=get_weather>" in text and "<parameter=city>\nParis\n</parameter>" in text and "18C" in text
    ref = generate(text, model=m, max_tokens=6)
    s = LiveServer(path, "--spec-draft-n-max", "2")
    try:
        status, body = s.request("POST", "/v1/chat/completions",
                                 {"messages": msgs, "tools": TOOLS, "max_tokens": 6, "temperature": 0})
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(ref.prompt_token_ids)
        msg = body["choices"][0]["message"]
        # this tiny model writes no call: its text is the answer, as generate's
        assert msg["content"] == ref.text and "tool_calls" not in msg
        status, none = s.request("POST", "/v1/chat/completions", {"messages": msgs[:1], "tools": TOOLS,
                                                                   "tool_choice": "none", "max_tokens": 1})
        status2, plain = s.request("POST", "/v1/chat/completions", {"messages": msgs[:1], "max_tokens": 1})
        assert status == status2 == 200 and none["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
        # a forced call (tool_choice names a tool): a grammar makes the answer that call
        from tests.chat.test_tool_calls import PING

        status, forced = s.request("POST", "/v1/chat/completions", {
            "messages": msgs[:1], "tools": [PING, *TOOLS], "max_tokens": 80,
            "tool_choice": {"type": "function", "function": {"name": "ping"}}, "parallel_tool_calls": False})
        assert status == 200, forced
        choice = forced["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["ping"]
        status, body = s.request("POST", "/v1/chat/completions", {
            "messages": msgs[:1], "tools": TOOLS, "tool_choice": "required",
            "response_format": {"type": "json_object"}})
        assert status == 400 and body["error"]["param"] == "tool_choice"
    finally:
        s.stop()
    s = LiveServer(need(MODEL), "--spec-type", "none")
    try:
        status, body = s.request("POST", "/v1/chat/completions", {"messages": msgs[:1], "tools": TOOLS})
        assert status == 400 and body["error"]["param"] == "tools" and "chat template" in body["error"]["message"]
    finally:
        s.stop()


def test_next_turn_reuses_the_prompt_cache(client, tiny):
    """A chat's second turn starts with the first turn's prompt: only the rest is prefilled
    (usage.prompt_tokens_details.cached_tokens, timings.cache_n), and the answer is the one a
    fresh generation gives; `cache_prompt: false` prefills everything."""
    turn1 = _chat("Tell me a story")
    r1 = client.chat.completions.create(model="x", messages=turn1, max_tokens=8, temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And then?"}]
    r2 = client.chat.completions.create(model="x", messages=turn2, max_tokens=8, temperature=0)
    ref = generate(messages=turn2, model=tiny, max_tokens=8)
    first = generate(messages=turn1, model=tiny, max_tokens=0)
    assert r2.choices[0].message.content == ref.text
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached == len(first.prompt_token_ids) - 1
    assert r2.usage.model_extra["timings"]["cache_n"] == cached
    assert r2.usage.model_extra["timings"]["prompt_n"] == r2.usage.prompt_tokens - cached
    r3 = client.chat.completions.create(model="x", messages=turn2, max_tokens=8, temperature=0,
                                        extra_body={"cache_prompt": False})
    assert r3.usage.prompt_tokens_details.cached_tokens == 0 and r3.choices[0].message.content == ref.text


def test_interleaved_conversations_each_keep_their_prompt(client):
    """Two users taking turns (the server keeps 4 prompts by default): each one's next turn still
    finds its own conversation's state."""
    first = {u: _chat(f"User {u} asks about {topic}") for u, topic in (("a", "sorting"), ("b", "graphs"))}
    answers = {u: client.chat.completions.create(model="x", messages=m, max_tokens=4, temperature=0)
               for u, m in first.items()}
    for u, m in first.items():
        nxt = m + [{"role": "assistant", "content": answers[u].choices[0].message.content},
                   {"role": "user", "content": "more"}]
        r = client.chat.completions.create(model="x", messages=nxt, max_tokens=2, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens > 0, u


@pytest.mark.parametrize("flag", ["--cache-slots", "--cache-ram", "-c"])
def test_serve_refuses_a_non_positive_size(flag, capsys):
    from mtp_engine.cli.main import main

    with pytest.raises(SystemExit) as e:
        main(["serve", flag, "0"])
    assert e.value.code == 2 and "expected a positive integer" in capsys.readouterr().err


def test_response_format_json(client):
    """response_format json_object / json_schema: the answer is JSON (of that schema), as OpenAI's
    structured outputs; a malformed response_format is a 400 naming it."""
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                               "ok": {"type": "boolean"}},
              "required": ["n", "ok"], "additionalProperties": False}
    r = client.chat.completions.create(model="x", messages=_chat("give JSON"), max_tokens=40, temperature=0,
                                       response_format={"type": "json_schema",
                                                        "json_schema": {"name": "t", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"n", "ok"} and isinstance(obj["n"], int) and isinstance(obj["ok"], bool)
    r = client.chat.completions.create(model="x", messages=_chat("give JSON"), max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=_chat("x"), response_format={"type": "yaml"})
    assert e.value.body["param"] == "response_format"


def test_api_key_guards_every_private_route(tmp_path):
    """`serve --api-key-file`: every route but the page and a bare /health needs `Authorization:
    Bearer KEY` (401 in OpenAI's shape otherwise, the key never echoed; the scheme in any case);
    /health without the key says only that the server is up; the Authorization header twice is a
    400; the openai client works with it."""
    key = "mtp-test-key-3f9a"
    f = tmp_path / "key"
    f.write_text(key + "\n")
    s = LiveServer(need(TINY_Q8), "--api-key-file", str(f))
    try:
        body = {"prompt": "Hi", "max_tokens": 2}
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": key}):
            status, err = s.request("POST", "/v1/completions", body, headers=headers)
            assert status == 401 and err["error"]["code"] == "invalid_api_key", err
            assert err["error"]["type"] == "invalid_request_error" and key not in json.dumps(err)
        for path in ("/v1/models", "/slots", "/metrics", "/no/such/route"):
            assert s.request("GET", path)[0] == 401, path
        assert s.request("GET", "/health") == (200, {"status": "ok"}) and s.request("GET", "/")[0] == 200
        full = s.request("GET", "/health", headers={"Authorization": f"bearer {key}"})[1]
        assert full["status"] == "ok" and "rss_bytes" in full and "completed" in full
        assert s.request("GET", "/slots", headers={"Authorization": f"BEARER {key}"})[0] == 200
        assert s.request("POST", "/v1/completions", body, headers={"Authorization": f"Bearer {key}"})[0] == 200
        assert s.request("POST", "/v1/completions", body, headers={"Authorization": f"bearer {key}"})[0] == 200
        c = http.client.HTTPConnection(s.host, s.port, timeout=30)
        c.putrequest("GET", "/v1/models")
        c.putheader("Authorization", "Bearer wrong")
        c.putheader("Authorization", f"Bearer {key}")
        c.endheaders()
        r = c.getresponse()
        assert r.status == 400 and json.loads(r.read())["error"]["code"] == "invalid_api_key"
        c.close()
        client = openai.OpenAI(base_url=f"http://{s.host}:{s.port}/v1", api_key=key)
        assert client.completions.create(model="m", prompt="Hi", max_tokens=2).choices[0].text is not None
        assert key not in "".join(s.stderr)
    finally:
        s.stop()


def test_connections_that_never_finish_their_headers_are_closed():
    """Half-open connections (nothing sent, or part of a request line) are closed at the header
    deadline, so they cannot pile up until file descriptors run out; a complete request is
    unaffected, and so is a keep-alive connection between requests."""
    import socket

    s = LiveServer(need(MODEL), "--header-timeout", "1")
    try:
        socks = []
        for i in range(30):
            c = socket.create_connection((s.host, s.port), timeout=10)
            if i % 2:
                c.sendall(b"GET /health HT")  # a request line that never ends
            socks.append(c)
        time.sleep(2.5)
        for c in socks:  # closed by the server: recv returns b"" at once (no reply was due)
            c.settimeout(0.5)
            assert c.recv(1024) == b""
            c.close()
        assert s.health()["status"] == "ok"
    finally:
        s.stop()


def test_chat_template_flag_replaces_the_models(tmp_path, capsys):
    """`serve --chat-template-file`: chat requests render with it (llama-server's flag; a model
    without a template gets tools and roles its own way); a template that does not compile is one
    line before the model loads."""
    from mtp_engine.cli.main import main

    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}<<{{ m.role }}>> {{ m.content }}\n{% endfor %}<<assistant>>")
    s = LiveServer(need(MODEL), "--chat-template-file", str(f))
    try:
        status, body = s.request("POST", "/v1/chat/completions",
                                 {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 3})
        assert status == 200, body
        m = load(need(MODEL))
        rendered = "<<user>> Hi there\n<<assistant>>"
        assert body["usage"]["prompt_tokens"] == len(m.tokenizer.encode(rendered))
        assert "ChatML" not in "".join(s.stderr)  # no fallback note: the flag's template is used
    finally:
        s.stop()
    rc = main(["serve", "-m", str(need(MODEL)), "--port", "0", "--chat-template", "{% for %}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "invalid chat template" in err[0]


def test_a_thousand_idle_connections_do_not_shut_another_peer_out():
    """1000 connections from one peer that never send their headers (the default 10 s header
    deadline has not passed): another peer's completions are answered within 1 s, 10 times of 10.
    They once filled uvicorn's connection limit, and 26 of 28 requests got 503s; now the oldest
    waiting connections are closed past a bound."""
    import resource
    import socket

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    s = LiveServer(need(MODEL), "--spec-type", "none")
    idle = []
    try:
        for i in range(1000):
            c = socket.socket()
            c.bind(("127.0.0.1", 0))
            c.connect((s.host, s.port))
            if i % 3 == 0:
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers that never end
            idle.append(c)
        times = []
        for _ in range(10):
            t = time.perf_counter()
            c = http.client.HTTPConnection(s.host, s.port, timeout=10, source_address=("127.0.0.2", 0))
            c.request("POST", "/v1/completions", body=json.dumps({"prompt": PROMPT, "max_tokens": 2}),
                      headers={"Content-Type": "application/json"})
            r = c.getresponse()
            assert r.status == 200, r.read()
            r.read()
            c.close()
            times.append(time.perf_counter() - t)
        assert max(times) < 1.0, times
    finally:
        for c in idle:
            c.close()
        s.stop()


def test_requests_open_at_once_are_bounded_with_retry_after():
    """`app.LimitRequests`: past its limit of open requests a 503 naming the limit, with
    Retry-After; the others are served, and a request after them is again."""
    import asyncio

    from mtp_engine.server.guards import LimitRequests

    gate = asyncio.Event()

    async def slow(scope, receive, send):
        await gate.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def call(app):
        sent = []

        async def send(m):
            sent.append(m)
        await app({"type": "http", "path": "/v1/x", "method": "GET", "headers": []}, None, send)
        return sent[0]["status"], dict(sent[0]["headers"]), sent[-1]["body"]

    async def main():
        app = LimitRequests(slow, limit=2)
        first = [asyncio.create_task(call(app)) for _ in range(2)]
        await asyncio.sleep(0.01)
        status, headers, body = await call(app)
        assert status == 503 and headers[b"retry-after"] == b"1" and b"too_many_requests" in body
        assert b"2 requests" in body
        gate.set()
        assert [(await t)[0] for t in first] == [200, 200]
        assert (await call(app))[0] == 200 and app.open == 0

    asyncio.run(main())


def test_metrics_count_what_the_answers_say():
    """`serve --metrics -np 4`: /metrics is Prometheus text (parsed by prometheus_client's own
    parser), scraped while 16 streams run and after them: its token and draft counters equal the
    sums of the answers' usage, requests are counted by status, queue depth and busy slots are
    there; behind the key when one is set."""
    from prometheus_client.parser import text_string_to_metric_families

    s = LiveServer(need(MODEL), "--metrics", "-np", "4", "--api-key", "k3y")
    auth = {"Authorization": "Bearer k3y"}
    try:
        assert s.request("GET", "/metrics")[0] == 401

        def scrape() -> dict:
            status, text = s.request("GET", "/metrics", headers=auth)
            assert status == 200
            return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
                    for fam in text_string_to_metric_families(text) for smp in fam.samples}

        def one(i: int) -> dict:
            c = http.client.HTTPConnection(s.host, s.port, timeout=60)
            c.request("POST", "/v1/completions", headers={"Content-Type": "application/json", **auth},
                      body=json.dumps({"prompt": f"def f{i}(x):", "max_tokens": 12 + i, "ignore_eos": True,
                                       "stream": True, "stream_options": {"include_usage": True}}))
            r = c.getresponse()
            usage = None
            for line in r:
                if line.startswith(b"data: {"):
                    usage = json.loads(line[6:]).get("usage") or usage
            c.close()
            return usage

        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(one, i) for i in range(16)]
            during = scrape()
            usages = [f.result() for f in futures]
        assert ("mtp_queue_depth", ()) in during and ("mtp_busy_slots", ()) in during
        assert during.get(("mtp_generated_tokens_total", ()), 0) <= sum(u["completion_tokens"] for u in usages)
        after = scrape()
        assert after[("mtp_generated_tokens_total", ())] == sum(u["completion_tokens"] for u in usages)
        assert after[("mtp_prompt_tokens_total", ())] == sum(u["prompt_tokens"] for u in usages)
        assert after[("mtp_requests_total", (("endpoint", "/v1/completions"), ("status", "200")))] == 16
        sd = [u["spec_decode"] for u in usages if "spec_decode" in u]
        assert sd, usages[0]
        assert after[("mtp_spec_decode_draft_tokens_total", ())] == sum(x["num_draft_tokens"] for x in sd)
        assert after[("mtp_spec_decode_accepted_tokens_total", ())] == sum(x["num_accepted_tokens"] for x in sd)
        per_pos = sum(v for (name, _), v in after.items() if name == "mtp_spec_decode_draft_tokens_per_pos_total")
        assert per_pos == after[("mtp_spec_decode_draft_tokens_total", ())]
        assert after[("mtp_time_to_first_token_seconds_count", ())] == 16
        assert s.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": -1}, headers=auth)[0] == 400
        assert scrape()[("mtp_requests_total", (("endpoint", "/v1/completions"), ("status", "400")))] == 1
    finally:
        s.stop()


def test_memory_returns_after_a_burst_by_itself():
    """A burst of long prompts and long drafts: the server's resident memory returns to within 15%
    of its idle level once it has been idle for the default --idle-release (it stayed ~2x up)."""
    s = LiveServer(need(MODEL))
    try:
        time.sleep(1)
        idle = s.health()["rss_bytes"]
        long = "".join(f"value_{i} = compute({i}, {i * 3})\n" for i in range(30))

        def one(i):
            return s.request("POST", "/v1/completions", {"prompt": long + f"# {i}\n", "max_tokens": 12,
                                                         "ignore_eos": True, "cache_prompt": False,
                                                         "spec_draft_n_max": 8 if i % 2 else "auto"})[0]

        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(one, range(4))) == [200] * 4
        grown = s.health()["rss_bytes"]
        assert grown > 1.2 * idle, (idle, grown)  # the burst did leave memory behind
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            time.sleep(1)
            now = s.health()["rss_bytes"]
            if now <= 1.15 * idle:
                break
        assert now <= 1.15 * idle, (idle, grown, now)
    finally:
        s.stop()


def test_a_streamed_answer_reports_the_prompts_reading_when_asked(server, tiny):
    """`return_progress` (llama-server's): a streamed answer first reports the prompt's reading,
    chunk by chunk, as empty deltas carrying `prompt_progress` {total, cache, processed, time_ms}
    (processed / total the share read, cache included); a prompt the server keeps is reported as
    reused the next time; without the field nothing changes; a non-boolean is refused."""
    prompt = "".join(f"value_{i} = compute({i}, scale={i % 7})\n" for i in range(48))
    n = len(tiny.tokenizer.encode(prompt))
    assert n > 1100  # three prefill chunks of 512 on this CPU
    runs = []
    for _ in range(2):
        c, resp = server.open_stream("/v1/completions", {"prompt": prompt, "max_tokens": 2, "return_progress": True})
        events = sse_events(resp)
        c.close()
        assert events[-1] == "[DONE]"
        prog = [e["prompt_progress"] for e in events[:-1] if "prompt_progress" in e]
        first_text = next(i for i, e in enumerate(events[:-1]) if e["choices"] and e["choices"][0].get("text"))
        assert prog and all("prompt_progress" not in e for e in events[first_text:-1])
        assert all(p["total"] == n for p in prog) and prog[-1]["processed"] == n
        assert [p["processed"] for p in prog] == sorted(p["processed"] for p in prog)
        assert all(e["choices"][0]["text"] == "" for e in events[:-1] if "prompt_progress" in e)
        runs.append(prog)
    assert runs[0][0]["cache"] == 0 and len(runs[0]) >= 4  # before the first chunk, then each of 3+
    assert runs[1][0]["cache"] > n // 2 and runs[1][0]["processed"] == runs[1][0]["cache"]  # kept from the first
    c, resp = server.open_stream("/v1/completions", {"prompt": prompt, "max_tokens": 2})
    plain = sse_events(resp)
    c.close()
    assert plain[-1] == "[DONE]" and not any("prompt_progress" in e for e in plain[:-1])
    c, resp = server.open_stream("/v1/chat/completions", {"messages": _chat(prompt), "max_tokens": 2,
                                                          "return_progress": True})
    chat = sse_events(resp)
    c.close()
    prog = [e for e in chat[:-1] if "prompt_progress" in e]
    assert prog and all(e["choices"][0]["delta"].get("content") in (None, "") for e in prog)
    assert prog[-1]["prompt_progress"]["processed"] == prog[-1]["prompt_progress"]["total"] > n
    assert any(e["choices"][0]["delta"].get("role") == "assistant" for e in chat[len(prog):-1])
    status, err = server.request("POST", "/v1/completions", {"prompt": "x", "return_progress": "yes"})
    assert status == 400 and "return_progress" in err["error"]["message"]
