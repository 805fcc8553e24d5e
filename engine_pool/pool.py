"""The engine pool: active workers, pre-initialised shadows, health probes, promotion and replacement.

Workers are either launched and supervised here (``VllmWorker``) or registered by URL (an engine that
is already running; the pool only probes and routes), each as an active worker or as a shadow
(``add_remote(url, shadow=True)``: ``belayer serve --shadow-url``). States::

    starting ──> ready (active, takes traffic) ──> draining ──> dead
        └──────> shadow (warm, no traffic) ──promote──> ready
    ready/shadow ──failed request / probe──> unhealthy ──probe ok──> ready or shadow   (registered)

A worker that dies or hangs is *fenced* and, if it was active, a shadow is promoted into its place at
once (no cold start). A launched worker is fenced by killing its process group, so it can never come back
half-alive; then a replacement is launched (on the devices the dead one freed) and the pool returns to
full strength. A registered worker cannot be killed from here: it is fenced by taking it out of routing
(``unhealthy``) until it passes a health probe again. Whoever comes back (a replacement, a registered
worker) becomes active while fewer workers are active than the pool's target, else a shadow: the
target is ``active`` launched workers plus the registered engines not given as shadows.

Routing (``PoolSettings.routing``, ``engine_pool.router``) by default prefers the worker that served the
session last (its prefix cache holds the session's tokens), then the one with the fewest outstanding
requests; the ``group`` policy also keeps a group's sessions on the group's first worker while its load
allows, and ``round-robin`` and ``least-loaded`` ignore the session. The affinity map holds named sessions only (a plain
``/v1`` request's one-request session is not remembered), is forgotten when a session closes, and is
bounded (least recently used first out). ``acquire`` waits, up to a deadline, for a worker when none is
ready (during a promotion or a restart); every state change wakes every waiter.

Weight versions (``POST /api/weights``, `WeightUpdater.update`): every worker holds a version (``weight_version``),
and only workers on the pool's current version are routed to or promoted. An update pauses new
generation (new requests wait, as for a promotion), lets the requests in flight finish for up to
``drain_s`` seconds, then cuts those still running (`Preemption`: the turn runner resubmits them after
the update, on the new version, and records the switch), loads the new weights on every active worker
and shadow (an active one first: if it cannot load them, nothing else is touched and the pool stays on
its version), then resumes. A worker that missed an update (unreachable, starting, a failed load) keeps
its old version: it is not routed to nor promoted until the pool has brought it up to the version (each
probe round tries, with backoff); a replacement worker is brought up before it takes traffic. A request
that must stay on one version (a failover, after some tokens) is routed only to workers on it, and waits
while none is ready; once the pool has moved past that version it takes the current one.

``EnginePool`` keeps membership (adding, registering, starting, removing and stopping workers), holds
its settings (``engine_pool.settings``, read live) and composes parts that share its members and read
only those settings: the members and their state changes (``engine_pool.roster``), routing
(``engine_pool.router``), probing, fencing, promotion and replacement (``engine_pool.supervisor``), the
weight version (``engine_pool.weights.versions``) and its updates (``engine_pool.weights.update``), the weight
owner (``engine_pool.weights.keeper``) and the making of launched workers (``engine_pool.workers.factory``).
What the gateway's turns call is the small protocol of ``engine_pool.face`` (`Engines`: lease a worker
for a `Placement`, report a failure, a view); readers get frozen views (`EnginePool.view`); the rest of
the gateway (the weights and engines APIs) calls the parts.

Example::

    settings = PoolSettings(spec_factory=lambda: WorkerSpec(model="./m", port=free_port()), active=2, shadows=1)
    pool = EnginePool(http, settings)
    await pool.start()
    async with pool.lease(Placement("session-1", wait=30.0)) as member:
        ...
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AbstractAsyncContextManager

import httpx
import tenacity

from core.errors import Conflict, EngineError, InvalidRequest
from engine_pool.engine.client import EngineClient
from engine_pool.face import MemberView, Placement, PoolView
from engine_pool.member import PoolMember, WorkerLauncher
from engine_pool.roster import Roster
from engine_pool.router import Router
from engine_pool.settings import PoolSettings
from engine_pool.states import DEAD, DRAINING, READY, SHADOW, STARTING, UNHEALTHY
from engine_pool.supervisor import Supervisor
from engine_pool.weights.keeper import WeightKeeper
from engine_pool.weights.update import WeightUpdater
from engine_pool.weights.versions import Preemption, WeightVersions
from engine_pool.workers.factory import WorkerFactory

__all__ = [
    "DEAD", "DRAINING", "READY", "SHADOW", "STARTING", "UNHEALTHY",
    "EnginePool", "Placement", "PoolMember", "PoolSettings", "PoolView", "Preemption",
    "WorkerLauncher",
]  # fmt: skip

log = logging.getLogger("belayer.engine_pool")


class EnginePool:
    """All workers behind the gateway: its `settings` and the parts that share its members (`roster`):
    `router`, `supervisor`, `updater`, `weights` (the weight owner's keeper) and `factory`, each of
    which reads only the settings. It implements `Engines` (``engine_pool.face``)."""

    def __init__(self, http: httpx.AsyncClient, settings: PoolSettings | None = None) -> None:
        self.http = http
        self.settings = settings if settings is not None else PoolSettings()
        """What the pool is asked to be (read live by the parts: a change applies at its next read)."""
        s = self.settings
        self.roster = Roster(s)
        """The members and their states (``engine_pool.roster``)."""
        self.versions = WeightVersions()
        """The weight version served, and whether an update runs (``engine_pool.weights.versions``)."""
        self.weights = WeightKeeper(s, self.roster, self.versions, self.report_failure)
        """Keeps the weight owner (``belayer serve --weight-owner``; ``engine_pool.weights.keeper``)."""
        self.updater = WeightUpdater(self.roster, self.versions, self.weights, self.report_failure)
        """Moves the workers to new weights (``engine_pool.weights.update``)."""
        self.router = Router(s, self.roster, self.versions)
        """Picks the worker for each request (``engine_pool.router``)."""
        self.factory = WorkerFactory(s, http, self.roster, self.versions, self.weights)
        """Makes launched workers (``engine_pool.workers.factory``)."""
        self.supervisor = Supervisor(
            s, self.roster, self.versions, self.router, self.weights, self.updater, self.factory
        )
        """Probes, fences, promotes, replaces (``engine_pool.supervisor``)."""
        self._remotes = 0

    # -- membership ---------------------------------------------------------------------------------

    def add_remote(self, url: str, model: str | None = None, shadow: bool = False) -> PoolMember:
        """Add a running engine by URL (checked: ``check_engine_url``; not twice), as an active worker
        or, with `shadow`, as a shadow that is promoted when an active worker fails."""
        url = check_engine_url(url)
        same = next((m for m in self.roster.members if m.client.base_url == url and m.state != DEAD), None)
        if same is not None:
            raise Conflict(f"engine {url} is in the pool already, as {same.name} ({same.state})", "url")
        member = PoolMember(
            f"remote-{self._remotes}", EngineClient(url, model or "", self.http), standby=shadow,
            weight_version=self.versions.version,
        )  # fmt: skip
        self._remotes += 1
        self.roster.members.append(member)
        return member

    async def remove(self, name: str, drain_timeout: float = 60.0) -> MemberView:
        """Take a worker out of routing, wait up to `drain_timeout` for its requests to finish, then
        drop it from the pool (a launched worker is stopped); its view, ``dead`` (`Supervisor.remove`)."""
        return MemberView.of(await self.supervisor.remove(name, drain_timeout), self.settings.start_timeout)

    async def register(self, url: str) -> MemberView:
        """Add a running engine at runtime (``POST /api/engines``): probed, then routed to; its view."""
        member = self.add_remote(url)
        try:
            member.info = await member.client.model_info()
        except EngineError:
            self.roster.set(member, UNHEALTHY, "not answering yet")  # the probe brings it in once it answers
        else:
            member.client.model = member.client.model or member.info.name
            self.roster.set(member, READY, "registered")
        return MemberView.of(member, self.settings.start_timeout)

    async def start(self) -> None:
        """Launch owned workers (active + shadows, concurrently), probe registered ones, start probing."""
        await self.weights.start()
        s = self.settings
        launched = [self.factory.new(shadow=i >= s.active) for i in range(s.active + s.shadows if s.spec_factory else 0)]
        for m in launched:
            assert m.process is not None
            m.process.launch()
        started = time.monotonic()
        for m in launched:
            assert m.process is not None
            await m.process.wait_ready(s.start_timeout)
            m.client.base_url = m.process.url  # a worker placed elsewhere has its address once placed
            await self.supervisor.launched(m, time.monotonic() - started)
        for m in sorted(self.roster.members, key=lambda m: m.standby):  # shadows take what actives leave
            if m.process is None and not await self._admit(m):
                self.roster.set(m, STARTING, "not answering yet")
                self.roster.tasks.spawn(self._wait_for_remote(m), f"await-{m.name}")
                continue
            m.info = m.info or await m.client.model_info()
            if not m.client.model:
                m.client.model = m.info.name
            self.roster.set(m, self.supervisor.role(), "started")
        # the interval is read each round: a live setting
        self.roster.tasks.every(lambda: s.probe_interval, self.supervisor.probe, "engine-pool-probe")

    async def _admit(self, m: PoolMember) -> bool:
        """Ask a registered engine for its model; False while it does not answer (still loading)."""
        try:
            m.info = await m.client.model_info()
        except EngineError:
            return False
        m.client.model = m.client.model or m.info.name
        return True

    async def _wait_for_remote(self, m: PoolMember) -> None:
        """An engine given by URL that is not answering yet (loading its weights): ask again with
        backoff, logging progress, until it answers; then route to it. Never gives up: a gateway
        started beside a slow engine serves as soon as it is up, instead of exiting in a crash loop."""
        started = time.monotonic()

        def progress(state: tenacity.RetryCallState) -> None:
            waited = time.monotonic() - started
            late = waited > self.settings.start_timeout
            log.log(
                logging.WARNING if late else logging.INFO,
                "engine %s at %s not answering yet (%s); waited %.0f s, asking again in %.1f s",
                m.name, m.client.base_url, state.outcome.exception() if state.outcome else "?", waited,
                state.next_action.sleep if state.next_action else 0.0,
            )  # fmt: skip

        retrying = tenacity.AsyncRetrying(
            wait=tenacity.wait_exponential(multiplier=0.25, max=5.0),
            retry=tenacity.retry_if_exception_type(EngineError),
            before_sleep=progress,
        )
        async for attempt in retrying:
            with attempt:
                if m.state != STARTING:  # removed meanwhile
                    return
                m.info = await m.client.model_info()
        m.client.model = m.client.model or (m.info.name if m.info else "")
        self.roster.set(m, self.supervisor.role(), f"answering after {time.monotonic() - started:.1f} s")

    async def stop(self) -> None:
        self.roster.closing = True
        await self.roster.tasks.close()
        members = self.roster.members
        await asyncio.gather(*(m.process.stop() for m in members if m.process is not None))
        await self.weights.stop()
        for m in members:
            self.roster.set(m, DEAD, "pool stopped")
        if self.settings.launcher is not None:
            await self.settings.launcher.close()

    # -- what the gateway asks (``engine_pool.face.Engines``) ----------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.roster.max_model_len

    @property
    def preemption(self) -> Preemption:
        """Triggered when an update's drain time is over; a new one for each update."""
        return self.versions.preemption

    def lease(self, placement: Placement) -> AbstractAsyncContextManager[PoolMember]:
        """A worker for `placement`, with the request (and its tokens) counted on it while it runs
        (`Router.lease`)."""
        return self.router.lease(placement)

    def pick(self, placement: Placement) -> PoolMember | None:
        """The worker `placement` would get now, or None (`Router.pick`)."""
        return self.router.pick(placement)

    def share(self, member: PoolMember) -> None:
        """A suspect running alone on `member` got past its prefill (its first token): the worker takes
        other requests again (`Router.share`)."""
        self.router.share(member)

    def report_failure(self, m: PoolMember, error: Exception) -> None:
        """``m`` failed a request or a probe: fence it and promote a shadow in its place."""
        self.supervisor.report_failure(m, error)

    async def confirm_failure(self, m: PoolMember) -> bool:
        """A stalled stream: is the worker really gone? (One probe; on failure, report it.)"""
        return await self.supervisor.confirm_failure(m)

    def forget(self, session_id: str) -> None:
        """The session is over: its worker need not be remembered."""
        self.router.forget(session_id)

    def view(self) -> PoolView:
        """The members and the weight version now, frozen (``engine_pool.face``)."""
        v, timeout = self.versions, self.settings.start_timeout
        return PoolView(
            members=tuple(MemberView.of(m, timeout) for m in self.roster.members),
            weight_version=v.version, weights_path=v.path, base_version=v.base,
            max_model_len=self.roster.max_model_len, remembered_sessions=self.router.remembered_sessions,
            groups=len(self.router.groups),
        )  # fmt: skip


def check_engine_url(url: str) -> str:
    """An engine's base URL, normalised; an `InvalidRequest` (param ``url``) says what is wrong.

    >>> check_engine_url("http://127.0.0.1:8001/")
    'http://127.0.0.1:8001'
    >>> check_engine_url("127.0.0.1:8001")
    Traceback (most recent call last):
    ...
    core.errors.InvalidRequest: engine URL '127.0.0.1:8001' needs a scheme and a host, e.g. http://127.0.0.1:8001
    """
    try:
        parsed = httpx.URL(url)
    except (httpx.InvalidURL, TypeError, ValueError) as e:
        raise InvalidRequest(f"engine URL {url!r} is not a URL ({e})", "url", "invalid_value") from e
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise InvalidRequest(
            f"engine URL {url!r} needs a scheme and a host, e.g. http://127.0.0.1:8001",
            "url",
            "invalid_value",
        )
    if parsed.query or parsed.fragment or parsed.userinfo:
        raise InvalidRequest(
            f"engine URL {url!r} may not carry a query, fragment or credentials", "url", "invalid_value"
        )
    return str(parsed).rstrip("/")
