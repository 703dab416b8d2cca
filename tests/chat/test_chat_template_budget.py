"""Chat templates render under a budget: real-shaped templates give exactly what a plain Jinja
sandbox gives, hostile ones end in MTPEngineError naming the GGUF field, in bounded time and
memory, and a sample of the fragment fuzzer (scripts/fuzz/fuzz_chat_template.py) holds the same
property."""
from __future__ import annotations

import json
import tracemalloc

import pytest

from tests.template_conversations import reference_env

from tests.chat_templates import TEMPLATES
from tests.conftest import load_script
from mtp_engine.chat.template import RenderLimits, compile_chat_template, render_chat_template
from mtp_engine.errors import MTPEngineError

FIELD = "tokenizer.chat_template"
FILE = "model.gguf"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CHATS = {
    "one user": [{"role": "user", "content": "Hello"}],
    "system + turns": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi  "},
                       {"role": "assistant", "content": "<think>\nplan\n</think>\n\nHello!"},
                       {"role": "user", "content": "naïve 漢字 🙂 'x' * 3 {{ not code }}"}],
    "tools": [{"role": "user", "content": "Weather in Paris?"},
              {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                             "arguments": {"city": "Paris"}}}]},
              {"role": "tool", "content": "18C"}, {"role": "user", "content": "Thanks"}],
    "long": [m for i in range(100) for m in ({"role": "user", "content": f"question {i} " + "word " * 400},
                                              {"role": "assistant", "content": f"answer {i} " + "text " * 400})]
            + [{"role": "user", "content": "x " * 200_000}],
}


def _reference_env():
    """The environment transformers renders with (`template_conversations.reference_env`) and the
    exception its `raise_exception` raises."""
    env = reference_env()
    try:
        env.globals["raise_exception"]("probe")
    except Exception as e:
        return env, type(e)


def _render(source: str, messages, gen: bool, variables, limits=None) -> str:
    t = compile_chat_template(source, file=FILE, field=FIELD)
    return render_chat_template(t, messages, gen, variables, file=FILE, field=FIELD, limits=limits)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_real_templates_render_unchanged(name):
    env, raised = _reference_env()
    ref_t = env.from_string(TEMPLATES[name])
    for chat_name, chat in CHATS.items():
        for gen in (True, False):
            variables = {"bos_token": "<s>", "eos_token": "</s>", "tools": TOOLS if chat_name == "tools" else None}
            try:
                expected = ref_t.render(messages=chat, add_generation_prompt=gen, **variables)
            except raised as e:
                with pytest.raises(MTPEngineError, match="refused the input") as ei:
                    _render(TEMPLATES[name], chat, gen, variables)
                assert str(e) in str(ei.value) and FIELD in str(ei.value)
                continue
            got = _render(TEMPLATES[name], chat, gen, variables)
            assert got == expected, (name, chat_name, gen)
            assert chat[-1]["content"].strip()[:20] in got or chat_name == "tools"


HOSTILE = [
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "characters of output|loop iterations|longer than"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "loop iterations|longer than"),
    ("{{ 'a' * 3000000000 }}", "would build"),
    ("{{ 'x'.ljust(5000000000) }}", "would build"),
    ("{{ 'x'|center(5000000000) }}", "would build"),
    ("{{ '{:>9999999999}'.format(1) }}", "would build"),
    ("{{ '%9999999999s' % 'a' }}", "would build"),
    ("{{ (['x' * 1000000] * 1000)|join }}", "would build"),
    ("{{ ('a' * 1000000)|replace('a', 'bbbbbbbbbbbbbbbb') }}", "would build"),
    ("{{ 'a\tb'.expandtabs(10**8) }}", "would build"),
    ("{{ messages|batch(10**12)|list }}", "would build"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "would build"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "would build"),
    ("{% set x %}{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}{% endset %}", "characters of output"),
    ("{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}", "loop iterations|longer than"),
    ("{% for c in 'x' * 1000000 %}{% for d in 'y' * 1000000 %}{% endfor %}{% endfor %}", "loop iterations|longer than"),
    ("{{ 1/0 }}", "ZeroDivisionError"),
    ("{{ 1 + 'a' }}", "TypeError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursion"),
    ("{% for x in messages recursive %}{{ loop(messages) }}{% endfor %}", "recursion"),
    ("{{ range(10**9) }}", "OverflowError"),
    ("{% include 'x' %}", "TypeError"),
    ("{% extends 'base' %}", "TypeError"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe|undefined"),
    ("{{ cycler.__init__.__globals__ }}", "unsafe"),
    ("{{ lipsum(10**6) }}", "undefined"),
    ("{{ raise_exception('nope') }}", "refused the input: nope"),
    ("{% if %}", "invalid chat template"),
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "invalid chat template"),
]


