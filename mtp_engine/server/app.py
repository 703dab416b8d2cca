"""The ASGI application (Starlette): OpenAI's chat/completions endpoints, /v1/models, /health
and the page at `/`. Handlers run on the event loop; generation runs on the worker thread.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..chat.tool_calls import ToolCallStream, split_tool_calls
from ..errors import MTPEngineError
from ..request.prepare import Prepared, prepare
from . import responses as R
from .schemas import (MAX_BODY_BYTES, APIError, GenRequest, ServerDefaults, engine_error, generation_request,
                      parse_chat, parse_completion, parse_json)
from .metrics import CONTENT_TYPE, ServerMetrics
from .worker import Event, GenerationWorker, Job, QueueFull, ShuttingDown

log = logging.getLogger("mtp_engine.server")
STATIC = Path(__file__).resolve().parent / "static"
POLL_S = 0.25  # how often a waiting handler checks that its client is still there


@dataclass
class ServerState:
    worker: GenerationWorker
    defaults: ServerDefaults
    model_name: str
    started: int
    metrics: ServerMetrics | None = None  # serve --metrics


class ClientGone(Exception):
    pass


def rss_bytes() -> int:
    """Resident memory now (Linux /proc), else the peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _error(e: APIError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, ShuttingDown):
        return APIError(503, str(e), code="shutting_down", retry_after=5)
    if isinstance(e, MTPEngineError):
        return engine_error(e)
    return APIError(500, f"generation failed: {type(e).__name__}: {e}")


BODY_TIMEOUT_S = 30.0  # a client that trickles its body holds a connection at most this long


