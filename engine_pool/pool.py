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

Routing prefers the worker that served the session last (its prefix cache holds the session's tokens),
then the one with the fewest outstanding requests. The affinity map holds named sessions only (a plain
``/v1`` request's one-request session is not remembered), is forgotten when a session closes, and is
bounded (least recently used first out). ``acquire`` waits, up to a deadline, for a worker when none is
ready (during a promotion or a restart); every state change wakes every waiter.

Weight versions (``POST /api/weights``, `update_weights`): every worker holds a version (``weight_version``),
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

Example::

    pool = EnginePool(http, spec_factory=lambda: WorkerSpec(model="./m", port=free_port()), active=2, shadows=1)
    await pool.start()
    member = await pool.acquire("session-1", wait=30.0)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
import tenacity

from core.errors import (
    Conflict,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    InvalidRequest,
    NotFound,
)
from core.tasks import TaskOwner
from core.telemetry import Telemetry
from engine_pool.client import EngineClient, ModelInfo
from engine_pool.states import DEAD, DRAINING, READY, SHADOW, STARTING, UNHEALTHY
from engine_pool.weight_cache import GpuWeightCache
from engine_pool.weight_keeper import WeightKeeper
from engine_pool.weight_owner import WeightOwner
from engine_pool.worker import VllmWorker, WorkerSpec

__all__ = ["DEAD", "DRAINING", "READY", "SHADOW", "STARTING", "UNHEALTHY", "EnginePool", "PoolMember"]

log = logging.getLogger("belayer.engine_pool")


@dataclass(slots=True)
class PoolMember:
    name: str
    client: EngineClient
    process: VllmWorker | None = None
    state: str = STARTING
    outstanding: int = 0
    served: int = 0
    info: ModelInfo | None = None
    probe_failures: int = 0
    history: list[tuple[float, str]] = field(default_factory=list)
    last_transition: dict[str, object] | None = None
    """The latest state change: ``{"at", "from", "to", "why"}``."""
    started_at: float = field(default_factory=time.time)
    standby: bool = False
    """Given as a shadow (``--shadow-url``): it starts as one, and does not count toward the pool's
    target of active workers."""
    weight_version: str = "base"
    """The weight version it holds: the pool's when it was added (a launched worker: the launch
    weights' version, `EnginePool.base_version`, or the version it mapped from the weight owner), then
    each update it loaded."""
    synced: int = 0
    """Times the pool brought it up to a version by loading weights from disk (`EnginePool._sync`)."""

    def view(self, start_timeout: float) -> dict[str, object]:
        """The member as ``GET /api/engines`` and the dashboard show it."""
        now = time.time()
        p = self.process
        launched_at = p.started_at if p is not None and p.started_at is not None else self.started_at
        return {
            "name": self.name,
            "url": self.client.base_url,
            "state": self.state,
            "launched": p is not None,
            "pid": p.pid if p is not None else None,
            "outstanding": self.outstanding,
            "served": self.served,
            "started_at": launched_at,
            "launched_at": p.started_at if p is not None else None,
            "ready_at": p.ready_at if p is not None else None,
            "max_model_len": self.info.max_model_len if self.info else None,
            "uptime_s": round(now - launched_at, 3),
            "last_transition": self.last_transition,
            "starting_elapsed_s": round(now - launched_at, 3) if self.state == STARTING else None,
            "start_timeout_s": start_timeout,
            "weight_version": self.weight_version,
            "node": getattr(p, "node", None),  # its Ray node (--ray); None: the gateway's machine
        }


class Preemption:
    """The signal that cuts the requests still running when a weight update's drain time is over.
    A stream's reader `watch` es it with the event it waits on, so it wakes at once; `triggered` is
    checked between chunks (no cost per token)."""

    def __init__(self) -> None:
        self.triggered = False
        self._watchers: set[asyncio.Event] = set()

    def watch(self, wake: asyncio.Event) -> None:
        self._watchers.add(wake)

    def unwatch(self, wake: asyncio.Event) -> None:
        self._watchers.discard(wake)

    def trigger(self) -> None:
        self.triggered = True
        for wake in self._watchers:
            wake.set()


@dataclass(frozen=True, slots=True)
class WeightUpdate:
    """What `EnginePool.update_weights` did."""

    version: str
    previous: str
    path: str
    updated: tuple[str, ...]
    """Workers now on `version`."""
    stale: tuple[str, ...]
    """Workers that missed it (unreachable, starting, or a failed load): brought up later."""
    preempted: int
    """Requests cut when the drain time ran out (resubmitted on the new version)."""
    drain_s: float
    seconds: float
    owner: str | None = None
    """The weight owner: ``following`` (an owner for these weights is being started in the background,
    made current once ready: ``weight_owner`` events say how it went), ``in_place`` (a GPU weight cache:
    its mappers wrote the update into its memory); None: the pool has none."""

    def as_json(self) -> dict[str, object]:
        return {
            "version": self.version, "previous": self.previous, "path": self.path,
            "updated": list(self.updated), "stale": list(self.stale), "preempted": self.preempted,
            "drain_s": round(self.drain_s, 3), "seconds": round(self.seconds, 3), "owner": self.owner,
        }  # fmt: skip


class WorkerLauncher(Protocol):
    """Where launched workers run when not as local processes (``engine_pool.ray_workers.RayLauncher``):
    it makes each worker (placed knowing whether it is to be a `shadow`, and the pool's `members`),
    names a shadow to move (`misplaced`: the pool starts a new one, then removes it), and is closed
    with the pool."""

    def worker(
        self, spec: WorkerSpec, log_dir: Path, name: str, shadow: bool, members: list[PoolMember]
    ) -> VllmWorker: ...

    async def misplaced(self, members: list[PoolMember]) -> PoolMember | None: ...

    async def close(self) -> None: ...


@dataclass(slots=True)
class EnginePool:
    """All workers behind the gateway."""

    http: httpx.AsyncClient
    log_dir: str = "logs"
    spec_factory: Callable[[], WorkerSpec] | None = None
    active: int = 1
    """Active launched workers (with a ``spec_factory``); registered engines add to the target."""
    shadows: int = 0
    probe_interval: float = 0.5
    probe_timeout: float = 2.0
    probe_failures: int = 3  # consecutive failed probes before a live worker counts as hung
    start_timeout: float = 300.0
    device_groups: tuple[tuple[int, ...], ...] = ()
    """Devices for launched workers, a group each (``engine_pool.launch.device_groups``); a new worker
    gets a group no live worker holds (or, with `colocate`, the group fewest live workers hold)."""
    colocate: bool = False
    """Shadows share the active workers' device groups: they map the group's weight cache over CUDA
    IPC, which works only on the device the memory is on (``engine_pool.weight_cache``)."""
    max_affinity: int = 65536
    """Sessions whose last worker is remembered (least recently used forgotten first)."""
    members: list[PoolMember] = field(default_factory=list)
    _affinity: OrderedDict[str, str] = field(default_factory=OrderedDict)
    _tasks: TaskOwner = field(default_factory=lambda: TaskOwner("engine-pool"))
    _waiters: set[asyncio.Future[None]] = field(default_factory=set)
    _launched: int = 0
    _remotes: int = 0
    _closing: bool = False
    telemetry: Telemetry = field(default_factory=Telemetry)
    """Where state changes, promotions, replacements and cold starts are published."""
    weight_version: str = "base"
    """The version the pool serves: routed workers hold it (see the module docstring)."""
    weights_path: str | None = None
    """Where the current version's weights are; None: the launch weights (`base_version`)."""
    base_version: str = "base"
    """The version of the weights launched workers start from (the model directory's)."""
    preemption: Preemption = field(default_factory=Preemption)
    """Triggered when an update's drain time is over; a new one for each update."""
    catch_up_backoff: float = 0.5
    """Seconds before a failed catch-up (a worker brought up to the version) is tried again; doubles
    after each failure, up to 30 s."""
    _updating: bool = False
    _switching: bool = False
    _update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _catching_up: set[str] = field(default_factory=set)
    _catch_up_after: dict[str, tuple[float, int]] = field(default_factory=dict)
    launcher: WorkerLauncher | None = None
    """Launches workers elsewhere (a Ray cluster: ``belayer serve --ray``); None: local processes."""
    _rebalancing: bool = False
    weights: WeightKeeper = field(init=False)
    """Keeps the weight owner (``belayer serve --weight-owner``; ``engine_pool.weight_keeper``)."""

    def __post_init__(self) -> None:
        self.weights = WeightKeeper(self)

    @property
    def weight_owner(self) -> WeightOwner | GpuWeightCache | None:
        """What holds the weights apart from the workers (None: each worker loads its own)."""
        return self.weights.owner

    @weight_owner.setter
    def weight_owner(self, owner: WeightOwner | GpuWeightCache | None) -> None:
        self.weights.owner = owner

    @property
    def owner_restart_delay(self) -> float:
        return self.weights.restart_delay

    @owner_restart_delay.setter
    def owner_restart_delay(self, seconds: float) -> None:
        self.weights.restart_delay = seconds

    def check_owner(self, why: str) -> bool:
        """Is the weight owner up? A dead one is restarted in the background (`WeightKeeper.check`)."""
        return self.weights.check(why)

    # -- membership ---------------------------------------------------------------------------------

    def add_remote(self, url: str, model: str | None = None, shadow: bool = False) -> PoolMember:
        """Add a running engine by URL (checked: ``check_engine_url``; not twice), as an active worker
        or, with `shadow`, as a shadow that is promoted when an active worker fails."""
        url = check_engine_url(url)
        same = next((m for m in self.members if m.client.base_url == url and m.state != DEAD), None)
        if same is not None:
            raise Conflict(f"engine {url} is in the pool already, as {same.name} ({same.state})", "url")
        member = PoolMember(
            f"remote-{self._remotes}", EngineClient(url, model or "", self.http), standby=shadow,
            weight_version=self.weight_version,
        )  # fmt: skip
        self._remotes += 1
        self.members.append(member)
        return member

    async def remove(self, name: str, drain_timeout: float = 60.0) -> PoolMember:
        """Take a worker out of routing, wait up to `drain_timeout` for its requests to finish, then
        drop it from the pool (a launched worker is stopped). Its state is ``dead`` afterwards."""
        member = next((m for m in self.members if m.name == name and m.state != DEAD), None)
        if member is None:
            names = ", ".join(m.name for m in self.members if m.state != DEAD) or "none"
            raise NotFound(f"no engine named {name!r} in the pool (engines: {names})", "name")
        was = member.state
        self._set(member, DRAINING, "removed by an admin")
        if was == READY:
            self._promote()
        deadline = time.monotonic() + drain_timeout
        while member.outstanding and (left := deadline - time.monotonic()) > 0:
            await self._wait_change(left)
        if member.process is not None:
            await member.process.stop()
        self.members.remove(member)
        for session, worker in list(self._affinity.items()):
            if worker == name:
                del self._affinity[session]
        self._set(
            member,
            DEAD,
            f"removed ({member.outstanding} requests cut off)" if member.outstanding else "removed",
        )
        return member

    def _new_launched(self, shadow: bool = False) -> PoolMember:
        assert self.spec_factory is not None, "the pool launches workers only with a spec_factory"
        spec = self.spec_factory()
        if self.device_groups:
            spec = dataclasses.replace(spec, devices=self._free_devices())
        if isinstance(self.weight_owner, GpuWeightCache):  # map the group's daemon (weight_cache)
            spec = dataclasses.replace(
                spec, extra_args=(*spec.extra_args, *self.weight_owner.worker_args(spec.devices))
            )
        name = f"worker-{self._launched}"
        self._launched += 1
        if self.launcher is not None:  # `shadow`: what it is launched to be (placement keeps roles apart)
            worker = self.launcher.worker(spec, Path(self.log_dir), name, shadow, self.members)
        else:
            worker = VllmWorker(spec, Path(self.log_dir), name)
        member = PoolMember(
            name, EngineClient(spec.url, spec.served_name, self.http), process=worker,
            weight_version=self.base_version,
        )  # fmt: skip
        self.members.append(member)
        return member

    def _free_devices(self) -> tuple[int, ...]:
        held = [m.process.spec.devices for m in self.members if m.process is not None and m.state != DEAD]
        if self.colocate:  # the least used group (the first of equals): actives spread, shadows join them
            return min(self.device_groups, key=held.count)
        free = next((g for g in self.device_groups if g not in held), None)
        if free is None:  # the configuration checks make this unreachable: each worker has its group
            raise EngineUnavailable(f"no free device group: all of {self.device_groups} are in use")
        return free

    async def register(self, url: str) -> PoolMember:
        """Add a running engine at runtime (``POST /api/engines``): probed, then routed to."""
        member = self.add_remote(url)
        try:
            member.info = await member.client.model_info()
        except EngineError:
            self._set(member, UNHEALTHY, "not answering yet")  # the probe brings it in once it answers
            return member
        member.client.model = member.client.model or member.info.name
        self._set(member, READY, "registered")
        return member

    async def start(self) -> None:
        """Launch owned workers (active + shadows, concurrently), probe registered ones, start probing."""
        await self.weights.start()
        launched = [
            self._new_launched(shadow=i >= self.active)
            for i in range(self.active + self.shadows if self.spec_factory else 0)
        ]
        for m in launched:
            assert m.process is not None
            m.process.launch()
        started = time.monotonic()
        for m in launched:
            assert m.process is not None
            await m.process.wait_ready(self.start_timeout)
            m.client.base_url = m.process.url  # a worker placed elsewhere has its address once placed
            self._cold_start(m, time.monotonic() - started)
            await self.weights.adopt_mapped_version(m)
            await self._sync(m)  # a restarted gateway whose version is not the launch weights'
        for m in sorted(self.members, key=lambda m: m.standby):  # shadows take what actives leave
            if m.process is None and not await self._admit(m):
                self._set(m, STARTING, "not answering yet")
                self._tasks.spawn(self._wait_for_remote(m), f"await-{m.name}")
                continue
            m.info = m.info or await m.client.model_info()
            if not m.client.model:
                m.client.model = m.info.name
            self._set(m, self._role(), "started")
        self._tasks.spawn(self._probe_forever(), "engine-pool-probe")

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
            late = waited > self.start_timeout
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
        self._set(m, self._role(), f"answering after {time.monotonic() - started:.1f} s")

    async def stop(self) -> None:
        self._closing = True
        await self._tasks.close()
        await asyncio.gather(*(m.process.stop() for m in self.members if m.process is not None))
        await self.weights.stop()
        for m in self.members:
            self._set(m, DEAD, "pool stopped")
        if self.launcher is not None:
            await self.launcher.close()

    # -- health -------------------------------------------------------------------------------------

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval)
            await self.probe()

    async def probe(self) -> None:
        """Probe every routable or suspect worker once, concurrently, and act on the results."""
        watched = [m for m in self.members if m.state in (READY, SHADOW, UNHEALTHY)]
        results = await asyncio.gather(*(self._healthy(m) for m in watched))
        for m, ok in zip(watched, results, strict=True):
            m.probe_failures = 0 if ok else m.probe_failures + 1
            exited = m.process is not None and not m.process.alive()
            if ok and m.state == UNHEALTHY:
                if m.info is None:  # registered before it answered
                    with contextlib.suppress(EngineUnavailable):
                        m.info = await m.client.model_info()
                        m.client.model = m.client.model or m.info.name
                    if m.info is None:
                        continue
                await self._observe_version(m)  # it may have restarted, with other weights
                self._set(m, self._role(), "health probe passed")
            elif exited or (m.probe_failures >= self.probe_failures and m.state != UNHEALTHY):
                why = "process exited" if exited else f"{m.probe_failures} health probes failed"
                self.report_failure(m, EngineUnavailable(why))
        self._start_catch_ups()
        self.check_owner("probe")
        self._start_rebalance()

    async def _healthy(self, m: PoolMember) -> bool:
        if m.process is not None and not m.process.alive():
            return False
        return await m.client.health(timeout=self.probe_timeout)

    async def confirm_failure(self, m: PoolMember) -> bool:
        """A stalled stream: is the worker really gone? (One probe; on failure, report it.)"""
        if await self._healthy(m):
            return False
        self.report_failure(m, EngineUnavailable("stalled and failed its health probe"))
        return True

    def report_failure(self, m: PoolMember, error: Exception) -> None:
        """``m`` failed a request or a probe: fence it (out of routing until a probe passes, for a
        registered worker; killed and replaced, for a launched one) and promote a shadow in its place."""
        if m.state in (DEAD, DRAINING, STARTING) or self._closing:
            return
        was = m.state
        if m.process is None:
            self._set(m, UNHEALTHY, f"failed: {error}; fenced until a health probe passes")
        else:
            self._set(m, DRAINING, f"failed: {error}")
            self._tasks.spawn(self._fence(m), f"fence-{m.name}")
            self.check_owner(f"{m.name} failed")  # before a shadow takes over: its replacement needs it
        if was == READY:
            self._promote()

    async def _fence(self, m: PoolMember) -> None:
        """Kill a failed (dead or hung) worker's whole process group, so it cannot come back; then
        launch its replacement (after: the replacement may need the devices, and memory, it held)."""
        assert m.process is not None
        await m.process.stop(grace=0.0)
        self._set(m, DEAD, "fenced")
        if not self._closing:
            self._tasks.spawn(self._launch_replacement(), "replace-worker")

    def _promote(self) -> None:
        """A shadow on the pool's version takes an active worker's place (one that missed an update
        is promoted once it is brought up to the version: `_catch_up`)."""
        shadow = next((m for m in self.members if m.state == SHADOW and self._current(m)), None)
        if shadow is not None:
            self._set(shadow, READY, "promoted from shadow")
            self.telemetry.publish("shadow_promoted", {"worker": shadow.name})
        elif any(m.state == SHADOW for m in self.members):
            log.warning(
                "no shadow holds weight version %r: one is promoted once it is brought up to it",
                self.weight_version,
            )

    async def _launch_replacement(self) -> PoolMember:
        member = self._new_launched(shadow=len(self.routable()) >= self._target())
        assert member.process is not None
        self.telemetry.publish("replacement_started", {"worker": member.name})
        started = time.monotonic()
        await member.process.start(self.start_timeout)
        member.client.base_url = member.process.url
        member.info = await member.client.model_info()
        self._cold_start(member, time.monotonic() - started)
        await self.weights.adopt_mapped_version(member)  # mapped from the owner: the version it held
        await self._sync(member)  # the launch weights (or the owner's) may be older than the pool's version
        self._set(member, self._role(), "replacement ready")
        return member

    def _start_rebalance(self) -> None:
        """Each probe round, at full strength: ask the launcher for a shadow to move (a lost node is
        back, and the shadow shares a node with an active worker)."""
        if self.launcher is None or self._rebalancing or self._closing or self._updating:
            return
        up = [m for m in self.members if m.process is not None and m.state in (READY, SHADOW)]
        if len(up) < self.active + self.shadows or any(m.state in (STARTING, DRAINING) for m in self.members):
            return
        self._rebalancing = True
        self._tasks.spawn(self._rebalance(), "rebalance")

    async def _rebalance(self) -> None:
        """Move a misplaced shadow: a new one first (placed apart from the active workers), then the old
        one removed, so the pool is never below strength."""
        assert self.launcher is not None
        try:
            victim = await self.launcher.misplaced(self.members)
            if victim is None:
                return
            log.info(
                "rebalancing: worker %s shares a node with an active worker; starting a shadow apart",
                victim.name,
            )
            try:
                await self._launch_replacement()
            except EngineError as e:
                log.warning("rebalancing: the new shadow did not start (%s); %s stays", e, victim.name)
                return
            if victim.state == SHADOW:
                await self.remove(victim.name, drain_timeout=0.0)
        finally:
            self._rebalancing = False

    # -- weight versions ----------------------------------------------------------------------------

    async def update_weights(
        self, version: str, path: str, drain_s: float = 30.0, timeout: float = 600.0
    ) -> WeightUpdate:
        """Move every worker to the weights at `path`, named `version` (module docstring). Raises
        `Conflict` while another update runs or when `version` is the current one, and
        `InvalidRequest` (param ``path``) when the first worker cannot load them: then no other
        worker was touched and the pool stays on its version."""
        if self._update_lock.locked():
            raise Conflict("a weight update is running; send the next one when it has ended",
                           "version", "weight_update_in_progress")  # fmt: skip
        async with self._update_lock:
            if version == self.weight_version:
                raise Conflict(f"the pool serves weight version {version!r} already; name each update "
                               "a new version", "version", "weight_version_exists")  # fmt: skip
            started, previous = time.monotonic(), self.weight_version
            self._updating = True
            self._wake_waiters()  # routing now holds new requests back
            try:
                await self._drain(started + drain_s)
                drained = time.monotonic() - started
                preempted = sum(m.outstanding for m in self.members)
                self._switching = True
                self.preemption.trigger()
                await self._drain(time.monotonic() + timeout)  # cut streams end their leases at once
                updated, stale = await self._load_everywhere(version, path, timeout)
                self.weight_version, self.weights_path = version, path
                owner = self.weights.follow()
            finally:
                self._updating = self._switching = False
                self.preemption = Preemption()
                self._wake_waiters()
        result = WeightUpdate(
            version, previous, path, updated, stale, preempted, drained, time.monotonic() - started, owner
        )
        log.info("weights: version %r -> %r from %s (%s)", previous, version, path, result.as_json())
        return result

    def adopt_version(self, version: str, path: str) -> None:
        """Before `start`: the pool serves `version` (weights at `path`), as a restarted gateway recorded
        it. Engines given by URL are taken to hold it; launched workers are brought up to it."""
        self.weight_version, self.weights_path = version, path
        for m in self.members:
            if m.process is None:
                m.weight_version = version

    async def _drain(self, deadline: float) -> None:
        """Until no request holds a worker, or `deadline` (``time.monotonic()``) passes."""
        while any(m.outstanding for m in self.members) and (left := deadline - time.monotonic()) > 0:
            await self._wait_change(left)

    async def _load_everywhere(
        self, version: str, path: str, timeout: float
    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Load the weights on every active worker and shadow: one first (an active one), alone, so
        that weights it cannot load reach no other worker; then the rest at once. (updated, stale)."""
        targets = sorted(
            (m for m in self.members if m.state in (READY, SHADOW)), key=lambda m: m.state != READY
        )
        if not targets:
            raise EngineUnavailable("no worker is up to load the weights; try again once one is ready")
        stale = [m.name for m in self.members if m.state in (STARTING, UNHEALTHY)]
        first = None
        while first is None and targets:
            m = targets.pop(0)
            try:
                await m.client.update_weights(path, version, timeout)
            except EngineRejected as e:
                raise Conflict(
                    f"worker {m.name} has no weight-update endpoints ({e}); run vLLM with "
                    "VLLM_SERVER_DEV_MODE=1 (launched workers have it)", "path", "weight_update_unsupported",
                ) from e  # fmt: skip
            except (EngineUnavailable, EngineTimeout) as e:  # the worker is lost, not the weights: next one
                self.report_failure(m, e)
                stale.append(m.name)
            except EngineError as e:  # a failed load may leave vLLM's engine dead (measured on 0.32)
                self.report_failure(m, e)
                await self.weights.restore_shared(m)
                raise InvalidRequest(
                    f"worker {m.name} could not load the weights at {path!r} ({e}); no other worker was "
                    f"changed and the pool stays on version {self.weight_version!r}", "path", "weights_not_loadable",
                ) from e  # fmt: skip
            else:
                first = m
        if first is None:
            raise EngineUnavailable(f"no worker answered to load the weights (lost: {', '.join(stale)})")
        first.weight_version = version
        updated = [first.name]
        results = await asyncio.gather(
            *(m.client.update_weights(path, version, timeout) for m in targets), return_exceptions=True
        )
        for m, outcome in zip(targets, results, strict=True):
            if isinstance(outcome, BaseException):
                log.warning("worker %s missed weight version %r: %r", m.name, version, outcome)
                stale.append(m.name)
                if m.state == READY and isinstance(outcome, Exception):
                    self.report_failure(m, outcome)
            else:
                m.weight_version = version
                updated.append(m.name)
        return tuple(updated), tuple(stale)

    async def _sync(self, m: PoolMember) -> bool:
        """Bring a worker that missed an update up to the pool's version; True when it holds it."""
        async with self._update_lock:
            if self._current(m):
                return True
            path = self.weights_path or (m.process.spec.model if m.process is not None else None)
            if path is None:  # a registered engine, and the version is the launch weights: unknown path
                return False
            try:
                await m.client.update_weights(path, self.weight_version)
            except EngineError as e:
                log.warning("worker %s: bringing it up to weight version %r failed: %s", m.name,
                            self.weight_version, e)  # fmt: skip
                return False
            m.weight_version = self.weight_version
            m.synced += 1
            self.telemetry.publish(
                "worker_weights", {"worker": m.name, "version": self.weight_version, "source": "disk"}
            )
            return True

    async def _catch_up(self, m: PoolMember) -> None:
        """`_sync`, then route to it: a shadow is promoted while fewer than the target are active."""
        try:
            ok = await self._sync(m)
        finally:
            self._catching_up.discard(m.name)
        if not ok:
            _, failures = self._catch_up_after.get(m.name, (0.0, 0))
            wait = min(30.0, self.catch_up_backoff * 2**failures)
            self._catch_up_after[m.name] = (time.monotonic() + wait, failures + 1)
            return
        self._catch_up_after.pop(m.name, None)
        if m.state == SHADOW and len(self.routable()) < self._target():
            self._set(m, READY, f"promoted from shadow, once on weight version {self.weight_version!r}")
            self.telemetry.publish("shadow_promoted", {"worker": m.name})
        else:
            self._wake_waiters()

    def _start_catch_ups(self) -> None:
        """Each probe round: a catch-up for every up worker on an old version (with backoff)."""
        if self._updating or self._closing:
            return
        now = time.monotonic()
        for m in self.members:
            due = self._catch_up_after.get(m.name, (0.0, 0))[0] <= now
            if (
                m.state in (READY, SHADOW)
                and not self._current(m)
                and m.name not in self._catching_up
                and due
            ):
                self._catching_up.add(m.name)
                self._tasks.spawn(self._catch_up(m), f"catch-up-{m.name}")

    async def _observe_version(self, m: PoolMember) -> None:
        """A worker back from a failure says which version it holds, where it can: a restarted vLLM
        says ``default`` (its launch weights) and must be brought up to the version again."""
        seen = await m.client.weight_version()
        if seen is not None and seen != m.weight_version:
            m.weight_version = self.base_version if seen == "default" else seen

    def _role(self) -> str:
        """What a worker that comes (back) up becomes: active while fewer than the target are."""
        return READY if len(self.routable()) < self._target() else SHADOW

    def _target(self) -> int:
        """Active workers wanted: the launched ones asked for, plus registered engines not given as shadows."""
        launched = self.active if self.spec_factory is not None else 0
        registered = sum(1 for m in self.members if m.process is None and not m.standby and m.state != DEAD)
        return launched + registered

    def _cold_start(self, m: PoolMember, seconds: float) -> None:
        self.telemetry.publish("worker_cold_start", {"worker": m.name, "seconds": round(seconds, 3)})

    def _set(self, m: PoolMember, state: str, why: str) -> None:
        """Change a member's state: logged (WARNING when it lost a worker, else INFO), published, and
        every waiter looks again."""
        if m.state != state:
            lost = state in (DEAD, UNHEALTHY, DRAINING) and why.startswith("failed")
            log.log(
                logging.WARNING if lost else logging.INFO,
                "worker %s: %s -> %s (%s)",
                m.name,
                m.state,
                state,
                why,
            )
            now = time.time()
            m.last_transition = {"at": now, "from": m.state, "to": state, "why": why}
            p = m.process
            data = {
                "worker": m.name, "from": m.state, "to": state, "why": why, "url": m.client.base_url,
                "pid": p.pid if p is not None else None, "launched": p is not None,
            }  # fmt: skip
            m.state = state
            m.history.append((now, state))
            self.telemetry.publish("worker_state", data)
            self._wake_waiters()

    def _wake_waiters(self) -> None:
        """Every waiter in ``acquire`` looks again (each has its own future: none can miss a change)."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    # -- routing ------------------------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        lens = [m.info.max_model_len for m in self.members if m.info and m.info.max_model_len]
        return min(lens) if lens else 0

    def ready(self) -> list[PoolMember]:
        return [m for m in self.members if m.state == READY]

    def routable(self) -> list[PoolMember]:
        """The ready workers on the pool's weight version."""
        return [m for m in self.members if m.state == READY and self._current(m)]

    def _current(self, m: PoolMember) -> bool:
        return m.weight_version == self.weight_version

    def pick(
        self,
        session_id: str | None = None,
        exclude: frozenset[str] = frozenset(),
        version: str | None = None,
    ) -> PoolMember | None:
        """The worker for a request, or None. `version`: the request has tokens from that version (a
        failover): during an update's drain it may still run on that version; without one it waits for
        the update, like every request while the update loads the weights."""
        if self._updating and (self._switching or version != self.weight_version):
            return None
        ready = [m for m in self.routable() if m.name not in exclude]
        if not ready:
            return None
        preferred = self._affinity.get(session_id) if session_id is not None else None
        for m in ready:
            if m.name == preferred:
                return m
        return min(ready, key=lambda m: m.outstanding)

    async def acquire(
        self,
        session_id: str | None = None,
        wait: float = 0.0,
        exclude: frozenset[str] = frozenset(),
        version: str | None = None,
    ) -> PoolMember:
        """A ready worker on the pool's weight version (not one named in `exclude`), waiting up to
        ``wait`` seconds for one (a promotion, a restart, a weight update); `version` as in `pick`."""
        deadline = time.monotonic() + wait
        while (member := self.pick(session_id, exclude, version)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                states = ", ".join(
                    f"{m.name}={m.state}" + ("" if self._current(m) else f" (weights {m.weight_version})")
                    for m in self.members
                ) or "none"  # fmt: skip
                if self._updating:
                    states += f"; a weight update to {self.weight_version!r} is running"
                raise EngineUnavailable(
                    f"no healthy inference worker became available within {wait:.0f}s (workers: {states}); "
                    "check the workers' logs in the gateway's --log-dir"
                )
            await self._wait_change(left)
        if session_id is not None:
            self._remember(session_id, member.name)
        return member

    async def _wait_change(self, timeout: float) -> None:
        """Until the next state change (or a lease ends), at most `timeout` seconds."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait({waiter}, timeout=timeout)
        finally:
            self._waiters.discard(waiter)
            waiter.cancel()

    def _remember(self, session_id: str, worker: str) -> None:
        self._affinity[session_id] = worker
        self._affinity.move_to_end(session_id)
        while len(self._affinity) > self.max_affinity:
            self._affinity.popitem(last=False)

    def forget(self, session_id: str) -> None:
        """The session is over: its worker need not be remembered."""
        self._affinity.pop(session_id, None)

    @property
    def remembered_sessions(self) -> int:
        """Sessions in the affinity map (bounded by ``max_affinity``)."""
        return len(self._affinity)

    @contextlib.asynccontextmanager
    async def lease(
        self,
        session_id: str | None = None,
        wait: float = 0.0,
        exclude: frozenset[str] = frozenset(),
        version: str | None = None,
    ) -> AsyncIterator[PoolMember]:
        member = await self.acquire(session_id, wait, exclude, version)
        member.outstanding += 1
        try:
            yield member
        finally:
            member.outstanding -= 1
            member.served += 1
            if (member.state == DRAINING and not member.outstanding) or self._updating:
                self._wake_waiters()  # a removal, or a weight update's drain, waits for this


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
