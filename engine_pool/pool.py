"""The engine pool: the workers the gateway may route to, and the choice of one per request.

Workers are either launched and supervised here (``VllmWorker``) or registered by URL (an engine that
is already running; the pool only probes and routes). Routing prefers the worker that served the
session last (its prefix cache holds the session's tokens), then the one with the fewest outstanding
requests.

Example::

    pool = EnginePool(http)
    pool.add_remote("http://127.0.0.1:8000")
    await pool.start()
    async with pool.lease(session_id="s1") as engine:
        ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from belayer.errors import EngineUnavailable
from engine_pool.client import EngineClient, ModelInfo
from engine_pool.worker import VllmWorker, WorkerSpec

READY = "ready"
STARTING = "starting"
UNHEALTHY = "unhealthy"  # failed a probe or a request; routed to again once it passes a probe
DEAD = "dead"  # a launched worker whose process exited

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


@dataclass(slots=True)
class EnginePool:
    """All workers behind the gateway."""

    http: httpx.AsyncClient
    log_dir: str = "logs"
    members: list[PoolMember] = field(default_factory=list)
    probe_interval: float = 2.0
    _affinity: dict[str, str] = field(default_factory=dict)
    _monitor: asyncio.Task[None] | None = None

    def add_remote(self, url: str, model: str | None = None) -> PoolMember:
        name = f"remote-{len(self.members)}"
        member = PoolMember(name, EngineClient(url, model or "", self.http))
        self.members.append(member)
        return member

    def add_launched(self, spec: WorkerSpec) -> PoolMember:
        from pathlib import Path

        name = f"worker-{len(self.members)}"
        worker = VllmWorker(spec, Path(self.log_dir), name)
        member = PoolMember(name, EngineClient(spec.url, spec.served_name, self.http), process=worker)
        self.members.append(member)
        return member

    async def start(self, timeout: float = 300.0) -> None:
        """Launch owned workers, then probe every worker and learn its model and context window."""
        for m in self.members:
            if m.process is not None:
                m.process.launch()
        for m in self.members:
            if m.process is not None:
                await m.process.wait_ready(timeout)
            m.info = await m.client.model_info()
            if not m.client.model:
                m.client.model = m.info.name
            m.state = READY
        self._monitor = asyncio.create_task(self._probe_forever(), name="engine-pool-probe")

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval)
            await self.probe()

    async def probe(self) -> None:
        """Probe every worker once and update its state."""
        for m in self.members:
            if m.state in (DEAD, STARTING):
                continue
            if m.process is not None and not m.process.alive():
                self._set(m, DEAD, f"process exited; log tail:\n{m.process.log_tail(10)}")
                continue
            self._set(m, READY if await m.client.health() else UNHEALTHY, "health probe")

    def _set(self, m: PoolMember, state: str, why: str) -> None:
        if m.state != state:
            log.warning("worker %s: %s -> %s (%s)", m.name, m.state, state, why)
            m.state = state

    def report_failure(self, m: PoolMember, error: Exception) -> None:
        """A request to ``m`` failed in transport: stop routing to it until it passes a probe."""
        if m.state == READY:
            self._set(m, UNHEALTHY, f"request failed: {error}")

    async def stop(self) -> None:
        if self._monitor is not None:
            self._monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._monitor
        for m in self.members:
            if m.process is not None:
                await m.process.stop()
            m.state = DEAD

    @property
    def max_model_len(self) -> int:
        lens = [m.info.max_model_len for m in self.members if m.info and m.info.max_model_len]
        return min(lens) if lens else 0

    def ready(self) -> list[PoolMember]:
        return [m for m in self.members if m.state == READY]

    def pick(self, session_id: str | None = None) -> PoolMember:
        ready = self.ready()
        if not ready:
            raise EngineUnavailable(
                "no healthy inference worker is available; check the workers' logs and `belayer serve` output"
            )
        if session_id is not None:
            preferred = self._affinity.get(session_id)
            for m in ready:
                if m.name == preferred:
                    return m
        return min(ready, key=lambda m: m.outstanding)

    @contextlib.asynccontextmanager
    async def lease(self, session_id: str | None = None) -> AsyncIterator[PoolMember]:
        member = self.pick(session_id)
        member.outstanding += 1
        try:
            yield member
        finally:
            member.outstanding -= 1
            member.served += 1
            if session_id is not None:
                self._affinity[session_id] = member.name
