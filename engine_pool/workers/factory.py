"""Making launched workers (`WorkerFactory`): each gets the next name, a spec from the pool's
``spec_factory``, a device group no live worker holds (or, colocated, the least used one), the arguments
that map its group's GPU weight cache, and a process (local, or from the pool's launcher). It is added to
the roster as ``starting``; launching it is the caller's.

Example::

    factory = WorkerFactory(settings, http, roster, versions, keeper)
    member = factory.new(shadow=True)  # worker-0, on the first free device group
    member.process.launch()
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import httpx

from core.errors import EngineUnavailable
from engine_pool.engine.client import EngineClient
from engine_pool.member import PoolMember
from engine_pool.roster import Roster
from engine_pool.settings import PoolSettings
from engine_pool.states import DEAD
from engine_pool.weights.cache import GpuWeightCache
from engine_pool.weights.keeper import WeightKeeper
from engine_pool.weights.versions import WeightVersions
from engine_pool.workers.worker import VllmWorker, may_raise_priority


class WorkerFactory:
    """Makes the pool's launched workers (not started)."""

    def __init__(
        self,
        settings: PoolSettings,
        http: httpx.AsyncClient,
        roster: Roster,
        versions: WeightVersions,
        keeper: WeightKeeper,
    ) -> None:
        self.settings, self.http, self.roster = settings, http, roster
        self.versions, self.keeper = versions, keeper
        self.launched = 0
        """Workers made so far (each is named after this count)."""

    def new(self, shadow: bool = False) -> PoolMember:
        """A new launched worker, in the roster; `shadow`: what it is launched to be (a launcher keeps
        the roles apart when it places it)."""
        s = self.settings
        assert s.spec_factory is not None, "the pool launches workers only with a spec_factory"
        spec = s.spec_factory()
        if s.device_groups:
            spec = dataclasses.replace(spec, devices=self.free_devices())
        owner = self.keeper.owner
        if isinstance(owner, GpuWeightCache):  # map the group's daemon (weight_cache)
            spec = dataclasses.replace(spec, extra_args=(*spec.extra_args, *owner.worker_args(spec.devices)))
        name = f"worker-{self.launched}"
        self.launched += 1
        if s.launcher is not None:
            worker = s.launcher.worker(spec, Path(s.log_dir), name, shadow, self.roster.members)
        else:
            worker = VllmWorker(spec, Path(s.log_dir), name, s.start_nice if may_raise_priority() else 0)
        member = PoolMember(
            name, EngineClient(spec.url, spec.served_name, self.http, api_key=spec.api_key), process=worker,
            weight_version=self.versions.base,
        )  # fmt: skip
        self.roster.members.append(member)
        return member

    def free_devices(self) -> tuple[int, ...]:
        """The device group for a new worker."""
        groups, members = self.settings.device_groups, self.roster.members
        held = [m.process.spec.devices for m in members if m.process is not None and m.state != DEAD]
        if self.settings.colocate:  # the least used group (first of equals): actives spread, shadows join
            return min(groups, key=held.count)
        free = next((g for g in groups if g not in held), None)
        if free is None:  # the configuration checks make this unreachable: each worker has its group
            raise EngineUnavailable(f"no free device group: all of {groups} are in use")
        return free
