"""The periodic sweep for turns a dead replica left running.

Replicated gateways share one PostgreSQL store. When one is killed mid-stream, its running turns keep
the tokens it wrote while they streamed (`gateway.turns.inflight`), but read as ``running`` until a live
gateway notices that their owner is gone. Starting a turn in the session notices it (the harness's
retry), but a session that nobody retries would stay ``running``: so each gateway sweeps the store every
``inflight.sweep_interval_s`` seconds (`TrajectoryStore.sweep_orphans`, in a worker thread), and a dead
replica's running turns become ``interrupted`` within one period, each session with a
``turns_interrupted`` event (the ``belayer_turns_interrupted`` metric counts them). A store only one
gateway opens (SQLite) has nothing to sweep: its default finds none.

Example::

    sweeper = OrphanSweeper(store, interval_s=5.0)
    sweeper.start()         # the app's lifespan does it
    await sweeper.close()
"""

from __future__ import annotations

import asyncio
import logging

from core.errors import StoreError
from core.tasks import TaskOwner
from store import TrajectoryStore

log = logging.getLogger("belayer.gateway")


class OrphanSweeper:
    """Calls `TrajectoryStore.sweep_orphans` every `interval_s` seconds until closed."""

    def __init__(self, store: TrajectoryStore, interval_s: float) -> None:
        self.store = store
        self.interval_s = interval_s
        self._tasks = TaskOwner("orphan-sweep")
        self.sweeps = 0
        """Sweeps done (tests)."""
        self.interrupted = 0
        """Turns this gateway's sweeps marked interrupted."""

    def start(self) -> None:
        self._tasks.every(self.interval_s, self.sweep, "sweep")

    async def sweep(self) -> int:
        """One sweep now; the turns it marked (a store error is logged by the store: the next sweep
        tries again)."""
        try:
            marked = await asyncio.to_thread(self.store.sweep_orphans)
        except StoreError:
            return 0
        self.sweeps += 1
        self.interrupted += marked
        if marked:
            log.info("orphan sweep: %d running turns of a gone gateway marked interrupted", marked)
        return marked

    async def close(self) -> None:
        await self._tasks.close()
