"""The gateway's HTTP transport to its engines: cheaper per request and per chunk than httpx's own.

The engine leg is the largest CPU cost on the gateway's token path (profiled with ``py-spy`` under
``belayer bench gateway``). Plain-HTTP engines are spoken to by `engine_pool.engine.http11.Http11Transport`
(``httptools``' C parser on asyncio protocols, httpx's own exceptions). Everything else (``https://``)
goes through httpx's transport (`httpx_transport`), where two parts are replaced, each behind a public
seam of ``httpcore``, so that everything above (``httpx.AsyncClient``, `EngineClient`, the error
translation in `engine_pool.engine.client.transport_errors`) is unchanged:

- **the network backend** (`AsyncioBackend`): asyncio streams instead of ``anyio``'s, which wrap every
  read and write of a streamed answer in a cancel scope and a timeout scope;
- **the pool's bookkeeping** (`_LinearPool`): ``httpcore`` 1.0's pool, on every request start and end,
  counts its connections once per idle connection (quadratic in the connections; at 32 streams it was a
  fifth of the engine leg's CPU). The count is the same, taken once; the method is otherwise the same.
  Applied to the ``httpcore`` 1.0 series only (the method is private); any other version keeps its own.

Timeouts and errors are ``httpcore``'s own (``ConnectTimeout``, ``ReadError``...), which ``httpx``
maps as it always does. Tests still inject ``httpx.ASGITransport`` in place of all of this.

Example::

    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(transport=engine_transport(limits), timeout=None) as http:
        engine = EngineClient("http://127.0.0.1:8001", "tiny", http)
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import typing
from collections.abc import Iterable

import httpcore
import httpx

from engine_pool.engine.http11 import Http11Transport

SockOpt = tuple[int, int, int] | tuple[int, int, bytes | bytearray] | tuple[int, int, None, int]


def engine_transport(limits: httpx.Limits) -> httpx.AsyncBaseTransport:
    """`Http11Transport` (``httptools`` on asyncio protocols) for plain-HTTP engines with `limits`, over
    `httpx_transport` for anything else (``https://``...)."""
    return Http11Transport(limits, fallback=httpx_transport(limits))


def httpx_transport(limits: httpx.Limits) -> httpx.AsyncBaseTransport:
    """httpx's HTTP/1.1 transport with `limits`, over `AsyncioBackend` and `_LinearPool`."""
    transport = httpx.AsyncHTTPTransport(limits=limits)
    if not isinstance(getattr(transport, "_pool", None), httpcore.AsyncConnectionPool):
        return transport  # an httpx whose transport is built otherwise: keep it as it is
    pool_class = _LinearPool if httpcore.__version__.startswith("1.0.") else httpcore.AsyncConnectionPool
    transport._pool = pool_class(
        ssl_context=httpx.create_ssl_context(),
        max_connections=limits.max_connections,
        max_keepalive_connections=limits.max_keepalive_connections,
        keepalive_expiry=limits.keepalive_expiry,
        network_backend=AsyncioBackend(),
    )
    return transport


class AsyncioStream(httpcore.AsyncNetworkStream):
    """One TCP (or TLS) connection as asyncio streams."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            if timeout is None:
                return await self._reader.read(max_bytes)
            async with asyncio.timeout(timeout):
                return await self._reader.read(max_bytes)
        except TimeoutError as e:
            raise httpcore.ReadTimeout(str(e)) from e
        except OSError as e:
            raise httpcore.ReadError(str(e) or repr(e)) from e

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            self._writer.write(buffer)
            if timeout is None:
                await self._writer.drain()
            else:
                async with asyncio.timeout(timeout):
                    await self._writer.drain()
        except TimeoutError as e:
            raise httpcore.WriteTimeout(str(e)) from e
        except (OSError, RuntimeError) as e:  # RuntimeError: written after the transport closed
            raise httpcore.WriteError(str(e) or repr(e)) from e

    async def aclose(self) -> None:
        with contextlib.suppress(OSError, RuntimeError):
            self._writer.close()

    async def start_tls(
        self, ssl_context: ssl.SSLContext, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                await self._writer.start_tls(ssl_context, server_hostname=server_hostname)
        except TimeoutError as e:
            raise httpcore.ConnectTimeout(str(e)) from e
        except (OSError, ssl.SSLError) as e:
            raise httpcore.ConnectError(str(e) or repr(e)) from e
        return self

    def get_extra_info(self, info: str) -> typing.Any:
        transport = self._writer.transport
        if info == "is_readable":  # asked of an idle connection: has the server closed it?
            sock = transport.get_extra_info("socket")
            return self._reader.at_eof() or transport.is_closing() or (sock is not None and _readable(sock))
        names = {"client_addr": "sockname", "server_addr": "peername"}
        if info in ("socket", "ssl_object", "client_addr", "server_addr"):
            return transport.get_extra_info(names.get(info, info))
        return None


class AsyncioBackend(httpcore.AsyncNetworkBackend):
    """``httpcore``'s network backend on asyncio streams (see the module docstring)."""

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[SockOpt] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        local = (local_address, 0) if local_address else None
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port, local_addr=local)
        except TimeoutError as e:
            raise httpcore.ConnectTimeout(str(e)) from e
        except OSError as e:
            raise httpcore.ConnectError(str(e) or repr(e)) from e
        sock = writer.transport.get_extra_info("socket")
        for option in socket_options or ():
            sock.setsockopt(*option)
        return AsyncioStream(reader, writer)

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[SockOpt] | None = None
    ) -> httpcore.AsyncNetworkStream:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(path)
        except TimeoutError as e:
            raise httpcore.ConnectTimeout(str(e)) from e
        except OSError as e:
            raise httpcore.ConnectError(str(e) or repr(e)) from e
        return AsyncioStream(reader, writer)

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


def _readable(sock: socket.socket) -> bool:
    """Whether a socket has something to read (for an idle connection: the server closed it)."""
    with contextlib.suppress(OSError, ValueError):
        return bool(select.select([sock], [], [], 0)[0])
    return True


class _LinearPool(httpcore.AsyncConnectionPool):
    """``httpcore`` 1.0's pool with its connection count taken once per pass (see the module docstring).
    The body is ``AsyncConnectionPool._assign_requests_to_connections`` with that one change."""

    def _assign_requests_to_connections(self) -> list[typing.Any]:
        closing_connections = []
        for connection in list(self._connections):
            if connection.is_closed():
                self._connections.remove(connection)
            elif connection.has_expired():
                self._connections.remove(connection)
                closing_connections.append(connection)
            elif connection.is_idle() and len(self._connections) > self._max_keepalive_connections:
                # httpcore counts ``len([c.is_idle() for c in self._connections])``: all of them
                self._connections.remove(connection)
                closing_connections.append(connection)

        for pool_request in [request for request in self._requests if request.is_queued()]:
            origin = pool_request.request.url.origin
            available = next(
                (c for c in self._connections if c.can_handle_request(origin) and c.is_available()), None
            )
            if available is not None:
                pool_request.assign_to_connection(available)
            elif len(self._connections) < self._max_connections:
                connection = self.create_connection(origin)
                self._connections.append(connection)
                pool_request.assign_to_connection(connection)
            elif (idle := next((c for c in self._connections if c.is_idle()), None)) is not None:
                self._connections.remove(idle)
                closing_connections.append(idle)
                connection = self.create_connection(origin)
                self._connections.append(connection)
                pool_request.assign_to_connection(connection)
        return closing_connections
