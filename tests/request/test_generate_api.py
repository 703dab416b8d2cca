"""The Python API: `load`, `generate`, `stream_generate` and `GenerationResult`.

Most tests run on llama.cpp's tiny fixture (vocabulary 512, fast; its EOS never wins greedily);
a few use the default code model (vocabulary 8192, ~25 tok/s here) for EOS and for speculative
rounds that accept several drafts. Generations are kept short.
"""
from __future__ import annotations

import math

import pytest

from tests.conftest import SHIPPED, TINY_Q8, need
from mtp_engine import GenerationResult, MTPEngineError, load, stream_generate
from mtp_engine import generate
from mtp_engine import api

CODE = SHIPPED
PROMPT = "To be"
CODE_PROMPT = "def parse_args(argv):"
# the code model ends the file (greedy <|endoftext|>) right after "())\n"
EOS_PROMPT = 'if __name__ == "__main__":\n    sys.exit(main'
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
STATS_KEYS = {"prompt_tokens", "generated_tokens", "prompt_tokens_per_second", "decode_tokens_per_second",
              "peak_memory_bytes"}
SPEC_KEYS = {"rounds", "drafted", "accepted", "acceptance_rate", "mean_accepted_length",
             "acceptance_per_position", "accepted_length_histogram", "decode_tokens_per_second"}


@pytest.fixture(scope="module")
def tiny(models):
    return models(TINY_Q8)


@pytest.fixture(scope="module")
def code(shipped_model):
    return shipped_model


@pytest.fixture(scope="module")
def tiny_greedy(tiny) -> GenerationResult:
    """32 greedy tokens after PROMPT (no stop, no EOS on this model)."""
    return generate(PROMPT, tiny, max_tokens=32)


@pytest.fixture(scope="module")
def code_greedy(code) -> GenerationResult:
    return generate(CODE_PROMPT, code, max_tokens=16)


def _field(e: MTPEngineError) -> str:
    """The error's field in the API's spelling (DraftParams names its fields n-min, p-min)."""
    return (e.field or "").replace("-", "_")


# ---------------------------------------------------------------------------------------- results

def test_generate_result_fields(tiny, tiny_greedy):
    r = tiny_greedy
    assert isinstance(r, GenerationResult)
    assert isinstance(r.text, str) and r.text
    assert r.prompt_token_ids == tiny.tokenizer.encode(PROMPT)
    assert len(r.token_ids) == 32 and all(isinstance(t, int) for t in r.token_ids)
    assert r.finish_reason == "length"
    assert r.text == tiny.tokenizer.decode(r.token_ids)
    assert STATS_KEYS <= r.stats.keys()
    assert r.stats["prompt_tokens"] == len(r.prompt_token_ids)
    assert r.stats["generated_tokens"] == len(r.token_ids)
    assert r.stats["prompt_tokens_per_second"] > 0
    assert r.stats["decode_tokens_per_second"] > 0
    assert r.stats["peak_memory_bytes"] > 0
    j = r.to_json()
    assert set(j) == {"text", "prompt_token_ids", "token_ids", "finish_reason", "stats"}
    assert j["token_ids"] == r.token_ids


def test_plain_stats_have_no_draft_keys(tiny_greedy):
    assert "rounds" not in tiny_greedy.stats and "profile" not in tiny_greedy.stats


@pytest.mark.parametrize("n", [1, 2, 5, 17])
def test_max_tokens_respected(tiny, tiny_greedy, n):
    r = generate(PROMPT, tiny, max_tokens=n)
    assert r.token_ids == tiny_greedy.token_ids[:n]
    assert r.finish_reason == "length"
    assert r.text == tiny.tokenizer.decode(r.token_ids)
    assert r.stats["generated_tokens"] == n


