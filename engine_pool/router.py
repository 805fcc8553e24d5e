"""Which worker serves a request (`Router`): a ready worker on the pool's weight version, chosen by the
pool's routing policy (``PoolSettings.routing``):

- ``affinity`` (the default): the worker that served the session last (its prefix cache holds the
  session's tokens), else the least-loaded one;
- ``group``: as ``affinity``, and a session that names a group (``POST /api/sessions {"group": ...}``)
  and has no worker yet goes to the worker that served its group first (its prefix cache holds the
  group's shared prompt), while that worker's load allows; a session (or a group's newcomer) *spills*
  to the least-loaded worker when its worker's outstanding tokens exceed ``routing_spill_factor`` ×
  the least-loaded's + ``routing_spill_floor``. A session that spills moves once (a ``session_moved``
  event) and stays on its new worker;
- ``round-robin``: the ready workers in turn, whatever the session;
- ``least-loaded``: the least-loaded worker (then the fewest served), whatever the session.

A worker's load is its outstanding tokens (`PoolMember.outstanding_tokens`): each running request counts
its prompt and the most tokens it may still generate (the ``tokens`` of its lease), then its
outstanding requests; a long prompt weighs what it costs, not one request like any other.

The affinity map holds named sessions only (a plain ``/v1`` request's one-request session is not
remembered), is forgotten when a session closes, and is bounded (least recently used first out); so is
the map of groups to their first worker, which moves to another worker when its worker is no longer
routable. Every policy keeps both maps, so a policy changed live starts from what they hold. After a
failover the session is remembered on the worker that took it over.
`acquire` waits, up to a deadline, for a worker when none is ready (during a promotion, a restart or a
weight update); every state change wakes every waiter (``engine_pool.roster``).

Each request's place is asked for with a `Placement` (``engine_pool.face``), built once per submission.

Example::

    router = Router(settings, roster, versions)
    async with router.lease(Placement("session-1", wait=30.0, group="task-7", tokens=1200)) as member:
        ...  # member.outstanding counts this request, member.outstanding_tokens its 1200 tokens
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator

from core import events
from core.errors import EngineUnavailable
from engine_pool.face import Placement
from engine_pool.member import PoolMember
from engine_pool.roster import Roster
from engine_pool.settings import PoolSettings
from engine_pool.states import DRAINING, READY, SHADOW
from engine_pool.weights.versions import WeightVersions


class Router:
    """Picks the worker for each request and remembers each named session's last worker."""

    def __init__(self, settings: PoolSettings, roster: Roster, versions: WeightVersions) -> None:
        self.settings, self.roster, self.versions = settings, roster, versions
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._groups: OrderedDict[str, str] = OrderedDict()
        """A group's worker: the first that served one of its sessions (``group`` policy)."""
        self._turn = 0
        """Requests placed under ``round-robin`` (its next worker)."""

    def routable(self) -> list[PoolMember]:
        """The ready workers on the pool's weight version."""
        return [m for m in self.roster.members if m.state == READY and self.versions.current(m)]

    def pick(self, placement: Placement) -> PoolMember | None:
        """The worker for a request now (its `wait` and `exclusive` aside), or None; nothing is counted
        or remembered. A placement's `version` (a failover's tokens) may still run on that version
        during an update's drain; without one it waits for the update, like every request while the
        update loads the weights."""
        placed = self._place(placement)
        return placed[0] if placed is not None else None

    def _place(self, placement: Placement) -> tuple[PoolMember, PoolMember | None] | None:
        """The worker for a request under the pool's policy, and the worker the session leaves because
        of its load (None: it stays, or had none); None when no worker can take it now."""
        v = self.versions
        if v.updating and (v.switching or placement.version != v.version):
            return None
        ready = [m for m in self.routable() if m.name not in placement.exclude and not m.isolating]
        if not ready:
            return None
        policy = self.settings.routing
        if policy == "round-robin":
            return ready[self._turn % len(ready)], None
        if policy == "least-loaded":
            return min(ready, key=lambda m: (*_load(m), m.served)), None
        least = min(ready, key=_load)
        session_id, group = placement.session_id, placement.group
        own = _named(ready, self._affinity.get(session_id) if session_id is not None else None)
        if policy == "affinity":
            return (own if own is not None else least), None
        if own is not None:  # group: the session's own worker first, while its load allows
            return (least, own) if self._crowded(own, least) else (own, None)
        home = _named(ready, self._groups.get(group) if group is not None else None)
        return (home if home is not None and not self._crowded(home, least) else least), None

    def _crowded(self, m: PoolMember, least: PoolMember) -> bool:
        """Is `m` too loaded to keep its sessions, next to the least-loaded worker (module docstring)?"""
        s = self.settings
        return (
            m is not least
            and m.outstanding_tokens
            > s.routing_spill_factor * least.outstanding_tokens + s.routing_spill_floor
        )

    async def acquire(self, placement: Placement) -> PoolMember:
        """A ready worker on the pool's weight version (not one the placement excludes), waiting up to
        its ``wait`` seconds for one (a promotion, a restart, a weight update). The session is
        remembered on it (and the group, when it has no routable worker yet)."""
        deadline = time.monotonic() + placement.wait
        while (placed := self._place(placement)) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise EngineUnavailable(
                    f"no healthy inference worker became available within {placement.wait:.0f}s (workers: "
                    f"{self._states()}); check the workers' logs in the gateway's --log-dir"
                )
            await self.roster.wait_change(left)
        member, moved_from = placed
        session_id, group = placement.session_id, placement.group
        if self.settings.routing == "round-robin":
            self._turn += 1
        if moved_from is not None:
            self._moved(session_id, group, moved_from, member)
        if session_id is not None:
            self._remember(session_id, member.name)
        if group is not None:
            self._home(group, member.name)
        return member

    def _moved(self, session_id: str | None, group: str | None, left: PoolMember, to: PoolMember) -> None:
        """The session leaves its worker for load: published as ``session_moved`` (once: it stays)."""
        moved = events.SessionMoved(
            from_worker=left.name, to_worker=to.name, group=group,
            from_outstanding_tokens=left.outstanding_tokens, to_outstanding_tokens=to.outstanding_tokens,
            from_outstanding=left.outstanding, to_outstanding=to.outstanding, why="load",
        )  # fmt: skip
        self.roster.publish(moved, session_id)

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

    async def _isolated(self, wait: float, placement: Placement) -> PoolMember:
        """A worker held for one request alone (module docstring), the first of: an idle routable worker
        (while another stays for everyone else), a shadow, the last routable worker when it is idle, or
        the least-loaded routable worker once the requests already on it have ended (reserved meanwhile;
        never the last one: its new requests would wait for all of them). Raises `EngineUnavailable` when none is
        free within `wait` seconds: the request never runs beside others."""
        deadline = time.monotonic() + wait
        exclude, version = placement.exclude, placement.version
        reserved: PoolMember | None = None
        try:
            while True:
                if reserved is not None and (reserved.state != READY or not self.versions.current(reserved)):
                    reserved.isolating, reserved = False, None  # it died or left meanwhile
                found = self._alone(exclude, version, reserved)
                if found is not None:
                    if reserved is not None and found is not reserved:
                        reserved.isolating = False
                        self.roster.wake()
                    found.isolating, reserved = True, None
                    return found
                if reserved is None:
                    reserved = self._reserve(exclude, version)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise EngineUnavailable(
                        f"this request was in flight on a worker that crashed, so it runs only on a worker of "
                        f"its own, and none became free within {wait:.0f} s (workers: {self._states()}); "
                        "retry it once the pool is back to strength"
                    )
                await self.roster.wait_change(left)
        finally:
            if reserved is not None:  # reserved, but another came first (or the wait ran out)
                reserved.isolating = False
                self.roster.wake()

    def _alone(
        self, exclude: frozenset[str], version: str | None, reserved: PoolMember | None
    ) -> PoolMember | None:
        """A worker the request can have to itself now, or None."""
        if self.versions.updating and version is not None:
            return None
        if reserved is not None and reserved.outstanding == 0:
            return reserved
        free = [m for m in self.routable() if not m.isolating]
        idle = [m for m in free if m.outstanding == 0 and m.name not in exclude]
        if idle and len(free) >= 2:
            return idle[0]
        shadow = next(
            (m for m in self.roster.members if m.state == SHADOW and not m.isolating and m.name not in exclude
             and self.versions.current(m) and m.outstanding == 0),
            None,
        )  # fmt: skip
        # the last routable worker, when it is idle and no shadow stands by: held only until the suspect's
        # first token (`share`), where waiting for another would starve the suspect of a one-worker pool
        return shadow or (idle[0] if idle else None)

    def _reserve(self, exclude: frozenset[str], version: str | None) -> PoolMember | None:
        """The least-loaded routable worker, taken out of routing until it empties (never the last)."""
        free = [m for m in self.routable() if not m.isolating]
        mine = [m for m in free if m.name not in exclude]
        if len(free) < 2 or not mine or (self.versions.updating and version is not None):
            return None
        member = min(mine, key=_load)
        member.isolating = True
        return member

    @contextlib.asynccontextmanager
    async def lease(self, placement: Placement) -> AsyncIterator[PoolMember]:
        """`acquire`, with the request counted on the worker while it runs: one request, and its
        `tokens` (its prompt and the most it may generate) in the worker's load. A placement with
        `exclusive` seconds is held alone, on a worker that frees up within them (module docstring)."""
        tokens, exclusive = placement.tokens, placement.exclusive
        alone = exclusive is not None
        if exclusive is not None:
            member = await self._isolated(exclusive, placement)
        else:
            member = await self.acquire(placement)
        member.outstanding += 1
        member.outstanding_tokens += tokens
        try:
            yield member
        finally:
            member.outstanding -= 1
            member.outstanding_tokens -= tokens
            member.served += 1
            if alone:
                member.isolating = False
                self.roster.wake()  # everyone else may use it again
            elif member.isolating or not member.outstanding:
                self.roster.wake()  # a suspect waits for a worker to empty (a reserved one, or the last one)
            if (member.state == DRAINING and not member.outstanding) or self.versions.updating:
                self.roster.wake()  # a removal, or a weight update's drain, waits for this

    def share(self, member: PoolMember) -> None:
        """End `member`'s isolation before its suspect ends: a query of death kills its worker before
        its first token (``gateway.turns.quarantine``), so once the suspect has one, holding the worker
        alone for the rest of its answer only serializes the turns a kill left behind."""
        if member.isolating:
            member.isolating = False
            self.roster.wake()

    def _remember(self, session_id: str, worker: str) -> None:
        self._affinity[session_id] = worker
        self._affinity.move_to_end(session_id)
        while len(self._affinity) > self.settings.max_affinity:
            self._affinity.popitem(last=False)

    def _home(self, group: str, worker: str) -> None:
        """The group's worker: the first that served it, until that one is no longer routable."""
        home = self._groups.get(group)
        if home is None or _named(self.routable(), home) is None:
            self._groups[group] = worker
        self._groups.move_to_end(group)
        while len(self._groups) > self.settings.max_affinity:
            self._groups.popitem(last=False)

    def forget(self, session_id: str) -> None:
        """The session is over: its worker need not be remembered."""
        self._affinity.pop(session_id, None)

    def forget_worker(self, name: str) -> None:
        """The worker is gone: no session is routed back to it."""
        for remembered in (self._affinity, self._groups):
            for key, worker in list(remembered.items()):
                if worker == name:
                    del remembered[key]

    @property
    def remembered_sessions(self) -> int:
        """Sessions in the affinity map (bounded by ``max_affinity``)."""
        return len(self._affinity)

    @property
    def sessions(self) -> list[str]:
        """Sessions in the affinity map (bounded by ``max_affinity``), least recently used first."""
        return list(self._affinity)

    @property
    def groups(self) -> dict[str, str]:
        """Each remembered group's worker (bounded by ``max_affinity``), least recently used first."""
        return dict(self._groups)


def _load(m: PoolMember) -> tuple[int, int]:
    """A worker's load: outstanding tokens, then outstanding requests (module docstring)."""
    return m.outstanding_tokens, m.outstanding


def _named(members: list[PoolMember], name: str | None) -> PoolMember | None:
    return next((m for m in members if m.name == name), None) if name is not None else None
