"""`engine_pool.engine.http11.Http11Transport` (httptools on asyncio protocols) against scripted raw HTTP servers
over real TCP: the same bodies and the same httpx exception classes as httpx's own transport for every
way a server can answer or fail, and the pool's limits (``httpx.Limits``) held."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import pytest

from core.net import free_port
from engine_pool.engine.http11 import Http11Transport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LIMITS = httpx.Limits(max_connections=4, max_keepalive_connections=2)
OK_HEAD = b"HTTP/1.1 200 OK\r\n"


def ours(limits: httpx.Limits = LIMITS) -> Http11Transport:
    return Http11Transport(limits, fallback=httpx.AsyncHTTPTransport(limits=limits))


TRANSPORTS: dict[str, Callable[[], httpx.AsyncBaseTransport]] = {
    "http11": ours,
    "httpx": lambda: httpx.AsyncHTTPTransport(limits=LIMITS),  # the reference
}


async def _request_head(reader: asyncio.StreamReader) -> bytes:
    """One request's head and body (Content-Length framed), or b"" at the end of the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return b""
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    return head + await reader.readexactly(length)


@contextlib.asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server on a free loopback port running `handler` per connection; its URL and a list with
    one entry per connection accepted."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    port = free_port()
    srv = await asyncio.start_server(on_connect, "127.0.0.1", port)
    async with srv:
        yield f"http://127.0.0.1:{port}", accepted


