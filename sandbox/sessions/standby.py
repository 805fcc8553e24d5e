"""Standby sandboxes: a session's newest checkpoint restored ahead of time and frozen, so that a recovery
unfreezes it instead of restoring from storage (the sandbox's counterpart of the engine pool's shadow
workers).

A restore from storage starts a container from the dump, and most of its time is the engine's and CRIU's
(about a second on a 2-core host, `sandbox.docker_backend.checkpoints`); unfreezing a paused container
takes milliseconds. So, with ``sandbox.standby`` on, once a sandbox has a checkpoint the manager restores
it into a second container in idle time and freezes it at once (`SandboxBackend.restore_standby`:
``docker pause``). At a failure, `Recovery` asks `take` for the standby of the checkpoint it restores:
when it holds that checkpoint, it is unfrozen (`SandboxBackend.activate`) and becomes the session's
sandbox, and the journal since the checkpoint is replayed on it as after any restore (a standby of
checkpoint k used at a failure after call n replays calls k+1..n). Otherwise (none, one being made, one
of another checkpoint, one that cannot be unfrozen) the restore comes from storage as before. The
``sandbox_restored`` event says which (``standby``).

When a standby is made: in an inference bubble (`sandbox.sessions.bubbles`), after the bubble's
checkpoint or in a bubble that takes none, when what is left of the bubble is predicted to hold it
(`AdaptivePolicy.standby_fits`: the recent standbys' cost, by ``margin``). It runs beside the session,
never under its lock: the session's calls never wait for it (a restore cannot be stopped halfway, so one
that overruns its bubble shares the CPU with the next call). The next standby is made after a recovery
used this one, in a later bubble.

When it is discarded (removed, a ``sandbox_standby`` event with ``discarded``): a newer checkpoint
supersedes the one it holds (`prune`, in the background), the checkpoint it holds is deleted (a restore
to an older checkpoint, released checkpoints), or the session's sandbox is removed (`close`, awaited).
A standby being made when it stops being wanted is removed once made. A gateway that stops without
closing (killed, or ``keep_on_shutdown``) leaves its standbys; they carry the same labels as the
session's sandbox, no open session's slot holds them, so the next gateway's start-up removes them as
leaked (`sandbox.sessions.adoption`).

What a standby means for the sandbox's processes:

- between the restore and the freeze they run for a few milliseconds, in the standby's own container,
  filesystem and network namespace: nothing the session's sandbox sees. Only ``network="none"``
  sandboxes get standbys: on a network, those milliseconds could reach something outside its
  namespaces (the gateway's sandbox listener, which does not know the standby's address, and would
  refuse a harness inside; or, with ``full``, a server that would then see a request twice);
- their clocks jump when it is unfrozen, as after any restore (wall and monotonic time both moved on
  while it was frozen, and timers that came due fire at once);
- it holds a second copy of the sandbox's memory (frozen, but resident and charged to its container)
  and a restore's CPU per checkpoint: why ``sandbox.standby`` is off by default.

Backends that cannot keep one (`SandboxBackend.keeps_standbys`: the cluster backend) are given none.

Example::

    standbys = Standbys(io, slots, events, policy, TaskOwner("sandbox-checkpoints"), enabled=True)
    standbys.offer(slot, turn, bubble_left_s=1.4)         # in turn's bubble, after its checkpoint
    box = await standbys.take(slot, chosen)               # at a failure: the unfrozen sandbox, or None
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace

from core import events as ev
from core.errors import SandboxError, SandboxNotFound
from core.logs import session_tag
from core.tasks import TaskOwner
from sandbox.backend import Checkpoint, Sandbox
from sandbox.sessions.io import SandboxIO
from sandbox.sessions.policy import AdaptivePolicy
from sandbox.sessions.records import CheckpointInfo, EventLog
from sandbox.sessions.state import Slot, Slots, Standby
from store import TurnRecord

log = logging.getLogger("belayer.sandbox")


class Standbys:
    """Makes, hands over and discards the slots' standby sandboxes (see the module docstring)."""

    def __init__(
        self,
        io: SandboxIO,
        slots: Slots,
        events: EventLog,
        policy: AdaptivePolicy,
        tasks: TaskOwner,
        *,
        enabled: bool,
    ) -> None:
        self.io = io
        self.slots = slots
        self.events = events
        self.policy = policy
        self.tasks = tasks
        self.enabled = enabled and io.backend.keeps_standbys
        """``sandbox.standby`` is on and the backend can keep standbys."""
        self.made = 0
        self.used = 0

    def wanted(self, slot: Slot) -> CheckpointInfo | None:
        """The checkpoint a standby should be made of now (the newest), or None: standbys are off, the
        sandbox is on a network or failed, or its newest checkpoint has one already (or one on the way,
        or one that could not be made)."""
        newest = slot.history.newest()
        if not self.enabled or slot.spec.network != "none" or slot.sandbox_id is None or newest is None:
            return None
        state, held = slot.standby, newest.checkpoint.id
        if (
            state.making is not None
            or state.failed == held
            or (state.ready and state.ready.checkpoint_id == held)
        ):
            return None
        return newest

    def offer(self, slot: Slot, turn: TurnRecord, bubble_left_s: float) -> None:
        """In `turn`'s bubble, with `bubble_left_s` predicted left of it: start making a standby of the
        newest checkpoint if one is wanted and predicted to fit."""
        chosen = self.wanted(slot)
        if chosen is None or turn.id not in slot.turns.running:
            return
        if not self.policy.standby_fits(bubble_left_s, chosen.dump_bytes):
            return
        slot.standby.making = chosen.checkpoint.id
        work = self._make(slot, chosen, slot.standby.attempt)
        self.tasks.spawn(work, f"standby/{session_tag(slot.session_id)}")

    async def _make(self, slot: Slot, chosen: CheckpointInfo, attempt: int) -> None:
        started = time.monotonic()
        # with the slot's own labels, as `Lifecycle.replace` restores: a restarted gateway finds it by them
        ckpt = chosen.checkpoint
        ckpt = replace(ckpt, spec=ckpt.spec.model_copy(update={"labels": slot.spec.labels}))
        try:
            box = await self._restore(ckpt)
        except SandboxError as exc:
            if slot.standby.attempt == attempt:
                slot.standby.making, slot.standby.failed = None, ckpt.id
            log.warning(
                "session %s: standby of checkpoint %s failed: %s", session_tag(slot.session_id), ckpt.id, exc
            )
            failed = ev.SandboxStandby(
                "failed", ckpt.id, None, _s(started), reason=f"{type(exc).__name__}: {exc}"
            )
            self.events.add(slot.session_id, None, failed)
            return
        seconds = time.monotonic() - started
        wanted = self.slots.current(slot) and slot.history.newest() is chosen and slot.sandbox_id is not None
        if slot.standby.attempt != attempt or not wanted:  # superseded, deleted or closed meanwhile
            await self._remove(slot.session_id, Standby(ckpt.id, box.id), "no longer wanted once made")
            return
        old, slot.standby.making, slot.standby.ready = slot.standby.ready, None, Standby(ckpt.id, box.id)
        if old is not None:
            self.tasks.spawn(
                self._remove(slot.session_id, old, f"superseded by checkpoint {ckpt.id}"), "standby"
            )
        self.made += 1
        self.policy.observe_standby(seconds)
        self.events.add(slot.session_id, None, ev.SandboxStandby("made", ckpt.id, box.id, round(seconds, 4)))

    async def _restore(self, ckpt: Checkpoint) -> Sandbox:
        """`restore_standby` in the short-operation pool. Cancelled (the manager closing without waiting
        for it), the restore still ends in its thread: what it made is removed before the cancel goes on."""
        made = asyncio.ensure_future(self.io.op(self.io.backend.restore_standby, ckpt))
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                box = await made
                await self.io.op(self.io.backend.destroy, box.id)
            raise

    async def take(self, slot: Slot, chosen: CheckpointInfo | None) -> str | None:
        """At a restore of `chosen` (the caller holds `slot.lock`): the slot's standby, unfrozen, when it
        holds `chosen`; else None (one that cannot be unfrozen is removed)."""
        ready = slot.standby.ready
        if chosen is None or ready is None or ready.checkpoint_id != chosen.checkpoint.id:
            return None
        slot.standby.ready = None
        started = time.monotonic()
        try:
            await self.io.op(self.io.backend.activate, ready.sandbox_id)
        except SandboxError as exc:
            log.warning("session %s: standby %s could not be unfrozen (restoring from storage): %s",
                        session_tag(slot.session_id), ready.sandbox_id, exc)  # fmt: skip
            await self._remove(slot.session_id, ready, f"it could not be unfrozen: {exc}")
            return None
        self.used += 1
        used = ev.SandboxStandby("used", ready.checkpoint_id, ready.sandbox_id, _s(started))
        self.events.add(slot.session_id, None, used)
        return ready.sandbox_id

    def prune(self, slot: Slot) -> None:
        """After the slot's checkpoints changed: a standby that does not hold the newest any more is
        removed in the background, and one being made of another is removed once made."""
        newest = slot.history.newest()
        keep = newest.checkpoint.id if newest is not None else None
        state = slot.standby
        if state.making is not None and state.making != keep:
            state.making, state.attempt = None, state.attempt + 1
        if state.ready is None or state.ready.checkpoint_id == keep:
            return
        ready, state.ready = state.ready, None
        held = any(c.checkpoint.id == ready.checkpoint_id for c in slot.history.items)
        why = f"superseded by checkpoint {keep}" if held else "its checkpoint was deleted"
        self.tasks.spawn(self._remove(slot.session_id, ready, why), f"standby/{session_tag(slot.session_id)}")

    async def close(self, slot: Slot) -> None:
        """The session's sandbox is being removed: remove its standby now (one being made, once made)."""
        state = slot.standby
        state.making, state.attempt = None, state.attempt + 1
        if state.ready is not None:
            ready, state.ready = state.ready, None
            await self._remove(slot.session_id, ready, "the session's sandbox was removed")

    async def _remove(self, session_id: str, standby: Standby, reason: str) -> None:
        try:
            await self.io.op(self.io.backend.destroy, standby.sandbox_id)
        except SandboxNotFound:
            pass
        except SandboxError as exc:  # a leak until the next start-up's sweep (`adoption`)
            log.warning(
                "session %s: could not remove standby %s: %s",
                session_tag(session_id),
                standby.sandbox_id,
                exc,
            )
        gone = ev.SandboxStandby("discarded", standby.checkpoint_id, standby.sandbox_id, 0.0, reason=reason)
        self.events.add(session_id, None, gone)


def _s(started: float) -> float:
    return round(time.monotonic() - started, 4)
