"""The server's ASGI guards: the API key on every private route, and a bound on the requests open
at once."""
from __future__ import annotations

import hmac

from starlette.responses import JSONResponse

from .schemas import APIError

OPEN_PATHS = ("/", "/health")  # the page (it asks for the key) and a bare liveness answer


def error_response(e: APIError) -> JSONResponse:
    """OpenAI's error body with the error's status (and `Retry-After` where it has one)."""
    headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


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
            await error_response(APIError(503, f"the server has {self.limit} requests open at once, its limit; "
                                          "retry later", code="too_many_requests"))(scope, receive, send)
            return
        self.open += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.open -= 1
