"""The engine pool's API: list the workers, and (admin) register a running vLLM server.

::

    GET  /api/engines                    every worker: state, load, process, context window
    POST /api/engines {"url": ...}       admin: register a running engine; probed, then routed to
"""

from __future__ import annotations

import secrets

from pydantic import BaseModel, ConfigDict
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core.errors import Forbidden
from gateway.bodies import read_json, validate
from gateway.runtime import Gateway, gateway_of


async def engines(request: Request) -> Response:
    gw = gateway_of(request)
    data = [
        {
            "name": m.name,
            "url": m.client.base_url,
            "state": m.state,
            "outstanding": m.outstanding,
            "served": m.served,
            "pid": m.process.pid if m.process else None,
            "launched_at": m.process.started_at if m.process else None,
            "ready_at": m.process.ready_at if m.process else None,
            "max_model_len": m.info.max_model_len if m.info else None,
        }
        for m in gw.pool.members
    ]
    return JSONResponse({"data": data})


class RegisterEngine(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str


def require_admin(gw: Gateway, request: Request) -> None:
    """Admin endpoints need ``Authorization: Bearer <admin token>``; with no token configured they are off."""
    token = gw.config.admin_token
    if token is None:
        raise Forbidden(
            "admin endpoints are disabled; start the gateway with --admin-token (or BELAYER_ADMIN_TOKEN)"
        )
    given = request.headers.get("authorization", "")
    if not secrets.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise Forbidden("this endpoint needs the gateway's admin token: send 'Authorization: Bearer <token>'")


async def register_engine(request: Request) -> Response:
    """Register a running vLLM server by URL; the pool probes it and routes to it once it answers."""
    gw = gateway_of(request)
    require_admin(gw, request)
    req = validate(RegisterEngine, await read_json(request, gw.config.max_body_bytes))
    member = await gw.pool.register(req.url)
    return JSONResponse(
        {"name": member.name, "url": member.client.base_url, "state": member.state}, status_code=201
    )


def routes() -> list[Route]:
    return [
        Route("/api/engines", engines, methods=["GET"]),
        Route("/api/engines", register_engine, methods=["POST"]),
    ]
