"""Tool calling on the chat endpoint: the format read from real chat templates, the model's
tool-call blocks parsed (XML with schema types, JSON), streamed in any cut the same as whole,
malformed or cut blocks kept as text, request checks, and the answer built from generated chunks
(non-streamed and streamed) by the server's own Generation."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings, strategies as st

from mtp_engine.generation.loop import Chunk
from mtp_engine.server.schemas import APIError, ServerDefaults, parse_chat
from mtp_engine.errors import MTPEngineError
from mtp_engine.chat.tool_calls import (
    HERMES, XML, ToolCallStream, check_tool_list, message_tool_calls, split_tool_calls, template_format,
)

TEMPLATES = Path(__file__).resolve().parent.parent / "fixtures" / "chat_templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "hours": {"type": "array"}, "where": {"type": "object"}, "ratio": {"type": "number"}}}}}]
XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
            "<parameter=hours>\n[1, 2]\n</parameter>\n<parameter=where>\n{\"lat\": 1.5}\n</parameter>\n"
            "<parameter=ratio>\n0.5\n</parameter>\n</function>\n</tool_call>")
XML_ARGS = {"city": "San Francisco, CA", "days": 3, "metric": True, "hours": [1, 2], "where": {"lat": 1.5}, "ratio": 0.5}


def _args(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


@pytest.mark.parametrize("name, fmt", [("Qwen3.5-4B", XML), ("Qwen-Qwen3-0.6B", HERMES), ("Qwen-QwQ-32B", HERMES),
                                       ("microsoft-Phi-3.5-mini-instruct", None)])
def test_format_is_read_from_the_template(name, fmt):
    assert template_format((TEMPLATES / f"{name}.jinja").read_text()) == fmt


def test_chatml_fallback_renders_no_tools():
    from mtp_engine.chat.template import CHATML

    assert template_format(CHATML) is None and template_format(None) is None


def test_xml_call_typed_by_the_schema():
    content, calls = split_tool_calls("Let me look.\n\n" + XML_CALL, XML, TOOLS)
    assert content == "Let me look."
    assert [c["function"]["name"] for c in calls] == ["get_weather"] and _args(calls[0]) == XML_ARGS
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")


def test_xml_values_that_do_not_fit_their_type_stay_strings():
    text = XML_CALL.replace("\n3\n", "\nthree\n").replace("\ntrue\n", "\nyes\n")
    _, calls = split_tool_calls(text, XML, TOOLS)
    assert _args(calls[0])["days"] == "three" and _args(calls[0])["metric"] == "yes"
    _, calls = split_tool_calls(XML_CALL.replace("get_weather", "unknown_tool"), XML, TOOLS)
    assert _args(calls[0])["days"] == "3"  # no schema: the text as written


def test_several_calls_and_only_calls():
    two = XML_CALL + "\n" + XML_CALL.replace("San Francisco, CA", "Paris")
    content, calls = split_tool_calls(two, XML, TOOLS)
    assert content is None and [_args(c)["city"] for c in calls] == ["San Francisco, CA", "Paris"]
    assert calls[0]["id"] != calls[1]["id"]


def test_hermes_json_call():
    text = 'ok\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    content, calls = split_tool_calls(text, HERMES, TOOLS)
    assert content == "ok" and _args(calls[0]) == {"city": "Paris", "days": 2}


@pytest.mark.parametrize("text", [
    "<tool_call>\n{not json}\n</tool_call>",  # does not parse
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar",  # cut by max_tokens
    "plain answer, no call",
    "a < b and <tool_ in the text",
])
def test_what_is_not_a_call_stays_text(text):
    fmt = HERMES if "{" in text else XML
    content, calls = split_tool_calls(text, fmt, TOOLS)
    assert calls == [] and content == text


@pytest.mark.parametrize("fmt, text", [
    (XML, "Checking both.\n\n" + XML_CALL + "\n" + XML_CALL.replace("3", "4")),
    (HERMES, 'x <tool_call>\n{"name": "get_weather", "arguments": {"city": "P"}}\n</tool_call>\n<tool_call>\n{bad'),
    (XML, "no calls at all, but <tool and <tool_call fragments <"),
    (XML, XML_CALL + "\n<tool_call>\nnot a function</tool_call>\n\nthen text\n" + XML_CALL + "  \n"),
])
def test_streamed_in_any_cut_equals_whole(fmt, text):
    whole_content, whole_calls = split_tool_calls(text, fmt, TOOLS)
    for cut in range(len(text) + 1):
        for size in (1, 3, 7):
            s = ToolCallStream(fmt, TOOLS)
            pieces = [text[:cut]] + [text[i:i + size] for i in range(cut, len(text), size)]
            content, calls = [], []
            for p in pieces:
                c, new = s.feed(p)
                content.append(c)
                calls.extend(new)
            content.append(s.finish())
            streamed = "".join(content)
            assert [_args(c) for c in calls] == [_args(c) for c in whole_calls]
            assert streamed.strip() == (whole_content or "").strip()
            assert "San Francisco" not in streamed  # a parsed call's text is never shown as content


def test_request_checks():
    d = ServerDefaults()
    msgs = [{"role": "user", "content": "hi"}]
    assert parse_chat({"messages": msgs, "tools": TOOLS}, d).tools == TOOLS
    assert parse_chat({"messages": msgs, "tools": TOOLS, "tool_choice": "none"}, d).tools is None
    assert parse_chat({"messages": msgs, "tools": TOOLS, "tool_choice": "required"}, d).forced_call == \
        {"name": None, "parallel": True}
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert parse_chat({"messages": msgs, "tools": TOOLS, "tool_choice": named, "parallel_tool_calls": False},
                      d).forced_call == {"name": "get_weather", "parallel": False}
    for body, field in [({"tool_choice": "required"}, "tool_choice"),  # no tools to call
                        ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
                        ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
                        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
                        ({"tools": [{"type": "code_interpreter"}]}, "tools"),
                        ({"tools": "x"}, "tools"),
                        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
                        ({"functions": [{"name": "f"}]}, "functions"),
                        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls")]:
        with pytest.raises(APIError) as e:
            parse_chat({"messages": msgs, **body}, d)
        assert e.value.status == 400 and e.value.param == field, body


def test_earlier_tool_calls_reach_the_template_as_mappings():
    d = ServerDefaults()
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    clean = parse_chat({"messages": msgs, "tools": TOOLS}, d).kwargs["messages"]
    assert clean[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert clean[2] == {"role": "tool", "content": "18C", "tool_call_id": "call_1"}
    with pytest.raises(MTPEngineError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"):
        message_tool_calls(1, [{"function": {"name": "f", "arguments": "{oops"}}])
    with pytest.raises(APIError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"):
        parse_chat({"messages": [msgs[0], {"role": "assistant", "content": None, "tool_calls": [
            {"function": {"name": "f", "arguments": "{oops"}}]}]}, d)
    assert parse_chat({"messages": msgs}, d).tools is None
    with pytest.raises(MTPEngineError, match=r"tools\[0\]\.function\.name: expected a non-empty string"):
        check_tool_list([{"type": "function", "function": {"name": " "}}])


# ---- the answer, from generated chunks --------------------------------------------------------

def _generation(tools, stream: bool, trace: bool = False):
    from mtp_engine.server.answer import Generation, ServerState
    from mtp_engine.server.schemas import GenRequest
    from mtp_engine.server.worker import Event, Job

    template = (TEMPLATES / "Qwen3.5-4B.jinja").read_text()
    model = SimpleNamespace(tokenizer=SimpleNamespace(chat_template=template))
    state = ServerState(SimpleNamespace(model=model), ServerDefaults(), "m", 0)
    req = GenRequest("chat", {}, stream, False, trace, None, tools)
    loop = asyncio.new_event_loop()
    from mtp_engine.chat.tool_calls import template_format
    job = Job(SimpleNamespace(tool_format=template_format(template) if tools else None), trace, loop)
    return Generation(state, req, job), job, Event, loop


def _events(Event, pieces: list[str], finish: str):
    stats = {"generated_tokens": len(pieces), "decode_tokens_per_second": 1.0}
    evs = [Event("chunk", Chunk(p, [i], drafted=[False]), [p]) for i, p in enumerate(pieces)]
    evs.append(Event("chunk", Chunk("", [], finish_reason=finish, stats=stats)))
    evs.append(Event("done", prompt_tokens=3))
    return evs


def _run(gen, job, loop, evs, stream: bool):
    request = SimpleNamespace(is_disconnected=lambda: asyncio.sleep(0, result=False))

    async def go():
        for e in evs[1:]:
            job.put(e)
        if not stream:
            return await gen.collect(evs[0], request)
        # one write may carry several SSE events (every chunk that had arrived)
        text = "".join([s async for s in gen.stream(evs[0], request)])
        return [json.loads(e[6:]) for e in text.split("\n\n") if e and e != "data: [DONE]"]

    try:
        return loop.run_until_complete(go())
    finally:
        loop.close()


def _pieces(text: str, size: int = 5) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def test_answer_with_a_call_not_streamed():
    gen, job, Event, loop = _generation(TOOLS, stream=False)
    body = _run(gen, job, loop, _events(Event, _pieces("I'll check.\n\n" + XML_CALL), "stop"), False)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "I'll check."
    assert _args(choice["message"]["tool_calls"][0]) == XML_ARGS


def test_answer_with_a_call_streamed():
    gen, job, Event, loop = _generation(TOOLS, stream=True)
    out = _run(gen, job, loop, _events(Event, _pieces("I'll check.\n\n" + XML_CALL + "\n" + XML_CALL), "stop"), True)
    deltas = [c["choices"][0]["delta"] for c in out if c.get("choices")]
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert content.strip() == "I'll check." and "<tool_call>" not in content
    assert [tc["index"] for tc in calls] == [0, 1] and all(_args(tc) == XML_ARGS for tc in calls)
    assert deltas[0]["role"] == "assistant" and sum("role" in d for d in deltas) == 1
    assert out[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_cut_call_streamed_comes_back_as_text():
    gen, job, Event, loop = _generation(TOOLS, stream=True)
    text = "ok " + XML_CALL[:40]
    out = _run(gen, job, loop, _events(Event, _pieces(text), "length"), True)
    deltas = [c["choices"][0]["delta"] for c in out if c.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == text
    assert out[-1]["choices"][0]["finish_reason"] == "length"


def test_without_tools_the_answer_is_unchanged():
    gen, job, Event, loop = _generation(None, stream=False)
    body = _run(gen, job, loop, _events(Event, _pieces(XML_CALL), "stop"), False)
    assert body["choices"][0]["message"] == {"role": "assistant", "content": XML_CALL}
    assert body["choices"][0]["finish_reason"] == "stop"


# ---- the Python API -----------------------------------------------------------------------------

@pytest.fixture
def qwen35_tiny(tiny_q4):
    """The tiny model with Qwen3.5's chat template for the length of a test."""
    tiny_q4.tokenizer.chat_template = (TEMPLATES / "Qwen3.5-4B.jinja").read_text()
    try:
        yield tiny_q4
    finally:
        tiny_q4.tokenizer.chat_template = None


