"""The engine leg's HTTP/1.1 client: ``httptools``' C parser on asyncio protocols, as an httpx transport.

On the gateway's token path the engine answer is parsed once per chunk, and ``httpcore`` does that with
``h11`` (pure Python) under several layers (its pool, its connection, trace hooks, anyio locks and cancel
scopes, a ``select`` per idle connection at every request). Profiled under ``belayer bench gateway``
they were most of the engine leg's CPU. `Http11Transport` replaces them for plain ``http://``:

- one `_Connection` per socket is an ``asyncio.Protocol`` whose ``data_received`` feeds ``httptools``
  (llhttp, the parser uvicorn serves with); body bytes queue up until the reader takes them, all at once
  (several engine events read together are one chunk for `engine_pool.engine.client`'s batching);
- `_Pool` keeps idle connections per origin, bounded by the same ``httpx.Limits`` as httpx's own pool
  (at most ``max_connections`` open, ``max_keepalive_connections`` idle for ``keepalive_expiry``
  seconds), and a request waits up to the ``pool`` timeout for one;
- errors are httpx's own, as its transport maps ``httpcore``'s: ``ConnectError``/``ConnectTimeout``,
  ``ReadTimeout`` (per read, as ``httpcore``'s), ``WriteTimeout``, ``PoolTimeout``, ``ReadError`` (a
  reset), ``RemoteProtocolError`` (a server that closes mid-answer or sends no HTTP), so that
  `engine_pool.engine.client.transport_errors` translates them unchanged.

Anything else (``https://``, a ``HEAD``, a streamed request body, an ``Upgrade``) goes to the
`fallback` transport (httpx's, see `engine_pool.engine.transport.engine_transport`): engines are spoken to in
small JSON requests over plain HTTP.

Example::

    transport = Http11Transport(httpx.Limits(max_connections=64), fallback=httpx.AsyncHTTPTransport())
    async with httpx.AsyncClient(transport=transport, timeout=None) as http:
        engine = EngineClient("http://127.0.0.1:8001", "tiny", http)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import typing
from collections.abc import AsyncIterator

import httptools
import httpx

_HIGH_WATER = 1 << 18  # body bytes queued unread before the socket stops being read
_NO_RESPONSE = "Server disconnected without sending a response."  # httpcore's words
_INCOMPLETE = "peer closed connection without sending complete message body"  # h11's


class _Connection(asyncio.Protocol):
    """One keep-alive connection: the parser's callbacks fill the current response's state."""

    def __init__(self, origin: tuple[bytes, int]) -> None:
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False  # the socket is gone (or going): never reused
        self.expires = 0.0
        self._waiter: asyncio.Future[bool] | None = None
        self._drain: asyncio.Future[None] | None = None
        self._start(False)

    def _start(self, in_flight: bool) -> None:
        """The state of one response (``in_flight``: a request was sent and its answer is awaited)."""
        self.in_flight = in_flight
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.head = False  # the final (non-1xx) response's headers are complete
        self.done = False  # its body is complete
        self.keep_alive = False
        self.until_close = False  # a body framed by the end of the connection
        self.seen = False  # any byte of an answer arrived
        self.error: Exception | None = None
        self.body: collections.deque[bytes] = collections.deque()
        self.buffered = 0

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self.in_flight or self.done:  # nothing asked: a server speaking out of turn
            self.close()
            return
        self.seen = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(httpx.RemoteProtocolError("engine answered with a protocol upgrade"))
        except httptools.HttpParserError as e:
            if self.done:  # bytes after a complete answer: the connection cannot be reused
                self.close()
            else:
                self._fail(httpx.RemoteProtocolError(f"malformed HTTP answer: {e}"))

    def eof_received(self) -> bool | None:
        self._lost(None)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost(exc)
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def pause_writing(self) -> None:
        self._drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # --- httptools callbacks ---

    def on_message_begin(self) -> None:
        if self.done:  # a second answer to one request: stop parsing (`data_received` closes)
            raise httpx.RemoteProtocolError("engine sent an answer that was not asked for")

    def on_status(self, status: bytes) -> None:
        self.reason += status

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 1xx: informational, the answer follows
            return
        self.status, self.head = status, True
        self.keep_alive = self.parser.should_keep_alive()
        framed = {n.lower() for n, _ in self.headers} & {b"content-length", b"transfer-encoding"}
        self.until_close = not framed and status not in (204, 304)
        self._wake()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if not self.head:  # the end of a 1xx answer
            self.reason, self.headers = b"", []
            return
        self.done = True
        self._wake()

    # --- used by the transport ---

    def usable(self, now: float) -> bool:
        """Idle and reusable: open, and its keep-alive not expired."""
        transport = self.transport
        return not self.closed and now < self.expires and transport is not None and not transport.is_closing()

    def send(self, data: bytes) -> None:
        self._start(True)
        assert self.transport is not None
        try:
            self.transport.write(data)
        except (OSError, RuntimeError) as e:  # RuntimeError: the transport closed meanwhile
            self._fail(httpx.WriteError(str(e) or repr(e)))

    async def drained(self, timeout: float | None) -> None:
        if self._drain is None or self._drain.done():
            return
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._drain)
        except TimeoutError as e:
            raise httpx.WriteTimeout("timed out writing the request") from e

    def take(self) -> bytes:
        """The body bytes received and not yet read (b"" when none)."""
        if not self.body:
            return b""
        data = self.body.popleft() if len(self.body) == 1 else b"".join(self.body)
        self.body.clear()
        if self.buffered > _HIGH_WATER and self.transport is not None and not self.closed:
            self.transport.resume_reading()
        self.buffered = 0
        return data

    async def wait(self, timeout: float | None) -> None:
        """Until the parser has something new (headers, body, the end) or the connection fails."""
        if self.error is not None:
            raise self.error
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, _expire, waiter) if timeout is not None else None
        try:
            if not await waiter:
                raise httpx.ReadTimeout("timed out reading the engine's answer")
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(True)

    def _fail(self, error: Exception) -> None:
        self.error = error
        self.close()
        self._wake()

    def _lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.in_flight or self.done or self.error is not None:
            return
        if self.head and self.until_close and exc is None:
            self.done = True  # the body was framed by this close
            self._wake()
        elif exc is not None:  # a reset
            self._fail(httpx.ReadError(str(exc) or repr(exc)))
        elif not self.seen:
            self._fail(httpx.RemoteProtocolError(_NO_RESPONSE))
        else:
            self._fail(httpx.RemoteProtocolError(_INCOMPLETE))


def _expire(waiter: asyncio.Future[bool]) -> None:
    if not waiter.done():
        waiter.set_result(False)


class _Pool:
    """Idle connections per origin, at most ``max_connections`` open (see the module docstring)."""

    def __init__(self, limits: httpx.Limits) -> None:
        self._max = limits.max_connections
        self._max_idle = limits.max_keepalive_connections
        self._expiry = limits.keepalive_expiry
        self._idle: dict[tuple[bytes, int], list[_Connection]] = {}
        self._idle_count = 0
        self._open = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    @property
    def connections(self) -> list[_Connection]:
        """The idle connections (those in use are held by their responses)."""
        return [c for conns in self._idle.values() for c in conns]

    @property
    def open_count(self) -> int:
        return self._open

    async def acquire(self, origin: tuple[bytes, int], timeouts: dict[str, float | None]) -> _Connection:
        while True:
            if (conn := self._reuse(origin)) is not None:
                return conn
            if self._max is None or self._open < self._max:
                return await self._connect(origin, timeouts.get("connect"))
            if not self._close_one_idle():
                await self._wait(timeouts.get("pool"))

    def release(self, conn: _Connection, reuse: bool) -> None:
        """A connection whose response was closed: idle when its answer was read whole, else closed."""
        if reuse and not conn.closed and (self._max_idle is None or self._idle_count < self._max_idle):
            conn.in_flight = False
            conn.expires = time.monotonic() + self._expiry if self._expiry is not None else float("inf")
            self._idle.setdefault(conn.origin, []).append(conn)
            self._idle_count += 1
        else:
            conn.close()
            self._open -= 1
        self._wake_one()

    def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
                self._open -= 1
        self._idle.clear()
        self._idle_count = 0

    def _reuse(self, origin: tuple[bytes, int]) -> _Connection | None:
        conns = self._idle.get(origin)
        now = time.monotonic()
        while conns:
            conn = conns.pop()  # the most recently used: the least likely to have been closed
            self._idle_count -= 1
            if conn.usable(now):
                return conn
            conn.close()
            self._open -= 1
        return None

    def _close_one_idle(self) -> bool:
        for conns in self._idle.values():
            if conns:
                conns.pop(0).close()
                self._idle_count -= 1
                self._open -= 1
                return True
        return False

    async def _connect(self, origin: tuple[bytes, int], timeout: float | None) -> _Connection:
        self._open += 1
        try:
            conn = _Connection(origin)
            try:
                async with asyncio.timeout(timeout):
                    await asyncio.get_running_loop().create_connection(
                        lambda: conn, origin[0].decode("ascii"), origin[1]
                    )
            except TimeoutError as e:
                raise httpx.ConnectTimeout(str(e) or "timed out connecting") from e
            except OSError as e:
                raise httpx.ConnectError(str(e) or repr(e)) from e
            return conn
        except BaseException:
            self._open -= 1
            self._wake_one()
            raise

    async def _wait(self, timeout: float | None) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except BaseException as e:
            if waiter.done() and not waiter.cancelled():
                self._wake_one()  # woken, but leaving (cancelled): the next one takes the connection
            else:
                waiter.cancel()
                _discard(self._waiters, waiter)
            if isinstance(e, TimeoutError):
                raise httpx.PoolTimeout("timed out waiting for a connection") from e
            raise

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return


def _discard(waiters: collections.deque[asyncio.Future[None]], waiter: asyncio.Future[None]) -> None:
    with contextlib.suppress(ValueError):
        waiters.remove(waiter)


class _Body(httpx.AsyncByteStream):
    """A response body read from its connection; closing it gives the connection back to the pool."""

    def __init__(self, pool: _Pool, conn: _Connection, read_timeout: float | None) -> None:
        self._pool, self._conn, self._timeout = pool, conn, read_timeout
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            data = conn.take()
            if data:
                yield data
            elif conn.done:
                return
            else:
                await conn.wait(self._timeout)

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            conn = self._conn
            self._pool.release(conn, conn.done and conn.keep_alive and not conn.body)


class Http11Transport(httpx.AsyncBaseTransport):
    """httpx's transport for plain-HTTP engines on `_Pool` and `_Connection` (see the module docstring)."""

    def __init__(self, limits: httpx.Limits, fallback: httpx.AsyncBaseTransport) -> None:
        self._pool = _Pool(limits)
        self._fallback = fallback

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        headers = request.headers
        if (
            url.scheme != "http"
            or request.method in ("HEAD", "CONNECT")
            or "transfer-encoding" in headers
            or "upgrade" in headers
            or not isinstance(request.stream, httpx.ByteStream)
        ):
            return await self._fallback.handle_async_request(request)
        timeouts = request.extensions.get("timeout") or {}
        payload = _serialize(request)
        origin = (url.raw_host, url.port or 80)
        conn = await self._pool.acquire(origin, timeouts)
        try:
            conn.send(payload)
            await conn.drained(timeouts.get("write"))
            while not conn.head:
                await conn.wait(timeouts.get("read"))
        except BaseException:
            self._pool.release(conn, False)
            raise
        if b"close" in (headers.get("connection") or "").encode().lower():
            conn.keep_alive = False
        return httpx.Response(
            conn.status,
            headers=conn.headers,
            stream=_Body(self._pool, conn, timeouts.get("read")),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": conn.reason},
        )

    async def aclose(self) -> None:
        self._pool.close()
        await self._fallback.aclose()


def _serialize(request: httpx.Request) -> bytes:
    """The request's bytes: request line, headers (as httpx set them: Host, Content-Length...), body."""
    lines = [b"%s %s HTTP/1.1" % (request.method.encode("ascii"), request.url.raw_path)]
    for name, value in request.headers.raw:
        if b"\r" in value or b"\n" in value or b"\r" in name or b"\n" in name or b":" in name:
            raise httpx.LocalProtocolError(f"illegal header {name!r}")
        lines.append(name + b": " + value)
    lines.append(b"\r\n")
    return b"\r\n".join(lines) + request.content
