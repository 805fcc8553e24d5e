"""The pool's keeper of its weight owner (``belayer serve --weight-owner``): the one object that starts,
checks, restarts and, after an update, replaces or re-maps what holds the weights apart from the workers.

Two kinds of owner (``engine_pool.weights.owner``, the CPU one: a process with the weights in shared
memory; ``engine_pool.weights.cache``, the GPU one: vLLM's weight cache per device group) are kept the same
way:

- **started before the workers** (`start`), so that they map its weights; if it cannot start, the
  workers load from disk and the probe rounds try again;
- **checked** (`check`) on every probe round and whenever a worker fails, before a shadow is promoted;
  a dead one is restarted in the background (after ``restart_delay``), and workers launched meanwhile
  load from disk;
- **after an update** (`follow`): a CPU owner is replaced by one holding the new weights, and the
  workers that took the update into their own pages are pointed back at its pages (`_remap_workers`);
  a GPU cache is updated in place, through its mappers, and a failed first load restores the group's
  shared weights (`restore_shared`);
- a launched worker that mapped a CPU owner holds that owner's version (`adopt_mapped_version`).

It works on the pool's members and background work (``engine_pool.roster``), its weight version and
update lock (``engine_pool.weights.versions``) and its settings, and fences a worker through the callable it is
given (``EnginePool.report_failure``); the pool asks it at the points above.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from core import events, shm_weights
from core.errors import ConfigError, EngineError, EngineUnavailable
from engine_pool.member import PoolMember
from engine_pool.roster import Roster
from engine_pool.settings import PoolSettings
from engine_pool.states import READY, SHADOW
from engine_pool.weights.cache import GpuWeightCache
from engine_pool.weights.owner import WeightOwner, maps_owner
from engine_pool.weights.versions import WeightVersions

log = logging.getLogger("belayer.engine_pool")


class WeightKeeper:
    """Its pool's weight owner, and the owner's one background job at a time (`busy`)."""

    def __init__(
        self,
        settings: PoolSettings,
        roster: Roster,
        versions: WeightVersions,
        fence: Callable[[PoolMember, Exception], None],
    ) -> None:
        self.settings, self.roster, self.versions = settings, roster, versions
        self.fence = fence
        """Fences a worker that failed (``EnginePool.report_failure``)."""
        self.owner: WeightOwner | GpuWeightCache | None = None
        """The current owner: it changes with updates (a CPU owner's successor)."""
        self.restart_delay = 0.0
        """Seconds a dead owner stays down before it is restarted (workers load from disk meanwhile)."""
        self.busy = False
        self.retry_at = 0.0
        self.down_since: float | None = None
        self.count = 0

    async def stop(self) -> None:
        if self.owner is not None:
            await self.owner.stop()
            self.owner.unpublish()

    async def start(self) -> None:
        """Start the weight owner before the workers, so that they map its weights. If it cannot start,
        the workers load from disk and the probe rounds try again."""
        if self.owner is None:
            return
        self.owner.unpublish()  # a pointer a killed gateway left
        if (
            isinstance(self.owner, WeightOwner)
            and self.versions.path is not None
            and self.versions.version != self.versions.base  # `WeightUpdater.adopt`
        ):
            try:
                self.owner = self.owner.successor(self.versions.path, self.versions.version, "weight-owner")
            except ConfigError as e:
                log.error("weight owner: %s; it holds the launch weights", e)
        owner = self.owner
        self.busy = True
        try:
            await owner.start(self.settings.start_timeout)
            owner.publish(owner.version or self.versions.base)
        except EngineUnavailable as e:
            log.error("weight owner: %s; workers load their weights from disk until it is up", e)
            self.retry_at = time.monotonic() + 5.0
        else:
            self.settings.telemetry.publish(
                events.WeightOwner("ready", seconds=owner.ready_s, version=owner.version)
            )
        finally:
            self.busy = False

    def check(self, why: str) -> bool:
        """Is the weight owner up (its process, lock and weights)? If it died, restart it in the
        background (workers launched meanwhile load from disk); True when there is none to check."""
        owner = self.owner
        if owner is None or owner.healthy():
            return True
        if self.busy or self.roster.closing:  # (re)starting, or stopping
            return False
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            log.warning("weight owner is down (checked: %s): workers launched meanwhile load from disk", why)
            self.settings.telemetry.publish(events.WeightOwner("down", why=why))
        if now >= max(self.retry_at, self.down_since + self.restart_delay):
            self.busy = True
            self.roster.tasks.spawn(self._keep(), "restart-weight-owner")
        return False

    def follow(self) -> str | None:
        """After an update: the owner is brought to the new weights in the background (`_keep`;
        one already running picks the new version up when it is done)."""
        if self.owner is None or self.roster.closing:
            return None
        if not self.owner.follows_updates:  # updated in place, through its mappers
            return "in_place"
        if not self.busy:
            self.busy = True
            self.roster.tasks.spawn(self._keep(), "follow-weight-owner")
        return "following"

    async def _keep(self) -> None:
        """The weight owner's one background job (while `busy`): until the owner holds the pool's
        current weights and is up. An owner on older weights (an update, or a restart after one) is
        replaced: a `WeightOwner.successor` for the current checkpoint, made current once it is ready,
        then the old one stopped (workers that mapped it keep their pages). If that one cannot start,
        the old one stays (restarted if it died) and workers launched meanwhile catch up from disk."""
        tried: set[str] = set()
        try:
            while not self.roster.closing:
                owner, version, path = self.owner, self.versions.version, self.versions.path
                assert owner is not None
                held = owner.version or self.versions.base
                if (
                    isinstance(owner, WeightOwner)
                    and held != version
                    and path is not None
                    and path not in tried
                ):
                    tried.add(path)
                    if await self._replace(owner, path, version):
                        await self._remap_workers()
                        continue
                if owner.healthy():
                    return
                await owner.restart(self.settings.start_timeout)
                owner.publish(held)
                self.down_since = None
                log.info("weight owner: restarted in %.1f s (version %r)", owner.ready_s or 0.0, held)
                self.settings.telemetry.publish(
                    events.WeightOwner("restarted", seconds=owner.ready_s, version=held)
                )
        except (EngineUnavailable, OSError) as e:
            log.error("weight owner: restart failed: %s; trying again in 30 s", e)
            self.retry_at = time.monotonic() + 30.0
        finally:
            self.busy = False

    async def _replace(self, old: WeightOwner, path: str, version: str) -> bool:
        """Start an owner for the weights at `path` (`version`), make it the current one once ready,
        and stop `old`; False (logged, `old` untouched) when it cannot start."""
        self.count += 1
        try:
            new = old.successor(path, version, f"weight-owner-{self.count}")
        except ConfigError as e:
            log.error("weight owner: cannot hold version %r (%s); the owner of %r stays", version, e,
                      old.version or self.versions.base)  # fmt: skip
            self.settings.telemetry.publish(
                events.WeightOwner("update_failed", version=version, why=str(e))
            )
            return False
        if new.checkpoint == old.checkpoint and old.healthy():  # the same files, named anew
            old.publish(version)
            return True
        current = False
        try:
            await new.start(self.settings.start_timeout)
            new.publish(version)
            self.owner, current = new, True
        except (EngineUnavailable, OSError) as e:
            log.error("weight owner: the owner for version %r did not start (%s); the owner of %r stays, "
                      "and workers launched meanwhile catch up from disk", version, e,
                      old.version or self.versions.base)  # fmt: skip
            self.settings.telemetry.publish(
                events.WeightOwner("update_failed", version=version, why=str(e))
            )
            return False
        finally:
            if not current:  # failed, or the pool is stopping: nothing of it is left
                await new.stop()
        self.down_since = None
        log.info("weight owner: version %r in shared memory in %.1f s; the old owner is stopped",
                 version, new.ready_s or 0.0)  # fmt: skip
        self.settings.telemetry.publish(
            events.WeightOwner("updated", version=version, seconds=new.ready_s)
        )
        await old.stop()
        return True

    async def _remap_workers(self) -> None:
        """Once the owner of the pool's version is published: each launched worker and shadow that loads
        with ``belayer_shm``, holds that version and did not map it from this owner (an update wrote the
        weights into its own copy-on-write pages) is asked to point its weights at the owner's pages
        (``shm_weights.REMAP``; the worker checks that they hold the same bytes), which frees its copy.
        One worker at a time, never during an update; one that cannot keeps its copy, and works on."""
        owner = self.owner
        if not isinstance(owner, WeightOwner) or owner.version is None:
            return
        remapped: list[str] = []
        failed: list[str] = []
        for m in list(self.roster.members):
            async with self.versions.lock:
                if self.roster.closing or owner is not self.owner or owner.version != self.versions.version:
                    break
                p = m.process
                up = m.state in (READY, SHADOW) and m.weight_version == owner.version
                if p is None or p.pid is None or not up:
                    continue
                report = shm_weights.find_load_report(owner.base, shm_weights.group_pids(p.pid)) or {}
                if not maps_owner(p.spec.argv()) or (
                    (report.get("checkpoint"), report.get("version")) == (owner.checkpoint, owner.version)
                ):
                    continue  # another load format, or it mapped this owner at this version already
                try:
                    results = await m.client.collective_rpc(
                        shm_weights.REMAP, {"weights_path": owner.weights}
                    )
                except EngineError as e:
                    results = [{"source": None, "why": str(e)}]
                if results and all(isinstance(r, dict) and r.get("source") == "remap" for r in results):
                    remapped.append(m.name)
                else:
                    failed.append(m.name)
                    log.warning("worker %s keeps its own copy of weight version %r (not re-mapped: %s)",
                                m.name, owner.version, results)  # fmt: skip
        if remapped or failed:
            log.info("weight owner: %d worker(s) back on its pages, %d not", len(remapped), len(failed))
            self.settings.telemetry.publish(
                events.WeightOwner("remapped", version=owner.version, workers=len(remapped), failed=failed),
            )

    async def adopt_mapped_version(self, m: PoolMember) -> None:
        """A launched worker that mapped the weight owner's weights holds the version the owner held
        (its loader's report, ``shm_weights.find_load_report``): recorded, and named in vLLM too
        (``/weight_info``, which `WeightVersions.observe` reads), so that `WeightUpdater.sync` does
        not load it from disk."""
        owner, p = self.owner, m.process
        if not isinstance(owner, WeightOwner) or p is None or p.pid is None:
            return  # (mappers of a GPU weight cache are caught up: engine_pool.weights.cache)
        report = shm_weights.find_load_report(owner.base, shm_weights.group_pids(p.pid))
        version = report.get("version") if report is not None and report.get("source") == "owner" else None
        if not isinstance(version, str) or version == m.weight_version:
            return
        try:
            await m.client.name_weight_version(version)
        except EngineError as e:
            log.warning(
                "worker %s mapped weight version %r but could not be told so (%s)", m.name, version, e
            )
            return
        m.weight_version = version
        self.settings.telemetry.publish(events.WorkerWeights(m.name, version, "owner"))

    async def restore_shared(self, failed: PoolMember) -> None:
        """The workers on a GPU weight cache's device group share one copy of the weights, so a load that
        failed half-way on one of them may have written part of the update into the others' weights too.
        The pool's version is loaded again on those of its group that are up (writing the same bits as
        before over whatever the failed load left); one that cannot load it is fenced."""
        if not isinstance(self.owner, GpuWeightCache) or failed.process is None:
            return
        devices, path = failed.process.spec.devices, self.versions.path or failed.process.spec.model
        for m in self.roster.members:
            if m is failed or m.process is None or m.process.spec.devices != devices:
                continue
            if m.state not in (READY, SHADOW):
                continue
            try:
                await m.client.update_weights(path, self.versions.version)
            except EngineError as e:
                log.warning("worker %s: restoring weight version %r after a failed update failed: %s",
                            m.name, self.versions.version, e)  # fmt: skip
                self.fence(m, e)
            else:
                self.settings.telemetry.publish(
                    events.WorkerWeights(m.name, self.versions.version, "restored")
                )