@pytest.mark.parametrize("source,needle", HOSTILE, ids=[h[0][:40] for h in HOSTILE])
def test_hostile_templates_are_refused(source, needle):
    # small step and time limits keep the test fast; the default limits are exercised by the fuzz run
    limits = RenderLimits(max_steps=20_000, timeout_s=1.0)
    tracemalloc.start()
    try:
        with pytest.raises(MTPEngineError, match=needle) as ei:
            _render(source, CHATS["one user"], True, {}, limits)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ei.value.field == FIELD and ei.value.file == FILE
    assert "\n" not in str(ei.value)
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB"


def test_default_limits_stop_a_hang():
    # the nested loop with the shipped limits: refused (steps or output), not hanging
    with pytest.raises(MTPEngineError, match=FIELD):
        _render(HOSTILE[0][0], CHATS["one user"], True, {})


def test_time_limit():
    src = "{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(40) }}"
    with pytest.raises(MTPEngineError, match="longer than the limit of 0.2 s"):
        _render(src, CHATS["one user"], True, {}, RenderLimits(timeout_s=0.2))


def test_template_source_size_limit():
    with pytest.raises(MTPEngineError, match="expected at most") as ei:
        compile_chat_template("x" * (2 << 20), file=FILE, field=FIELD)
    assert ei.value.field == FIELD


def test_budget_grows_with_the_input():
    # a 3 MB message through a template that outputs it twice still renders (limits scale with input)
    big = [{"role": "user", "content": "z" * 3_000_000}]
    out = _render("{{ messages[0].content }}{{ messages[0].content }}", big, True, {})
    assert len(out) == 6_000_000


def test_fuzz_sample():
    fuzz = load_script("fuzz/fuzz_chat_template")
    make_template, run_case = fuzz.make_template, fuzz.run_case

    limits = RenderLimits(max_steps=50_000, timeout_s=2.0)
    outcomes = {}
    for i in range(150):
        out = run_case(make_template(7, i), limits)
        assert out["outcome"] in ("rendered", "clean_error"), (i, out)
        outcomes[out["outcome"]] = outcomes.get(out["outcome"], 0) + 1
    assert outcomes.get("rendered", 0) > 5 and outcomes.get("clean_error", 0) > 5


# Values other than str and lists that can be made large, and growth through methods the cheap
# call path does not check (encode/decode doubling a string each iteration).
MORE_HOSTILE = [
    ("{{ 'x'.encode() * 5000000000 }}", "would build"),
    ("{{ 'x'.encode().ljust(5000000000) }}", "would build"),
    ("{{ (5).to_bytes(5000000000, 'big') }}", "would build"),
    ("{{ ('a' * 1000).encode().replace('a'.encode(), ('b' * 100000).encode()) }}", "would build"),
    ("{{ ('a' * 100000).translate({97: 'b' * 100000}) }}", "would build"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s.encode('utf-16').decode('latin-1') %}"
     "{% endfor %}", "would build"),
    ("{% set ns = namespace(l=[1, 2]) %}{% for i in range(60) %}{% set ns.l = ns.l + ns.l %}{% endfor %}", "would build"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s + ns.s + ns.s + ns.s %}"
     "{% endfor %}", "would build"),
    ("{{ messages|tojson(indent=3000000000) }}", "would build"),
    ("{% set ns = namespace(s='\\\\') %}{% for i in range(60) %}{% set ns.s = [ns.s]|string %}{% endfor %}",
     "would build"),
    ("{{ ('x' * 1000000)|map('upper')|list|length }}", "loop iterations"),
    ("{{ range(99999)|map('string')|map('upper')|map('lower')|map('trim')|map('upper')|list|length }}{{ f }}"
     * 3, "loop iterations"),
]


