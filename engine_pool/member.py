"""A pool member (`PoolMember`: one engine behind the pool, launched or registered, with its state and
counters) and the seam for launching workers elsewhere (`WorkerLauncher`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from engine_pool.engine.client import EngineClient, ModelInfo
from engine_pool.states import STARTING
from engine_pool.workers.worker import VllmWorker, WorkerSpec


@dataclass(slots=True)
class PoolMember:
    name: str
    client: EngineClient
    process: VllmWorker | None = None
    state: str = STARTING
    outstanding: int = 0
    """Requests running on it."""
    outstanding_tokens: int = 0
    """The load of the requests running on it, in tokens: each counts its prompt and the most tokens it
    may still generate, from its lease to its end (``engine_pool.router``)."""
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
    weights' version, `WeightVersions.base`, or the version it mapped from the weight owner), then
    each update it loaded."""
    isolating: bool = False
    """Held for one suspect request alone (``Router.lease(exclusive=True)``): routed nothing else."""
    synced: int = 0
    """Times the pool brought it up to a version by loading weights from disk (`WeightUpdater.sync`)."""
    streams: set[Callable[[Exception], None]] = field(default_factory=set)
    """How to cut each stream running on it (the failover guard's, ``gateway.turns.guard``): when a
    vital process of a launched worker exits, `Supervisor.exited` cuts them all at once, with the error."""

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
            "outstanding_tokens": self.outstanding_tokens,
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
            "isolating": self.isolating,
            "node": getattr(p, "node", None),  # its Ray node (--ray); None: the gateway's machine
        }


class WorkerLauncher(Protocol):
    """Where launched workers run when not as local processes (``engine_pool.workers.ray_workers.RayLauncher``):
    it makes each worker (placed knowing whether it is to be a `shadow`, and the pool's `members`),
    names a shadow to move (`misplaced`: the pool starts a new one, then removes it), and is closed
    with the pool."""

    def worker(
        self, spec: WorkerSpec, log_dir: Path, name: str, shadow: bool, members: list[PoolMember]
    ) -> VllmWorker: ...

    async def misplaced(self, members: list[PoolMember]) -> PoolMember | None: ...

    async def close(self) -> None: ...
