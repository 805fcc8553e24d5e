"""What the gateway records of each HTTP request: one log line, and its Prometheus figures.

One log line per HTTP request, at INFO on the ``belayer.requests`` logger: method, path, session,
status and duration (uvicorn's own access log is off, so each request is logged once). A session id
is a capability, so the line carries its short digest (`core.logs.session_tag`), in the path too; the
query string is never logged (``/api/events?token=`` carries a token). With metrics
on, the same timing feeds `GatewayMetrics.observe_request`, and the request gets a `RequestClock`
that the turn runner charges its engine time to (the gateway's own added time is the difference).

The line is written when the response is complete (for a stream, when its last chunk went out), with
the values as structured fields for ``--log-format json``: ``method``, ``path``, ``session_tag`` (of
``/s/{id}/…`` or ``/api/sessions/{id}/…``; null elsewhere), ``status`` and ``duration_ms``. A request
that raised before it answered is logged with status 500 (what the server then answers).

Example::

    Starlette(routes=..., middleware=[Middleware(RequestObserver), Middleware(UnexpectedErrors), ...])

>>> session_of("/s/3f2a/v1/chat/completions"), session_of("/api/sessions/3f2a/trajectory"), session_of("/health")
('3f2a', '3f2a', None)
>>> logged_path("/s/ses_3f2a/v1/chat/completions"), logged_path("/health")
('/s/s-1cec09b2865f/v1/chat/completions', '/health')
"""

from __future__ import annotations

import logging
import re
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.logs import session_tag
from gateway.observe.metrics import REQUEST_CLOCK, GatewayMetrics, RequestClock, protocol_of

log = logging.getLogger("belayer.requests")

_SESSION_PATH = re.compile(r"^/(?:s|api/sessions)/([^/]+)")


def session_of(path: str) -> str | None:
    """The session id a request's path names, if any."""
    match = _SESSION_PATH.match(path)
    return match.group(1) if match else None


def logged_path(path: str) -> str:
    """`path` with its session id replaced by the id's tag."""
    match = _SESSION_PATH.match(path)
    if match is None:
        return path
    return f"{path[: match.start(1)]}{session_tag(match.group(1))}{path[match.end(1) :]}"


class RequestObserver:
    """ASGI middleware: times each HTTP request and tracks its status, then logs it (at INFO) and
    meters it (with metrics on) once its response is complete (see the module)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gateway = getattr(scope["app"].state, "gateway", None)
        metrics: GatewayMetrics | None = getattr(gateway, "metrics", None)
        logged = log.isEnabledFor(logging.INFO)
        if metrics is None and not logged:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # unless the app answers: it raised, and the server answers 500
        clock = RequestClock()
        token = REQUEST_CLOCK.set(clock) if metrics is not None else None

        async def tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            seconds = time.perf_counter() - started
            if token is not None:
                REQUEST_CLOCK.reset(token)
            if metrics is not None:
                template = getattr(scope.get("route"), "path", None) or "unmatched"
                path = scope["path"]
                metrics.observe_request(protocol_of(path), template, scope["method"], status, seconds, clock)
            if logged:
                _log(scope, status, seconds * 1000)


def _log(scope: Scope, status: int, ms: float) -> None:
    method, sid = scope["method"], session_of(scope["path"])
    path = logged_path(scope["path"])
    fields = {
        "method": method,
        "path": path,
        "session_tag": session_tag(sid) if sid is not None else None,
        "status": status,
        "duration_ms": round(ms, 2),
    }
    log.info("%s %s %d %.1f ms", method, path, status, ms, extra=fields)