def test_generate_renders_tools_and_earlier_calls(qwen35_tiny):
    from mtp_engine import generate

    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    r = generate(messages=msgs, model=qwen35_tiny, tools=TOOLS, max_tokens=4, spec="draft-mtp", n_max=2)
    text = qwen35_tiny.tokenizer.decode(r.prompt_token_ids)
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text  # the earlier call
    assert '"name": "get_weather"' in text  # the tool list
    assert r.tool_calls == split_tool_calls(r.text, XML, TOOLS)[1]  # what the text holds (this model writes none)
    plain = generate(messages=msgs, model=qwen35_tiny, max_tokens=0)
    assert len(plain.prompt_token_ids) < len(r.prompt_token_ids)  # without tools: no tool list


def test_generate_refuses_tools_it_cannot_use(tiny_q4, qwen35_tiny):
    from mtp_engine import generate

    with pytest.raises(MTPEngineError) as e:
        generate("x", model=qwen35_tiny, tools=TOOLS, max_tokens=1)
    assert e.value.field == "tools" and "messages" in str(e.value)
    with pytest.raises(MTPEngineError) as e:
        generate(messages=[{"role": "user", "content": "x"}], model=qwen35_tiny, tools=[{"type": "function"}])
    assert e.value.field == "tools[0]"
    from mtp_engine.chat.template import CHATML

    qwen35_tiny.tokenizer.chat_template = CHATML
    with pytest.raises(MTPEngineError, match="does not render tools") as e:
        generate(messages=[{"role": "user", "content": "x"}], model=qwen35_tiny, tools=TOOLS, max_tokens=1)
    assert e.value.field == "tools"
    assert "--chat-template-file" in str(e.value) and "chat_template" in str(e.value)  # the fix, named


