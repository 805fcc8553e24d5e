"""Which worker serves a request (`Router`): a ready worker on the pool's weight version, preferring the
one that served the session last (its prefix cache holds the session's tokens), then the one with the
fewest outstanding requests.

The affinity map holds named sessions only (a plain ``/v1`` request's one-request session is not
remembered), is forgotten when a session closes, and is bounded (least recently used first out).
`acquire` waits, up to a deadline, for a worker when none is ready (during a promotion, a restart or a
weight update); every state change wakes every waiter (``engine_pool.roster``).

Example::

    router = Router(settings, roster, versions)
    async with router.lease("session-1", wait=30.0) as member:
        ...  # member.outstanding counts this request
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

from core.errors import EngineUnavailable
from engine_pool.member import PoolMember
from engine_pool.roster import Roster
from engine_pool.settings import PoolSettings
from engine_pool.states import DRAINING, READY
from engine_pool.versions import WeightVersions


class Router:
    """Picks the worker for each request and remembers each named session's last worker."""

    def __init__(self, settings: PoolSettings, roster: Roster, versions: WeightVersions) -> None:
        self.settings, self.roster, self.versions = settings, roster, versions
        self._affinity: OrderedDict[str, str] = OrderedDict()

    def routable(self) -> list[PoolMember]:
        """The ready workers on the pool's weight version."""
        return [m for m in self.roster.members if m.state == READY and self.versions.current(m)]

    def pick(
        self,
        session_id: str | None = None,
        exclude: frozenset[str] = frozenset(),
        version: str | None = None,
    ) -> PoolMember | None:
        """The worker for a request, or None. `version`: the request has tokens from that version (a
        failover): during an update's drain it may still run on that version; without one it waits for
        the update, like every request while the update loads the weights."""
        v = self.versions
        if v.updating and (v.switching or version != v.version):
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
                raise EngineUnavailable(
                    f"no healthy inference worker became available within {wait:.0f}s (workers: "
                    f"{self._states()}); check the workers' logs in the gateway's --log-dir"
                )
            await self.roster.wait_change(left)
        if session_id is not None:
            self._remember(session_id, member.name)
        return member

    def _states(self) -> str:
        """The workers' states, for a request that found none to run on."""
        v = self.versions
        states = ", ".join(
            f"{m.name}={m.state}" + ("" if v.current(m) else f" (weights {m.weight_version})")
            for m in self.roster.members
        ) or "none"  # fmt: skip
        if v.updating:
            states += f"; a weight update to {v.version!r} is running"
        return states

    @contextlib.asynccontextmanager
    async def lease(
        self,
        session_id: str | None = None,
        wait: float = 0.0,
        exclude: frozenset[str] = frozenset(),
        version: str | None = None,
    ) -> AsyncIterator[PoolMember]:
        """`acquire`, with the request counted on the worker while it runs."""
        member = await self.acquire(session_id, wait, exclude, version)
        member.outstanding += 1
        try:
            yield member
        finally:
            member.outstanding -= 1
            member.served += 1
            if (member.state == DRAINING and not member.outstanding) or self.versions.updating:
                self.roster.wake()  # a removal, or a weight update's drain, waits for this

    def _remember(self, session_id: str, worker: str) -> None:
        self._affinity[session_id] = worker
        self._affinity.move_to_end(session_id)
        while len(self._affinity) > self.settings.max_affinity:
            self._affinity.popitem(last=False)

    def forget(self, session_id: str) -> None:
        """The session is over: its worker need not be remembered."""
        self._affinity.pop(session_id, None)

    def forget_worker(self, name: str) -> None:
        """The worker is gone: no session is routed back to it."""
        for session, worker in list(self._affinity.items()):
            if worker == name:
                del self._affinity[session]

    @property
    def remembered_sessions(self) -> int:
        """Sessions in the affinity map (bounded by ``max_affinity``)."""
        return len(self._affinity)

    @property
    def sessions(self) -> list[str]:
        """Sessions in the affinity map (bounded by ``max_affinity``), least recently used first."""
        return list(self._affinity)
