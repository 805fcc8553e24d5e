"""The watcher: a sandbox that stops while nobody calls into it is restored at once.

It polls every idle sandbox's state (`watch_interval_s`), so a container that dies between tool calls
(an OOM kill, a crash of a harness running inside) is restored without waiting for the next call. A
harness outside learns of it from its next tool call (`SandboxRestored`, before anything runs). While
a session's sandbox is being restored, `SandboxManager.settled()` holds the session's next LLM request
back, so that the request is matched against the truncated trajectory.

Example::

    watcher = Watcher(slots, io, recovery)
    tasks.every(0.5, watcher.sweep, "watcher")    # or, in a test: await watcher.sweep()
"""

from __future__ import annotations

import logging

from core.errors import SandboxError
from core.logs import session_tag
from sandbox.backend import SandboxStatus
from sandbox.sessions.io import SandboxIO
from sandbox.sessions.recovery import Failure, Recovery
from sandbox.sessions.state import Slot, Slots

log = logging.getLogger("belayer.sandbox")


class Watcher:
    """Polls the slots' sandboxes and recovers the ones that stopped."""

    def __init__(self, slots: Slots, io: SandboxIO, recovery: Recovery) -> None:
        self.slots = slots
        self.io = io
        self.recovery = recovery

    async def sweep(self) -> None:
        """Check every idle sandbox once; recover those that stopped."""
        for slot in self.slots:
            if slot.sandbox_id is None or slot.lock.locked():
                continue  # failed already, or a call in progress will see the failure itself
            status = await self.io.status(slot.sandbox_id)
            if status is None or status.running:
                continue
            try:
                await self._recover(slot, status)
            except SandboxError as exc:
                log.warning("session %s: recovery failed: %s", session_tag(slot.session_id), exc)

    async def _recover(self, slot: Slot, status: SandboxStatus) -> None:
        async with slot.lock:
            box = slot.sandbox_id
            if box is None or not self.slots.current(slot):
                return  # failed, destroyed or replaced meanwhile
            status = await self.io.status(box) or status  # re-check under the lock
            if status.running:
                return
            failure = Failure(status.failure_kind, f"sandbox stopped: {status.detail}")
            slot.restores.unreported = await self.recovery.recover(slot, failure)
