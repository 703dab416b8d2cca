"""The generation loop: prompt in, streamed text chunks out, with stopping rules and statistics.

Decoders (plain or speculative) emit lists of tokens per round; this loop cuts them at EOS,
max_tokens and stop strings, detokenizes incrementally and times prefill and decode separately.
"""
from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol

import mlx.core as mx

from ..errors import MTPEngineError, out_of_memory
from ..tokenizer.tokenizer import Tokenizer
from .profiler import Profiler
from .prompt_cache import PromptCache


@dataclass
class Chunk:
    """A piece of streamed output. The last chunk has `finish_reason` and `stats` set."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: dict = field(default_factory=dict)
    drafted: list[bool] = field(default_factory=list)  # per token: an accepted draft (else trunk-sampled)
    logprobs: list[dict] | None = None  # per token, when asked for: {"token", "logprob", "top": [(id, lp)]}
    n_drafted: int = 0  # drafts proposed by the round(s) this chunk came from (accepted or not)
    tool_calls: list[dict] | None = None  # the last chunk, when tools were given: the calls the text holds
    # per token, its text from the stream's detokenizer (stop strings not yet cut; a last extra
    # entry: bytes held back until the end), for traces that show each token's text
    pieces: list[str] = field(default_factory=list)


class _StopMatcher:
    """Holds back text that could still turn into a stop string."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.buffer = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop string was hit)."""
        self.buffer += text
        if not self.stops:
            out, self.buffer = self.buffer, ""
            return out, False
        hits = [(self.buffer.find(s), s) for s in self.stops if s in self.buffer]
        if hits:
            pos = min(h[0] for h in hits)
            out, self.buffer = self.buffer[:pos], ""
            return out, True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.buffer)), 0, -1):
                if self.buffer.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = self.buffer[: len(self.buffer) - hold]
        self.buffer = self.buffer[len(out):]
        return out, False

    def flush(self) -> str:
        out, self.buffer = self.buffer, ""
        return out


def peak_memory_bytes() -> int:
    """Peak memory of this process: MLX's allocator peak where it tracks one, else max RSS."""
    try:
        peak = int(mx.get_peak_memory())
    except Exception:
        peak = 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss = rss if sys.platform == "darwin" else rss * 1024
    return max(peak, int(rss))


class Decoder(Protocol):
    """What the loop drives: `decode.PlainDecoder` (and the speculative decoders built on it) or
    `batching.slot.SlotDecoder` (a sequence in a batch). After `prefill` and each `step`, the
    `round_*` fields describe the tokens returned: per token whether it was an accepted draft,
    their logprobs (when asked for), how many drafts the round proposed."""

    model: object  # its `cfg` bounds the context
    prof: Profiler
    prompt_cache: PromptCache | None
    cache: object  # the trunk's caches (released to the prompt cache at the end)
    cached_tokens: int  # prompt tokens the prompt cache supplied
    round_drafted: list[bool]
    round_logprobs: list[dict] | None
    round_n_drafted: int

    def prefill(self, ids: list[int], budget: int | None = None) -> list[int]: ...

    def step(self) -> list[int]: ...

    def finish(self) -> None: ...

    def stats(self) -> dict: ...


def check_context(n_prompt: int, max_tokens: int, cfg) -> None:
    """A generation's context rules: a prompt of at least one token, no longer than the context
    (whatever max_tokens is), and room in the context for max_tokens more; MTPEngineError naming
    the field at fault and where the context length comes from (`cfg.context_source`)."""
    ctx = cfg.context_length
    if n_prompt == 0:
        raise MTPEngineError("the prompt is empty: at least one token is needed", field="prompt")
    if n_prompt > ctx:
        raise MTPEngineError(f"the prompt ({n_prompt} tokens) is longer than the context length {ctx} "
                             f"({cfg.context_source})", field="prompt")
    if n_prompt + max_tokens > ctx:
        raise MTPEngineError(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context "
                             f"length {ctx} ({cfg.context_source})", field="max_tokens")


def run(decoder: Decoder, tokenizer: Tokenizer, prompt_ids: list[int], max_tokens: int,
        stop: list[str] | None = None, ignore_eos: bool = False,
        profiler: Profiler | None = None) -> Iterator[Chunk]:
    """Streams the generation of up to `max_tokens` tokens after `prompt_ids`."""
    check_context(len(prompt_ids), max_tokens, decoder.model.cfg)
    prof = profiler or decoder.prof
    t0 = time.perf_counter()
    if max_tokens == 0:
        st = _stats(decoder, len(prompt_ids), 0, 0, 0.0, 0.0, prof)
        st["time_to_first_token_seconds"] = 0.0
        yield Chunk("", [], "length", st)
        return
    try:
        yield from _generate(decoder, tokenizer, prompt_ids, max_tokens, stop, ignore_eos, prof, t0)
    except (RuntimeError, MemoryError) as e:
        err = out_of_memory(e, f"generating after a prompt of {len(prompt_ids)} tokens")
        if err is None:
            raise
        raise err from e
    finally:  # also when the caller abandons the stream: its prompt-cache state may be handed over
        if decoder.prompt_cache is not None and decoder.cache is not None:
            decoder.prompt_cache.release(decoder.cache)