async def _read_body(request: Request) -> bytes:
    async def read() -> bytes:
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > MAX_BODY_BYTES:
                raise APIError(400, f"request body exceeds {MAX_BODY_BYTES} bytes")
        return bytes(raw)

    try:
        return await asyncio.wait_for(read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise APIError(408, f"request body not received within {BODY_TIMEOUT_S:.0f} s") from None


async def _next_event(job: Job, request: Request) -> Event:
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
            ev = await _next_event(self.job, request)
        if ev.kind == "error":
            raise _engine_error(ev.error)
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
            while ev.kind == "chunk":
                # every chunk that has arrived goes out in one write: one send per loop turn, not
                # per token (the client sees the same events)
                parts = []
                while True:
                    c = last = ev.chunk
                    last_ev = ev
                    if c.text or c.token_ids:  # the final chunk only carries the finish reason and stats
                        for body in self._chunk_bodies(ev, not opened):
                            opened = True
                            parts.append(f"data: {json.dumps(body, ensure_ascii=False)}\n\n")
                    nxt = self.job.pop()
                    if nxt is None or nxt.kind != "chunk":
                        break
                    ev = nxt
                if parts:
                    yield "".join(parts)
                ev = nxt if nxt is not None else await _next_event(self.job, request)
            if ev.kind == "error":  # headers are sent: the error travels as an event
                yield f"data: {json.dumps(_engine_error(ev.error).body())}\n\n"
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


PREPARE_TIMEOUT_S = 10.0


def _prepare(raw: bytes, parse, state: ServerState) -> tuple[GenRequest, Prepared]:
    """The request as the engine takes it (off the event loop): parsed, typed, and prepared for
    the model (rendered, tokenized, the context checked, its grammars compiled)."""
    req = parse(parse_json(raw), state.defaults)
    worker = state.worker
    request = generation_request(req, state.defaults, worker.prompt_cache)
    try:
        return req, prepare(worker.model, request)
    except MTPEngineError as e:
        raise engine_error(e) from None


async def _generate(request: Request, parse) -> Response:
    resp = await _answer(request, parse)
    metrics = request.app.state.mtp.metrics
    if metrics is not None:
        metrics.request(request.url.path, resp.status_code)
    return resp


async def _answer(request: Request, parse) -> Response:
    state: ServerState = request.app.state.mtp
    try:
        raw = await _read_body(request)
        # parsing compiles grammars (JSON schemas, forced tool calls): CPU work that held the event
        # loop, and every other client with it, for seconds; a thread does it, within a deadline
        req, prepared = await asyncio.wait_for(asyncio.to_thread(_prepare, raw, parse, state), PREPARE_TIMEOUT_S)
    except APIError as e:
        return _error(e)
    except asyncio.TimeoutError:
        return _error(APIError(400, f"the request's grammar (schema or tools) took more than "
                                    f"{PREPARE_TIMEOUT_S:.0f} s to compile: simplify it"))
    except ClientDisconnect:
        return Response(status_code=499)
    job = Job(prepared, req.mtp_trace, asyncio.get_running_loop())
    try:
        state.worker.submit(job)
    except ShuttingDown as e:
        return _error(_engine_error(e))
    except QueueFull:
        return _error(APIError(503, f"the server is busy: its queue of {state.worker.queue_size} waiting requests "
                                    "(--queue-size) is full; retry later", code="queue_full"))
    gen = Generation(state, req, job)
    try:
        first = await _next_event(job, request)
        if first.kind == "error":
            return _error(_engine_error(first.error))
        if req.stream:
            return StreamingResponse(gen.stream(first, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await gen.collect(first, request))
    except ClientGone:
        return Response(status_code=499)
    except APIError as e:
        return _error(e)
    finally:
        if not req.stream:
            job.cancel()


async def chat_completions(request: Request) -> Response:
    return await _generate(request, parse_chat)


async def completions(request: Request) -> Response:
    return await _generate(request, parse_completion)


async def models(request: Request) -> Response:
    s: ServerState = request.app.state.mtp
    m = s.worker.model
    return JSONResponse({"object": "list", "data": [{
        "id": s.model_name, "object": "model", "created": s.started, "owned_by": "mtp-engine",
        "meta": {"path": m.path, "context_length": m.model.cfg.context_length, "vocab_size": m.model.cfg.vocab_size,
                 "mtp_head": m.model.mtp is not None}}]})


async def health(request: Request) -> Response:
    """Liveness for everyone; the server's figures only for a caller with the key (when one is set)."""
    if not getattr(request.state, "authorized", True):
        return JSONResponse({"status": "ok"})
    s: ServerState = request.app.state.mtp
    w = s.worker
    return JSONResponse({"status": "ok", "busy": w.busy, "running": w.running, "parallel": w.parallel,
                         "waiting": w.waiting, "queue_size": w.queue_size, "completed": w.completed,
                         "rss_bytes": rss_bytes()})


async def slots(request: Request) -> Response:
    """llama-server's /slots: what each slot is doing."""
    w = request.app.state.mtp.worker
    return JSONResponse(w.slots())


async def metrics(request: Request) -> Response:
    """Prometheus text (serve --metrics)."""
    return Response(request.app.state.mtp.metrics.render(), media_type=CONTENT_TYPE)


async def page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html")


async def _not_found(request: Request, exc) -> Response:
    return _error(APIError(404, f"no route {request.method} {request.url.path}"))


async def _internal(request: Request, exc) -> Response:
    log.exception("unhandled error")
    return _error(APIError(500, f"internal error: {type(exc).__name__}"))


async def _method(request: Request, exc) -> Response:
    return JSONResponse(APIError(405, f"method {request.method} not allowed on {request.url.path}").body(),
                        status_code=405)


OPEN_PATHS = ("/", "/health")  # the page (it asks for the key) and a bare liveness answer


class RequireKey:
    """ASGI middleware: every request but the page and /health must carry `Authorization: Bearer
    <key>` (the scheme in any case, the key compared in constant time); others get OpenAI's 401,
    and a request with two Authorization headers a 400 (which one counts would be a guess). /health
    answers everyone, but only a caller with the key sees more than that the server is up
    (`scope["state"]["authorized"]`)."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    def _authorized(self, headers) -> bool | None:
        """True / False, or None when the header is given more than once."""
        given = [v for k, v in headers if k.lower() == b"authorization"]
        if len(given) > 1:
            return None
        scheme, _, token = (given[0] if given else b"").strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        ok = self._authorized(scope.get("headers") or [])
        if ok is None:
            e = APIError(400, "the Authorization header was sent more than once", code="invalid_api_key")
            await JSONResponse(e.body(), status_code=400)(scope, receive, send)
            return
        scope.setdefault("state", {})["authorized"] = ok
        if not ok and scope["path"] not in OPEN_PATHS:
            e = APIError(401, "invalid or missing API key: send the header 'Authorization: Bearer <key>'",
                         code="invalid_api_key")
            await JSONResponse(e.body(), status_code=401, headers={"WWW-Authenticate": "Bearer"})(
                scope, receive, send)
            return
        await self.app(scope, receive, send)


class LimitRequests:
    """ASGI middleware: at most `limit` requests open at once (streams included); past it a 503 that
    names the limit, with `Retry-After`. Generation has its own bounded queue; this bounds the
    handlers themselves (uvicorn's own limit counted idle connections too)."""

    def __init__(self, app, limit: int):
        self.app, self.limit, self.open = app, limit, 0

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.open >= self.limit:
            await _error(APIError(503, f"the server has {self.limit} requests open at once, its limit; retry later",
                                  code="too_many_requests"))(scope, receive, send)
            return
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1


def create_app(worker: GenerationWorker, defaults: ServerDefaults, model_name: str,
               api_key: str | None = None, max_open: int | None = None, with_metrics: bool = False) -> Starlette:
    """The application around a started worker whose model is loaded; with `api_key`, every route
    but the page and a bare /health requires it (`RequireKey`); `with_metrics`: GET /metrics."""
    extra = [Route("/metrics", metrics)] if with_metrics else []
    app = Starlette(routes=[*extra,
        Route("/", page),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
        Route("/slots", slots),
    ], exception_handlers={404: _not_found, 405: _method, Exception: _internal})
    app.state.mtp = ServerState(worker, defaults, model_name, R.now(),
                                ServerMetrics(lambda: worker.waiting, lambda: worker.running) if with_metrics else None)
    if api_key:
        app.add_middleware(RequireKey, key=api_key)
    app.add_middleware(LimitRequests, limit=max_open or max(64, 4 * worker.queue_size))
    return app
