"""What an operator watches: ``/metrics``, the live feed ``/api/events``, and the dashboard's state.

- ``GET /metrics``: Prometheus text (`gateway.observe.metrics`), with the prefix-cache hit rate computed
  from a scrape of the workers (`gateway.api.engine_metrics.prefix_cache_hit_rate`); 404 with
  ``--no-metrics``.
- ``GET /api/events?since=SEQ&session=ID&kinds=a,b``: the live feed (`core.telemetry`) as server-sent
  events, one ``id: <seq>`` / ``event: <kind>`` / ``data: <json>`` block each. With ``since``, the
  retained events after that sequence number come first, so a reader that took a snapshot
  (``/api/dashboard/state``'s ``seq``) continues without a gap. A comment line every 15 s keeps
  proxies from closing an idle stream; a reader that fell behind gets a ``lagged`` event saying how
  many events it lost, and a ``shutdown`` event ends the stream when the gateway stops. Browsers'
  ``EventSource`` cannot send headers: ``?token=`` is accepted here.
- ``GET /api/dashboard/state``: one snapshot of everything the dashboard shows (workers, sandboxes,
  totals, the recovery timeline, the per-second series, the prefix-cache hit rate of each worker and of
  all, as on ``/metrics``), with the feed's ``seq`` at that moment.

Example::

    curl -N 'http://127.0.0.1:8000/api/events?kinds=failover,worker_state'
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from core.errors import InvalidRequest, NotFound
from gateway.api import engine_metrics
from gateway.gateway import Gateway, gateway_of
from gateway.observe.recorder import Totals
from store import SessionQuery

HEARTBEAT_S = 15.0
MAX_OFFSET = 1 << 53


def _number(request: Request, name: str, kind: type[int] | type[float] = float) -> Any:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = kind(raw)
    except ValueError:
        raise InvalidRequest(f"query parameter {name!r} must be a number, not {raw!r}", name) from None
    if value != value or value in (float("inf"), float("-inf")):
        raise InvalidRequest(f"query parameter {name!r} must be a finite number", name)
    return value


def encode_cursor(created_at: float, session_id: str) -> str:
    """An opaque page cursor: where the last session of a page sits in the list's order.

    >>> decode_cursor(encode_cursor(1.5, "ses_1"))
    (1.5, 'ses_1')
    """
    raw = json.dumps([created_at, session_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> tuple[float, str]:
    try:
        created_at, session_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if isinstance(created_at, int | float) and isinstance(session_id, str) and math.isfinite(created_at):
            return float(created_at), session_id
    except (ValueError, TypeError, UnicodeDecodeError):
        pass
    raise InvalidRequest("cursor is not one this gateway gave (use a page's next_cursor as it is)", "cursor")


def session_query(request: Request) -> SessionQuery:
    """``GET /api/sessions``'s filters and page from its query string (errors name the parameter)."""
    q = request.query_params
    status = q.get("status") or None
    if status not in (None, "open", "closed"):
        raise InvalidRequest(f"status must be 'open' or 'closed', not {status!r}", "status")
    has_reward = q.get("has_reward")
    if has_reward not in (None, "", "true", "false"):
        raise InvalidRequest(f"has_reward must be 'true' or 'false', not {has_reward!r}", "has_reward")
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"order must be 'asc' or 'desc', not {order!r}", "order")
    limit = _number(request, "limit", int)
    offset = _number(request, "offset", int)
    if limit is not None and not 0 <= limit <= 1000:
        raise InvalidRequest("limit must be between 0 and 1000", "limit")
    if offset is not None and not 0 <= offset <= MAX_OFFSET:
        raise InvalidRequest(f"offset must be between 0 and {MAX_OFFSET}", "offset")
    metadata = {k[5:]: v for k, v in q.multi_items() if k.startswith("meta.") and len(k) > 5}
    cursor = q.get("cursor") or None
    return SessionQuery(
        after=decode_cursor(cursor) if cursor is not None else None,
        status=status,
        reward_min=_number(request, "reward_min"),
        reward_max=_number(request, "reward_max"),
        has_reward=None if not has_reward else has_reward == "true",
        created_after=_number(request, "created_after"),
        created_before=_number(request, "created_before"),
        metadata=metadata,
        limit=100 if limit is None else limit,
        offset=offset or 0,
        newest_first=order == "desc",
    )


