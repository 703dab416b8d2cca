"""`mtp-engine serve`'s start-up: check the flags, load the model on the worker thread, then run
uvicorn and print the URL once the socket listens."""
from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

from ..errors import MTPEngineError
from ..generation.penalties import PenaltyConfig
from ..generation.sampling import SamplerConfig
from ..server.schemas import ServerDefaults
from ..speculative.draft_mtp import DraftParams


def defaults_from_args(args) -> ServerDefaults:
    """The flags checked with the engine's own validators (a bad flag exits 2 before loading)."""
    pen = PenaltyConfig(args.presence_penalty, args.frequency_penalty, args.repeat_penalty, args.repeat_last_n)
    SamplerConfig(args.temp, args.top_k, args.top_p, args.min_p, args.seed, pen)
    DraftParams(args.spec_draft_n_max, args.spec_draft_n_min, args.spec_draft_p_min)
    if args.spec_type not in ("none", "draft-mtp"):
        raise MTPEngineError(f"expected none or draft-mtp, found {args.spec_type!r}", field="spec-type")
    if args.max_tokens < 0:
        raise MTPEngineError(f"expected an integer >= 0, found {args.max_tokens}", field="n-predict")
    if not 0.1 <= args.header_timeout <= 3600:
        raise MTPEngineError(f"expected seconds in [0.1, 3600], found {args.header_timeout}", field="header-timeout")
    if not 1 <= args.queue_size <= 100_000:
        raise MTPEngineError(f"expected an integer in 1..100000, found {args.queue_size}", field="queue-size")
    if not 0 <= args.idle_release < 1e9:
        raise MTPEngineError(f"expected seconds >= 0, found {args.idle_release}", field="idle-release")
    if not 0 <= args.port <= 65535:
        raise MTPEngineError(f"expected a port in 0..65535, found {args.port}", field="port")
    return ServerDefaults(args.max_tokens, args.temp, args.top_k, args.top_p, args.min_p, args.seed, args.spec_type,
                          args.spec_draft_n_max, args.spec_draft_n_min, args.spec_draft_p_min, pen)


def check_bind(host: str, port: int) -> None:
    """Refuses, before the model loads, an address this process cannot listen on (a port in use
    once printed uvicorn's 39-line traceback after the whole load)."""
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        raise MTPEngineError(f"cannot listen on host {host!r}: {e}", field="host") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            s.bind(addr)
        except OSError as e:
            why = "in use" if e.errno in (98, 48, 10048) else (e.strerror or str(e))
            raise MTPEngineError(f"cannot listen on {host}:{port}: {why} (choose another --port)", field="port") from None


def chat_template_from_args(args) -> str | None:
    """The template of --chat-template or --chat-template-file, compiled once here (a bad one is
    one line before the model loads); None: the model's own (or ChatML)."""
    from ..chat.template import compile_chat_template
    from ..text_input import read_prompt_file

    text, path = getattr(args, "chat_template", None), getattr(args, "chat_template_file", None)
    if path is not None:
        text = read_prompt_file(path, "chat-template-file")
    if text is not None:
        compile_chat_template(text, file=path, field="chat-template-file" if path else "chat-template")
    return text


def api_key_from_args(args) -> str | None:
    """The key of --api-key, or the first line of --api-key-file; never logged."""
    key = getattr(args, "api_key", None)
    path = getattr(args, "api_key_file", None)
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                key = f.readline(4097).strip()
        except (OSError, UnicodeDecodeError) as e:
            raise MTPEngineError(f"cannot read the API key: {getattr(e, 'strerror', None) or e}", file=path,
                                 field="api-key-file") from None
    if key is not None and (not key or len(key) > 4096 or any(c.isspace() or not c.isprintable() for c in key)):
        raise MTPEngineError("expected a key of 1..4096 printable characters without spaces",
                             field="api-key-file" if path else "api-key")
    return key


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def open_bind_warning(host: str, api_key: str | None) -> str | None:
    """The one warning for a server others can reach that needs no key."""
    if api_key is None and not _loopback(host):
        return f"listening on {host} without --api-key: anyone who can reach this port can generate"
    return None


def run_serve(args) -> int:
    from ..server.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="mtp-engine: %(message)s", stream=sys.stderr)
    defaults = defaults_from_args(args)
    api_key = api_key_from_args(args)
    chat_template = chat_template_from_args(args)
    check_bind(args.host, args.port)
    warning = open_bind_warning(args.host, api_key)
    if warning:
        print(f"mtp-engine: warning: {warning}", file=sys.stderr, flush=True)
    worker, model = _start_worker(args, defaults, chat_template)
    if defaults.spec == "draft-mtp" and model.model.mtp is None:
        logging.getLogger("mtp_engine.server").warning("%s has no MTP head: serving with spec-type none", model.path)
        defaults.spec = "none"
    name = args.alias or Path(model.path).name
    server = _http_server(create_app(worker, defaults, name, api_key=api_key, with_metrics=args.metrics), args, worker)

    async def main() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            port = server.servers[0].sockets[0].getsockname()[1]
            host = f"[{args.host}]" if ":" in args.host else args.host
            warmed = f", warmed up in {worker.warm_seconds:.1f} s" if worker.warm_seconds is not None else ""
            print(f"mtp-engine: serving {name} at http://{host}:{port}/ (OpenAI API under /v1{warmed})", flush=True)
        await task

    try:
        asyncio.run(main())
    finally:
        worker.stop()
    return 0 if server.started else 1


def _start_worker(args, defaults, chat_template):
    """The generation worker, started, and its loaded model (warmed up with the server's own
    default settings, as a request without settings gets them)."""
    from ..load_progress import load_progress
    from ..server.schemas import parse_completion
    from ..server.worker import GenerationWorker, wait_ready
    from .output import model_label

    warm = parse_completion({"prompt": "x"}, defaults).kwargs
    warm.pop("prompt")
    worker = GenerationWorker(args.model, args.queue_size, exact=args.exact, max_context=args.max_context,
                              warm_up=warm, idle_release_s=args.idle_release,
                              cache_slots=args.cache_slots, cache_bytes=args.cache_ram << 20,
                              chat_template=chat_template, parallel=args.parallel,
                              load_progress=load_progress(model_label(args.model)))
    worker.start()
    return worker, wait_ready(worker)  # MTPEngineError -> exit 2 in cli.main


def _http_server(app, args, worker):
    """uvicorn's server for `app`, every resource a client can hold bounded: a request's headers
    have a deadline and the connections waiting for theirs a number (the protocol), its body a
    deadline and the requests open at once a number (app.LimitRequests, a 503 with Retry-After
    past it); idle connections between requests close at the header deadline."""
    import uvicorn

    from ..server.protocol import DeadlineH11Protocol, WaitingConnections

    protocol = type("Protocol", (DeadlineH11Protocol,), {"header_timeout_s": args.header_timeout,
                                                         "waiting": WaitingConnections()})
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                            lifespan="off", timeout_graceful_shutdown=2, http=protocol)

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            # before uvicorn waits for open connections: the running generation ends at its next
            # chunk and every stream gets a "shutting down" error and closes, so none is still
            # open when the grace period ends (uvicorn would cancel it with a traceback)
            worker.shutdown()
            await super().shutdown(sockets)

    return Server(config)
