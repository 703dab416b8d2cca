"""One request's answer, built from the worker's events: a JSON body or a stream of server-sent
events (OpenAI's shapes, with the `mtp` extension per chunk), ending the job when its client leaves."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import AsyncIterator

from starlette.requests import Request

from ..chat.tool_calls import ToolCallStream, split_tool_calls
from ..errors import MTPEngineError
from . import responses as R
from .metrics import ServerMetrics
from .schemas import APIError, GenRequest, ServerDefaults, engine_error
from .worker import Event, GenerationWorker, Job, ShuttingDown

POLL_S = 0.25  # how often a waiting handler checks that its client is still there


@dataclass
class ServerState:
    """What every handler shares: the generation worker, the server's defaults, its model's name,
    its start time and its metrics."""

    worker: GenerationWorker
    defaults: ServerDefaults
    model_name: str
    started: int
    metrics: ServerMetrics | None = None  # serve --metrics


class ClientGone(Exception):
    """The client disconnected while its request ran (its job is cancelled)."""


def api_error(e: BaseException) -> APIError:
    """The HTTP error a failed generation answers with: 503 while shutting down, the engine's
    error as a 400-class answer, anything else a 500 naming it."""
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), code="shutting_down", retry_after=5)
    if isinstance(e, MTPEngineError):
        return engine_error(e)
    return APIError(500, f"generation failed: {type(e).__name__}: {e}")


async def next_event(job: Job, request: Request) -> Event:
    """The job's next event; cancels the job and raises ClientGone if the client disconnects.
    The client is checked every POLL_S whether or not events keep coming: a fast generation never
    let the wait time out, so a client that left a non-streamed request was noticed only at the end."""
    now = time.monotonic()
    if job.checked_at is None:
        job.checked_at = now
    elif now - job.checked_at >= POLL_S:
        job.checked_at = now
        if await request.is_disconnected():
            job.cancel()
            raise ClientGone
    while True:
        ev = job.pop()
        if ev is not None:
            return ev
        if not await job.wait(POLL_S):
            job.checked_at = time.monotonic()
            if await request.is_disconnected():
                job.cancel()
                raise ClientGone


def _trace(ev: Event, counters: dict) -> dict:
    """The `mtp` extension of a chunk: each token's text and provenance, live figures."""
    c = ev.chunk
    counters["drafted"] += c.n_drafted
    counters["accepted"] += sum(c.drafted)
    counters["tokens"] += len(c.token_ids)
    if counters["t0"] is None:
        counters["t0"] = time.perf_counter()
    dt = time.perf_counter() - counters["t0"]
    toks = [{"id": t, "text": p, "drafted": bool(d)} for t, p, d in zip(c.token_ids, ev.pieces, c.drafted)]
    if len(ev.pieces) > len(c.token_ids) and ev.pieces[-1]:  # bytes held back until the end
        toks.append({"id": None, "text": ev.pieces[-1], "drafted": False})
    return {"tokens": toks, "round_drafted": c.n_drafted,
            "acceptance_rate": counters["accepted"] / counters["drafted"] if counters["drafted"] else None,
            "tokens_per_second": (counters["tokens"] - 1) / dt if dt > 0.05 and counters["tokens"] > 1 else None}


def _finish_reason(last, calls: list | None) -> str | None:
    """OpenAI's: an answer that stopped by itself after calling tools ends with "tool_calls"."""
    return "tool_calls" if calls and last.finish_reason == "stop" else last.finish_reason


