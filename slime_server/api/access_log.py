"""Per-request observability: one access-log line (fields a log shipper indexes) and Prometheus
request counts and latencies labelled by route template (never by raw path: ids would explode
the label space)."""

from __future__ import annotations

import logging
import time

from prometheus_client import Counter, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

REQUESTS = Counter("slime_http_requests_total", "HTTP requests answered", ["route", "method", "status"])
LATENCY = Histogram("slime_http_request_duration_seconds", "time to the last byte of the answer", ["route"],
                    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120))


class AccessLogMiddleware:
    """Counts and times every HTTP request; logs one line per request at INFO (method, path,
    status, ms, session and request ids). Pure ASGI, and nothing is formatted unless INFO is
    enabled for ``slime_server.access``: the gateway's overhead budget is a few milliseconds."""

    log = logging.getLogger("slime_server.access")

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), 500

        async def watching_send(msg: Message) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, watching_send)
        finally:
            elapsed = time.perf_counter() - t0
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            REQUESTS.labels(route, scope.get("method", ""), str(status)).inc()
            LATENCY.labels(route).observe(elapsed)
            if self.log.isEnabledFor(logging.INFO):
                self._log(scope, status, elapsed)

    def _log(self, scope: Scope, status: int, elapsed: float) -> None:
        headers = dict(scope.get("headers", []))
        self.log.info("%s %s %s", scope.get("method"), scope.get("path"), status, extra={
            "method": scope.get("method"), "path": scope.get("path"), "status": status,
            "duration_ms": round(elapsed * 1e3, 2),
            "session_id": headers.get(b"x-session-id", b"").decode(errors="replace") or None,
            "request_id": headers.get(b"x-request-id", b"").decode(errors="replace") or None})
