"""The pool's members and their states (`Roster`): each state change is logged, published and wakes
every waiter, so that whoever waits for a worker (``acquire``, a drain) looks again at once.

It also holds what all the pool's parts share: the owner of their background work and whether the pool
is closing.

Example::

    roster = Roster(PoolSettings())
    roster.members.append(member)
    roster.set(member, READY, "started")  # logged, published as ``worker_state``, waiters woken
    await roster.wait_change(5.0)         # until the next change, at most 5 s
"""

from __future__ import annotations

import asyncio
import logging
import time

from core import events
from core.tasks import TaskOwner
from engine_pool.member import PoolMember
from engine_pool.settings import PoolSettings
from engine_pool.states import DEAD, DRAINING, READY, UNHEALTHY

log = logging.getLogger("belayer.engine_pool")


class Roster:
    """The members, their state changes and the waiters for them."""

    def __init__(self, settings: PoolSettings) -> None:
        self.settings = settings
        self.members: list[PoolMember] = []
        self.tasks = TaskOwner("engine-pool")
        """The owner of the pool's background work (probes, fences, replacements, catch-ups)."""
        self.closing = False
        """The pool is stopping: nothing is fenced, replaced or restarted any more."""
        self._waiters: set[asyncio.Future[None]] = set()

    def live(self, name: str) -> PoolMember | None:
        """The member named `name` that is not dead."""
        return next((m for m in self.members if m.name == name and m.state != DEAD), None)

    def ready(self) -> list[PoolMember]:
        return [m for m in self.members if m.state == READY]

    @property
    def max_model_len(self) -> int:
        lens = [m.info.max_model_len for m in self.members if m.info and m.info.max_model_len]
        return min(lens) if lens else 0

    def set(self, m: PoolMember, state: str, why: str) -> None:
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
            event = events.WorkerState(
                worker=m.name, from_=m.state, to=state, why=why, url=m.client.base_url,
                pid=p.pid if p is not None else None, launched=p is not None,
            )  # fmt: skip
            m.state = state
            m.history.append((now, state))
            self.publish(event)
            self.wake()

    def publish(self, event: events.Payload, session_id: str | None = None) -> None:
        """An event of the pool's (state changes, promotions, replacements, cold starts, loads, a
        session moved for load: that one names its session)."""
        self.settings.telemetry.publish(event, session_id)

    def wake(self) -> None:
        """Every waiter looks again (each has its own future: none can miss a change)."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._waiters.clear()

    async def wait_change(self, timeout: float) -> None:
        """Until the next state change (or a lease ends), at most `timeout` seconds."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait({waiter}, timeout=timeout)
        finally:
            self._waiters.discard(waiter)
            waiter.cancel()
