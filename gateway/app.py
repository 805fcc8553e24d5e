"""The Starlette app: routes, the error table, and the lifespan that owns the long-lived objects.

Example::

    app = build_app(GatewayConfig(model="./tiny-model", engine_urls=["http://127.0.0.1:8012"]))
    uvicorn.run(app, port=8000)

Tests inject their own pool (for instance over ``httpx.ASGITransport(fake_engine_app)``)::

    app = build_app(config, pool=EnginePool(http))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core import __version__
from core.net import free_port
from core.tasks import started_threads
from core.telemetry import Telemetry
from core.worker_auth import new_worker_key
from engine_pool.engine.transport import engine_transport
from engine_pool.pool import READY, STARTING, EnginePool, PoolSettings, WorkerLauncher
from engine_pool.weights.cache import GpuWeightCache
from engine_pool.weights.owner import WeightOwner, loader_args
from engine_pool.workers.launch import colocated_utilization, model_context_length, names_option
from engine_pool.workers.worker import WorkerSpec
from gateway.api import engine_metrics
from gateway.api import engines as engines_api
from gateway.api import export as export_api
from gateway.api import finished as finished_api
from gateway.api import observe as observe_api
from gateway.api import sandbox as sandbox_api
from gateway.api import sessions as sessions_api
from gateway.api import weights as weights_api
from gateway.api.anthropic import routes as anthropic_routes
from gateway.api.openai import responses_routes
from gateway.api.openai import routes as openai_routes
from gateway.api.sandbox_listener import serve_sandboxes
from gateway.config import GatewayConfig, gateway_identity, gpu_weight_cache, launch_devices
from gateway.gateway import Gateway, gateway_of
from gateway.http.access import Access
from gateway.http.errors import UnexpectedErrors, handlers
from gateway.observe.dashboard import routes as dashboard_routes
from gateway.observe.event_log import log_event
from gateway.observe.loop_lag import LoopLagSampler
from gateway.observe.metrics import GatewayMetrics
from gateway.observe.recorder import Recorder
from gateway.observe.request_log import RequestObserver
from gateway.policy import weights
from gateway.policy.tokenization import ChatTokenizer
from gateway.turns.observers import TurnObserver
from gateway.turns.orphan_sweep import OrphanSweeper
from gateway.turns.protocol import TurnSettings
from gateway.turns.runner import TurnRunner
from gateway.turns.sessions import SessionManager
from sandbox.backend import SandboxBackend
from store.factory import open_store

log = logging.getLogger("belayer.gateway")


TIES_ENV = "BELAYER_NEAR_TIES_DIR"
"""Where a launched vLLM worker's keyed sampler writes its near ties (``belayer_vllm.keyed``)."""


def build_pool(config: GatewayConfig, http: httpx.AsyncClient) -> EnginePool:
    """The pool `config` describes: launched workers (unless engine URLs are given) on their device
    groups, the engines at ``engine_urls`` as active workers, and those at ``shadow_urls`` as shadows."""
    fake = config.worker_kind == "fake"
    # vLLM reads the model's context length itself; a fake worker is told it
    max_model_len = config.max_model_len or (model_context_length(config.model) if fake else None)
    launch = config.launch
    # every launched worker asks this key of its callers (core.worker_auth): on a Ray node it listens on
    # the node's address, with vLLM's development endpoints on
    worker_key = launch.worker_api_key or new_worker_key()

    def spec() -> WorkerSpec:
        return WorkerSpec(
            model=config.model, port=free_port(), max_model_len=max_model_len, kind=config.worker_kind,
            profile=launch.profile, tensor_parallel_size=launch.tensor_parallel_size,
            extra_args=() if fake else (*launch.vllm_args, *owner_args), api_key=worker_key,
            keyed_sampler=config.sampling == "keyed",
            extra_env={TIES_ENV: str(Path(config.log_dir).resolve())},  # keyed sampling's near ties
        )  # fmt: skip

    owned = launch.weight_owner and not fake and not config.engine_urls and not config.ray.address
    on_gpus = owned and gpu_weight_cache(config)
    groups = launch_devices(config)
    owner_args: tuple[str, ...] = ()
    if on_gpus and not names_option(launch.vllm_args, "gpu-memory-utilization"):
        share = colocated_utilization(config.workers, config.shadows, len(groups))
        owner_args = (f"--gpu-memory-utilization={share}",)  # the group's processes share its memory
    elif owned and not on_gpus:
        owner_args = loader_args(launch.weight_owner_dir, launch.weight_owner_linear)
    launching = not config.engine_urls
    launcher = ray_launcher(config) if launching and config.ray.address else None
    settings = PoolSettings(
        log_dir=config.log_dir,
        spec_factory=spec if launching else None,
        active=config.workers if launching else len(config.engine_urls),
        shadows=config.shadows if launching else 0,
        start_timeout=config.worker_start_timeout,
        device_groups=() if launcher else groups,
        colocate=on_gpus,
        launcher=launcher,
        routing=config.routing,
        routing_spill_factor=config.routing_spill_factor,
        routing_spill_floor=config.routing_spill_floor,
        watch_exits=config.failover.exit_watch,
        warm_up=config.failover.warm_up,
        start_nice=config.failover.start_nice,
    )
    pool = EnginePool(http, settings)
    if on_gpus:  # a vLLM weight cache per device group, mapped over CUDA IPC (engine_pool.weights.cache)
        pool.weights.owner = GpuWeightCache(spec(), groups, Path(config.log_dir))
    elif owned:  # one owner for the host's workers and shadows (engine_pool.weights.owner)
        pool.weights.owner = WeightOwner(spec(), launch.weight_owner_dir, Path(config.log_dir))
    for url in config.engine_urls:
        pool.add_remote(url)
    for url in config.shadow_urls:
        pool.add_remote(url, shadow=True)
    return pool


