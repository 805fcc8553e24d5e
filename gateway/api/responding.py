"""What every protocol's routes share once a request is prepared: turning a turn's events into an HTTP
response (JSON, or SSE with errors reported in the stream once the headers are out)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from typing import Any, Protocol

from starlette.responses import JSONResponse, Response, StreamingResponse

from gateway.gateway import Gateway
from gateway.turns.protocol import Delta, Done, GenerationRequest

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


class Formatter(Protocol):
    """One protocol's rendering of one turn."""

    def feed(self, delta: Delta) -> object:
        """Non-streamed: take in a delta (the final ``response`` may need it)."""

    def response(self, done: Done) -> dict[str, Any]:
        """Non-streamed: the response body."""

    def stream(self, events: AsyncIterator[Delta | Done]) -> AsyncIterator[str]:
        """Streamed: the SSE text for the events."""

    def stream_error(self, exc: Exception) -> str:
        """Streamed: the SSE text that reports an error after the headers went out."""


async def respond(gw: Gateway, gen: GenerationRequest, fmt: Formatter) -> Response:
    events = gw.runner.run(gen)
    headers = {"x-belayer-session": gen.session.id, "x-belayer-pid": str(os.getpid())}
    if not gen.stream:
        async for ev in events:
            if isinstance(ev, Done):
                headers["x-belayer-turn"] = str(ev.turn.index)
                return JSONResponse(fmt.response(ev), headers=headers)
            fmt.feed(ev)
        raise AssertionError("generation ended without Done")
    # Pull the first event before sending headers, so that errors raised before any token (no engine,
    # context length, engine rejection) still get their proper HTTP status.
    first = await events.__anext__()

    async def chained() -> AsyncIterator[Delta | Done]:
        yield first
        async for ev in events:
            yield ev

    async def body() -> AsyncIterator[str]:
        try:
            async for text in fmt.stream(chained()):
                yield text
        except Exception as e:  # the headers are out: report the error in the stream
            yield fmt.stream_error(e)
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers | SSE_HEADERS)