@pytest.mark.parametrize("source,needle", MORE_HOSTILE, ids=[h[0][:40] for h in MORE_HOSTILE])
def test_more_hostile_templates_are_refused(source, needle):
    test_hostile_templates_are_refused(source, needle)


def test_top_level_output_is_counted():
    # no loop runs out of steps here: the top level's output (counted per chunk) is what stops it
    src = "{% for i in range(1000) %}{{ 'abcdefghij' * 5 }}-{% endfor %}"
    with pytest.raises(MTPEngineError, match="characters of output"):
        _render(src, CHATS["one user"], True, {}, RenderLimits(max_chars=10_000, chars_per_input_char=0))
    assert len(_render(src, CHATS["one user"], True, {}, RenderLimits(max_chars=60_000))) == 51_000


def test_input_is_measured_only_past_the_base_limit():
    from mtp_engine.chat.budget import Budget

    def measure():
        raise AssertionError("measured")

    b = Budget(RenderLimits(max_chars=100), measure)
    b.emit(60)
    b.size(100, "x")  # within the base limit: the input is not walked
    calls = []
    b = Budget(RenderLimits(max_chars=100, chars_per_input_char=2), lambda: calls.append(1) or 50)
    b.emit(150)  # past 100: measured once, the limit becomes 100 + 2 * 50
    b.size(200, "x")
    assert calls == [1] and b.max_chars == 200
    with pytest.raises(Exception, match="characters of output"):
        b.emit(100)


def test_time_limit_in_a_long_loop_without_other_steps():
    # a long loop is counted item by item, so the clock is read while it runs (100,000 iterations
    # of a 3 MB string would take ~30 s)
    src = "{% for i in range(100000) %}{% set x = 'a' * 3000000 %}{% endfor %}"
    with pytest.raises(MTPEngineError, match="longer than the limit of 0.2 s"):
        _render(src, CHATS["one user"], True, {}, RenderLimits(timeout_s=0.2))


def test_walking_filters_are_charged_per_item_only_when_they_walk_in_python():
    chat = [{"role": "user", "content": "x" * 200_000}]
    limits = RenderLimits(max_steps=2_000)
    # join without an attribute is str.join: no per-item Python work, one step
    assert _render("{{ messages[0].content|join('')|length }}", chat, True, {}, limits) == "200000"
    with pytest.raises(MTPEngineError, match="loop iterations"):  # with one, each item is a lookup
        _render("{{ (messages * 3000)|join(',', attribute='role')|length }}", chat, True, {}, limits)
    with pytest.raises(MTPEngineError, match="loop iterations"):
        _render("{{ messages[0].content|map('upper')|list|length }}", chat, True, {}, limits)