PING = {"type": "function", "function": {"name": "ping", "description": "no arguments"}}
SET_MODE = {"type": "function", "function": {"name": "set_mode", "parameters": {
    "type": "object", "properties": {"mode": {"type": "string", "enum": ["on", "off"]}},
    "required": ["mode"], "additionalProperties": False}}}


@pytest.mark.parametrize("fmt, tools, name", [(XML, [PING, *TOOLS], "ping"), (HERMES, [SET_MODE, *TOOLS], "set_mode")])
def test_a_forced_call_is_a_call_plain_and_draft_mtp(tiny_q4, fmt, tools, name):
    """tool_choice naming a tool: the answer is exactly one call to it in the template's format
    (plain and draft-mtp alike), which the parser turns back into that call."""
    from mtp_engine import generate
    from mtp_engine.chat.tool_calls import forced_call_constraint

    c = forced_call_constraint(fmt, tools, name, parallel=False)
    plain = generate("x", model=tiny_q4, max_tokens=150, constraint=c)
    assert plain.finish_reason == "stop", plain.text
    content, calls = split_tool_calls(plain.text, fmt, tools)
    assert content is None and [x["function"]["name"] for x in calls] == [name]
    if name == "set_mode":
        assert _args(calls[0])["mode"] in ("on", "off")
    spec = generate("x", model=tiny_q4, max_tokens=150, constraint=c, spec="draft-mtp", n_max=3)
    assert spec.token_ids == plain.token_ids


