"""The gateway's long-lived objects, built in the app's lifespan and closed there."""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import TypeVar

import httpx
from pydantic import BaseModel
from starlette.requests import Request

from core.errors import AuxiliaryUnavailable, NotFound
from engine_pool.pool import EnginePool
from gateway.auxiliary import AuxRoute, refuse
from gateway.config import GatewayConfig
from gateway.sandboxes.manager import SandboxManager
from gateway.sessions import SessionManager
from gateway.store import TrajectoryStore
from gateway.tokenization import ChatTokenizer
from gateway.turn_runner import TurnRunner

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
            raise AuxiliaryUnavailable("the gateway has no client for auxiliary providers (it is shutting down)")
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