def ray_launcher(config: GatewayConfig) -> WorkerLauncher:
    """Workers as Ray actors (``--ray``); Ray itself is imported only once the pool connects."""
    from engine_pool.workers.ray_workers import RayLauncher, RaySettings

    ray, launch = config.ray, config.launch
    assert ray.address is not None
    gpus = (
        float(launch.tensor_parallel_size)
        if launch.profile == "gpu" and config.worker_kind == "vllm"
        else 0.0
    )
    return RayLauncher(
        RaySettings(
            address=ray.address, node_ip=ray.node_ip, namespace=ray.namespace,
            cpus_per_worker=ray.cpus_per_worker, gpus_per_worker=gpus, resources=dict(ray.resources),
        )
    )  # fmt: skip


async def health(request: Request) -> Response:
    """200 with a ready worker; 503 ``starting`` while engines load, ``no_engine`` with none."""
    gw = gateway_of(request)
    pool = gw.pool.view()
    ready = [m.name for m in pool.in_state(READY)]
    starting = [m.name for m in pool.in_state(STARTING)]
    status = "ok" if ready else "starting" if starting else "no_engine"
    body = {
        "status": status,
        "ready_workers": ready,
        "starting_workers": starting,
        "store_bytes": gw.store.size_bytes(),
        "pid": os.getpid(),  # which process answered (belayer serve --processes N)
    }
    return JSONResponse(body, status_code=200 if ready else 503)


ENGINE_KEEPALIVE = 1024
"""Idle engine connections kept open: enough for the streams of thousands of sessions that end and start
again within seconds (fewer: a new connection to the engine for most turns, `belayer bench scale`)."""


def engine_limits(config: GatewayConfig) -> httpx.Limits:
    """The engine leg's connections: as many as client connections (each stream holds one), at least 1024."""
    most = max(1024, config.server.max_connections)
    return httpx.Limits(max_connections=most, max_keepalive_connections=min(most, ENGINE_KEEPALIVE))


