"""OpenAI response objects built from the engine's chunks and statistics.

Field names for the draft figures (documented in README.md):
  usage.timings      llama.cpp server's `timings` (cache_n, prompt_n, prompt_ms, prompt_per_second,
                     predicted_n, predicted_ms, predicted_per_second, draft_n, draft_n_accepted);
                     also at the top level of the response / the final stream chunk, as llama-server
  usage.prompt_tokens_details.cached_tokens  OpenAI's: prompt tokens the prompt cache supplied
  usage.spec_decode  vLLM's speculative-decoding figures (num_drafts = rounds that drafted,
                     num_draft_tokens, num_accepted_tokens, draft_acceptance_rate,
                     mean_acceptance_length = 1 + accepted / num_drafts) plus this engine's
                     mean_accepted_length (accepted / rounds, plain rounds included),
                     acceptance_rate_per_pos and decode_tokens_per_second
"""
from __future__ import annotations

import time
import uuid

from ..tokenizer.tokenizer import Tokenizer


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def timings(stats: dict, prompt_tokens: int, completion_tokens: int) -> dict:
    pre, dec = stats.get("prefill_seconds", 0.0), stats.get("decode_seconds", 0.0)
    cached = stats.get("cached_prompt_tokens", 0)
    processed = prompt_tokens - cached  # llama-server's prompt_n: the tokens prefilled, cache_n the rest
    out = {
        "cache_n": cached,
        "prompt_n": processed,
        "prompt_ms": pre * 1e3,
        "prompt_per_token_ms": pre * 1e3 / processed if processed else 0.0,
        "prompt_per_second": stats.get("prompt_tokens_per_second", 0.0),
        "predicted_n": completion_tokens,
        "predicted_ms": dec * 1e3,
        "predicted_per_token_ms": dec * 1e3 / completion_tokens if completion_tokens else 0.0,
        "predicted_per_second": stats.get("decode_tokens_per_second", 0.0),
    }
    if "drafted" in stats:
        out["draft_n"] = stats["drafted"]
        out["draft_n_accepted"] = stats["accepted"]
    return out


def usage(stats: dict, prompt_tokens: int, completion_tokens: int) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens,
         "prompt_tokens_details": {"cached_tokens": stats.get("cached_prompt_tokens", 0)},
         "timings": timings(stats, prompt_tokens, completion_tokens)}
    if "drafted" in stats:
        # vLLM counts a draft per round that proposed tokens: auto's plain rounds and rounds whose
        # drafts p-min cut to none are not drafts, and would dilute the acceptance length
        drafts = stats.get("drafting_rounds", stats.get("rounds", 0))
        per_pos = [None if a is None else a for a in stats.get("acceptance_per_position", [])]
        u["spec_decode"] = {
            "num_drafts": drafts,
            "num_draft_tokens": stats["drafted"],
            "num_accepted_tokens": stats["accepted"],
            "draft_acceptance_rate": stats["acceptance_rate"],
            "mean_acceptance_length": 1 + stats["accepted"] / drafts if drafts else 0.0,
            "mean_accepted_length": stats.get("mean_accepted_length", 0.0),
            "acceptance_rate_per_pos": per_pos,
            "decode_tokens_per_second": stats.get("decode_tokens_per_second", 0.0),
        }
    return u


def _piece(tok: Tokenizer, t: int) -> tuple[str, list[int]]:
    b = tok.token_bytes(t)
    return b.decode("utf-8", errors="replace"), list(b)


def chat_logprobs(tok: Tokenizer, lps: list[dict]) -> dict:
    content = []
    for e in lps:
        text, b = _piece(tok, e["token"])
        top = []
        for i, lp in e["top"]:
            t2, b2 = _piece(tok, i)
            top.append({"token": t2, "logprob": lp, "bytes": b2})
        content.append({"token": text, "logprob": e["logprob"], "bytes": b, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(tok: Tokenizer, lps: list[dict], offset: int) -> tuple[dict, int]:
    """The legacy completions format; `offset` is the text offset of the first token."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in lps:
        text, _ = _piece(tok, e["token"])
        out["tokens"].append(text)
        out["token_logprobs"].append(e["logprob"])
        out["top_logprobs"].append({_piece(tok, i)[0]: lp for i, lp in e["top"]})
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset


def choice(kind: str, text: str | None, finish: str | None, logprobs, stream: bool, first: bool = False,
           tool_calls: list[dict] | None = None) -> dict:
    if kind == "chat":
        if stream:
            delta = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            return {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        message = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish}
    return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}


def tool_call_delta(call: dict, index: int) -> dict:
    """A whole tool call as one streamed delta (clients join `arguments` pieces; this is one)."""
    return {"index": index, **call}


def envelope(kind: str, rid: str, model: str, created: int, choices: list, stream: bool) -> dict:
    obj = {"chat": ("chat.completion.chunk" if stream else "chat.completion")}.get(kind, "text_completion")
    return {"id": rid, "object": obj, "created": created, "model": model, "system_fingerprint": "mtp-engine",
            "choices": choices}


def now() -> int:
    return int(time.time())
