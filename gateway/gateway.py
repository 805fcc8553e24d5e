"""The gateway's long-lived objects, built in the app's lifespan and closed there."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any, TypeVar

import httpx
from starlette.requests import Request

from core.errors import AuxiliaryUnavailable, NotFound
from core.telemetry import Telemetry
from engine_pool.pool import EnginePool
from gateway.config import GatewayConfig
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.recorder import Recorder
from gateway.policy.tokenization import ChatTokenizer
from gateway.turns.auxiliary import AuxRoute, refuse
from gateway.turns.runner import TurnRunner
from gateway.turns.sessions import SessionManager
from sandbox.sessions.manager import SandboxManager
from store import TrajectoryStore

T = TypeVar("T")

INLINE_PREPARE_BYTES = 8192
"""A generating request whose body is at most this many bytes is prepared on the event loop (`prepare`)."""


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
    telemetry: Telemetry = field(default_factory=Telemetry)
    metrics: GatewayMetrics | None = None
    recorder: Recorder = field(default_factory=lambda: Recorder(Telemetry()))
    version: str = "0"

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

    async def offload(self, work: Callable[..., T], *args: Any) -> T:
        """Run CPU-heavy request work (templating, tokenization, reading many sessions) in a worker
        thread, so that the event loop keeps serving every other request and stream meanwhile."""
        return await asyncio.to_thread(work, *args)

    async def prepare(self, request: Request, work: Callable[..., T], *args: Any) -> T:
        """Turn a generating request into its generation (templating, tokenization, the session's prefix
        lookup): on the event loop when the body is small (``INLINE_PREPARE_BYTES``) and the store local,
        where handing it to a thread costs more than the work (in one `belayer bench gateway` run against
        the thread: 2-3% less CPU per short request, 21-22% less per streamed token); else `offload`."""
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) <= INLINE_PREPARE_BYTES and not self.store.remote:
            return work(*args)
        return await self.offload(work, *args)

    def aux_http_client(self) -> httpx.AsyncClient:
        if self.aux_http is None:
            raise AuxiliaryUnavailable(
                "the gateway has no client for auxiliary providers (it is shutting down)"
            )
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