async def open_gateway(
    app: Starlette,
    config: GatewayConfig,
    stack: contextlib.AsyncExitStack,
    pool: EnginePool | None = None,
    observers: list[TurnObserver] | None = None,
    sandbox_backend: SandboxBackend | None = None,
    aux_transport: httpx.AsyncBaseTransport | None = None,
) -> Gateway:
    """Open the long-lived objects in order; `stack` closes them in reverse: the turn runner first (its
    recomputations need pool and store), then the sandboxes, the pool, and the store last."""
    # `asyncio.to_thread`'s threads, all started now: not one at a time later, on the loop (`started_threads`)
    asyncio.get_running_loop().set_default_executor(started_threads())
    limits = engine_limits(config)
    # httpx's transport on asyncio streams: the engine leg's CPU per chunk (engine_pool.engine.transport)
    http = await stack.enter_async_context(
        httpx.AsyncClient(transport=engine_transport(limits), timeout=None)
    )
    telemetry = Telemetry()
    telemetry.listen(log_event)
    recorder = Recorder(telemetry)
    store = open_store(config.store_path, config.store_synchronous, telemetry)
    stack.callback(store.close)
    tok = ChatTokenizer.load(config.model)
    the_pool = pool or build_pool(config, http)
    the_pool.settings.telemetry = telemetry
    weights.restore(store, the_pool)  # the version a gateway before this one moved the workers to
    stack.push_async_callback(the_pool.stop)  # also when start fails half-way: launched workers stop
    await the_pool.start()
    sandboxes = await stack.enter_async_context(
        sandbox_api.open_sandboxes(config.sandbox, store, the_pool, sandbox_backend, gateway_identity(config))
    )
    if sandboxes is not None and config.sandbox.sandbox_port is not None:
        await stack.enter_async_context(
            serve_sandboxes(app, sandboxes, sandboxes.network, config.sandbox.sandbox_port, config.server)
        )
    aux_http = await stack.enter_async_context(httpx.AsyncClient(timeout=None, transport=aux_transport))
    watchers = [*(observers or []), *([sandboxes] if sandboxes else [])]
    metrics = None
    if config.metrics:
        views = sandboxes.views if sandboxes is not None else list
        nodes = sandboxes.backend.nodes if sandboxes is not None else list
        metrics = GatewayMetrics(telemetry, the_pool, store, views, __version__, nodes)
        lag = LoopLagSampler(metrics.loop_lag)
        lag.start()
        stack.push_async_callback(lag.close)
    runner = TurnRunner(
        store,
        the_pool,
        tok,
        TurnSettings.of(config, launched=pool is None),
        observers=watchers,
        telemetry=telemetry,
        metrics=metrics,
    )
    stack.push_async_callback(runner.close)
    if metrics is not None:
        remembered = runner.failover.quarantine.remembered
        metrics.queries_of_death_remembered.set_function(lambda: len(remembered()))
    runner.recomputer.resume()  # what a gateway before this one left pending (it died, or shut down)
    sweeper = OrphanSweeper(store, config.inflight.sweep_interval_s)  # a dead replica's running turns
    sweeper.start()
    stack.push_async_callback(sweeper.close)
    recorder.start()
    stack.push_async_callback(recorder.close)
    sessions = SessionManager(store, tok)
    return Gateway(
        config, store, tok, the_pool, sessions, runner, sandboxes, aux_http, telemetry, metrics, recorder,
        __version__,
    )  # fmt: skip


def _warn_open(config: GatewayConfig) -> None:
    if config.api_token is None:
        log.warning(
            "the API is open: anyone who reaches %s:%d can list, read, reward and close every session; "
            "set --api-token (or BELAYER_API_TOKEN) unless only you can reach this port",
            config.host,
            config.port,
        )
    if config.host in ("0.0.0.0", "::") and not (config.public_url or config.allowed_hosts):
        log.warning(
            "listening on all addresses: set --public-url so that session base_urls are reachable; until "
            "then only IP addresses and the loopback names are answered as Host (--allowed-hosts adds names)"
        )


def build_app(
    config: GatewayConfig,
    pool: EnginePool | None = None,
    observers: list[TurnObserver] | None = None,
    sandbox_backend: SandboxBackend | None = None,
    aux_transport: httpx.AsyncBaseTransport | None = None,
) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as stack:
            gw = await open_gateway(app, config, stack, pool, observers, sandbox_backend, aux_transport)
            app.state.gateway = gw
            _warn_open(config)
            view = gw.pool.view()
            ready = [m.name for m in view.in_state(READY)]
            log.info("gateway ready: workers=%s max_model_len=%d", ready, view.max_model_len)
            yield

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            *openai_routes.routes(),
            *responses_routes.routes(),
            *anthropic_routes.routes(),
            *sessions_api.routes(),
            *engines_api.routes(),
            *sandbox_api.routes(),
            *observe_api.routes(),
            *engine_metrics.routes(),
            *export_api.routes(),
            *finished_api.routes(),
            *weights_api.routes(),
            *dashboard_routes.routes(),
        ],
        exception_handlers=handlers(),
        middleware=[
            Middleware(RequestObserver),
            Middleware(UnexpectedErrors),
            Middleware(Access, config=config),
        ],
        lifespan=lifespan,
    )