class Generation:
    """One request's answer, built from the worker's events."""

    def __init__(self, state: ServerState, req: GenRequest, job: Job):
        self.state, self.req, self.job = state, req, job
        self.kind = req.kind
        self.rid, self.created = R.new_id(req.kind), R.now()
        self.tok = state.worker.model.tokenizer
        self.offset = 0  # completions' text_offset
        self.counters = {"drafted": 0, "accepted": 0, "tokens": 0, "t0": None}
        fmt = job.prepared.tool_format
        self.calls = ToolCallStream(fmt, req.tools) if fmt else None  # None: no tools in this request
        self.n_calls = 0
        self.pending_lps: list = []

    def logprobs(self, lps: list[dict] | None) -> dict | None:
        if self.req.logprobs is None or lps is None:
            return None
        if self.kind == "chat":
            return R.chat_logprobs(self.tok, lps)
        out, self.offset = R.completion_logprobs(self.tok, lps, self.offset)
        return out

    def final_usage(self, ev: Event, last) -> dict:
        completion = last.stats.get("generated_tokens", 0)
        if self.state.metrics is not None:
            self.state.metrics.generation(last.stats, ev.prompt_tokens, completion)
        return R.usage(last.stats, ev.prompt_tokens, completion)

    async def collect(self, first: Event, request: Request) -> dict:
        text, lps, ev, last = [], [], first, None
        while ev.kind == "chunk":
            text.append(ev.chunk.text)
            lps.extend(ev.chunk.logprobs or [])
            last = ev.chunk
            ev = await next_event(self.job, request)
        if ev.kind == "error":
            raise api_error(ev.error)
        lp = self.logprobs(lps)
        u = self.final_usage(ev, last)
        content, calls = "".join(text), None
        if self.calls is not None:
            content, calls = split_tool_calls(content, self.calls.fmt, self.calls.tools)
        body = R.envelope(self.kind, self.rid, self.state.model_name, self.created,
                          [R.choice(self.kind, content, _finish_reason(last, calls), lp, stream=False,
                                    tool_calls=calls or None)], stream=False)
        body["usage"] = u
        body["timings"] = u["timings"]
        return body

    async def stream(self, first: Event, request: Request) -> AsyncIterator[str]:
        ev, last, opened = first, None, False
        try:
            while ev.kind in ("chunk", "progress"):
                # every chunk that has arrived goes out in one write: one send per loop turn, not
                # per token (the client sees the same events)
                parts = []
                while True:
                    if ev.kind == "progress":  # llama-server's: an empty delta with prompt_progress
                        body = self._body(None, None, False)
                        body["prompt_progress"] = ev.progress
                        parts.append(f"data: {json.dumps(body)}\n\n")
                    else:
                        c = last = ev.chunk
                        last_ev = ev
                        if c.text or c.token_ids:  # the final chunk only carries the finish reason and stats
                            for body in self._chunk_bodies(ev, not opened):
                                opened = True
                                parts.append(f"data: {json.dumps(body, ensure_ascii=False)}\n\n")
                    nxt = self.job.pop()
                    if nxt is None or nxt.kind not in ("chunk", "progress"):
                        break
                    ev = nxt
                if parts:
                    yield "".join(parts)
                ev = nxt if nxt is not None else await next_event(self.job, request)
            if ev.kind == "error":  # headers are sent: the error travels as an event
                yield f"data: {json.dumps(api_error(ev.error).body())}\n\n"
                return
            if self.calls is not None:
                rest = self.calls.finish()  # a block max_tokens cut, or one that did not parse
                if rest:
                    yield f"data: {json.dumps(self._body(rest, None, not opened), ensure_ascii=False)}\n\n"
                    opened = True
            u = self.final_usage(ev, last)
            end = R.envelope(self.kind, self.rid, self.state.model_name, self.created,
                             [R.choice(self.kind, None if self.kind == "chat" else "",
                                       _finish_reason(last, self.calls.calls if self.calls else None),
                                       None, True, not opened)], True)
            end["timings"] = u["timings"]
            if self.req.mtp_trace:
                end["mtp"] = {**_trace(last_ev, self.counters), "usage": u}
            yield f"data: {json.dumps(end)}\n\n"
            if self.req.include_usage:
                tail = R.envelope(self.kind, self.rid, self.state.model_name, self.created, [], True)
                tail["usage"] = u
                yield f"data: {json.dumps(tail)}\n\n"
            yield "data: [DONE]\n\n"
        except ClientGone:
            return
        finally:
            self.job.cancel()  # closed early (client gone) or done: either way nothing more to run

    def _body(self, text: str | None, logprobs, first: bool, tool_calls: list | None = None) -> dict:
        return R.envelope(self.kind, self.rid, self.state.model_name, self.created,
                          [R.choice(self.kind, text, None, logprobs, True, first, tool_calls)], True)

    def _chunk_bodies(self, ev: Event, first: bool) -> list[dict]:
        """The stream chunks for one generated chunk: its text; with tools, the text outside
        tool-call blocks and each call once its block has closed (logprobs and the mtp trace ride
        on the first chunk sent, or wait for the next one)."""
        c = ev.chunk
        lps = self.logprobs(c.logprobs)
        trace = _trace(ev, self.counters) if self.req.mtp_trace else None
        if self.calls is None:
            bodies = [self._body(c.text, lps, first)]
        else:
            text, calls = self.calls.feed(c.text)
            self.pending_lps.extend((lps or {}).get("content", []))
            bodies = [self._body(text, None, first)] if text else []
            for call in calls:
                bodies.append(self._body(None, None, first and not bodies, [R.tool_call_delta(call, self.n_calls)]))
                self.n_calls += 1
            if not bodies and trace is not None:
                bodies = [self._body(None, None, first)]  # the page still sees every token
            if bodies and self.pending_lps:
                bodies[0]["choices"][0]["logprobs"] = {"content": self.pending_lps}
                self.pending_lps = []
        if bodies and trace is not None:
            bodies[0]["mtp"] = trace
        return bodies
