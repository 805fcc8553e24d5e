"""Keeping the pool at strength (`Supervisor`): health probes, fencing, promotion of shadows,
replacement of launched workers, catch-ups to the weight version, removal, and moving misplaced shadows.

A worker that dies or hangs is *fenced* and, if it was active, a shadow is promoted into its place at
once (no cold start). A launched worker's vital processes are watched from the moment it is ready
(`watch`, ``engine_pool.workers.exits``): when one exits, the streams running on it are cut at once with a
`WorkerExited` (the turns resubmit them, cause ``dead``) and it is fenced, all in the loop iteration
that noticed, so the resubmissions never pick it. A launched worker is fenced by killing its process group, so it can never come
back half-alive; then a replacement is launched (on the devices the dead one freed). A registered worker
cannot be killed from here: it is fenced by taking it out of routing (``unhealthy``) until it passes a
health probe again. Whoever comes back becomes active while fewer workers are active than the pool's
target (`role`), else a shadow. Each probe round also brings workers that missed a weight update up to
the version (with backoff), checks the weight owner, and asks the launcher for a shadow to move.

Example::

    supervisor = Supervisor(settings, roster, versions, router, keeper, updater, factory)
    await supervisor.probe()                     # one round
    supervisor.report_failure(member, EngineUnavailable("stream cut"))
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from core import events
from core.errors import EngineError, EngineUnavailable, NotFound, WorkerExited
from engine_pool.member import PoolMember
from engine_pool.roster import Roster
from engine_pool.router import Router
from engine_pool.settings import PoolSettings
from engine_pool.states import DEAD, DRAINING, READY, SHADOW, STARTING, UNHEALTHY
from engine_pool.weights.keeper import WeightKeeper
from engine_pool.weights.update import WeightUpdater
from engine_pool.weights.versions import WeightVersions
from engine_pool.workers.factory import WorkerFactory
from engine_pool.workers.warm_up import warm_up

log = logging.getLogger("belayer.engine_pool")


class Supervisor:
    """Probes, fences, promotes, replaces and catches up the pool's workers."""

    def __init__(
        self,
        settings: PoolSettings,
        roster: Roster,
        versions: WeightVersions,
        router: Router,
        keeper: WeightKeeper,
        updater: WeightUpdater,
        factory: WorkerFactory,
    ) -> None:
        self.settings, self.roster, self.versions, self.router = settings, roster, versions, router
        self.keeper, self.updater, self.factory = keeper, updater, factory
        self._catching_up: set[str] = set()
        self._catch_up_after: dict[str, tuple[float, int]] = {}
        self._rebalancing = False

    # -- roles --------------------------------------------------------------------------------------

    def role(self) -> str:
        """What a worker that comes (back) up becomes: active while fewer than the target are."""
        return READY if len(self.router.routable()) < self.target() else SHADOW

    def target(self) -> int:
        """Active workers wanted: the launched ones asked for, plus registered engines not given as shadows."""
        launched = self.settings.active if self.settings.spec_factory is not None else 0
        registered = sum(
            1 for m in self.roster.members if m.process is None and not m.standby and m.state != DEAD
        )
        return launched + registered

    def cold_start(self, m: PoolMember, seconds: float) -> None:
        self.roster.publish(events.WorkerColdStart(m.name, round(seconds, 3)))

    # -- health -------------------------------------------------------------------------------------

    async def probe(self) -> None:
        """Probe every routable or suspect worker once, concurrently, and act on the results."""
        watched = [m for m in self.roster.members if m.state in (READY, SHADOW, UNHEALTHY)]
        results = await asyncio.gather(*(self.healthy(m) for m in watched))
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
                await self.versions.observe(m)  # it may have restarted, with other weights
                self.roster.set(m, self.role(), "health probe passed")
            elif exited or (m.probe_failures >= self.settings.probe_failures and m.state != UNHEALTHY):
                why = "process exited" if exited else f"{m.probe_failures} health probes failed"
                self.report_failure(m, EngineUnavailable(why))
        self._start_catch_ups()
        self.keeper.check("probe")
        self._start_rebalance()

    async def healthy(self, m: PoolMember) -> bool:
        if m.process is not None and not m.process.alive():
            return False
        return await m.client.health(timeout=self.settings.probe_timeout)

    async def confirm_failure(self, m: PoolMember) -> bool:
        """A stalled stream: is the worker really gone? (One probe; on failure, report it.)"""
        if await self.healthy(m):
            return False
        self.report_failure(m, EngineUnavailable("stalled and failed its health probe"))
        return True

    # -- noticing a launched worker's exit ----------------------------------------------------------

    async def launched(self, m: PoolMember, cold_start: float) -> None:
        """A launched worker answers (after `cold_start` seconds): on the pool's weight version, warmed
        up, at full CPU priority and watched, before the caller gives it a role (active or shadow)."""
        self.cold_start(m, cold_start)
        await self.keeper.adopt_mapped_version(m)  # mapped from the owner: the version it held
        await self.updater.sync(m)  # the launch weights (or the owner's) may be older than the pool's
        await self.warm(m)
        if m.process is not None:
            m.process.serving()  # started niced: its start yielded to the serving workers
        self.watch(m)

    async def warm(self, m: PoolMember) -> None:
        """Before a launched worker takes traffic or stands as a shadow: its first requests' one-off
        costs, paid now rather than by a stream resumed on it (`engine_pool.workers.warm_up`; off: `warm_up`).
        A worker that fails it is not held back: the probes and the failover judge it like any other."""
        if not self.settings.warm_up or m.process is None:
            return
        try:
            m.info = m.info or await m.client.model_info()
            await warm_up(m.client, m.info.max_model_len)
        except EngineError as e:
            log.warning("worker %s: warm-up failed (%s); it goes on unwarmed", m.name, e)

    def watch(self, m: PoolMember) -> None:
        """A launched worker is ready: watch its vital processes (unless the pool does not: `watch_exits`)."""
        if self.settings.watch_exits and m.process is not None:
            m.process.watch(lambda why, at: self.exited(m, why, at))

    def exited(self, m: PoolMember, why: str, at: float) -> None:
        """A vital process of `m` exited (noticed at `at`): cut its streams, then fence it (out of
        routing now, a shadow promoted), before any of the cut turns looks for a worker."""
        error = WorkerExited(f"worker {m.name}: {why}", at)
        log.warning("worker %s: %s; cutting its %d streams", m.name, why, len(m.streams))
        for cut in list(m.streams):
            cut(error)
        self.report_failure(m, error)

    # -- fencing, promotion, replacement ------------------------------------------------------------

    def report_failure(self, m: PoolMember, error: Exception) -> None:
        """``m`` failed a request or a probe: fence it (out of routing until a probe passes, for a
        registered worker; killed and replaced, for a launched one) and promote a shadow in its place."""
        if m.state in (DEAD, DRAINING, STARTING) or self.roster.closing:
            return
        was = m.state
        if m.process is None:
            self.roster.set(m, UNHEALTHY, f"failed: {error}; fenced until a health probe passes")
        else:
            self.roster.set(m, DRAINING, f"failed: {error}")
            self.roster.tasks.spawn(self._fence(m), f"fence-{m.name}")
            self.keeper.check(f"{m.name} failed")  # before a shadow takes over: its replacement needs it
        if was == READY:
            self.promote()

    async def _fence(self, m: PoolMember) -> None:
        """Kill a failed (dead or hung) worker's whole process group, so it cannot come back; then
        launch its replacement (after: the replacement may need the devices, and memory, it held). The
        group is killed at the lowest CPU priority, so that its teardown yields to the resumed streams."""
        assert m.process is not None
        m.process.yield_cpu()  # its teardown must not slow the streams resuming elsewhere
        await m.process.stop(grace=0.0)
        self.roster.set(m, DEAD, "fenced")
        if not self.roster.closing:
            self.roster.tasks.spawn(self.launch_replacement(), "replace-worker")

    def promote(self) -> None:
        """A shadow on the pool's version takes an active worker's place (one that missed an update
        is promoted once it is brought up to the version: `_catch_up`)."""
        members = self.roster.members
        # one that holds a suspect request alone (``Router.lease(exclusive=...)``) is promoted last: it
        # takes no other request until that one ends
        shadows = [m for m in members if m.state == SHADOW and self.versions.current(m)]
        shadow = min(shadows, key=lambda m: m.isolating, default=None)
        if shadow is not None:
            self.roster.set(shadow, READY, "promoted from shadow")
            self.roster.publish(events.ShadowPromoted(shadow.name))
        elif any(m.state == SHADOW for m in members):
            log.warning(
                "no shadow holds weight version %r: one is promoted once it is brought up to it",
                self.versions.version,
            )

    async def launch_replacement(self) -> PoolMember:
        member = self.factory.new(shadow=len(self.router.routable()) >= self.target())
        assert member.process is not None
        self.roster.publish(events.ReplacementStarted(member.name))
        started = time.monotonic()
        await member.process.start(self.settings.start_timeout)
        member.client.base_url = member.process.url
        member.info = await member.client.model_info()
        await self.launched(member, time.monotonic() - started)
        self.roster.set(member, self.role(), "replacement ready")
        return member

    async def remove(self, name: str, drain_timeout: float = 60.0) -> PoolMember:
        """Take a worker out of routing, wait up to `drain_timeout` for its requests to finish, then
        drop it from the pool (a launched worker is stopped). Its state is ``dead`` afterwards."""
        member = self.roster.live(name)
        if member is None:
            names = ", ".join(m.name for m in self.roster.members if m.state != DEAD) or "none"
            raise NotFound(f"no engine named {name!r} in the pool (engines: {names})", "name")
        was = member.state
        self.roster.set(member, DRAINING, "removed by an admin")
        if was == READY:
            self.promote()
        deadline = time.monotonic() + drain_timeout
        while member.outstanding and (left := deadline - time.monotonic()) > 0:
            await self.roster.wait_change(left)
        if member.process is not None:
            await member.process.stop()
        self.roster.members.remove(member)
        self.router.forget_worker(name)
        self.roster.set(
            member,
            DEAD,
            f"removed ({member.outstanding} requests cut off)" if member.outstanding else "removed",
        )
        return member

    # -- catch-ups to the weight version ------------------------------------------------------------

    def _start_catch_ups(self) -> None:
        """Each probe round: a catch-up for every up worker on an old version (with backoff)."""
        if self.versions.updating or self.roster.closing:
            return
        now = time.monotonic()
        for m in self.roster.members:
            due = self._catch_up_after.get(m.name, (0.0, 0))[0] <= now
            if (
                m.state in (READY, SHADOW)
                and not self.versions.current(m)
                and m.name not in self._catching_up
                and due
            ):
                self._catching_up.add(m.name)
                self.roster.tasks.spawn(self._catch_up(m), f"catch-up-{m.name}")

    async def _catch_up(self, m: PoolMember) -> None:
        """`WeightUpdater.sync`, then route to it: a shadow is promoted while fewer than the target are active."""
        try:
            ok = await self.updater.sync(m)
        finally:
            self._catching_up.discard(m.name)
        if not ok:
            _, failures = self._catch_up_after.get(m.name, (0.0, 0))
            wait = min(30.0, self.settings.catch_up_backoff * 2**failures)
            self._catch_up_after[m.name] = (time.monotonic() + wait, failures + 1)
            return
        self._catch_up_after.pop(m.name, None)
        if m.state == SHADOW and len(self.router.routable()) < self.target():
            self.roster.set(
                m, READY, f"promoted from shadow, once on weight version {self.versions.version!r}"
            )
            self.roster.publish(events.ShadowPromoted(m.name))
        else:
            self.roster.wake()

    # -- moving misplaced shadows -------------------------------------------------------------------

    def _start_rebalance(self) -> None:
        """Each probe round, at full strength: ask the launcher for a shadow to move (a lost node is
        back, and the shadow shares a node with an active worker)."""
        s, members = self.settings, self.roster.members
        if s.launcher is None or self._rebalancing or self.roster.closing or self.versions.updating:
            return
        up = [m for m in members if m.process is not None and m.state in (READY, SHADOW)]
        if len(up) < s.active + s.shadows or any(m.state in (STARTING, DRAINING) for m in members):
            return
        self._rebalancing = True
        self.roster.tasks.spawn(self._rebalance(), "rebalance")

    async def _rebalance(self) -> None:
        """Move a misplaced shadow: a new one first (placed apart from the active workers), then the old
        one removed, so the pool is never below strength."""
        assert self.settings.launcher is not None
        try:
            victim = await self.settings.launcher.misplaced(self.roster.members)
            if victim is None:
                return
            log.info(
                "rebalancing: worker %s shares a node with an active worker; starting a shadow apart",
                victim.name,
            )
            try:
                await self.launch_replacement()
            except EngineError as e:
                log.warning("rebalancing: the new shadow did not start (%s); %s stays", e, victim.name)
                return
            if victim.state == SHADOW:
                await self.remove(victim.name, drain_timeout=0.0)
        finally:
            self._rebalancing = False
