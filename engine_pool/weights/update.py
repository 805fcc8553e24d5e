"""Moving the pool to new weights (`WeightUpdater`): an update of every worker (`update`), bringing
one worker that missed it up to the pool's version (`sync`), and, before the pool starts, taking up the
version a gateway before this one recorded (`adopt`).

An update pauses new generation (new requests wait, as for a promotion), lets the requests in flight
finish for up to ``drain_s`` seconds, then cuts those still running (``Preemption``: the turn runner
resubmits them after the update, on the new version), loads the new weights on every active worker and
shadow (an active one first: if it cannot load them, nothing else is touched and the pool stays on its
version), then resumes. The module docstring of ``engine_pool.pool`` tells the whole story.

Example::

    updater = WeightUpdater(roster, versions, keeper, fence=pool.report_failure)
    result = await updater.update("v2", "/ckpt/v2", drain_s=30.0)  # its ``weights_updated`` event
    result.stale  # the workers that missed it, brought up later (`sync`)
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from core import events
from core.errors import (
    Conflict,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnavailable,
    InvalidRequest,
)
from engine_pool.member import PoolMember
from engine_pool.roster import Roster
from engine_pool.states import READY, SHADOW, STARTING, UNHEALTHY
from engine_pool.weights.keeper import WeightKeeper
from engine_pool.weights.versions import Preemption, WeightVersions

log = logging.getLogger("belayer.engine_pool")


class WeightUpdater:
    """Loads new weights on the pool's workers, and brings those that missed them up to the version."""

    def __init__(
        self,
        roster: Roster,
        versions: WeightVersions,
        keeper: WeightKeeper,
        fence: Callable[[PoolMember, Exception], None],
    ) -> None:
        self.roster, self.versions, self.keeper = roster, versions, keeper
        self.fence = fence
        """Fences a worker that failed (``EnginePool.report_failure``)."""

    def adopt(self, version: str, path: str) -> None:
        """Before the pool starts: it serves `version` (weights at `path`), as a restarted gateway
        recorded it. Engines given by URL are taken to hold it; launched workers are brought up to it."""
        self.versions.version, self.versions.path = version, path
        for m in self.roster.members:
            if m.process is None:
                m.weight_version = version

    async def update(
        self, version: str, path: str, drain_s: float = 30.0, timeout: float = 600.0
    ) -> events.WeightsUpdated:
        """Move every worker to the weights at `path`, named `version`. Raises `Conflict` while another
        update runs or when `version` is the current one, and `InvalidRequest` (param ``path``) when the
        first worker cannot load them: then no other worker was touched and the pool stays on its version."""
        v = self.versions
        if v.lock.locked():
            raise Conflict("a weight update is running; send the next one when it has ended",
                           "version", "weight_update_in_progress")  # fmt: skip
        async with v.lock:
            if version == v.version:
                raise Conflict(f"the pool serves weight version {version!r} already; name each update "
                               "a new version", "version", "weight_version_exists")  # fmt: skip
            started, previous = time.monotonic(), v.version
            v.updating = True
            self.roster.wake()  # routing now holds new requests back
            try:
                await self._drain(started + drain_s)
                drained = time.monotonic() - started
                preempted = sum(m.outstanding for m in self.roster.members)
                v.switching = True
                v.preemption.trigger()
                await self._drain(time.monotonic() + timeout)  # cut streams end their leases at once
                updated, stale = await self._load_everywhere(version, path, timeout)
                v.version, v.path = version, path
                owner = self.keeper.follow()
            finally:
                v.updating = v.switching = False
                v.preemption = Preemption()
                self.roster.wake()
        result = events.WeightsUpdated(
            version, previous, path, list(updated), list(stale), preempted, round(drained, 3),
            round(time.monotonic() - started, 3), owner,
        )  # fmt: skip
        log.info("weights: version %r -> %r from %s (%s)", previous, version, path, result.data())
        return result

    async def _drain(self, deadline: float) -> None:
        """Until no request holds a worker, or `deadline` (``time.monotonic()``) passes."""
        members = self.roster.members
        while any(m.outstanding for m in members) and (left := deadline - time.monotonic()) > 0:
            await self.roster.wait_change(left)

    async def _load_everywhere(
        self, version: str, path: str, timeout: float
    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """Load the weights on every active worker and shadow: one first (an active one), alone, so
        that weights it cannot load reach no other worker; then the rest at once. (updated, stale)."""
        members = self.roster.members
        targets = sorted((m for m in members if m.state in (READY, SHADOW)), key=lambda m: m.state != READY)
        if not targets:
            raise EngineUnavailable("no worker is up to load the weights; try again once one is ready")
        stale = [m.name for m in members if m.state in (STARTING, UNHEALTHY)]
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
                self.fence(m, e)
                stale.append(m.name)
            except EngineError as e:  # a failed load may leave vLLM's engine dead (measured on 0.32)
                self.fence(m, e)
                await self.keeper.restore_shared(m)
                raise InvalidRequest(
                    f"worker {m.name} could not load the weights at {path!r} ({e}); no other worker was "
                    f"changed and the pool stays on version {self.versions.version!r}", "path", "weights_not_loadable",
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
                    self.fence(m, outcome)
            else:
                m.weight_version = version
                updated.append(m.name)
        return tuple(updated), tuple(stale)

    async def sync(self, m: PoolMember) -> bool:
        """Bring a worker that missed an update up to the pool's version; True when it holds it."""
        v = self.versions
        async with v.lock:
            if v.current(m):
                return True
            path = v.path or (m.process.spec.model if m.process is not None else None)
            if path is None:  # a registered engine, and the version is the launch weights: unknown path
                return False
            try:
                await m.client.update_weights(path, v.version)
            except EngineError as e:
                log.warning("worker %s: bringing it up to weight version %r failed: %s", m.name,
                            v.version, e)  # fmt: skip
                return False
            m.weight_version = v.version
            m.synced += 1
            self.roster.publish(events.WorkerWeights(m.name, v.version, "disk"))
            return True
