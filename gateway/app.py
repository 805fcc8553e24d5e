"""The Starlette app: routes, the error table, and the lifespan that owns the long-lived objects.

Example::

    app = build_app(GatewayConfig(model="./tiny-model", engine_urls=["http://127.0.0.1:8012"]))
    uvicorn.run(app, port=8000)

Tests inject their own pool (for instance over ``httpx.ASGITransport(fake_engine_app)``)::

    app = build_app(config, pool=EnginePool(http))
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine_pool.pool import EnginePool
from engine_pool.worker import WorkerSpec, free_port
from gateway import engines_api, sandbox_api, sessions_api
from gateway.access import Access
from gateway.anthropic import routes as anthropic_routes
from gateway.config import GatewayConfig
from gateway.errors import UnexpectedErrors, handlers
from gateway.observers import TurnObserver
from gateway.openai import routes as openai_routes
from gateway.runtime import Gateway, gateway_of
from gateway.sandbox_listener import serve_sandboxes
from gateway.sessions import SessionManager
from gateway.store import SqliteStore
from gateway.tokenization import ChatTokenizer
from gateway.turn_runner import TurnRunner
from sandbox.backend import SandboxBackend

log = logging.getLogger("belayer.gateway")


def build_pool(config: GatewayConfig, http: httpx.AsyncClient) -> EnginePool:
    def spec() -> WorkerSpec:
        return WorkerSpec(model=config.model, port=free_port(), max_model_len=config.max_model_len)

    launch = not config.engine_urls
    pool = EnginePool(
        http,
        log_dir=config.log_dir,
        spec_factory=spec if launch else None,
        active=config.workers if launch else len(config.engine_urls),
        shadows=config.shadows if launch else 0,
        start_timeout=config.worker_start_timeout,
    )
    for url in config.engine_urls:
        pool.add_remote(url)
    return pool


async def health(request: Request) -> Response:
    gw = gateway_of(request)
    ready = [m.name for m in gw.pool.ready()]
    body = {"status": "ok" if ready else "no_engine", "ready_workers": ready}
    return JSONResponse(body, status_code=200 if ready else 503)


def _warn_open(config: GatewayConfig) -> None:
    if config.api_token is None:
        log.warning(
            "the API is open: anyone who reaches %s:%d can list, read, reward and close every session; "
            "set --api-token (or BELAYER_API_TOKEN) unless only you can reach this port",
            config.host,
            config.port,
        )
    if config.host in ("0.0.0.0", "::") and not (config.public_url or config.allowed_hosts):
        log.warning("listening on all addresses: set --public-url so that session base_urls are reachable")


def build_app(
    config: GatewayConfig,
    pool: EnginePool | None = None,
    observers: list[TurnObserver] | None = None,
    sandbox_backend: SandboxBackend | None = None,
    aux_transport: httpx.AsyncBaseTransport | None = None,
) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        async with httpx.AsyncClient(limits=limits, timeout=None) as http:
            the_pool = pool or build_pool(config, http)
            store = SqliteStore(config.store_path, config.store_synchronous)
            tok = ChatTokenizer.load(config.model)
            owned = contextlib.AsyncExitStack()  # what the lifespan opens after the pool, closed first
            try:
                await the_pool.start()
                sandboxes = await owned.enter_async_context(
                    sandbox_api.open_sandboxes(config.sandbox, store, the_pool, sandbox_backend)
                )
                if sandboxes is not None and config.sandbox.sandbox_port is not None:
                    await owned.enter_async_context(
                        serve_sandboxes(app, sandboxes, sandboxes.network, config.sandbox.sandbox_port)
                    )
                watchers = [*(observers or []), *([sandboxes] if sandboxes else [])]
                aux_http = await owned.enter_async_context(
                    httpx.AsyncClient(timeout=None, transport=aux_transport)
                )
                runner = TurnRunner(
                    store,
                    the_pool,
                    tok,
                    config.default_max_tokens,
                    watchers,
                    config.failover,
                    config.max_tokens_cap,
                )
                # Closed first: its recomputations finish (or are cancelled) while pool and store are up.
                owned.push_async_callback(runner.close)
                sessions = SessionManager(store, tok)
                app.state.gateway = Gateway(
                    config, store, tok, the_pool, sessions, runner, sandboxes, aux_http
                )
                _warn_open(config)
                log.info(
                    "gateway ready: workers=%s max_model_len=%d",
                    [m.name for m in the_pool.ready()],
                    the_pool.max_model_len,
                )
                yield
            finally:
                await owned.aclose()
                await the_pool.stop()
                store.close()

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            *openai_routes.routes(),
            *anthropic_routes.routes(),
            *sessions_api.routes(),
            *engines_api.routes(),
            *sandbox_api.routes(),
        ],
        exception_handlers=handlers(),
        middleware=[Middleware(UnexpectedErrors), Middleware(Access, config=config)],
        lifespan=lifespan,
    )
