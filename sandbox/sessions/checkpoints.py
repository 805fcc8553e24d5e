"""Taking a session's checkpoints, tagging them with turns, and deleting the ones it no longer needs.

A checkpoint taken while turn k's LLM call runs is tagged with turn k (see `records` for what
`keep_through` means). Each one feeds the policy its cost, clears the replay journal (the calls before
it are in it), supersedes the standby of the one before (`standby`), and evicts the oldest beyond
`keep_checkpoints`. A deletion that fails leaks the
checkpoint's storage: it is logged and counted (`delete_failures`), never raised, since the session
itself is fine.

Where the storage driver does not enforce the sandboxes' disk quota (`SandboxIO.check_disk_quota`), a
checkpoint first measures the sandbox's writable layer: over the quota, it is refused (a
``sandbox_checkpoint_refused`` event and a `CheckpointError`) rather than committing a layer that large.

Example::

    info = await checkpointer.take(slot, "explicit", bubble=None)   # under slot.lock
    await checkpointer.delete(slot.session_id, info)
"""

from __future__ import annotations

import logging
import time

from core import events as ev
from core.errors import CheckpointError, SandboxError
from core.logs import session_tag
from sandbox.backend import checkpoint_record
from sandbox.sessions.io import SandboxIO
from sandbox.sessions.policy import AdaptivePolicy
from sandbox.sessions.records import CheckpointInfo, EventLog
from sandbox.sessions.standby import Standbys
from sandbox.sessions.state import Slot
from store import TurnRecord

log = logging.getLogger("belayer.sandbox")


class Checkpointer:
    """Takes and deletes checkpoints of slots' sandboxes; counts what it did."""

    def __init__(
        self, io: SandboxIO, events: EventLog, policy: AdaptivePolicy, keep: int, standbys: Standbys
    ) -> None:
        self.io = io
        self.events = events
        self.policy = policy
        self.keep = keep
        self.standbys = standbys
        self.taken = 0
        self.delete_failures = 0
        """Checkpoints whose deletion failed: their storage leaked (each one is logged)."""

    async def take(self, slot: Slot, trigger: str, bubble: TurnRecord | None) -> CheckpointInfo:
        """Checkpoint the slot's sandbox now (the caller holds `slot.lock`); `bubble` is the turn whose
        LLM call it was taken for, if any."""
        box = slot.live()
        running = bubble.index if bubble is not None else slot.turns.newest_running()
        turn_index = running if running is not None else slot.turns.last
        await self._check_disk(slot.session_id, box, bubble)
        started = time.monotonic()
        # The session's tag, not its id (the capability): the label is in the store's meta.json
        label = f"{session_tag(slot.session_id)}/turn-{turn_index}"
        ckpt = await self.io.op(self.io.backend.checkpoint, box, label=label)
        seconds = time.monotonic() - started
        in_bubble = running is not None and (bubble is None or bubble.id in slot.turns.running)
        keep = turn_index - 1 if (running is not None and slot.harness_inside) else turn_index
        info = CheckpointInfo(
            ckpt, slot.session_id, turn_index, in_bubble, keep, seconds, ckpt.dump_bytes, trigger
        )
        slot.history.add(info)
        slot.journal.clear()
        self.taken += 1
        self.policy.observe_checkpoint(seconds=seconds, dump_bytes=ckpt.dump_bytes)
        taken = ev.SandboxCheckpoint(**info.as_json(), record=checkpoint_record(ckpt))  # the whole record: `adoption`
        self.events.add(slot.session_id, bubble.id if bubble else None, taken)
        self.standbys.prune(slot)  # a standby of the checkpoint before is superseded
        for old in slot.history.evict(self.keep):
            await self.delete(slot.session_id, old)
        return info

    async def _check_disk(self, session_id: str, box: str, bubble: TurnRecord | None) -> None:
        quota = self.io.backend.disk_quota_bytes
        if not self.io.check_disk_quota or quota is None:
            return
        used = await self.io.op(self.io.backend.writable_bytes, box)
        if used is None or used <= quota:
            return
        refused = ev.SandboxCheckpointRefused("disk_quota", used, quota, box)
        self.events.add(session_id, bubble.id if bubble else None, refused)
        raise CheckpointError(
            f"checkpoint refused: the sandbox has written {used} bytes, over its disk quota of {quota} "
            "(sandbox.disk_quota_bytes; the storage driver does not enforce it)"
        )

    async def delete(self, session_id: str, info: CheckpointInfo) -> None:
        """Free a checkpoint's storage; a failure is logged and counted, not raised."""
        try:
            await self.io.op(self.io.backend.delete_checkpoint, info.checkpoint)
        except SandboxError as exc:
            self.delete_failures += 1
            log.warning(
                "session %s: could not delete checkpoint %s (its storage leaks): %s",
                session_tag(session_id), info.checkpoint.id, exc,
            )  # fmt: skip

    async def delete_all(self, session_id: str, infos: list[CheckpointInfo]) -> None:
        for info in infos:
            await self.delete(session_id, info)