@pytest.mark.parametrize("spec", [None, "draft-mtp"])
def test_max_tokens_zero(tiny, spec):
    r = generate(PROMPT, tiny, max_tokens=0, spec=spec)
    assert r.text == "" and r.token_ids == []
    assert r.prompt_token_ids == tiny.tokenizer.encode(PROMPT)
    assert r.finish_reason == "length"
    assert r.stats["generated_tokens"] == 0
    chunks = list(stream_generate(PROMPT, tiny, max_tokens=0, spec=spec))
    assert len(chunks) == 1 and chunks[0].finish_reason == "length" and chunks[0].token_ids == []


def test_prompt_as_token_ids(tiny, tiny_greedy):
    ids = tiny.tokenizer.encode(PROMPT)
    r = generate(ids, tiny, max_tokens=32)
    assert r.prompt_token_ids == ids
    assert r.token_ids == tiny_greedy.token_ids and r.text == tiny_greedy.text
    r2 = generate(tuple(ids), tiny, max_tokens=4)
    assert r2.token_ids == tiny_greedy.token_ids[:4]


def test_prompt_ids_at_context_length_with_no_new_tokens(tiny):
    ctx = tiny.model.cfg.context_length
    r = generate([1] * ctx, tiny, max_tokens=0)
    assert r.token_ids == [] and len(r.prompt_token_ids) == ctx


def test_model_by_path(tiny_greedy):
    r = generate(PROMPT, str(TINY_Q8), max_tokens=6)
    assert r.token_ids == tiny_greedy.token_ids[:6]


def test_default_model_path(monkeypatch):
    need(CODE)
    monkeypatch.delenv("MTP_ENGINE_MODEL", raising=False)
    assert api.default_model_path().resolve() == CODE.resolve()
    monkeypatch.setenv("MTP_ENGINE_MODEL", str(TINY_Q8))
    assert api.default_model_path() == TINY_Q8


# ---------------------------------------------------------------------------------------- chat

@pytest.fixture
def tiny_chat():
    """A separate tiny model whose tokenizer gets a chat template (the fixture has none)."""
    m = load(need(TINY_Q8))
    m.tokenizer.chat_template = TEMPLATE
    return m


