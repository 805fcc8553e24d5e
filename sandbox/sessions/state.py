"""Per-session state of the sandbox manager: one `Slot` per session, kept in `Slots`.

A slot's parts each belong to one concern: `Journal` to recovery by replay, `CheckpointHistory` to the
checkpoints and the policy's inputs, `Turns` to the bubble observer, `Restores` to recovery and
`settled()`, `StandbyState` to the standby sandbox (`standby`). Every change to a slot's sandbox happens
under `Slot.lock`: one operation at a time (a standby is made beside it, never in it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

from core import events as ev
from core.errors import NoSandbox, SandboxFailed
from sandbox.backend import SandboxSpec
from sandbox.sessions.journal import Journal
from sandbox.sessions.records import CheckpointInfo
from store import TurnRecord

RecoveryMode = Literal["replay", "truncate"]


@dataclass(slots=True)
class Turns:
    """The session's LLM calls, as the bubble observer sees them start and finish."""

    running: dict[int, int] = field(default_factory=dict)
    """Turn id -> index of the LLM calls in flight."""
    last: int = -1
    """The newest turn index started (after a restore: the last turn kept)."""
    discarded: set[int] = field(default_factory=set)
    """Turns in flight at a restore: discarded again when they finish."""

    def start(self, turn: TurnRecord) -> None:
        self.running[turn.id] = turn.index
        self.last = max(self.last, turn.index)

    def finish(self, turn_id: int) -> bool:
        """Forget a finished call; True when a restore discarded it while it ran."""
        self.running.pop(turn_id, None)
        if turn_id not in self.discarded:
            return False
        self.discarded.discard(turn_id)
        return True

    def newest_running(self) -> int | None:
        return max(self.running.values(), default=None)

    def rewind(self, keep_through: int) -> None:
        """A restore kept the turns through `keep_through`; the calls in flight belong to the past."""
        self.discarded |= set(self.running)
        self.last = keep_through


@dataclass(slots=True)
class CheckpointHistory:
    """The session's checkpoints, oldest first, and how far the sandbox moved since the newest."""

    items: list[CheckpointInfo] = field(default_factory=list)
    turns_since: int = 0
    bytes_since: int = 0
    """Bytes written through the file API since the newest checkpoint (the next dump grows by them)."""
    last_cost_s: float | None = None
    """How long this session's newest checkpoint took."""
    pending: bool = False
    """A bubble checkpoint is scheduled or running."""
    queued: TurnRecord | None = None
    """In mode ``always``: a turn whose bubble found a checkpoint running, checkpointed when that one
    ends if its bubble is still open (every turn of a harness inside then gets its own, to fork at)."""

    def newest(self) -> CheckpointInfo | None:
        return self.items[-1] if self.items else None

    def add(self, info: CheckpointInfo) -> None:
        self.items.append(info)
        self.turns_since, self.bytes_since, self.last_cost_s = 0, 0, info.seconds

    def evict(self, keep: int) -> list[CheckpointInfo]:
        """Forget the oldest checkpoints beyond `keep`; return them (to be deleted)."""
        evicted, self.items = self.items[: max(0, len(self.items) - keep)], self.items[-keep:]
        return evicted

    def rollback_to(self, checkpoint_id: str | None) -> tuple[CheckpointInfo | None, list[CheckpointInfo]]:
        """The checkpoint to restore (the newest when `checkpoint_id` is None; None if there is no such
        one) and the newer ones, forgotten here: they belong to the branch being discarded."""
        if checkpoint_id is None:
            return self.newest(), []
        for i, info in enumerate(self.items):
            if info.checkpoint.id == checkpoint_id:
                newer, self.items = self.items[i + 1 :], self.items[: i + 1]
                return info, newer
        return None, []

    def release(self) -> list[CheckpointInfo]:
        released, self.items = self.items, []
        return released


@dataclass(slots=True)
class Restores:
    """The session's restores: one in progress, the last one, and one no tool call has reported yet."""

    in_progress: bool = False
    last: ev.SandboxRestored | None = None
    unreported: ev.SandboxRestored | None = None
    """A restore made while no call was in flight; the next tool call of a harness outside reports it."""
    count: int = 0

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Mark a restore in progress for its duration (`settled()` waits for it)."""
        self.in_progress = True
        try:
            yield
        finally:
            self.in_progress = False

    def done(self, info: ev.SandboxRestored) -> None:
        self.last = info
        self.count += 1


@dataclass(frozen=True, slots=True)
class Standby:
    """A frozen sandbox holding one of the session's checkpoints (`sandbox.sessions.standby`)."""

    checkpoint_id: str
    sandbox_id: str


@dataclass(slots=True)
class StandbyState:
    """The session's standby: the one ready, and the one being made."""

    ready: Standby | None = None
    making: str | None = None
    """The checkpoint a standby is being made of."""
    attempt: int = 0
    """Bumped when a standby being made is no longer wanted: it is removed once made."""
    failed: str | None = None
    """The checkpoint whose standby could not be made: not tried again (the next checkpoint's is)."""


@dataclass(slots=True)
class Slot:
    """One session's sandbox and its recovery state."""

    session_id: str
    spec: SandboxSpec
    harness_inside: bool
    recovery: RecoveryMode
    sandbox_id: str | None
    address: str | None = None
    """The sandbox's address on the gateway network (network="gateway" only)."""
    failure: str | None = None
    """Why the sandbox is gone and was not restored."""
    lineage: tuple[str, ...] = ()
    """A fork child's: its parent session, the parent's parent... (newest first). Its sandbox came from
    one of theirs, so its processes may still call their sessions' URLs (`sandbox_listener`)."""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    journal: Journal = field(default_factory=Journal)
    history: CheckpointHistory = field(default_factory=CheckpointHistory)
    turns: Turns = field(default_factory=Turns)
    restores: Restores = field(default_factory=Restores)
    standby: StandbyState = field(default_factory=StandbyState)

    def live(self) -> str:
        """The sandbox's id; raises `SandboxFailed` when it failed and was not restored."""
        if self.sandbox_id is None:
            raise SandboxFailed(f"the session's sandbox failed earlier ({self.failure}) and was not restored")
        return self.sandbox_id


class Slots:
    """The manager's slots by session id."""

    def __init__(self) -> None:
        self._by_session: dict[str, Slot] = {}

    def get(self, session_id: str) -> Slot | None:
        return self._by_session.get(session_id)

    def require(self, session_id: str) -> Slot:
        slot = self._by_session.get(session_id)
        if slot is None:
            raise NoSandbox(
                f"session {session_id} has no sandbox; create one with POST /api/sessions/{session_id}/sandbox"
            )
        return slot

    def add(self, slot: Slot) -> None:
        self._by_session[slot.session_id] = slot

    def remove(self, slot: Slot) -> None:
        if self.current(slot):
            del self._by_session[slot.session_id]

    def current(self, slot: Slot) -> bool:
        """Whether `slot` is still its session's (not destroyed or replaced meanwhile)."""
        return self._by_session.get(slot.session_id) is slot

    def live(self, session_id: str) -> bool:
        slot = self._by_session.get(session_id)
        return slot is not None and slot.sandbox_id is not None

    def session_for_address(self, address: str) -> str | None:
        return next((s.session_id for s in self._by_session.values() if s.address == address), None)

    def sessions(self) -> list[str]:
        return list(self._by_session)

    def __iter__(self) -> Iterator[Slot]:
        return iter(list(self._by_session.values()))

    def __len__(self) -> int:
        return len(self._by_session)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._by_session
