"""``GET /api/finished``: the finished feed, every closed session once, in the order they closed.

A trainer reads it instead of polling: each session that closes (``POST /api/sessions/{id}/close``)
is recorded in the store with its place in the feed (a ``session_closed`` event), so the feed is
durable and resumable: a reader that comes back with the last cursor it saw, even to a restarted
gateway on the same store, gets exactly the sessions after it, none missed and none twice.

Query: ``after`` (a cursor; empty or absent: from the first; ``Last-Event-ID`` works too), ``follow``
(``true``: after the backlog, wait for new closes; default ``false``: end after the backlog),
``limit`` (end after that many sessions) and ``rows`` (``true``: each session's export rows too,
as ``store.export.session_rows`` builds them). The answer is server-sent events::

    id: <cursor>
    event: finished
    data: {"cursor": "<cursor>", "session": {<as GET /api/sessions/{id}>}, "rows": [...]}

then ``event: end`` (``data: {"cursor": ...}``) when the backlog or the limit is done, or ``event:
shutdown`` (same data) when the gateway stops: the reader reconnects with its cursor. A comment
line every 15 s keeps proxies from closing an idle stream. Cursors are opaque strings; one that this
store never gave (another store's) is refused (400, ``unknown_cursor``) rather than waited for.

Example::

    curl -N -H "Authorization: Bearer $TOKEN" 'http://127.0.0.1:8000/api/finished?follow=true&rows=true'
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from core.errors import InvalidRequest
from gateway.api.observe import HEARTBEAT_S, MAX_OFFSET
from gateway.api.sessions import _summary
from gateway.gateway import Gateway, gateway_of
from store.export import session_rows

BATCH = 100
"""Sessions read from the store per round (their rows are built in a worker thread)."""
MAX_CURSOR = (1 << 63) - 1  # SQLite's largest rowid


def parse_cursor(raw: str | None, param: str) -> int:
    """A cursor as given (the event id as text); absent or empty: before the first.

    >>> parse_cursor("42", "after"), parse_cursor("", "after")
    (42, 0)
    """
    if not raw:
        return 0
    if not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_CURSOR:
        raise InvalidRequest(
            f"{param} must be a cursor from this feed (a finished event's id), not {raw!r}", param
        )
    return int(raw)


def _flag(request: Request, name: str) -> bool:
    raw = request.query_params.get(name) or "false"
    if raw not in ("true", "false"):
        raise InvalidRequest(f"{name} must be 'true' or 'false', not {raw!r}", name)
    return raw == "true"


def _limit(request: Request) -> int | None:
    raw = request.query_params.get("limit")
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()) or int(raw) > MAX_OFFSET:
        raise InvalidRequest(f"limit must be a whole number between 0 and {MAX_OFFSET}, not {raw!r}", "limit")
    return int(raw)


def _read(gw: Gateway, request: Request, after: int, n: int, rows: bool) -> tuple[list[bytes], int, int]:
    """The next (at most) `n` finished sessions after `after` as SSE blocks, the cursor after them, and
    how many events were read (a session deleted since it closed is skipped, its cursor passed)."""
    blocks, cursor = [], after
    found = gw.store.closed_after(after, n)
    for event_id, session_id in found:
        cursor = event_id
        session = gw.store.get_session(session_id)
        if session is None:
            continue
        data: dict[str, Any] = {"cursor": str(event_id), "session": _summary(gw, request, session)}
        if rows:
            data["rows"] = session_rows(gw.store, session_id)
        body = json.dumps(data, separators=(",", ":"), allow_nan=False)
        blocks.append(f"id: {event_id}\nevent: finished\ndata: {body}\n\n".encode())
    return blocks, cursor, len(found)


def _last(kind: str, cursor: int) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'cursor': str(cursor)})}\n\n".encode()


async def finished(request: Request) -> Response:
    gw = gateway_of(request)
    q = request.query_params
    after = (
        parse_cursor(q.get("after"), "after")
        if "after" in q
        else parse_cursor(request.headers.get("last-event-id"), "Last-Event-ID")
    )
    follow, rows, limit = _flag(request, "follow"), _flag(request, "rows"), _limit(request)
    if after > await gw.offload(gw.store.last_event_id):  # a new store: waiting would skip its first
        raise InvalidRequest(
            f"cursor {after} is not from this gateway's store (its feed has not reached it); start again "
            "without a cursor to read this store's finished sessions",
            "after" if "after" in q else "Last-Event-ID",
            "unknown_cursor",
        )

    async def stream() -> AsyncIterator[bytes]:
        cursor, left = after, limit
        # Subscribed before the first read: a close committed after any read wakes the loop below.
        # (feed_advanced: another gateway on the same PostgreSQL store closed one, `store.postgres`)
        async with gw.telemetry.subscribe(kinds=["session_closed", "feed_advanced"]) as sub:
            yield b": belayer finished feed\n\n"
            while left is None or left > 0:
                n = BATCH if left is None else min(BATCH, left)
                blocks, cursor, read = await gw.offload(_read, gw, request, cursor, n, rows)
                for block in blocks:
                    yield block
                left = None if left is None else left - len(blocks)
                if read == n:  # more backlog, maybe
                    continue
                if not follow:
                    break
                woken = "shutdown" if gw.telemetry.closed else await _woken(sub.queue)
                if woken == "shutdown":
                    yield _last("shutdown", cursor)
                    return
                if woken == "idle":  # and read the store again: a missed wake-up costs 15 s, no more
                    yield b": keep-alive\n\n"
            yield _last("end", cursor)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)


async def _woken(queue: asyncio.Queue[Any]) -> str:
    """Wait for a close to be published: ``closed``, ``idle`` after `HEARTBEAT_S` without one, or
    ``shutdown`` when the feed ended. Every queued wake-up is taken: one read of the store covers all."""
    try:
        items = [await asyncio.wait_for(queue.get(), HEARTBEAT_S)]
    except TimeoutError:
        return "idle"
    while not queue.empty():
        items.append(queue.get_nowait())
    return "shutdown" if None in items else "closed"


def routes() -> list[Route]:
    return [Route("/api/finished", finished, methods=["GET"])]