def test_messages_with_chat_template(tiny_chat):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "To be"}]
    r = generate(model=tiny_chat, messages=msgs, max_tokens=6)
    rendered = tiny_chat.tokenizer.apply_chat_template(msgs, add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nTo be<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert r.prompt_token_ids == tiny_chat.tokenizer.encode(rendered)
    im_start = tiny_chat.tokenizer.token_to_id("<|im_start|>")
    assert im_start is not None and r.prompt_token_ids.count(im_start) == 3
    assert len(r.token_ids) == 6
    # the same as giving the rendered text as the prompt
    assert generate(rendered, tiny_chat, max_tokens=6).token_ids == r.token_ids
    streamed = list(stream_generate(model=tiny_chat, messages=msgs, max_tokens=6))
    assert [t for c in streamed for t in c.token_ids] == r.token_ids


def test_chat_template_reassignment_takes_effect(tiny_chat):
    msgs = [{"role": "user", "content": "hi"}]
    a = generate(model=tiny_chat, messages=msgs, max_tokens=0).prompt_token_ids
    tiny_chat.tokenizer.chat_template = "{{ messages[0].content }} and more"
    b = generate(model=tiny_chat, messages=msgs, max_tokens=0).prompt_token_ids
    assert b == tiny_chat.tokenizer.encode("hi and more") and a != b


def test_messages_without_chat_template(tiny):
    """A model without a template chats in ChatML, as the command line, the server and llama.cpp
    do (one preparation for all of them), and the API says so with a warning."""
    assert tiny.tokenizer.chat_template is None
    with pytest.warns(UserWarning, match="ChatML"):
        r = generate(model=tiny, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.prompt_token_ids == tiny.tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tiny.tokenizer.chat_template is None  # the model is left as it was


def test_prompt_and_messages_exclusive(tiny_chat):
    with pytest.raises(MTPEngineError) as ei:
        generate("x", tiny_chat, messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert ei.value.field == "prompt"
    with pytest.raises(MTPEngineError) as ei:
        generate(model=tiny_chat, max_tokens=1)
    assert ei.value.field == "prompt"


# ---------------------------------------------------------------------------------------- streaming

@pytest.mark.parametrize("spec", [None, "draft-mtp"])
def test_stream_matches_generate(tiny, tiny_greedy, spec):
    chunks = list(stream_generate(PROMPT, tiny, max_tokens=32, spec=spec))
    assert len(chunks) > 2
    assert "".join(c.text for c in chunks) == tiny_greedy.text
    assert [t for c in chunks for t in c.token_ids] == tiny_greedy.token_ids
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert STATS_KEYS <= last.stats.keys()
    assert last.stats["generated_tokens"] == 32
    for c in chunks[:-1]:
        assert c.finish_reason is None and not c.stats


def test_stream_with_stop(tiny, tiny_greedy):
    stop = tiny_greedy.text[len(tiny_greedy.text) // 2:][:3]
    r = generate(PROMPT, tiny, max_tokens=32, stop=stop)
    chunks = list(stream_generate(PROMPT, tiny, max_tokens=32, stop=stop))
    assert "".join(c.text for c in chunks) == r.text
    assert chunks[-1].finish_reason == "stop"


# ---------------------------------------------------------------------------------------- stop strings

def _boundary_stop(tok, ids: list[int], i: int) -> str:
    """A stop string made of the last character of token i and the first two of token i+1."""
    a, b = tok.decode([ids[i]]), tok.decode([ids[i + 1]])
    return a[-1] + b[:2]


def _expected_cut(tok, ids: list[int], stop: str) -> tuple[str, list[int]]:
    """The text before the first `stop` and the shortest token prefix whose text contains it."""
    full = tok.decode(ids)
    pos = full.find(stop)
    assert pos >= 0
    n = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k]))
    return full[:pos], ids[:n]


def _find_boundary_stop(tok, ids: list[int], start: int) -> tuple[str, int]:
    for i in range(start, len(ids) - 1):
        a, b = tok.decode([ids[i]]), tok.decode([ids[i + 1]])
        if not a or len(b) < 2:
            continue
        s = _boundary_stop(tok, ids, i)
        # the string first occurs across this boundary (not earlier, not inside one token)
        full = tok.decode(ids)
        if full.find(s) == len(tok.decode(ids[:i + 1])) - 1:
            return s, i
    raise AssertionError("no usable token boundary")


def test_stop_string_spanning_two_tokens(tiny, tiny_greedy):
    tok, ids = tiny.tokenizer, tiny_greedy.token_ids
    stop, i = _find_boundary_stop(tok, ids, len(ids) // 3)
    text, cut_ids = _expected_cut(tok, ids, stop)
    r = generate(PROMPT, tiny, max_tokens=32, stop=stop)
    assert r.finish_reason == "stop"
    assert r.text == text
    assert stop not in r.text
    assert r.token_ids == cut_ids == ids[:i + 2]


def test_stop_single_string_and_list(tiny, tiny_greedy):
    tok, ids = tiny.tokenizer, tiny_greedy.token_ids
    stop, _ = _find_boundary_stop(tok, ids, len(ids) // 2)
    a = generate(PROMPT, tiny, max_tokens=32, stop=stop)
    b = generate(PROMPT, tiny, max_tokens=32, stop=["never appears \x00", stop])
    assert a.text == b.text and a.finish_reason == b.finish_reason == "stop"


def test_earliest_stop_wins(tiny, tiny_greedy):
    tok, ids = tiny.tokenizer, tiny_greedy.token_ids
    early, _ = _find_boundary_stop(tok, ids, 4)
    late, _ = _find_boundary_stop(tok, ids, 20)
    r = generate(PROMPT, tiny, max_tokens=32, stop=[late, early])
    assert r.text == _expected_cut(tok, ids, early)[0]


def test_stop_not_found_runs_to_length(tiny, tiny_greedy):
    r = generate(PROMPT, tiny, max_tokens=32, stop=["\x00zz never"])
    assert r.finish_reason == "length" and r.token_ids == tiny_greedy.token_ids
    assert r.text == tiny_greedy.text


def test_empty_stop_string_is_ignored(tiny, tiny_greedy):
    r = generate(PROMPT, tiny, max_tokens=8, stop=[""])
    assert r.token_ids == tiny_greedy.token_ids[:8] and r.finish_reason == "length"


def test_stop_with_spec_is_lossless(code, code_greedy):
    """draft-mtp must give the same result as plain decoding, also when a stop string ends the
    generation in the middle of a round that accepted several drafts. (Stops that fall on tokens
    emitted by multi-token rounds: '[' is token 5, '-' token 8 of the greedy output.)"""
    tok, ids = code.tokenizer, code_greedy.token_ids
    for stop in ["[", "-"]:
        text, cut_ids = _expected_cut(tok, ids, stop)
        plain = generate(CODE_PROMPT, code, max_tokens=16, stop=stop)
        spec = generate(CODE_PROMPT, code, max_tokens=16, stop=stop, spec="draft-mtp")
        assert plain.text == spec.text == text
        assert plain.finish_reason == spec.finish_reason == "stop"
        assert plain.token_ids == cut_ids
        assert spec.token_ids == plain.token_ids, f"stop {stop!r}: draft-mtp kept tokens past the stop"
        assert spec.stats["generated_tokens"] == plain.stats["generated_tokens"]


# ---------------------------------------------------------------------------------------- EOS

def test_eos_never_in_token_ids_tiny(tiny):
    eos = tiny.tokenizer.eos_token_ids
    for seed in range(3):
        r = generate(PROMPT, tiny, max_tokens=48, temperature=1.5, seed=seed)
        assert not eos & set(r.token_ids)
        assert r.text == tiny.tokenizer.decode(r.token_ids)
        if r.finish_reason == "length":
            assert len(r.token_ids) == 48
        else:
            assert r.finish_reason == "stop" and len(r.token_ids) < 48


@pytest.mark.parametrize("spec", [None, "draft-mtp"])
def test_eos_stops_code_model(code, spec):
    tok = code.tokenizer
    r = generate(EOS_PROMPT, code, max_tokens=8, spec=spec)
    assert r.finish_reason == "stop"
    assert 0 < len(r.token_ids) < 8
    assert not tok.eos_token_ids & set(r.token_ids)
    assert r.text == tok.decode(r.token_ids) == "())\n"
    ig = generate(EOS_PROMPT, code, max_tokens=8, spec=spec, ignore_eos=True)
    assert ig.finish_reason == "length" and len(ig.token_ids) == 8
    n = len(r.token_ids)
    assert ig.token_ids[:n] == r.token_ids and ig.token_ids[n] in tok.eos_token_ids
    assert ig.text == tok.decode(ig.token_ids)
    assert "<|endoftext|>" in ig.text


# ---------------------------------------------------------------------------------------- sampling

@pytest.mark.parametrize("spec", [None, "draft-mtp"])
def test_seed_reproducible(tiny, spec):
    a = generate(PROMPT, tiny, max_tokens=16, temperature=0.8, seed=1234, spec=spec)
    b = generate(PROMPT, tiny, max_tokens=16, temperature=0.8, seed=1234, spec=spec)
    assert a.token_ids == b.token_ids and a.text == b.text


def test_different_seeds_differ(tiny):
    outs = {tuple(generate(PROMPT, tiny, max_tokens=16, temperature=0.8, seed=s).token_ids) for s in range(4)}
    assert len(outs) >= 2


@pytest.mark.parametrize("spec", [None, "draft-mtp"])
def test_top_k_one_is_greedy(tiny, tiny_greedy, spec):
    r = generate(PROMPT, tiny, max_tokens=16, temperature=1.0, top_k=1, seed=7, spec=spec)
    assert r.token_ids == tiny_greedy.token_ids[:16]


def test_tiny_top_p_is_greedy(tiny, tiny_greedy):
    r = generate(PROMPT, tiny, max_tokens=12, temperature=1.0, top_p=1e-6, seed=3)
    assert r.token_ids == tiny_greedy.token_ids[:12]


def test_spec_greedy_equals_plain(tiny, tiny_greedy, code, code_greedy):
    assert generate(PROMPT, tiny, max_tokens=32, spec="draft-mtp").token_ids == tiny_greedy.token_ids
    r = generate(CODE_PROMPT, code, max_tokens=16, spec="draft-mtp", n_max=2)
    assert r.token_ids == code_greedy.token_ids
    assert r.stats["accepted"] > 0


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_spec_max_tokens_respected(code, code_greedy, n):
    """Rounds that emit several tokens are cut at max_tokens."""
    r = generate(CODE_PROMPT, code, max_tokens=n, spec="draft-mtp")
    assert r.token_ids == code_greedy.token_ids[:n]
    assert r.finish_reason == "length" and r.stats["generated_tokens"] == n


def test_acceptance_rate_is_null_when_nothing_was_drafted(tiny):
    # 0.0 read as "every draft was rejected"; the JSON output says null
    r = generate(PROMPT, tiny, max_tokens=8, spec="draft-mtp", n_max=0)
    assert r.stats["drafted"] == 0 and r.stats["acceptance_rate"] is None


@pytest.mark.parametrize("n_max", [1, 3])
def test_spec_stats(tiny, n_max):
    r = generate(PROMPT, tiny, max_tokens=24, spec="draft-mtp", n_max=n_max)
    s = r.stats
    assert (STATS_KEYS | SPEC_KEYS) <= s.keys()
    assert s["rounds"] > 0
    assert 0 <= s["accepted"] <= s["drafted"] <= n_max * s["rounds"]
    assert 0.0 <= s["acceptance_rate"] <= 1.0
    assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"])
    assert s["mean_accepted_length"] == pytest.approx(s["accepted"] / s["rounds"])
    app = s["acceptance_per_position"]
    assert isinstance(app, list) and len(app) == n_max
    assert all(a is None or 0.0 <= a <= 1.0 for a in app)
    hist = s["accepted_length_histogram"]
    assert sorted(hist) == [str(i) for i in range(n_max + 1)]
    assert sum(hist.values()) == s["rounds"]
    assert sum(int(k) * v for k, v in hist.items()) == s["accepted"]
    assert s["decode_tokens_per_second"] > 0
    # every generated token comes from a round: its accepted drafts plus one
    assert s["generated_tokens"] <= s["accepted"] + s["rounds"]


def test_spec_n_max_zero(tiny, tiny_greedy):
    r = generate(PROMPT, tiny, max_tokens=8, spec="draft-mtp", n_max=0)
    assert r.token_ids == tiny_greedy.token_ids[:8]
    assert r.stats["drafted"] == 0 and r.stats["acceptance_per_position"] == []


def test_profile_stats(tiny):
    r = generate(PROMPT, tiny, max_tokens=6, spec="draft-mtp", n_max=2, profile="precise")
    prof = r.stats["profile"]
    assert prof["mode"] == "precise" and prof["wall_seconds"] > 0
    assert {"prefill", "draft", "verify", "accept"} <= prof["stages"].keys()


# ---------------------------------------------------------------------------------------- bad input

BAD = [
    ("empty text prompt", dict(prompt=""), "prompt"),
    ("empty id prompt", dict(prompt=[]), "prompt"),
    ("negative temperature", dict(temperature=-0.5), "temperature"),
    ("nan temperature", dict(temperature=math.nan), "temperature"),
    ("inf temperature", dict(temperature=math.inf), "temperature"),
    ("top_p 0", dict(top_p=0.0), "top_p"),
    ("top_p 1.5", dict(top_p=1.5), "top_p"),
    ("min_p -0.1", dict(min_p=-0.1), "min_p"),
    ("top_k -1", dict(top_k=-1), "top_k"),
    ("n_min > n_max", dict(spec="draft-mtp", n_min=3, n_max=2), "n_min"),
    ("p_min 1.5", dict(spec="draft-mtp", p_min=1.5), "p_min"),
    ("p_min -0.1", dict(spec="draft-mtp", p_min=-0.1), "p_min"),
    ("spec eagle", dict(spec="eagle"), "spec"),
    ("token id = vocab", dict(prompt=[1, 512]), "prompt"),
    ("negative token id", dict(prompt=[-1, 2]), "prompt"),
    ("negative max_tokens", dict(max_tokens=-1), "max_tokens"),
    ("float max_tokens", dict(max_tokens=2.5), "max_tokens"),
    ("prompt not text or ids", dict(prompt=3.5), "prompt"),
    ("nan top_p", dict(top_p=math.nan), "top_p"),
    ("min_p 1", dict(min_p=1.0), "min_p"),
    ("float top_k", dict(top_k=2.5), "top_k"),
    ("nan p_min", dict(spec="draft-mtp", p_min=math.nan), "p_min"),
    ("negative n_max", dict(spec="draft-mtp", n_max=-1), "n_max"),
    ("spec empty string", dict(spec=""), "spec"),
    ("stop list of ints", dict(stop=[1]), "stop"),
    ("stop int", dict(stop=5), "stop"),
    ("stop list with None", dict(stop=["a", None]), "stop"),
    ("messages a string", dict(prompt=None, messages="hello"), "messages"),
    ("messages empty", dict(prompt=None, messages=[]), "messages"),
    ("messages of strings", dict(prompt=None, messages=["hello"]), "messages"),
    ("message without content", dict(prompt=None, messages=[{"role": "user"}]), "messages"),
    ("message content not str", dict(prompt=None, messages=[{"role": "user", "content": 5}]), "messages"),
    ("message role not str", dict(prompt=None, messages=[{"role": None, "content": "hi"}]), "messages"),
]


@pytest.mark.parametrize("kwargs,field", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(tiny, kwargs, field):
    kw = dict(prompt=PROMPT, max_tokens=4)
    kw.update(kwargs)
    prompt = kw.pop("prompt")
    with pytest.raises(MTPEngineError) as ei:
        generate(prompt, tiny, **kw)
    assert _field(ei.value) == field
    assert ei.value.field in str(ei.value)
    # streaming validates the same way (on first iteration)
    with pytest.raises(MTPEngineError):
        list(stream_generate(prompt, tiny, **kw))


def test_prompt_longer_than_context(tiny):
    ctx = tiny.model.cfg.context_length
    for max_tokens in (0, 1, 5):  # the prompt alone is too long: its fault, whatever max_tokens is
        with pytest.raises(MTPEngineError, match="context length") as ei:
            generate([1] * (ctx + 1), tiny, max_tokens=max_tokens)
        assert _field(ei.value) == "prompt"
    with pytest.raises(MTPEngineError, match="context length") as ei:
        generate("a " * (ctx + 10), tiny, max_tokens=1)
    assert _field(ei.value) == "prompt"
    with pytest.raises(MTPEngineError, match="context length") as ei:
        generate([1] * ctx, tiny, max_tokens=1)
    assert _field(ei.value) == "max_tokens"
    with pytest.raises(MTPEngineError, match="context length"):
        generate(PROMPT, tiny, max_tokens=ctx)


def test_bad_model_argument():
    with pytest.raises(MTPEngineError) as ei:
        generate("x", 42, max_tokens=1)
    assert ei.value.field == "model"
    with pytest.raises(MTPEngineError, match="no such file"):
        load("/nonexistent/model.gguf")


@pytest.mark.parametrize("spec", [None, "draft-mtp"])
@pytest.mark.parametrize("seed", [-1, 2**64], ids=["seed-1", "seed2^64"])
def test_out_of_range_seed_is_refused_or_accepted_cleanly(tiny, spec, seed):
    """llama.cpp's default seed is -1 (random). Refusing it with an MTPEngineError naming `seed`, or
    accepting it, are both fine; a raw numpy ValueError / mlx TypeError is not."""
    try:
        r = generate(PROMPT, tiny, max_tokens=4, temperature=1.0, seed=seed, spec=spec)
    except MTPEngineError as e:
        assert e.field == "seed"
    else:
        assert len(r.token_ids) == 4
