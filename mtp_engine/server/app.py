"""The ASGI application (Starlette): OpenAI's chat/completions endpoints, /v1/models, /health
and the page at `/`. Handlers run on the event loop; generation runs on the worker thread.
"""
from __future__ import annotations

import asyncio
import logging
import os
import resource
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import MTPEngineError
from ..request.prepare import Prepared, prepare
from . import responses as R
from .answer import ClientGone, Generation, ServerState, next_event, api_error
from .guards import LimitRequests, RequireKey, error_response
from .metrics import CONTENT_TYPE, ServerMetrics
from .schemas import (MAX_BODY_BYTES, APIError, GenRequest, ServerDefaults, engine_error, generation_request,
                      parse_chat, parse_completion, parse_json)
from .worker import GenerationWorker, Job, QueueFull, ShuttingDown

log = logging.getLogger("mtp_engine.server")
STATIC = Path(__file__).resolve().parent / "static"


def rss_bytes() -> int:
    """Resident memory now (Linux /proc), else the peak."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


BODY_TIMEOUT_S = 30.0  # a client that trickles its body holds a connection at most this long
PREPARE_TIMEOUT_S = 10.0


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
        return error_response(e)
    except asyncio.TimeoutError:
        return error_response(APIError(400, f"the request's grammar (schema or tools) took more than "
                                    f"{PREPARE_TIMEOUT_S:.0f} s to compile: simplify it"))
    except ClientDisconnect:
        return Response(status_code=499)
    job = Job(prepared, req.mtp_trace, asyncio.get_running_loop(), progress=req.stream and req.return_progress)
    try:
        state.worker.submit(job)
    except ShuttingDown as e:
        return error_response(api_error(e))
    except QueueFull:
        return error_response(APIError(503, f"the server is busy: its queue of {state.worker.queue_size} waiting requests "
                                    "(--queue-size) is full; retry later", code="queue_full"))
    gen = Generation(state, req, job)
    try:
        first = await next_event(job, request)
        if first.kind == "error":
            return error_response(api_error(first.error))
        if req.stream:
            return StreamingResponse(gen.stream(first, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return JSONResponse(await gen.collect(first, request))
    except ClientGone:
        return Response(status_code=499)
    except APIError as e:
        return error_response(e)
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
    return error_response(APIError(404, f"no route {request.method} {request.url.path}"))


async def _internal(request: Request, exc) -> Response:
    log.exception("unhandled error")
    return error_response(APIError(500, f"internal error: {type(exc).__name__}"))


async def _method(request: Request, exc) -> Response:
    return JSONResponse(APIError(405, f"method {request.method} not allowed on {request.url.path}").body(),
                        status_code=405)




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