def _generate(decoder: Decoder, tokenizer: Tokenizer, prompt_ids: list[int], max_tokens: int,
              stop: list[str] | None, ignore_eos: bool, prof: Profiler, t0: float) -> Iterator[Chunk]:
    eos = set() if ignore_eos else set(tokenizer.eos_token_ids)
    detok = tokenizer.detokenizer()
    matcher = _StopMatcher(stop or [])
    generated: list[int] = []
    finish = "length"
    prof.start()
    # the decoder may queue its next round before the host reads the current one (mx.async_eval), so
    # this loop's detokenization and stop checks overlap device work; the budget keeps it from
    # queuing rounds past max_tokens (it counts what it emits)
    pending = decoder.prefill(prompt_ids, budget=max_tokens)
    meta = _round_meta(decoder, pending)
    from_prefill = len(pending)
    t_prefill = time.perf_counter() - t0
    t1 = time.perf_counter()
    ttft = None
    done = False
    while not done:
        out_ids: list[int] = []
        pieces: list[str] = []
        drafted, logprobs, n_drafted = meta
        with prof.stage("emit"):
            stopped, done, text = _emit(pending, eos, max_tokens, generated, out_ids, pieces, detok, matcher)
        finish = "stop" if stopped else finish
        if ttft is None and pending:
            ttft = time.perf_counter() - t0
        if text or out_ids:
            yield Chunk(text, out_ids, drafted=drafted[:len(out_ids)], n_drafted=n_drafted,
                        logprobs=logprobs[:len(out_ids)] if logprobs is not None else None, pieces=pieces)
        if not done:
            pending = decoder.step()
            meta = _round_meta(decoder, pending)
    t_decode = time.perf_counter() - t1
    prof.stop()
    decoder.finish()
    stats = _stats(decoder, len(prompt_ids), len(generated), from_prefill, t_prefill, t_decode, prof)
    stats["time_to_first_token_seconds"] = ttft if ttft is not None else t_prefill + t_decode
    yield Chunk("", [], finish, stats)


def _round_meta(decoder: Decoder, pending: list[int]) -> tuple[list[bool], list[dict] | None, int]:
    """What the decoder recorded about the round that emitted `pending`: per-token provenance,
    logprobs and the number of drafts it proposed."""
    drafted = decoder.round_drafted
    if len(drafted) != len(pending):
        drafted = [False] * len(pending)
    return drafted, decoder.round_logprobs, decoder.round_n_drafted


def _emit(pending: list[int], eos: set[int], max_tokens: int, generated: list[int], out_ids: list[int],
          pieces: list[str], detok, matcher: "_StopMatcher") -> tuple[bool, bool, str]:
    """Hands out a round's tokens one by one, so a round that overshoots EOS, max_tokens or a stop
    string is cut exactly: appends to `generated`, `out_ids` and `pieces`; returns (stopped by EOS
    or a stop string, done, the chunk's text)."""
    text = ""
    stopped = done = hit = False
    for tok in pending:
        if tok in eos:
            stopped = done = True
            break
        generated.append(tok)
        out_ids.append(tok)
        pieces.append(detok.add(tok))
        piece, hit = matcher.push(pieces[-1])
        text += piece
        if hit:
            stopped = done = True
            break
        if len(generated) >= max_tokens:
            done = True
            break
    if done and not hit:  # held-back bytes and stop-string prefixes are final text now
        pieces.append(detok.flush())
        tail, _ = matcher.push(pieces[-1])
        text += tail + matcher.flush()
    return stopped, done, text


def _stats(decoder: Decoder, n_prompt: int, n_gen: int, from_prefill: int, t_prefill: float, t_decode: float,
           prof: Profiler) -> dict:
    # decode speed counts only tokens produced by decode steps (a plain prefill yields the first);
    # prefill speed only the tokens prefilled (not those a prompt cache supplied)
    cached = decoder.cached_tokens
    stats = {
        "prompt_tokens": n_prompt,
        "cached_prompt_tokens": cached,
        "generated_tokens": n_gen,
        "prefill_seconds": t_prefill,
        "decode_seconds": t_decode,
        "prompt_tokens_per_second": (n_prompt - cached) / t_prefill if t_prefill else 0.0,
        "decode_tokens_per_second": (n_gen - from_prefill) / t_decode if t_decode and n_gen > from_prefill else 0.0,
        "peak_memory_bytes": peak_memory_bytes(),
    }
    stats.update(decoder.stats())
    if prof.enabled:
        stats["profile"] = prof.report()
    return stats