def answering(*answers: bytes, then_close: bool = False) -> Handler:
    """A server that answers successive requests on a connection with `answers` (then closes, or waits)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            if not await _request_head(reader):
                return
            writer.write(answer)
            await writer.drain()
        if not then_close:
            await reader.read()  # until the client closes

    return handle


async def _get(transport: httpx.AsyncBaseTransport, url: str, **kw: float) -> httpx.Response:
    async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5.0, **kw)) as http:
        return await http.post(f"{url}/v1/completions", content=b'{"x": 1}')


@pytest.mark.parametrize("name", TRANSPORTS)
@pytest.mark.parametrize(
    ("answer", "body"),
    [
        (OK_HEAD + b"Content-Length: 5\r\n\r\nhello", b"hello"),
        (OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n", b"hello"),
        (b"HTTP/1.1 100 Continue\r\n\r\n" + OK_HEAD + b"Content-Length: 2\r\n\r\nok", b"ok"),
        (OK_HEAD + b"Connection: close\r\n\r\nuntil the end", b"until the end"),
        (b"HTTP/1.1 204 No Content\r\n\r\n", b""),
    ],
    ids=["length", "chunked", "1xx", "until-close", "204"],
)
async def test_bodies_as_httpx(name: str, answer: bytes, body: bytes) -> None:
    async with server(answering(answer, then_close=True)) as (url, _):
        resp = await _get(TRANSPORTS[name](), url)
    assert (resp.status_code, resp.content) == (int(answer.rpartition(b"HTTP/1.1 ")[2][:3]), body)


@pytest.mark.parametrize("name", TRANSPORTS)
@pytest.mark.parametrize(
    ("answer", "error"),
    [
        (b"", httpx.RemoteProtocolError),  # closed without an answer
        (OK_HEAD + b"Content-Length: 10\r\n\r\nhalf", httpx.RemoteProtocolError),  # closed mid-body
        (OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n", httpx.RemoteProtocolError),
        (b"this is not HTTP\r\n\r\n", httpx.RemoteProtocolError),
    ],
    ids=["no-answer", "short-body", "cut-chunked", "garbage"],
)
async def test_failures_raise_what_httpx_raises(name: str, answer: bytes, error: type[Exception]) -> None:
    async with server(answering(answer, then_close=True)) as (url, _):
        with pytest.raises(error):
            await _get(TRANSPORTS[name](), url)


@pytest.mark.parametrize("name", TRANSPORTS)
async def test_a_reset_mid_body_is_a_read_error(name: str) -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_head(reader)
        writer.write(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n")
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # RST, as a killed engine's kernel sends

    async with (
        server(reset) as (url, _),
        httpx.AsyncClient(transport=TRANSPORTS[name](), timeout=5.0) as http,
        http.stream("POST", f"{url}/v1/completions", content=b"{}") as resp,
    ):
        with pytest.raises(httpx.ReadError):
            await resp.aread()


@pytest.mark.parametrize("name", TRANSPORTS)
async def test_timeouts_and_refusals_raise_what_httpx_raises(name: str) -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()

    async with server(silent) as (url, _):
        with pytest.raises(httpx.ReadTimeout):
            await _get(TRANSPORTS[name](), url, read=0.05)
    with pytest.raises(httpx.ConnectError):
        await _get(TRANSPORTS[name](), f"http://127.0.0.1:{free_port()}")


async def test_keep_alive_reuses_one_connection_and_survives_a_server_close() -> None:
    length = OK_HEAD + b"Content-Length: 2\r\n\r\nok"
    async with server(answering(length, length, then_close=True)) as (url, accepted):
        transport = ours()
        async with httpx.AsyncClient(transport=transport, timeout=5.0) as http:
            for _ in range(2):
                assert (await http.post(f"{url}/a", content=b"{}")).content == b"ok"
            assert len(accepted) == 1  # one connection, kept alive
            # the server closed it after two answers: the next request opens a new one
            async with asyncio.timeout(5):
                while transport._pool.connections and not transport._pool.connections[0].closed:
                    await asyncio.sleep(0.01)
            assert (await http.post(f"{url}/b", content=b"{}")).content == b"ok"
            assert len(accepted) == 2
            assert transport._pool.open_count == 1


@pytest.mark.parametrize(
    "answer",
    [
        (OK_HEAD + b"Content-Length: 2\r\n\r\nok") * 2,  # bytes after the answer: two answers to one request
        OK_HEAD + b"Content-Length: 2\r\nConnection: close\r\n\r\nok",
    ],
    ids=["bytes-after-the-answer", "connection-close"],
)
async def test_an_answer_is_read_and_its_connection_not_reused(answer: bytes) -> None:
    async with server(answering(answer, answer)) as (url, accepted):
        transport = ours()
        async with httpx.AsyncClient(transport=transport, timeout=5.0) as http:
            for _ in range(3):
                assert (await http.post(f"{url}/a", content=b"{}")).content == b"ok"
        assert len(accepted) == 3 and transport._pool.open_count == 0


async def test_the_limits_hold_under_concurrency_and_the_pool_times_out() -> None:
    gate = asyncio.Event()
    peak = [0, 0]  # open now, most open at once

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peak[0] += 1
        peak[1] = max(peak)
        try:
            while await _request_head(reader):
                await gate.wait()
                writer.write(OK_HEAD + b"Content-Length: 2\r\n\r\nok")
                await writer.drain()
        finally:
            peak[0] -= 1

    limits = httpx.Limits(max_connections=3, max_keepalive_connections=1)
    async with server(slow) as (url, accepted):
        transport = ours(limits)
        async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(5.0, pool=0.1)) as http:
            tasks = [asyncio.create_task(http.post(f"{url}/a", content=b"{}")) for _ in range(3)]
            while len(accepted) < 3:
                await asyncio.sleep(0.01)
            with pytest.raises(httpx.PoolTimeout):  # all 3 busy
                await http.post(f"{url}/b", content=b"{}")
            gate.set()
            assert [r.content for r in await asyncio.gather(*tasks)] == [b"ok"] * 3
            many = await asyncio.gather(*(http.post(f"{url}/c", content=b"{}") for _ in range(12)))
            assert [r.content for r in many] == [b"ok"] * 12
            assert peak[1] <= 3 and transport._pool.open_count <= 1  # one idle kept
    assert transport._pool.open_count == 0


async def test_a_cancelled_stream_closes_its_connection() -> None:
    async def dribble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await _request_head(reader):
            writer.write(OK_HEAD + b"Transfer-Encoding: chunked\r\n\r\n")
            for i in range(1000):
                writer.write(b"2\r\n%02d\r\n" % (i % 100))
                await writer.drain()
                await asyncio.sleep(0.01)

    async with server(dribble) as (url, accepted):
        transport = ours()
        async with httpx.AsyncClient(transport=transport, timeout=5.0) as http:

            async def read() -> None:
                async with http.stream("POST", f"{url}/s", content=b"{}") as resp:
                    async for _ in resp.aiter_bytes():
                        pass

            task = asyncio.create_task(read())
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert transport._pool.open_count == 0 and not transport._pool.connections
            async with http.stream("POST", f"{url}/s", content=b"{}") as resp:  # a new connection works
                first = await anext(resp.aiter_bytes())
            assert first.startswith(b"00") and len(accepted) == 2


async def test_https_and_streamed_bodies_go_to_the_fallback() -> None:
    seen: list[str] = []

    def fallback(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.scheme)
        return httpx.Response(200, content=b"fallback")

    transport = Http11Transport(LIMITS, fallback=httpx.MockTransport(fallback))

    async def body() -> AsyncIterator[bytes]:
        yield b"{}"

    async with httpx.AsyncClient(transport=transport, timeout=5.0) as http:
        assert (await http.get("https://engine.invalid/health")).content == b"fallback"
        assert (await http.post("http://engine.invalid/x", content=body())).content == b"fallback"
    assert seen == ["https", "http"]
