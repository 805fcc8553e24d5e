"""Forks: a session's sandbox copied into child sessions at one of its turns.

A child's sandbox is restored from the parent's state at the fork turn (the checkpoint consistent with
it, or the nearest earlier one and the journaled tool calls up to the turn replayed), then checkpointed
as the child's own base for recovery, since its journal starts at the fork.
"""

from __future__ import annotations

import asyncio
from typing import Any

from core import events as ev
from core.errors import SandboxExists
from sandbox.sessions.checkpoints import Checkpointer
from sandbox.sessions.journal import Call
from sandbox.sessions.lifecycle import SESSION_LABEL, Lifecycle
from sandbox.sessions.records import CheckpointInfo, EventLog
from sandbox.sessions.recovery import Recovery
from sandbox.sessions.state import Slot, Slots


class Forks:
    """Forking sessions' sandboxes, over the manager's slots and parts."""

    def __init__(
        self, slots: Slots, lifecycle: Lifecycle, checkpointer: Checkpointer, recovery: Recovery, events: EventLog
    ) -> None:
        self.slots = slots
        self.lifecycle = lifecycle
        self.checkpointer = checkpointer
        self.recovery = recovery
        self.events = events

    async def fork(self, session_id: str, children: list[str], at_turn: int) -> None:
        """Give each child session a sandbox restored from this session's state at turn `at_turn`: its
        checkpoint consistent with that turn, or the nearest earlier one and the journaled tool calls
        up to the turn replayed (`Recovery.fork_source`), then checkpointed (trigger ``"fork"``): the
        child's own base for recovery, since its journal starts at the fork. All or nothing: when one
        fails, the sandboxes and checkpoints made so far are removed and the error raised. Each child's
        listener requests for its ancestors' sessions land in its own (`lineage_of`)."""
        slot = self.slots.require(session_id)
        taken = [c for c in children if c in self.slots]
        if taken:
            raise SandboxExists(f"sessions {taken} already have a sandbox")
        async with slot.lock:
            chosen, calls = self.recovery.fork_source(slot, at_turn)
            made = [self._fork_slot(slot, child_id) for child_id in children]
            for child in made:  # a restored process may call before the fork returns: `owner_of`
                self.slots.add(child)  # waits for the restore in progress
            results = await asyncio.gather(
                *(self._fork_into(child, chosen, calls, at_turn) for child in made), return_exceptions=True
            )
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                for child in made:
                    self.slots.remove(child)
                    await self.lifecycle.drop(child)
                    await self.checkpointer.delete_all(child.session_id, child.history.release())
                raise failed[0]
        for child in made:
            forked = ev.SandboxForked(
                sandbox_id=child.sandbox_id, parent_session=session_id, fork_turn=at_turn,
                checkpoint_id=chosen.checkpoint.id if chosen else None, replayed=len(calls),
                address=child.address, lineage=list(child.lineage), **restorable(child),
            )  # fmt: skip
            self.events.add(child.session_id, None, forked)

    def _fork_slot(self, slot: Slot, child_id: str) -> Slot:
        labels = {**slot.spec.labels, SESSION_LABEL: child_id}
        return Slot(
            child_id, slot.spec.model_copy(update={"labels": labels}), slot.harness_inside, slot.recovery,
            None, lineage=(slot.session_id, *slot.lineage),
        )  # fmt: skip

    async def _fork_into(
        self, child: Slot, chosen: CheckpointInfo | None, calls: list[Call], at_turn: int
    ) -> None:
        async with child.lock:
            with child.restores.running():
                await self.recovery.fork_into(child, chosen, calls, at_turn)


def restorable(slot: Slot) -> dict[str, Any]:
    """What a ``sandbox_created`` or ``sandbox_forked`` event keeps so that a restarted gateway can
    rebuild the slot (`sandbox.sessions.adoption`)."""
    spec = slot.spec.model_dump(mode="json")
    return {"spec": spec, "harness_inside": slot.harness_inside, "recovery": slot.recovery}
