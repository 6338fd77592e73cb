"""OpenAI-format errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Why: OpenAI SDKs map the status code to an exception class (400 BadRequestError, 404
NotFoundError, ...) and show ``error.message``; FastAPI's defaults (422, ``{"detail": ...}``)
would surface as opaque errors in every agent framework. Handlers here cover our own
``APIError``, request validation (-> 400), unknown routes (-> 404), too large bodies (-> 413),
the store's typed errors (their own status: a full or read-only disk is 503 ``store_unavailable``)
and, as a last resort, unexpected exceptions (-> 500, logged, never a stack trace to the client).
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from slime_server.buffer.schema import StoreError
from slime_server.gateway.errors import APIError

log = logging.getLogger(__name__)

# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); the Messages routes
# answer ``{"type": "error", "error": {"type", "message"}}`` so Anthropic SDKs raise their own classes.
ANTHROPIC_PREFIX = "/v1/messages"
_ANTHROPIC_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                   413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error_body(err: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPE.get(err.status, "api_error"), "message": err.message}}


def error_response(err: APIError, path: str | None = None) -> JSONResponse:
    """The error in the format of the API ``path`` belongs to (Anthropic's under /v1/messages, else OpenAI's)."""
    anthropic = path is not None and (path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"))
    body = anthropic_error_body(err) if anthropic else err.body()
    return JSONResponse(body, status_code=err.status, headers=err.headers)


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p not in ("body", "query", "path", "header")]
    if not parts:
        return None
    out = parts[0]
    for p in parts[1:]:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


async def _validation_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid request"))
    if first.get("type") == "json_invalid":
        msg = "request body is not valid JSON"
    message = f"{param}: {msg}" if param else msg
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more error(s))"
    return error_response(APIError(400, message, param=param, code="invalid_request"), request.url.path)


async def _http_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    if exc.status_code == 404:
        err = APIError(404, f"unknown route: {request.method} {request.url.path}", code="unknown_url")
    elif exc.status_code == 405:
        err = APIError(405, f"method {request.method} not allowed on {request.url.path}",
                       code="method_not_allowed", headers={"Allow": _allowed_methods(request)})
        return error_response(err, request.url.path)
    elif exc.status_code == 413:
        err = APIError(413, "request body too large", code="request_too_large")
    else:
        err = APIError(exc.status_code, str(exc.detail))
    err.headers = dict(exc.headers) if exc.headers else None
    return error_response(err, request.url.path)


def _allowed_methods(request: Request) -> str:
    """Every method some route serves on this path (Starlette names only the first route that matched)."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in request.app.router.routes:
        if getattr(route, "methods", None) and route.matches(request.scope)[0] != Match.NONE:
            methods |= route.methods
    return ", ".join(sorted(methods))


async def _api_error_handler(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc, request.url.path)


async def _store_error_handler(request: Request, exc: Exception) -> JSONResponse:
    """A typed store error that no route mapped (jobs, keys): its own status, e.g. 503 store_unavailable."""
    status = getattr(exc, "status_code", 500)
    if not isinstance(status, int) or not 400 <= status < 600:
        return await _unexpected_handler(request, exc)
    return error_response(APIError(status, str(exc), code=getattr(exc, "code", None)), request.url.path)


async def _unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(APIError(500, "internal server error", type="server_error", code="internal_error"),
                          request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error the app can raise through the OpenAI error format."""
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(StoreError, _store_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(Exception, _unexpected_handler)


class BodySizeLimitMiddleware:
    """Reject request bodies over ``max_bytes`` with 413 before they are parsed.

    Checks ``Content-Length`` up front and also counts streamed (chunked) bodies, so a client
    cannot bypass the limit by omitting the header.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = False
                if too_big:
                    await self._reject(scope, receive, send)
                    return
        seen = 0
        started = False

        async def counting_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return msg

        async def tracking_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._reject(scope, receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = APIError(413, f"request body larger than {self.max_bytes} bytes", code="request_too_large")
        await error_response(err, scope.get("path"))(scope, receive, send)


class _TooLarge(StarletteHTTPException):
    """An HTTPException so that FastAPI's body parsing re-raises it unchanged (-> 413 via _http_handler)."""

    def __init__(self) -> None:
        super().__init__(413, "request body too large")
