"""``GET /api/export`` and ``POST /api/export``: the export (`store.export`) over HTTP, for a trainer
beside the gateway. GET only reads; POST answers the same and marks the page's sessions as exported
(for ``belayer store prune --exported-only``), so no link or image on a web page can mark anything.

Both take ``GET /api/sessions``'s filters and page (``status``, ``reward_min``, ``meta.KEY``, ``limit``,
``offset``...) and ``format=jsonl|parquet|atif``, and answers the matching sessions' rows (one per
branch, with ``belayer export``'s columns: docs/export.md) as a file, or with ``format=atif`` their
ATIF trajectories (one per branch, one per line: ``store.atif``), with ``X-Total-Count`` (sessions that
match) so that a trainer pages through them; ``X-Row-Count`` counts the rows or trajectories. Each run is published on the live feed (``export``) and counted in ``belayer_exports_total{format}``.

Example::

    curl 'http://127.0.0.1:8000/api/export?status=closed&has_reward=true&format=jsonl&limit=500'
    curl -X POST 'http://127.0.0.1:8000/api/export?status=closed&format=jsonl'   # and mark them
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from core import events
from core.errors import InvalidRequest
from gateway.api.observe import session_query
from gateway.gateway import Gateway, gateway_of
from gateway.http.bodies import read_json
from store import SessionQuery
from store.export import FORMATS, encode_sessions


async def export(request: Request) -> Response:
    gw = gateway_of(request)
    fmt = request.query_params.get("format", "jsonl")
    if fmt not in FORMATS:
        raise InvalidRequest(f"format must be one of {', '.join(FORMATS)}, not {fmt!r}", "format")
    query = session_query(request)
    mark = request.method == "POST"
    if mark and await read_json(request, gw.config.max_body_bytes, optional=True):
        raise InvalidRequest(
            "POST /api/export takes its filters in the query string, as GET does; send no body (or {})"
        )
    body, rows, total = await gw.offload(_export, gw, query, fmt, mark)
    gw.telemetry.publish(events.Export(format=fmt, rows=rows, sessions_matched=total, marked=mark))
    headers = {"X-Total-Count": str(total), "X-Row-Count": str(rows)}
    return Response(body, media_type=FORMATS[fmt], headers=headers)


def _export(gw: Gateway, query: SessionQuery, fmt: str, mark: bool) -> tuple[bytes, int, int]:
    sessions, total = gw.store.query_sessions(query)
    body, rows = encode_sessions(gw.store, [s.id for s in sessions], fmt)
    if mark:
        gw.store.mark_exported([s.id for s in sessions])  # for `belayer store prune --exported-only`
    return body, rows, total


def routes() -> list[Route]:
    return [Route("/api/export", export, methods=["GET", "POST"])]