def test_forced_call_refusals():
    from mtp_engine.chat.tool_calls import forced_call_constraint, tool_choice_name

    with pytest.raises(MTPEngineError, match="no tool named"):
        forced_call_constraint(XML, TOOLS, "nope")
    odd = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a>b": {}}}}}]
    with pytest.raises(MTPEngineError, match="letters, digits"):
        forced_call_constraint(XML, odd)
    assert tool_choice_name("auto") == (False, None) and tool_choice_name("required") == (True, None)
    with pytest.raises(MTPEngineError):
        tool_choice_name({"type": "function", "function": {}})


def test_generate_tool_choice(qwen35_tiny):
    from mtp_engine import generate

    msgs = [{"role": "user", "content": "ping it"}]
    r = generate(messages=msgs, model=qwen35_tiny, tools=[PING, *TOOLS], max_tokens=80,
                 tool_choice={"type": "function", "function": {"name": "ping"}})
    assert [c["function"]["name"] for c in r.tool_calls] == ["ping"]
    from mtp_engine import stream_generate

    chunks = list(stream_generate(messages=msgs, model=qwen35_tiny, tools=[PING, *TOOLS], max_tokens=80,
                                  tool_choice="required", spec="draft-mtp", n_max=2))
    assert chunks[-1].tool_calls and all(c.tool_calls is None for c in chunks[:-1])
    assert chunks[-1].tool_calls[0]["function"]["name"] in {"ping", "get_weather"}
    none = generate(messages=msgs, model=qwen35_tiny, tools=TOOLS, max_tokens=0, tool_choice="none")
    bare = generate(messages=msgs, model=qwen35_tiny, max_tokens=0)
    assert none.prompt_token_ids == bare.prompt_token_ids and none.tool_calls == []
    with pytest.raises(MTPEngineError) as e:
        generate(messages=msgs, model=qwen35_tiny, tool_choice="required", max_tokens=1)
    assert e.value.field == "tool_choice"


_FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "</tool", "<function=get_weather>", "</function>",
              "<parameter=city>", "</parameter>", "\n", " ", "Paris", "{", "}", '"name": "get_weather"',
              '"arguments": {"city": "P"}', "<", ">", "=", "é", "🎉", XML_CALL]


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(st.sampled_from(_FRAGMENTS), max_size=30), cuts=st.lists(st.integers(1, 9), min_size=1,
                                                                                max_size=20),
       fmt=st.sampled_from([XML, HERMES]))