def test_indented_json_is_the_json_modules_text():
    # tojson(indent=...) under a budget is written by template_json, not json.dumps: the same text,
    # and the same errors, over a seeded sample of values, indents, separators and key types
    import random

    from markupsafe import Markup

    from mtp_engine.chat.tojson import indented_json

    rng = random.Random(15)
    scalars = [0, -7, 2**70, True, False, None, 1.5, -0.0, float("nan"), float("inf"), -float("inf"), "",
               "é\n\"\\x\u2028", "\ud83d\ude00", Markup("<b>"), "\x00\x1f"]
    keys = ["k", "", "é", "a", 1, 2.5, True, False, None]

    def value(depth=0):
        r = rng.random()
        if depth > 4 or r < 0.35:
            return rng.choice(scalars + ([object()] if rng.random() < 0.02 else []))
        if r < 0.6:
            items = [value(depth + 1) for _ in range(rng.randint(0, 4))]
            return tuple(items) if rng.random() < 0.2 else items
        return {rng.choice(keys + ([(1,)] if rng.random() < 0.03 else [])): value(depth + 1)
                for _ in range(rng.randint(0, 4))}

    def outcome(f):
        try:
            return f()
        except Exception as e:  # noqa: BLE001 - the error is part of what is compared
            return type(e).__name__, str(e)

    for _ in range(3000):
        v = value()
        if rng.random() < 0.02:
            v = [v]
            v.append(v)  # circular
        indent = rng.choice([0, 1, 4, -2, True, "\t", "ab"])
        ascii_, sort = rng.random() < 0.5, rng.random() < 0.2
        seps = rng.choice([None, (",", ": "), (" , ", ":"), ("", "")])
        item, key = seps or (",", ": ")
        expected = outcome(lambda: json.dumps(v, indent=indent, ensure_ascii=ascii_, separators=seps, sort_keys=sort))
        got = outcome(lambda: indented_json(v, ensure_ascii=ascii_, indent=indent, item_separator=item,
                                            key_separator=key, sort_keys=sort, limit=1 << 40, over=lambda n: 1 << 40))
        assert got == expected, (v, indent, seps)


def _tojson_refused_within(src: str, max_bytes: int) -> None:
    """The render is refused for its tojson, having allocated less than `max_bytes` at its peak."""
    tracemalloc.start()
    try:
        with pytest.raises(MTPEngineError, match="the filter tojson would build"):
            _render(src, CHATS["one user"], True, {})
        assert tracemalloc.get_traced_memory()[1] < max_bytes
    finally:
        tracemalloc.stop()


def test_indented_json_is_refused_before_it_is_built():
    # 400 levels of nesting at an indent of 100,000: ~8 GB of indentation as text
    src = "{% set ns = namespace(v=1) %}{% for i in range(400) %}{% set ns.v = [ns.v] %}{% endfor %}" \
          "{{ ns.v|tojson(indent=100000) }}"
    _tojson_refused_within(src, 200 << 20)
    # within the budget it is the json module's text, and the input's share widens the budget
    tools = {"tools": TOOLS * 50}
    src = "{{ tools|tojson(indent=4) }}"
    assert _render(src, CHATS["one user"], True, tools, RenderLimits(max_chars=5_000)) == json.dumps(tools["tools"], indent=4)
    with pytest.raises(MTPEngineError, match="the filter tojson would build"):
        _render(src, CHATS["one user"], True, tools, RenderLimits(max_chars=5_000, chars_per_input_char=0))


def test_compact_json_size_is_the_json_modules_length():
    # the size compact tojson is checked against before it is built: exactly the length of
    # json.dumps's text wherever json.dumps succeeds, over a seeded sample with shared parts
    import random

    from markupsafe import Markup

    from mtp_engine.chat.tojson import compact_json_bound, compact_json_size

    rng = random.Random(16)
    scalars = [0, -7, 2**70, True, False, None, 1.5, -0.0, float("nan"), float("inf"), -float("inf"), "",
               "é\n\"\\x\u2028", "\ud83d\ude00", "🎉", Markup("<b>"), "\x00\x1f", "🎉🎉\x01", 10**50, 5e-324]
    keys = ["k", "", "é", "a", 1, 2.5, True, False, None, -3, 10**40, -1.2345678901234567e-308, Markup("\x01"), "\x00🎉"]
    made = []

    def value(depth=0):
        r = rng.random()
        if made and r < 0.1:
            return rng.choice(made)  # a part used twice
        if depth > 4 or r < 0.4:
            return rng.choice(scalars)
        if r < 0.65:
            v = [value(depth + 1) for _ in range(rng.randint(0, 4))]
            v = tuple(v) if rng.random() < 0.2 else v
        else:
            v = {rng.choice(keys): value(depth + 1) for _ in range(rng.randint(0, 4))}
        made.append(v)
        return v

    for _ in range(3000):
        v = value()
        ascii_ = rng.random() < 0.5
        item, key = rng.choice([(", ", ": "), (",", ":"), (" , ", " :: ")])
        expected = len(json.dumps(v, ensure_ascii=ascii_, separators=(item, key)))
        got = compact_json_size(v, ensure_ascii=ascii_, item_separator=item, key_separator=key,
                                limit=1 << 40, over=lambda n: 1 << 40)
        assert got == expected, (v, ascii_, item, key)
        # the quick bound that decides whether to count exactly is never below it
        assert compact_json_bound(v, ensure_ascii=ascii_, item_separator=item, key_separator=key) >= expected