async def metrics(request: Request) -> Response:
    gw = gateway_of(request)
    if gw.metrics is None:
        raise NotFound("metrics are off on this gateway (started with --no-metrics)")
    scrapes = await engine_metrics.scrape_pool(gw)  # for the figures computed from the workers' own
    registry = gw.metrics

    def render() -> bytes:
        return registry.render() + engine_metrics.render([engine_metrics.prefix_cache_hit_rate(scrapes)])

    body = await gw.offload(render)
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


async def events(request: Request) -> Response:
    gw = gateway_of(request)
    since = _number(request, "since", int)
    kinds_param = request.query_params.get("kinds")
    kinds = [k for k in kinds_param.split(",") if k] if kinds_param else None
    session = request.query_params.get("session") or None

    async def stream() -> AsyncIterator[bytes]:
        async with gw.telemetry.subscribe(since, session, kinds) as sub:
            yield b": belayer live feed\n\n"
            lost = 0
            while True:
                try:
                    event = await asyncio.wait_for(sub.queue.get(), HEARTBEAT_S)
                except TimeoutError:
                    yield b": keep-alive\n\n"
                    continue
                if event is None:  # the gateway is shutting down: the reader reconnects later
                    yield b"event: shutdown\ndata: {}\n\n"
                    return
                if sub.lost > lost:
                    body = json.dumps({"kind": "lagged", "data": {"lost": sub.lost - lost}})
                    yield f"event: lagged\ndata: {body}\n\n".encode()
                    lost = sub.lost
                body = json.dumps(event.as_json(), separators=(",", ":"))
                yield f"id: {event.seq}\nevent: {event.kind}\ndata: {body}\n\n".encode()

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(stream(), media_type="text/event-stream", headers=headers)


async def dashboard_state(request: Request) -> Response:
    gw = gateway_of(request)
    rate = engine_metrics.prefix_cache_hit_rate(await engine_metrics.scrape_pool(gw))
    hit_rates = {s.labels["worker"]: round(s.value, 6) for s in rate.samples}
    return await gw.offload(_state, gw, hit_rates)


def _state(gw: Gateway, hit_rates: dict[str, float]) -> Response:
    """The snapshot; `hit_rates`: each worker's prefix-cache hit rate, and ``all``'s (those that have one)."""
    seq = gw.telemetry.seq
    rec = gw.recorder
    _, open_sessions = gw.store.query_sessions(SessionQuery(status="open", limit=0))
    sandboxes = gw.sandboxes.views() if gw.sandboxes is not None else []
    now = time.time()
    body = {
        "gateway": {
            "version": gw.version,
            "started_at": gw.telemetry.started_at,
            "uptime_s": round(now - gw.telemetry.started_at, 3),
            "store_bytes": gw.store.size_bytes(),
            "sandboxes": gw.sandboxes is not None,
            "metrics": gw.metrics is not None,
        },
        "workers": [
            m.as_json() | {"prefix_cache_hit_rate": hit_rates.get(m.name)} for m in gw.pool.view().members
        ],
        "prefix_cache_hit_rate": hit_rates.get("all"),
        "queries_of_death": gw.runner.failover.quarantine.remembered(),
        "sandboxes": sandboxes,
        "sandbox_nodes": gw.sandboxes.backend.nodes() if gw.sandboxes is not None else [],
        "totals": {**_totals(rec.totals), "sessions_open": open_sessions},
        "timeline": [e.as_json() for e in list(rec.timeline)],
        "series": list(rec.series),
        "seq": seq,
    }
    return JSONResponse(body)


def _totals(t: Totals) -> dict[str, int]:
    return {name: getattr(t, name) for name in Totals.__dataclass_fields__}


def routes() -> list[Route]:
    return [
        Route("/metrics", metrics, methods=["GET"]),
        Route("/api/events", events, methods=["GET"]),
        Route("/api/dashboard/state", dashboard_state, methods=["GET"]),
    ]
