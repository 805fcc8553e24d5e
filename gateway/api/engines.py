"""The engine pool's API: list the workers, and (admin) register a running vLLM server.

::

    GET    /api/engines                  every worker: state, load, process, context window
    POST   /api/engines {"url": ...}     admin: register a running engine; probed, then routed to
                                         (an invalid URL, or one outside --engine-allow, is a 400;
                                         one already in the pool a 409)
    DELETE /api/engines/{name}           admin: drain a worker (no new requests; in-flight ones may
                                         finish for ?drain_s=60 seconds), then remove it
    GET    /api/routing                  the routing policy and its spill threshold, and how many
                                         sessions and groups have a worker remembered
    PUT    /api/routing {"routing": ...} admin: change the policy (``routing``), ``routing_spill_factor``
                                         or ``routing_spill_floor`` live; the next request is placed
                                         by it (the sessions' and groups' workers are kept)
"""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core.errors import InvalidRequest
from engine_pool.face import MemberView
from engine_pool.pool import EnginePool
from engine_pool.settings import RoutingPolicy
from gateway.config import engine_allowed
from gateway.gateway import gateway_of
from gateway.http.access import require_admin
from gateway.http.bodies import read_json, validate

log = logging.getLogger(__name__)


def _engine_json(m: MemberView, request: Request) -> dict[str, Any]:
    """A worker as the pool sees it, and the tokens it has sent for each request in flight on it."""
    gw = gateway_of(request)
    in_flight = gw.runner.failover.quarantine.in_flight().get(m.name, [])
    return m.as_json() | {"in_flight_tokens": in_flight}


async def engines(request: Request) -> Response:
    """The workers, and the queries of death refused now (``gateway.turns.quarantine``)."""
    gw = gateway_of(request)
    quarantine = gw.runner.failover.quarantine
    return JSONResponse({
        "data": [_engine_json(m, request) for m in gw.pool.view().members],
        "queries_of_death": quarantine.remembered(),
        "quarantine": {"enabled": quarantine.config.enabled, "convicted": quarantine.convicted_total,
                       "refused": quarantine.refused_total},
    })  # fmt: skip


class RegisterEngine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str


async def register_engine(request: Request) -> Response:
    """Register a running vLLM server by URL; the pool probes it and routes to it once it answers."""
    gw = gateway_of(request)
    require_admin(gw.config, request)
    req = validate(RegisterEngine, await read_json(request, gw.config.max_body_bytes))
    if not engine_allowed(req.url, gw.config.engine_allow):
        raise InvalidRequest(
            f"{req.url} is not an engine this gateway may use; the allowed ones are {gw.config.engine_allow} "
            "(--engine-allow)",
            "url",
            "engine_not_allowed",
        )
    member = await gw.pool.register(req.url)
    return JSONResponse(_engine_json(member, request), status_code=201)


async def remove_engine(request: Request) -> Response:
    """Drain a worker, then remove it from the pool (a launched one is stopped)."""
    gw = gateway_of(request)
    require_admin(gw.config, request)
    raw = request.query_params.get("drain_s", "60")
    try:
        drain_s = float(raw)
    except ValueError:
        drain_s = -1.0
    if not 0 <= drain_s <= 3600:
        raise InvalidRequest(
            f"drain_s must be seconds between 0 and 3600, not {raw!r}", "drain_s", "invalid_value"
        )
    member = await gw.pool.remove(request.path_params["name"], drain_timeout=drain_s)
    return JSONResponse(_engine_json(member, request))


ROUTING_SETTINGS = ("routing", "routing_spill_factor", "routing_spill_floor")
"""The pool settings ``PUT /api/routing`` changes (`engine_pool.settings.PoolSettings`)."""


def _routing_json(pool: EnginePool) -> dict[str, Any]:
    settings = {name: getattr(pool.settings, name) for name in ROUTING_SETTINGS}
    view = pool.view()
    return settings | {"sessions": view.remembered_sessions, "groups": view.groups}


async def routing(request: Request) -> Response:
    return JSONResponse(_routing_json(gateway_of(request).pool))


class SetRouting(BaseModel):
    """``PUT /api/routing``: what to change (each optional), bounded as in `GatewayConfig`."""

    model_config = ConfigDict(extra="forbid", strict=True)
    routing: RoutingPolicy | None = None
    routing_spill_factor: float | None = Field(default=None, ge=1.0, le=1e6, allow_inf_nan=False)
    routing_spill_floor: int | None = Field(default=None, ge=0, le=2**40)


async def set_routing(request: Request) -> Response:
    """Change the routing policy or its spill threshold live (admin)."""
    gw = gateway_of(request)
    require_admin(gw.config, request)
    req = validate(SetRouting, await read_json(request, gw.config.max_body_bytes))
    before = _routing_json(gw.pool)
    for name, value in req.model_dump(exclude_none=True).items():
        setattr(gw.pool.settings, name, value)  # read live by the router
    after = _routing_json(gw.pool)
    changed = {name: after[name] for name in ROUTING_SETTINGS if after[name] != before[name]}
    if changed:
        log.info("routing changed: %s", changed, extra={"event": "routing_changed", **changed})
    return JSONResponse(after)


def routes() -> list[Route]:
    return [
        Route("/api/engines", engines, methods=["GET"]),
        Route("/api/engines", register_engine, methods=["POST"]),
        Route("/api/engines/{name}", remove_engine, methods=["DELETE"]),
        Route("/api/routing", routing, methods=["GET"]),
        Route("/api/routing", set_routing, methods=["PUT"]),
    ]
