"""The gateway's long-lived objects, built in the app's lifespan and closed there."""

from __future__ import annotations

import json
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from belayer.config import GatewayConfig
from belayer.errors import EngineUnavailable, InvalidRequest, NotFound
from engine_pool.pool import EnginePool
from gateway.auxiliary import AuxRoute, refuse
from gateway.generation import TurnRunner
from gateway.sessions import SessionManager
from gateway.store import TrajectoryStore
from gateway.tokenization import ChatTokenizer
from sandbox.manager import SandboxManager

M = TypeVar("M", bound=BaseModel)


@dataclass(slots=True)
class Gateway:
    config: GatewayConfig
    store: TrajectoryStore
    tokenizer: ChatTokenizer
    pool: EnginePool
    sessions: SessionManager
    runner: TurnRunner
    sandboxes: SandboxManager | None = None
    aux_http: httpx.AsyncClient | None = None

    def route_model(self, model: str) -> AuxRoute | None:
        """None when the policy serves `model` (a served name or an alias); its auxiliary route when an
        ``auxiliary_models`` pattern matches (checked first); raises for ``reject`` and unknown names."""
        for pattern, text in self.config.auxiliary_models.items():
            if fnmatchcase(model, pattern):
                route = AuxRoute.parse(text)
                if route.kind == "reject":
                    raise refuse(model, pattern)
                return route
        self.check_model(model)
        return None

    def aux_http_client(self) -> httpx.AsyncClient:
        if self.aux_http is None:
            raise EngineUnavailable("the gateway has no client for auxiliary providers (it is shutting down)")
        return self.aux_http

    def check_model(self, model: str) -> str:
        """The served model that ``model`` names: itself, or the target of a matching ``model_aliases``."""
        served = self.config.served_model_names
        aliased = (to for pattern, to in self.config.model_aliases.items() if fnmatchcase(model, pattern))
        target = model if model in served else next(aliased, None)
        if target is None or target not in served:
            raise NotFound(
                f"The model '{model}' does not exist here; use one of: {', '.join(self.config.served_model_names)}",
                param="model",
                code="model_not_found",
            )
        return target


def gateway_of(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


async def read_json(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object, enforcing the size limit while reading."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise InvalidRequest("the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise InvalidRequest(
            f"the request body is not valid JSON ({e}); send a JSON object", code="invalid_json"
        ) from e
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object", code="invalid_json")
    return body


def _too_large(size: int, limit: int) -> InvalidRequest:
    err = InvalidRequest(
        f"the request body is {size} bytes, over the gateway's limit of {limit} bytes; send a shorter request "
        "or raise --max-body-bytes",
        code="request_too_large",
    )
    err.status = 413
    return err


def validate(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(
            f"invalid value for '{loc}': {first['msg']} ({e.error_count()} error(s) in total)",
            param=loc or None,
            code="invalid_type" if "type" in first["type"] else "invalid_value",
        ) from e