def test_any_text_streams_as_it_parses_whole(parts, cuts, fmt):
    """Model output is arbitrary text: whatever it holds and however it arrives, the stream never
    raises, loses no non-space text outside the calls it parsed, and agrees with the whole parse."""
    text = "".join(parts)
    whole_content, whole_calls = split_tool_calls(text, fmt, TOOLS)
    s, pos, i = ToolCallStream(fmt, TOOLS), 0, 0
    content, calls = [], []
    while pos < len(text):
        n = cuts[i % len(cuts)]
        c, new = s.feed(text[pos:pos + n])
        content.append(c)
        calls.extend(new)
        pos, i = pos + n, i + 1
    content.append(s.finish())
    assert [x["function"] for x in calls] == [x["function"] for x in whole_calls]
    assert "".join(content).strip() == (whole_content or "").strip()
    if not whole_calls:
        assert whole_content == text  # nothing parsed: every character is still there


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"type": "string", "enum": ["c", "f"]}, "alerts": {"type": "boolean"}},
    "required": ["city", "days"]}}}


def _xml_call(*params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function=get_weather>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize("text, ok", [
    (_xml_call(("city", "Paris"), ("days", "3")), True),
    (_xml_call(("city", "New York\nor near it"), ("days", "-12"), ("unit", "f"), ("alerts", "true")), True),
    (_xml_call(("city", "Paris")), False),  # a required parameter missing
    (_xml_call(("city", "Paris"), ("days", "three")), False),  # not an integer
    (_xml_call(("city", "Paris"), ("days", "3"), ("unit", "k")), False),  # not in the enum
    (_xml_call(("city", "Paris"), ("city", "Rome"), ("days", "3")), False),  # twice
    (_xml_call(("city", "Paris"), ("days", "3"), ("alerts", "yes")), False),  # not a boolean
    (_xml_call(("city", "Paris"), ("days", "3"))[:-len("</tool_call>")], False),  # not closed
])
def test_forced_xml_call_follows_the_schema(tiny_q4, text, ok):
    """Qwen3.5's own format: the forced call's grammar takes the required parameters once each,
    typed values and the closing tags (it once left values free and parameters optional and
    repeatable, and the model looped on <parameter=...> without ever closing the call)."""
    from mtp_engine.chat.tool_calls import forced_call_constraint

    tok = tiny_q4.tokenizer
    state = forced_call_constraint(XML, [WEATHER], "get_weather", parallel=False).matcher(
        tok, tiny_q4.model.cfg.vocab_size)
    ids = tok.encode(text)
    followed = state.allowed_after(ids) is not None
    if followed:
        walker = state.m.deep_copy()
        for t in ids:
            walker.consume_token(t)
        followed = walker.is_accepting()
    assert followed == ok


def test_forced_xml_call_generated_is_typed_by_the_schema(qwen35_tiny):
    """A real Qwen3.5 template, tool_choice naming the tool: the answer is one call whose parsed
    arguments are what the schema asks for (typed scalars only: a free string value has no end
    this random model would reach)."""
    from mtp_engine import generate

    tool = {"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer"}, "loud": {"type": "boolean"},
                                         "tone": {"type": "string", "enum": ["bell", "beep"]}},
        "required": ["hour", "loud", "tone"]}}}
    msgs = [{"role": "user", "content": "Wake me up"}]
    for spec in ("none", "draft-mtp"):
        r = generate(messages=msgs, model=qwen35_tiny, tools=[tool], max_tokens=200, spec=spec,
                     tool_choice={"type": "function", "function": {"name": "set_alarm"}})
        assert r.tool_calls, r.text  # parallel calls allowed (OpenAI's default): this model writes several
        for call in r.tool_calls:
            args = json.loads(call["function"]["arguments"])
            assert call["function"]["name"] == "set_alarm" and set(args) == {"hour", "loud", "tone"}
            assert isinstance(args["hour"], int) and isinstance(args["loud"], bool)
            assert args["tone"] in ("bell", "beep")
