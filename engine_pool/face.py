"""What the gateway sees of the pool: where a submission may run (`Placement`), frozen views of the
members and the pool for readers (`MemberView`, `PoolView`), and the small protocol the gateway's turns
depend on (`Engines`: lease a worker, report its failure, and a view), which ``EnginePool`` implements.

A `Placement` is built once per submission and says everything the router needs: the session (its
last worker), how long to wait for a worker, the workers that refused the request, the weight version its
tokens are on, the session's group, its load in tokens, and whether it must run alone::

    placement = Placement("session-1", wait=30.0, group="task-7", tokens=1200)
    async with pool.lease(placement) as member:
        ...  # member.outstanding counts this request, member.outstanding_tokens its 1200 tokens
    [view.state for view in pool.view().members]  # frozen: reading it changes nothing in the pool

Readers outside the pool (metrics, the engines API, the dashboard) read views, never the live
`PoolMember`s, whose fields only the pool's parts write.
"""

from __future__ import annotations

import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, fields
from typing import Any, Protocol

from engine_pool.member import PoolMember
from engine_pool.states import STARTING
from engine_pool.weights.versions import Preemption


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one submission may run (``engine_pool.router``)."""

    session_id: str | None = None
    """Its session: the worker that served it last comes first (None: not remembered)."""
    wait: float = 0.0
    """Seconds to wait for a worker when none can take it now (a promotion, a restart, an update)."""
    exclude: frozenset[str] = frozenset()
    """Workers it may not run on (those that refused it)."""
    version: str | None = None
    """The weight version of its tokens so far (a failover): during an update's drain it may still run
    on that version; None: it waits for the update, like every new request."""
    group: str | None = None
    """Its session's group (the ``group`` policy places it by its group)."""
    tokens: int = 0
    """Its load: its prompt and the most tokens it may generate."""
    exclusive: float | None = None
    """Seconds to wait for a worker of its own (a suspect of a worker's death); None: it shares."""


@dataclass(frozen=True, slots=True)
class MemberView:
    """A member as ``GET /api/engines`` and the dashboard show it, taken at one moment (`of`)."""

    name: str
    url: str
    state: str
    launched: bool
    pid: int | None
    outstanding: int
    outstanding_tokens: int
    served: int
    started_at: float
    launched_at: float | None
    ready_at: float | None
    max_model_len: int | None
    uptime_s: float
    last_transition: dict[str, object] | None
    starting_elapsed_s: float | None
    start_timeout_s: float
    weight_version: str
    isolating: bool
    node: str | None
    """Its Ray node (``--ray``); None: the gateway's machine."""

    @classmethod
    def of(cls, m: PoolMember, start_timeout: float) -> MemberView:
        now = time.time()
        p = m.process
        launched_at = p.started_at if p is not None and p.started_at is not None else m.started_at
        return cls(
            name=m.name, url=m.client.base_url, state=m.state, launched=p is not None,
            pid=p.pid if p is not None else None, outstanding=m.outstanding,
            outstanding_tokens=m.outstanding_tokens, served=m.served, started_at=launched_at,
            launched_at=p.started_at if p is not None else None, ready_at=p.ready_at if p is not None else None,
            max_model_len=m.info.max_model_len if m.info else None, uptime_s=round(now - launched_at, 3),
            last_transition=dict(m.last_transition) if m.last_transition is not None else None,
            starting_elapsed_s=round(now - launched_at, 3) if m.state == STARTING else None,
            start_timeout_s=start_timeout, weight_version=m.weight_version, isolating=m.isolating,
            node=getattr(p, "node", None),
        )  # fmt: skip

    def as_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.last_transition is not None:
            out["last_transition"] = dict(self.last_transition)
        return out


@dataclass(frozen=True, slots=True)
class PoolView:
    """The pool at one moment, for its readers (``EnginePool.view``)."""

    members: tuple[MemberView, ...]
    weight_version: str
    """The version the pool serves: routed workers hold it."""
    weights_path: str | None
    """Where the current version's weights are; None: the launch weights (`base_version`)."""
    base_version: str
    """The version of the weights launched workers start from."""
    max_model_len: int
    remembered_sessions: int
    """Sessions whose last worker the router remembers."""
    groups: int
    """Groups whose first worker the router remembers."""

    def in_state(self, *states: str) -> list[MemberView]:
        return [m for m in self.members if m.state in states]


class Engines(Protocol):
    """What the gateway's turns ask of the pool: lease a worker for a submission, report a worker's
    failure (or ask whether a stalled one failed), and a view. ``EnginePool`` is the one implementation;
    a test may pass its own."""

    @property
    def max_model_len(self) -> int:
        """The smallest context window of the members that said theirs (0: none has yet)."""
        ...

    @property
    def preemption(self) -> Preemption:
        """Triggered when a weight update's drain time is over; a new one for each update."""
        ...

    def lease(self, placement: Placement) -> AbstractAsyncContextManager[PoolMember]:
        """A worker for `placement`, counted busy while the context runs (`Router.lease`)."""
        ...

    def pick(self, placement: Placement) -> PoolMember | None:
        """The worker `placement` would get now, or None (nothing is counted)."""
        ...

    def share(self, member: PoolMember) -> None:
        """A suspect alone on `member` got its first token: the worker takes others again."""
        ...

    def report_failure(self, member: PoolMember, error: Exception) -> None:
        """`member` failed a request: fence it and promote a shadow in its place."""
        ...

    async def confirm_failure(self, member: PoolMember) -> bool:
        """A stalled stream: is the worker really gone? (One probe; on failure, reported.)"""
        ...

    def view(self) -> PoolView: ...
