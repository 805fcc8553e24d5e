"""The policy's weight version: read it, and (admin) move every worker to new weights.

::

    GET  /api/weights                          the version served, each worker's, and recent updates
    POST /api/weights {"version": "step-120",  admin: load the weights at "path" on every active worker
                       "path": "/ckpt/step-120",      and shadow, then serve them as "version"
                       "drain_s": 30}

An update holds new requests back, lets the requests in flight finish on the old weights for up to
``drain_s`` seconds (default 30; 0 cuts them at once), cuts those still running and resumes them on the
new weights once every worker has them (each turn records which version generated which of its tokens:
``weight_segments`` and ``weight_versions``, named and shaped alike in ``/trajectory`` and the export), and records the update
(`gateway.policy.weights`). Answers 200 with what was done, 400 (``weights_not_loadable``, param ``path``) for
weights that cannot replace the served model's or lie outside ``--weights-root`` (then no worker
was changed), 409 while another
update runs or for the version already served, 403 without the admin token.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core import events
from core.errors import BelayerError, Conflict
from gateway.gateway import gateway_of
from gateway.http.access import require_admin
from gateway.http.bodies import read_json, validate
from gateway.policy import weights

HISTORY = 100
"""Updates ``GET /api/weights`` lists (the newest)."""


class UpdateWeights(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=4096)
    drain_s: float = Field(default=30.0, ge=0, le=3600, allow_inf_nan=False)
    """Seconds the requests in flight may finish on the old weights before they are cut."""


async def current(request: Request) -> Response:
    gw = gateway_of(request)
    pool = gw.pool.view()
    body = {
        "version": pool.weight_version,
        "path": pool.weights_path,
        "base_version": pool.base_version,
        "workers": [
            {"name": m.name, "state": m.state, "weight_version": m.weight_version} for m in pool.members
        ],
        "updates": (await gw.offload(weights.history, gw.store))[-HISTORY:],
    }
    return JSONResponse(body)


async def update(request: Request) -> Response:
    gw = gateway_of(request)
    require_admin(gw.config, request)
    req = validate(UpdateWeights, await read_json(request, gw.config.max_body_bytes))
    version = weights.check_version(req.version)
    path = await gw.offload(weights.check_weights, req.path, gw.config.model, gw.config.weights_root)
    try:
        result = await gw.pool.updater.update(version, path, req.drain_s)
    except Conflict:
        raise  # another update runs, or this version is served: nothing was attempted
    except BelayerError as e:
        failed = events.WeightsUpdateFailed(version, path, gw.pool.view().weight_version, str(e))
        await gw.offload(weights.record, gw.store, failed)
        raise
    await gw.offload(weights.record, gw.store, result)
    return JSONResponse(result.data())


def routes() -> list[Route]:
    return [
        Route("/api/weights", current, methods=["GET"]),
        Route("/api/weights", update, methods=["POST"]),
    ]
