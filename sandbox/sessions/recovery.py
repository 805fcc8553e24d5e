"""Tool calls that survive their sandbox: run each call under the slot's lock, and on a failure restore.

On a sandbox failure (the container is gone or stopped, the exec transport breaks, a tool call hangs
past its deadline plus `exec_grace_s`), or on an explicit `restore`, the newest checkpoint is restored
into a new sandbox and the session's later turns are marked discarded (`EventLog.discard_turns_after`).
What happens next depends on the sandbox's `recovery` mode:

- ``"replay"`` (the default for a harness outside): the manager journals every tool call (exec, file
  write) since the newest checkpoint (`journal`). It restores that checkpoint (or, with none, starts
  again from the image; with ``sandbox.standby``, it unfreezes the checkpoint's standby, `standby`,
  where there is one), replays the journal, then runs the failed call again and returns its result:
  the harness never notices, and no turn is discarded. A replayed call whose exit code or output
  differs from the original is counted as diverged. A call that breaks the sandbox again is refused
  (`SandboxCallFailed`) after a restore without replay.
- ``"truncate"``: the session's later turns are discarded, and the call raises `SandboxRestored`,
  which says after which turn to resume (for harnesses that can rebuild their history).

A harness *inside* the sandbox is always truncated: its memory comes back with the checkpoint, and so
is a sandbox whose journal cannot be replayed (a large file write rebuilt by a restarted gateway without
its content, `journal`).

**The journal is capped** (``sandbox.max_journal_bytes``, `Journal.held`): a journaled call that would
take it past the cap checkpoints the sandbox first (trigger ``journal_full``), which empties it, so what
a session holds for replay, in the gateway's memory and in its store, stays under the cap plus one call.
A checkpoint is chosen over refusing the call because it is what the journal stands in for, and the
harness (which cannot checkpoint) just goes on. Only where no checkpoint can be taken (the checkpoint
policy is ``never``, or the checkpoint failed) is the call refused, with `SandboxJournalFull` (429, with
Retry-After): nothing of it ran; a checkpoint by the trainer, or a restore, empties the journal.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from core import events as ev
from core.errors import (
    CheckpointError,
    NoCheckpoint,
    SandboxArgumentError,
    SandboxCallFailed,
    SandboxError,
    SandboxFailed,
    SandboxFileNotFound,
    SandboxJournalFull,
    SandboxRestored,
    SandboxTimeout,
    SandboxUnavailable,
)
from sandbox.backend import ExecResult
from sandbox.config import SandboxConfig
from sandbox.sessions.checkpoints import Checkpointer
from sandbox.sessions.io import SandboxIO
from sandbox.sessions.journal import Call, fingerprint
from sandbox.sessions.lifecycle import Lifecycle
from sandbox.sessions.records import CheckpointInfo, EventLog
from sandbox.sessions.state import Slot


@dataclass(frozen=True, slots=True)
class Failure:
    """A sandbox failure: its kind (exited, oom, tool_hang, sandbox_error) and what happened."""

    kind: str
    detail: str


def resume_hint(info: ev.SandboxRestored) -> str:
    """What a restore means to the harness, in words (the end of a refused call's message)."""
    return (
        f"restored to the checkpoint of turn {info.turn_index}: continue after turn {info.keep_through} "
        f"(turns {info.discarded_turns} were discarded)"
    )


class Recovery:
    """Runs tool calls on slots' sandboxes and recovers the sandboxes that fail (see above)."""

    def __init__(
        self,
        io: SandboxIO,
        lifecycle: Lifecycle,
        checkpointer: Checkpointer,
        events: EventLog,
        settings: SandboxConfig,
    ) -> None:
        self.io = io
        self.lifecycle = lifecycle
        self.checkpointer = checkpointer
        self.standbys = checkpointer.standbys
        self.events = events
        self.settings = settings
        self.restores = 0
        self.replays = 0

    # ------------------------------------------------------------------ tool calls
    async def run(self, slot: Slot, call: Call, deadline: float | None) -> Any:
        """Run `call` under the slot's lock; a failure of the sandbox restores it, then replays (and
        returns the call's result) or raises `SandboxRestored`."""
        async with slot.lock:
            self._report_restore(slot)
            await self._make_room(slot, call)
            failure = await self._attempt(slot, slot.live(), call, deadline)
            if failure is None:
                return call.take()
            info = await self.recover(slot, failure)
            if info.mode != "replay":
                raise SandboxRestored(
                    f"the sandbox failed ({failure.detail}); it was {resume_hint(info)}", info
                )
            return await self._retry(slot, call, deadline, info)

    async def _make_room(self, slot: Slot, call: Call) -> None:
        """Before a journaled call that would take the journal past ``max_journal_bytes``: checkpoint
        (the journal starts again), or, where none can be taken, refuse the call (see the module
        docstring). A journal that is empty takes any one call: the request's size bounds it."""
        cap = self.settings.max_journal_bytes
        cost = slot.journal.cost(call)
        if not len(slot.journal) or slot.journal.held + cost <= cap:
            return
        held = f"the tool calls since the sandbox's last checkpoint hold {slot.journal.held} bytes for replay"
        if self.settings.policy.mode == "never":
            raise SandboxJournalFull(
                f"{held}, and this call would take them past sandbox.max_journal_bytes ({cap}); automatic "
                "checkpoints are off (checkpoint policy never): checkpoint the sandbox (POST "
                f"/api/sessions/{{id}}/sandbox/checkpoints) and retry, or raise sandbox.max_journal_bytes"
            )
        try:
            await self.checkpointer.take(slot, "journal_full", None)
        except CheckpointError as exc:
            raise SandboxJournalFull(
                f"{held}, and this call would take them past sandbox.max_journal_bytes ({cap}); the "
                f"checkpoint that would empty them failed ({exc}): retry later, or checkpoint or restore the "
                "sandbox"
            ) from exc

    def _report_restore(self, slot: Slot) -> None:
        """A harness outside in truncate mode learns of a restore the watcher made from its next call."""
        info, slot.restores.unreported = slot.restores.unreported, None
        if info is not None and slot.recovery == "truncate" and not slot.harness_inside:
            raise SandboxRestored(
                f"the sandbox failed ({info.reason}) before this call and was {resume_hint(info)}; "
                "nothing of this call ran",
                info,
            )

    async def _retry(self, slot: Slot, call: Call, deadline: float | None, replay: ev.SandboxRestored) -> Any:
        """Run the failed call again after a replay; if it breaks the sandbox again, restore without
        replaying anything and refuse it."""
        failure = await self._attempt(slot, replay.sandbox_id, call, deadline)
        if failure is None:
            return call.take()
        self._failure_event(slot, failure, after_replay=True)
        info = await self.restore(slot, None, f"failed again after a replay: {failure.detail}")
        raise SandboxCallFailed(
            f"this call broke the sandbox again after a restore and a replay of the "
            f"{replay.replayed} tool calls before it ({failure.detail}); the sandbox was, without "
            f"replaying, {resume_hint(info)}"
        )

    async def _attempt(self, slot: Slot, box: str, call: Call, deadline: float | None) -> Failure | None:
        """Run `call` once; None when the sandbox held up (the result is in `call.result`), else the
        failure. The command's own errors (timeout, bad path...) propagate."""
        try:
            call.result = await self.io.call(call.run, box, long=call.long, deadline=deadline)
        except SandboxTimeout:
            self._journal(slot, call)  # it ran, and what it did until the kill is part of the state
            raise
        except (SandboxArgumentError, SandboxFileNotFound, SandboxUnavailable):
            raise  # the caller's problem, or the engine's: the sandbox is fine
        except TimeoutError:
            return Failure("tool_hang", f"{call.op} did not return within {deadline:g}s")
        except SandboxError as exc:
            status = await self.io.status(box)
            if status is not None and not status.running:
                return Failure(status.failure_kind, f"{call.op} failed: {status.detail}")
            return Failure("sandbox_error", f"{call.op} failed: {exc}")
        self._journal(slot, call)
        return None

    def _journal(self, slot: Slot, call: Call) -> None:
        """Journal a call that ran, in memory and in the store (``sandbox_call``: a restarted gateway
        rebuilds the journal from these, `adoption`)."""
        call.turn = slot.turns.last
        slot.journal.record(call)
        if call.journaled and call.args is not None:
            code, digest = fingerprint(call.result) if isinstance(call.result, ExecResult) else (ev.ABSENT, ev.ABSENT)
            self.events.add(slot.session_id, None, ev.SandboxCall(call.op, call.args, call.turn, code, digest))

    # ------------------------------------------------------------------ recovery
    async def recover(self, slot: Slot, failure: Failure) -> ev.SandboxRestored:
        """Bring a failed sandbox back (the caller holds `slot.lock`): replay, or restore and truncate,
        or, with nothing to restore, drop it and raise `SandboxFailed`."""
        self._failure_event(slot, failure)  # logged from the live feed (gateway.observe.event_log)
        reason = f"{failure.kind}: {failure.detail}"
        # a fork child's journal starts at its fork: without its fork checkpoint, nothing to replay on;
        # and a journal rebuilt without a large write's content cannot be replayed
        replayable = (bool(slot.history.items) or not slot.lineage) and slot.journal.replayable
        if self.settings.auto_restore and slot.recovery == "replay" and replayable:
            return await self.replay(slot, reason)
        if self.settings.auto_restore and slot.history.items:
            return await self.restore(slot, None, reason)
        await self.lifecycle.drop(slot)
        slot.failure = reason
        raise SandboxFailed(
            f"the sandbox failed ({failure.detail}) and there is no checkpoint to restore; "
            "create a new sandbox or a new session"
        )

    async def restore(self, slot: Slot, checkpoint_id: str | None, reason: str) -> ev.SandboxRestored:
        """Restore the newest (or the given) checkpoint into a new sandbox and truncate the trajectory
        after its `keep_through` (the caller holds `slot.lock`)."""
        if not slot.history.items:
            raise NoCheckpoint(f"session {slot.session_id} has no checkpoint to restore")
        chosen, newer = slot.history.rollback_to(checkpoint_id)
        self.standbys.prune(slot)  # one of a newer checkpoint goes with it
        await self.checkpointer.delete_all(slot.session_id, newer)
        if chosen is None:
            raise NoCheckpoint(f"session {slot.session_id} has no checkpoint {checkpoint_id!r}")
        started = time.monotonic()
        slot.restores.unreported = None
        slot.journal.clear()
        with slot.restores.running():
            box, standby = await self._replace(slot, chosen, reason)
        discarded = await self.events.discard_turns_after(
            slot.session_id, chosen.keep_through, f"sandbox restore: {reason}"
        )
        slot.turns.rewind(chosen.keep_through)
        slot.history.turns_since = 0
        info = ev.SandboxRestored(
            chosen.checkpoint.id, chosen.turn_index, chosen.keep_through, discarded, box,
            round(time.monotonic() - started, 4), reason, standby=_standby(standby),
        )  # fmt: skip
        self._restored(slot, info)
        self.restores += 1
        return info

    async def replay(self, slot: Slot, reason: str) -> ev.SandboxRestored:
        """Restore the newest checkpoint (or, with none, start again from the image) and run the
        journal again; the trajectory stays whole."""
        chosen = slot.history.newest()
        started = time.monotonic()
        with slot.restores.running():
            box, standby = await self._replace(slot, chosen, reason)
            diverged = await self._replay_journal(slot, box)
        info = ev.SandboxRestored(
            chosen.checkpoint.id if chosen else "", chosen.turn_index if chosen else -1, slot.turns.last,
            [], box, round(time.monotonic() - started, 4), reason, "replay", len(slot.journal), diverged,
            _standby(standby),
        )  # fmt: skip
        self._restored(slot, info)
        self.replays += 1
        return info

    async def _replace(self, slot: Slot, chosen: CheckpointInfo | None, reason: str) -> tuple[str, bool]:
        """The slot's standby of `chosen`, unfrozen, when it has one (`standby`), else `Lifecycle.replace`;
        the new sandbox and whether it was the standby. A restore that fails (a checkpoint the store
        cannot give back, say) is written to the trajectory with its reason (``sandbox_restore_failed``)
        before it is raised."""
        standby = await self.standbys.take(slot, chosen)
        if standby is not None:
            await self.lifecycle.swap_in(slot, standby)
            return standby, True
        try:
            return await self.lifecycle.replace(slot, chosen), False
        except SandboxError as exc:
            checkpoint = chosen.checkpoint.id if chosen else None
            failed = ev.SandboxRestoreFailed(checkpoint, reason, f"{type(exc).__name__}: {exc}")
            self.events.add(slot.session_id, None, failed)
            raise

    async def _replay_journal(self, slot: Slot, box: str, calls: list[Call] | None = None) -> int:
        """Run the journaled calls (or `calls`) on the new sandbox; return how many gave another result."""
        diverged = 0
        for call in slot.journal if calls is None else calls:
            try:
                again = await self.io.call(call.run, box, long=call.long, deadline=None)
            except SandboxTimeout:
                continue  # it timed out the first time too
            diverged += call.diverged(again)
        return diverged

    # ------------------------------------------------------------------ forks
    def fork_source(self, slot: Slot, at_turn: int) -> tuple[CheckpointInfo | None, list[Call]]:
        """What a fork at turn `at_turn` restores (the caller holds `slot.lock`): the newest checkpoint
        consistent with exactly that turn (``keep_through == at_turn``), else the nearest earlier one
        (None: the image, when the sandbox never had one) and the journaled calls of the turns from it
        up to `at_turn` to replay. Raises `NoCheckpoint` when that state cannot be rebuilt."""
        exact = [c for c in slot.history.items if c.keep_through == at_turn]
        if exact:
            return exact[-1], []
        if slot.harness_inside:
            raise NoCheckpoint(
                f"session {slot.session_id} has no checkpoint at turn {at_turn} (a harness inside its sandbox "
                "is forked with its memory, which only a checkpoint holds); fork at a turn that has one: "
                f"{sorted({c.keep_through for c in slot.history.items})}"
            )
        newest = slot.history.newest()
        earlier = [c for c in slot.history.items if c.keep_through < at_turn]
        since_start = newest is None and slot.restores.last is None
        if not since_start and (not earlier or earlier[-1] is not newest):
            raise NoCheckpoint(
                f"session {slot.session_id} cannot be forked at turn {at_turn}: no checkpoint at or before it "
                "from which the journaled tool calls reach it (the journal holds the calls since the newest "
                f"checkpoint only; checkpoints at turns {sorted(c.keep_through for c in slot.history.items)})"
            )
        calls = [c for c in slot.journal if c.turn < at_turn]
        if not all(c.replayable for c in calls):
            raise NoCheckpoint(
                f"session {slot.session_id} cannot be forked at turn {at_turn}: a file write since its newest "
                "checkpoint was recorded before the gateway restarted, without its content; fork at a turn "
                f"that has a checkpoint: {sorted({c.keep_through for c in slot.history.items})}"
            )
        return newest, calls

    async def fork_into(
        self, child: Slot, chosen: CheckpointInfo | None, calls: list[Call], at_turn: int
    ) -> CheckpointInfo:
        """Give `child` its sandbox: restored from `chosen` (or the image), then `calls` replayed, then
        checkpointed (trigger ``"fork"``, consistent with turn `at_turn`). The child's journal starts at
        its fork, so that checkpoint is its own base for a later recovery, which neither the parent's
        retention nor its close can take away."""
        child.turns.last = at_turn  # its next tool calls are turn k's, which the fork left to it
        await self.lifecycle.replace(child, chosen)
        await self._replay_journal(child, child.live(), calls)
        return await self.checkpointer.take(child, "fork", None)

    def _restored(self, slot: Slot, info: ev.SandboxRestored) -> None:
        slot.restores.done(info)
        self.events.add(slot.session_id, None, info)

    def _failure_event(self, slot: Slot, failure: Failure, *, after_replay: bool = False) -> None:
        again: bool | ev.Absent = True if after_replay else ev.ABSENT
        failed = ev.SandboxFailure(failure.kind, failure.detail, slot.sandbox_id, after_replay=again)
        self.events.add(slot.session_id, None, failed)


def _standby(used: bool) -> bool | ev.Absent:
    """A restore's ``standby`` field: present (true) only where its standby was used."""
    return True if used else ev.ABSENT
