"""What the sandbox manager hands out (`CheckpointInfo`) and records (`EventLog`). A restore's record is
its event, `core.events.SandboxRestored`: the manager hands out what it writes.

Each checkpoint is tagged with the session and a turn index, and with `keep_through`: the last turn the
checkpoint is consistent with. A checkpoint taken in turn k's bubble holds the environment the harness
had when it asked for turn k, so:

- a harness outside the sandbox keeps turn k: it resumes by re-running turn k's tool calls;
- a harness inside the sandbox is restored *waiting for* turn k; it will retry that call, so turn k is
  discarded and the retry extends turn k-1 (prefix reuse ignores discarded turns).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from core import events as ev
from sandbox.backend import Checkpoint
from store import EventRecord
from store.roles import SandboxEvents


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A checkpoint of a session's sandbox, tagged with the turn it belongs to."""

    checkpoint: Checkpoint
    session_id: str
    turn_index: int
    """The turn in whose bubble it was taken (or, outside a bubble, the last turn started); -1: none."""
    in_bubble: bool
    """Taken while turn `turn_index`'s LLM call ran."""
    keep_through: int
    """The last turn consistent with it: a restore discards the turns after this one."""
    seconds: float
    dump_bytes: int
    trigger: str

    @classmethod
    def from_json(cls, data: dict[str, Any], checkpoint: Checkpoint) -> CheckpointInfo:
        """Rebuild one from its `as_json` values (a ``sandbox_checkpoint`` event) and its checkpoint."""
        return cls(
            checkpoint, data["session_id"], data["turn_index"], data["in_bubble"], data["keep_through"],
            data["seconds"], data["dump_bytes"], data["trigger"],
        )  # fmt: skip

    def as_json(self) -> dict[str, Any]:
        c = self.checkpoint
        return {
            "id": c.id, "session_id": self.session_id, "turn_index": self.turn_index,
            "in_bubble": self.in_bubble, "keep_through": self.keep_through, "trigger": self.trigger,
            "seconds": round(self.seconds, 4), "fs_seconds": round(c.fs_seconds, 4),
            "process_seconds": round(c.process_seconds, 4), "dump_bytes": self.dump_bytes,
            "created_at": c.created_at, "location": c.location,
        }  # fmt: skip


class EventLog:
    """Writes the manager's trajectory events (``sandbox_*``), and the turns a restore discards, to the
    store, through its front (`store.front`: after the session's earlier writes, off the event loop
    for a remote store)."""

    def __init__(self, store: SandboxEvents) -> None:
        self._store = store

    def add(self, session_id: str, turn_id: int | None, event: ev.Payload) -> None:
        """Posted: not awaited."""
        record = EventRecord.of(session_id, turn_id, event)
        self._store.front.post(session_id, self._store.add_event, record)

    def discard_turns(self, session_id: str, turn_ids: list[int], reason: str) -> None:
        """Mark these turns discarded (`Truncation.discard_turns`); posted: not awaited."""
        self._store.front.post(session_id, self._store.discard_turns, session_id, turn_ids, reason)

    async def discard_turns_after(self, session_id: str, turn_index: int, reason: str) -> list[int]:
        """Mark the turns after `turn_index` discarded (`Truncation.discard_turns_after`); their indices."""
        store = self._store
        return await store.front.call(session_id, store.discard_turns_after, session_id, turn_index, reason)
