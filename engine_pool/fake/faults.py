"""Faults in front of fake engines: a transport that injects the failures real workers have
(`FaultInjector`, one `Fault` at a time per host), and an ASGI wrapper that makes each completion slow
(`LatentEngine`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(slots=True)
class Fault:
    """What happens to the next request to one host: ``drop_after`` N streamed events then a reset
    connection; ``refuse`` the connection; ``stall_after`` N events then silence (a hung worker)."""

    kind: str
    after: int = 0


class LatentEngine:
    """An ASGI wrapper that makes each completion take `latency_s` first: an LLM call's bubble."""

    def __init__(self, app: Any, latency_s: float) -> None:
        self.app, self.latency_s = app, latency_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/completions"):
            await asyncio.sleep(self.latency_s)
        await self.app(scope, receive, send)


class FaultInjector(httpx.AsyncBaseTransport):
    """A transport in front of fake engines that injects the failures real workers have: the same
    exceptions httpx raises when a worker is killed (``RemoteProtocolError``, ``ConnectError``) or hangs.

    ``faults[host]`` is a queue consumed one generation request at a time; ``hung`` hosts also fail
    their health checks (time out), like a SIGSTOPped worker. A generation request that `kills` returns
    True for (given its body) is a query of death: its host goes ``down`` (it refuses every connection
    from then on, probes included) and the request's stream is reset before its first token (with
    `kill_with_error`, after an error event, as a server whose engine process died answers);
    ``killed`` lists the hosts it took down, in order.
    """

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self.inner = inner
        self.faults: dict[str, list[Fault]] = {}
        self.hung: set[str] = set()
        self.down: set[str] = set()
        self.kills: Callable[[dict[str, Any]], bool] | None = None
        self.kill_with_error = False
        self.killed: list[str] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if self.kills is not None and request.url.path == "/v1/completions":
            body = json.loads(await request.aread())
            if self.kills(body):
                self.down.add(host)
                self.killed.append(host)
                died = b'data: {"error": {"message": "EngineCore died", "code": 500}}\n\n'
                stream = _FaultyStream([died] if self.kill_with_error else [], Fault("drop_after"), request)
                return httpx.Response(
                    200, headers={"content-type": "text/event-stream"}, stream=stream, request=request
                )
        if request.url.path == "/health" and host in self.hung:
            raise httpx.ReadTimeout("health check timed out", request=request)
        queue = self.faults.get(host) or []
        if request.url.path != "/v1/completions" or not queue:
            return await self.inner.handle_async_request(request)
        fault = queue.pop(0)
        if fault.kind == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        response = await self.inner.handle_async_request(request)
        body = await response.aread()
        events = [e + b"\n\n" for e in body.split(b"\n\n") if e.strip()]
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_FaultyStream(events[: fault.after], fault, request),
            request=request,
        )


class _FaultyStream(httpx.AsyncByteStream):
    def __init__(self, events: list[bytes], fault: Fault, request: httpx.Request) -> None:
        self.events = events
        self.fault = fault
        self.request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for event in self.events:
            yield event
            await asyncio.sleep(0)
        if self.fault.kind == "stall_after":
            await asyncio.Event().wait()  # never set: the worker hangs
        raise httpx.RemoteProtocolError(
            "peer closed connection without sending complete message body", request=self.request
        )
