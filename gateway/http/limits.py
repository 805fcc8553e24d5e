"""The limits of the gateway's HTTP servers, over uvicorn's httptools protocol: the main port
(``gateway.serve.server``, which states them) and the sandbox listener (``gateway.api.sandbox_listener``)
share them, so that neither a client of the port nor code in a sandbox can hold the gateway.

- `LimitedHttpProtocol`: header timeout, max header size, a timeout for a body the app does not read,
  and a connection limit answered at once in JSON (503, ``too_many_connections``).
- `BodyTimeout`: the ASGI side of the body timeout (408 through the error table).
- `connection_budget` / `sandbox_connection_budget`: ``max_connections`` and the sandbox listener's
  ``sandbox_max_connections``, lowered together to fit the process's open-file limit. Each connection
  may hold an engine connection too, and `RESERVED_FDS` are kept for the rest; so connections of
  either server can never starve the other, or the gateway, of descriptors.

Example::

    config = LimitsConfig(BodyTimeout(app, 30.0), ServerConfig(), http=LimitedHttpProtocol)
    await uvicorn.Server(config).serve()
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from http import HTTPStatus
from typing import Any

import uvicorn
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from core.errors import RequestTimeout
from gateway.config import ServerConfig
from gateway.http.errors import error_body, for_route

log = logging.getLogger("belayer.gateway")

LINGER_S = 1.0
"""After answering a connection it refuses, how long it is read (and the bytes dropped) while the
client closes it: closing at once with its request unread would reset it, and the client could lose
the answer."""
RESERVED_FDS = 128
"""Open files kept beside client and engine connections: the store, logs, health probes, sandboxes."""


class LimitsConfig(uvicorn.Config):
    """uvicorn's configuration, carrying the limits to each connection's protocol."""

    def __init__(self, app: ASGIApp, limits: ServerConfig, **options: Any) -> None:
        super().__init__(app, **options)
        self.limits = limits


def connection_budget(limits: ServerConfig, *, sandbox_listener: bool = False) -> int:
    """``max_connections``, lowered if the open-file limit cannot hold it beside the sandbox listener's
    ``sandbox_max_connections`` (when `sandbox_listener` runs): each client connection may hold an engine
    connection too. The soft limit is raised towards the hard one first, if needed."""
    wanted, boxes = limits.max_connections, limits.sandbox_max_connections if sandbox_listener else 0
    fits = fit_connections(wanted, boxes, _open_files(2 * (wanted + boxes) + RESERVED_FDS))[0]
    if fits < wanted:
        log.warning(
            "max_connections lowered from %d to %d to fit the open-file limit (raise it with `ulimit -n`)",
            wanted,
            fits,
        )
    return fits


def sandbox_connection_budget(limits: ServerConfig) -> int:
    """``sandbox_max_connections``, lowered as `connection_budget` lowers ``max_connections`` (in proportion:
    the two servers' connections together fit the open-file limit)."""
    wanted, boxes = limits.max_connections, limits.sandbox_max_connections
    fits = fit_connections(wanted, boxes, _open_files(2 * (wanted + boxes) + RESERVED_FDS))[1]
    if fits < boxes:
        log.warning(
            "sandbox_max_connections lowered from %d to %d to fit the open-file limit (raise it with "
            "`ulimit -n`)",
            boxes,
            fits,
        )
    return fits


def fit_connections(main: int, boxes: int, open_files: int | None) -> tuple[int, int]:
    """``(main, boxes)``, the connections of the main port and of the sandbox listener, lowered in
    proportion so that ``2 * (main + boxes) + RESERVED_FDS`` fits `open_files` (None: no limit).

    >>> fit_connections(8192, 1024, 400), fit_connections(1024, 0, 256), fit_connections(100, 10, None)
    ((121, 15), (64, 0), (100, 10))
    """
    if open_files is None or 2 * (main + boxes) + RESERVED_FDS <= open_files:
        return main, boxes
    total = max(1, (open_files - RESERVED_FDS) // 2)
    share = min(boxes, max(1, total * boxes // (main + boxes))) if boxes else 0
    return max(1, total - share), share


def _open_files(needed: int) -> int | None:
    """The soft open-file limit, raised towards `needed` as far as the hard limit lets it (None: none)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, raised, exc)
    return None if soft == resource.RLIM_INFINITY else soft


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header timeout, a max header size, a timeout for a body
    the app does not read, and a connection limit answered in JSON. One timer (``_deadline``) covers
    whatever the connection is waiting for from its client."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = config.limits if isinstance(config, LimitsConfig) else ServerConfig()
        self._deadline: asyncio.TimerHandle | None = None
        self._in_message = False  # a request is being received (first byte .. end of its body)
        self._headers_done = False
        self._header_bytes = 0  # of the request being received, counted as the parser reports them
        self._raw_header_bytes = 0  # bytes received while its headers are incomplete
        self._refused = False  # answered by the protocol itself: what comes next is dropped
        self.url = b""  # uvicorn sets it at a request's first byte

    # -------------------------------------------------------------- connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.connections.discard(self)  # not served: it does not count
            self._refuse_connection()
            return
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadline()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # read while lingering, and dropped
        super().data_received(data)
        if not self._headers_done:  # httptools buffers a header whole: count what it holds so far
            self._raw_header_bytes += len(data)
            self._check_header_bytes()
        if not self._refused and not self.transport.is_closing():
            self._watch()

    # -------------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_message, self._headers_done = True, False
        self._header_bytes = self._raw_header_bytes = 0

    def on_url(self, url: bytes) -> None:
        if not self._refused:
            super().on_url(url)
            self._header_bytes += len(url)
            self._check_header_bytes()

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._refused:
            super().on_header(name, value)
            self._header_bytes += len(name) + len(value) + 4  # ": " and CRLF
            self._check_header_bytes()

    def on_headers_complete(self) -> None:
        if not self._refused:
            self._headers_done = True
            self._stop_deadline()
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._refused:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._refused:
            self._in_message = False
            super().on_message_complete()

    # -------------------------------------------------------------- limits
    def _busy(self) -> bool:
        """A request is in flight (its response not complete): the protocol must not write now."""
        return self.cycle is not None and not self.cycle.response_complete

    def _watch(self) -> None:
        """Arm the deadline for what the connection now waits for from its client, if any."""
        if self._in_message and self._headers_done:
            if not self._busy():  # the app answered without reading the whole body: it is dropped
                self._stop_deadline()
                self._start_deadline(self.limits.body_timeout_s)
            return  # else the app reads the body, under BodyTimeout
        if self._in_message:
            if self._deadline is None:  # from the request's first byte (or the accept), not re-armed
                self._start_deadline(self.limits.header_timeout_s)
            return
        if self._busy() or self.timeout_keep_alive_task is not None:
            return  # serving a request, or idle under uvicorn's keep-alive timeout
        if self._deadline is None:  # a new connection (or bytes that began no request)
            self._start_deadline(self.limits.header_timeout_s)

    def _start_deadline(self, seconds: float) -> None:
        self._deadline = self.loop.call_later(seconds, self._deadline_passed)

    def _stop_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _deadline_passed(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if self._in_message and self._headers_done:  # dropping an unread body
            self.transport.close()
        elif self._in_message:
            seconds = self.limits.header_timeout_s
            self._refuse(
                408,
                "request_timeout",
                f"the request's headers did not arrive within {seconds:g}s; send the whole request at once",
            )
        elif self._busy():  # a pipelined request's bytes, behind one in flight: close after it
            self.cycle.keep_alive = False
        else:  # a connection that sent nothing
            self.transport.close()

    def _check_header_bytes(self) -> None:
        limit = self.limits.max_header_bytes
        if not self._refused and max(self._header_bytes, self._raw_header_bytes) > limit:
            self._refuse(
                431,
                "request_header_fields_too_large",
                f"the request line and headers are over the gateway's limit of {limit} bytes; "
                "send smaller headers",
            )

    def _refuse(self, status: int, code: str, message: str) -> None:
        """Answer the request being received with an error in its route's format, and close."""
        self._refused = True
        self._stop_deadline()
        if self._busy():  # never write into the response in flight: close once it is complete
            self.cycle.keep_alive = False
            return
        body = error_body(message, "invalid_request_error", None, code)
        self._answer_and_close(status, for_route(self.url.decode("latin-1"), status, body))

    def _refuse_connection(self, message: str | None = None) -> None:
        limit = self.limits.max_connections
        message = message or (
            f"the gateway is serving its limit of {limit} connections; retry shortly (Retry-After), "
            "or raise the gateway's --max-connections"
        )
        # Answered before the request is read, so the route (OpenAI or Anthropic) is unknown: the body
        # has both shapes, {"type": "error", "error": {"type", "message", "param", "code"}}.
        body = {
            "type": "error",
            "error": {
                "type": "overloaded_error",
                "message": message,
                "param": None,
                "code": "too_many_connections",
            },
        }
        self._refused = True
        # Closed at once, not lingering: its descriptor is what the limit protects. (A client that
        # sends its request meanwhile is reset, but still reads the answer it has received.)
        self._answer_and_close(503, body, [(b"retry-after", b"1")], linger=False)

    def _answer_and_close(
        self,
        status: int,
        body: dict[str, Any],
        headers: list[tuple[bytes, bytes]] | None = None,
        linger: bool = True,
    ) -> None:
        """Write a complete JSON response and close: with `linger`, end our side and close once the
        client has closed its side (or after ``LINGER_S``)."""
        payload = json.dumps(body).encode()
        lines = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}".encode()]
        for name, value in [
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"connection", b"close"),
            *(headers or []),
        ]:
            lines.append(name + b": " + value)
        self.transport.write(b"\r\n".join(lines) + b"\r\n\r\n" + payload)
        if linger and self.transport.can_write_eof():
            self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


class BodyTimeout:
    """ASGI middleware: a request body that pauses for ``seconds`` raises `RequestTimeout` in the app
    (answered 408 by the error table, in the route's format) and the connection is closed after it.
    Only while the body is incomplete: a wait for the client's disconnect is not bounded.

    Example::

        uvicorn.run(BodyTimeout(build_app(config), 30.0))
    """

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app = app
        self.seconds = seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), b"?").decode()
        more, received, timed_out = True, 0, False

        async def timed_receive() -> Message:
            nonlocal more, received, timed_out
            if not more:  # the body is in: waiting for a disconnect is not bounded
                return await receive()
            try:
                async with asyncio.timeout(self.seconds):
                    message = await receive()
            except TimeoutError:
                timed_out = True
                raise RequestTimeout(
                    f"the request body stopped arriving: no bytes for {self.seconds:g}s ({received} of "
                    f"{declared} bytes received); send the whole body without pausing",
                    code="request_timeout",
                ) from None
            received += len(message.get("body", b""))
            more = message["type"] == "http.request" and bool(message.get("more_body", False))
            return message

        async def closing_send(message: Message) -> None:
            if timed_out and message["type"] == "http.response.start":  # the rest of the body is not read
                message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, timed_receive, closing_send)