@pytest.mark.parametrize("src", [
    "{% set a = ['x' * 3000] * 1000 %}{{ ([a] * 1000)|tojson }}",  # 3 GB of text from two small lists
    "{% set a = {'k': 'x' * 3000} %}{% set ns = namespace(v=[a]) %}"
    "{% for i in range(12) %}{% set ns.v = [ns.v] * 10 %}{% endfor %}{{ ns.v|tojson }}",  # 10^12 copies
    "{% set a = 'y' * 1000 %}{{ ([a] * 1000000)|tojson(separators=(',', ':')) }}",
])
def test_compact_json_of_shared_parts_is_refused_before_it_is_built(src):
    _tojson_refused_within(src, 100 << 20)
    # the same shapes, small, are the json module's text
    small = src.replace("3000", "3").replace("1000000", "10").replace("1000", "10").replace("range(12)", "range(2)")
    assert _render(small, CHATS["one user"], True, {}) == reference_env().from_string(small).render(
        messages=CHATS["one user"], add_generation_prompt=True)


def test_compact_json_counted_exactly_when_the_quick_bound_is_over():
    # 10 x 1,000 'x': 10,021 characters of JSON, a quick bound of ~60,000 (every character
    # escaped): under a 20,000 budget it renders, counted exactly; under 10,000 it is refused
    src = "{{ (['x' * 1000] * 10)|tojson }}"
    limits = RenderLimits(max_chars=20_000, chars_per_input_char=0)
    assert _render(src, CHATS["one user"], True, {}, limits) == json.dumps(["x" * 1000] * 10)
    with pytest.raises(MTPEngineError, match="the filter tojson would build"):
        _render(src, CHATS["one user"], True, {}, RenderLimits(max_chars=10_000, chars_per_input_char=0))


@pytest.mark.parametrize("source", [
    "{{ 'a' + messages[0].content + 'b' }}",  # led by a literal, at the top level: Python's +
    "{{ 'a' + 1 }}",  # TypeError, as the plain sandbox raises it
    "{{ 'a' + undefined_name }}",
    "{% for m in messages %}{{ '<' + m.role + '>' + m.content|trim + '</' + m.role + '>' }}{% endfor %}",
    "{% macro f(m) %}{{ 'x' + m }}{% endmacro %}{{ f('y') }}",  # captured: the hook
    "{{ messages[0].content + 'z' }}",  # led by a variable: the hook
])
def test_plus_chains_render_as_the_plain_sandbox(source):
    env, _ = _reference_env()
    chat = CHATS["system + turns"]
    try:
        expected = env.from_string(source).render(messages=chat, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - then the engine gives its error
        with pytest.raises(MTPEngineError):
            _render(source, chat, True, {})
        return
    assert _render(source, chat, True, {}) == expected


def test_top_level_plus_chain_output_is_counted():
    # a chain led by a literal goes straight into the output: the output's count is its check
    src = "{% set s = 'x' * 900 %}{% for i in range(100) %}{{ '-' + s + s + s + s }}{% endfor %}"
    with pytest.raises(MTPEngineError, match="characters of output"):
        _render(src, CHATS["one user"], True, {}, RenderLimits(max_chars=100_000, chars_per_input_char=0))
    assert len(_render(src, CHATS["one user"], True, {}, RenderLimits(max_chars=400_000))) == 360_100
