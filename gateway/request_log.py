"""One log line per HTTP request, at INFO on the ``belayer.requests`` logger: method, path, session,
status and duration (uvicorn's own access log is off, so each request is logged once).

The line is written when the response is complete (for a stream, when its last chunk went out), with
the values as structured fields for ``--log-format json``: ``method``, ``path``, ``session_id`` (from
``/s/{id}/…`` or ``/api/sessions/{id}/…``; null elsewhere), ``status`` and ``duration_ms``. A request
that raised before it answered is logged with status 500 (what the server then answers).

Example::

    Starlette(routes=..., middleware=[Middleware(RequestLog), Middleware(UnexpectedErrors), ...])

>>> session_of("/s/3f2a/v1/chat/completions"), session_of("/api/sessions/3f2a/trajectory"), session_of("/health")
('3f2a', '3f2a', None)
"""

from __future__ import annotations

import logging
import re
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("belayer.requests")

_SESSION_PATH = re.compile(r"^/(?:s|api/sessions)/([^/]+)")


def session_of(path: str) -> str | None:
    """The session id a request's path names, if any."""
    match = _SESSION_PATH.match(path)
    return match.group(1) if match else None


class RequestLog:
    """ASGI middleware: logs each HTTP request once its response is complete (see the module)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not log.isEnabledFor(logging.INFO):
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 500  # unless the app answers: it raised, and the server answers 500

        async def tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            _log(scope, status, (time.perf_counter() - started) * 1000)


def _log(scope: Scope, status: int, ms: float) -> None:
    method, path = scope["method"], scope["path"]
    fields = {
        "method": method,
        "path": path,
        "session_id": session_of(path),
        "status": status,
        "duration_ms": round(ms, 2),
    }
    log.info("%s %s %d %.1f ms", method, path, status, ms, extra=fields)
