"""Sandboxes outlive their gateway: at start-up, the manager takes back the containers of its open sessions.

Every sandbox carries its store's identity as a label (`STORE_LABEL`, `TrajectoryStore.store_id`) and
its gateway's id (`GATEWAY_LABEL`, ``--gateway-id``: replicas share a store), and everything its slot
holds is in the store, as the session's sandbox events in order (`fold`; the spec in
``sandbox_created`` and ``sandbox_forked`` carries the labels, so the store knows which gateway holds
each session's sandbox):

======================= ================================================================================
``sandbox_created``     a new slot: spec, harness_inside, recovery mode, sandbox id
``sandbox_forked``      a fork child's slot, with its lineage
``sandbox_call``        a journaled tool call: its arguments, turn, exit code and output digest
``sandbox_checkpoint``  a checkpoint (its whole record); the journal starts again; the oldest beyond
                        ``keep_checkpoints`` were deleted
``sandbox_restored``    the new sandbox; truncate mode: back to that checkpoint, the journal cleared
``sandbox_failure``     the sandbox failed (a restore follows, or it stayed gone)
``sandbox_failed``      it failed for good at a start-up: no sandbox, nothing to restore
``sandbox_adopted``     a restarted gateway took it over
``sandbox_destroyed``   no slot any more (its checkpoints were deleted)
======================= ================================================================================

At start-up (`Adoption.run`), before the gateway serves:

- an open session's sandbox that still runs is *adopted*: the same container, its processes and files
  untouched, its slot rebuilt (spec, journal, the checkpoints whose storage is still there, lineage),
  and its address on the gateway network looked up again, so the sandbox listener maps its requests to
  its session: a harness inside just retries its call;
- one that stopped, vanished, or is off its network is recovered as a failure is (`Recovery.recover`):
  its newest checkpoint restored and the journal replayed (or the trajectory truncated), or, with
  nothing to restore, marked ``sandbox_failed``;
- a container of this store that no open session's slot holds was leaked (a gateway killed between
  closing a session and removing its sandbox, or in the middle of a restore): it is removed, and a closed
  session's checkpoints with it. Containers without this store's label are never touched.

**Replicas.** Gateways on one PostgreSQL store share its identity, so the store label alone cannot tell
one replica's containers from another's. A gateway with an id (the app always has one: ``--gateway-id``,
by default ``HOSTNAME:PORT``) lists only containers with both labels, and rebuilds only the slots of
sessions whose recorded sandbox carries its id: another replica's sandboxes, live or not, are never
adopted, restored or removed (`AdoptionReport.others`). A dead replica's sandboxes are left for their
owner: the replica restarted with the same id (on the same host and port, or the same ``--gateway-id``)
adopts them, its journal and checkpoints intact. Taking them over from another replica would need to
know that their gateway is dead *for good* (a replica that restarts would find its sessions' sandboxes
driven by someone else, two gateways exec-ing, checkpointing and restoring one container), and a
session's sandbox calls go to the gateway holding its slot anyway. A replica that will never come back
is taken over by starting a gateway with its id. Sandboxes made before gateways had ids carry no
gateway label; a gateway adopts those as before.

Example::

    report = await manager.adopt()      # the app's lifespan does it when sandboxes are enabled
    report.adopted, report.restored, report.failed, report.removed
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from core import events as ev
from core.errors import SandboxError, SandboxNotFound
from core.logs import session_tag
from sandbox.backend import Sandbox, SandboxSpec, checkpoint_from_record
from sandbox.sessions.checkpoints import Checkpointer
from sandbox.sessions.io import SandboxIO
from sandbox.sessions.journal import Call, bind_call
from sandbox.sessions.lifecycle import Lifecycle
from sandbox.sessions.records import CheckpointInfo, EventLog
from sandbox.sessions.recovery import Failure, Recovery
from sandbox.sessions.state import RecoveryMode, Slot, Slots
from store import EventRecord, SessionQuery
from store.base import TURN_DISCARDED
from store.roles import TrajectoryReader

log = logging.getLogger("belayer.sandbox")

STORE_LABEL = "belayer.store"
"""The label with the identity of the store whose gateway made the sandbox."""
GATEWAY_LABEL = "belayer.gateway"
"""The label with the id of the gateway (replica) that made the sandbox (``--gateway-id``)."""


@dataclass(slots=True)
class Recorded:
    """A session's sandbox as its events tell it (`fold`)."""

    session_id: str
    live: bool = False
    """Created (or forked) and not destroyed since."""
    spec: SandboxSpec | None = None
    harness_inside: bool = False
    recovery: RecoveryMode = "replay"
    lineage: tuple[str, ...] = ()
    sandbox_id: str | None = None
    failure: str | None = None
    """A failure that no restore or adoption followed."""
    failed: bool = False
    """Recorded as failed for good (``sandbox_failed``)."""
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    calls: list[dict[str, Any]] = field(default_factory=list)
    """The journal since the newest checkpoint: ``sandbox_call`` events' data."""
    last_restore: ev.SandboxRestored | None = None

    @property
    def gateway(self) -> str | None:
        """The gateway that holds the sandbox (its spec's `GATEWAY_LABEL`); None: made by a gateway
        without an id (the only one on its store)."""
        return self.spec.labels.get(GATEWAY_LABEL) if self.spec is not None else None


def fold(session_id: str, events: Iterable[EventRecord], keep: int) -> Recorded:
    """What the session's events say of its sandbox now (see the module docstring)."""
    rec = Recorded(session_id)
    for event in events:
        _apply(rec, event.kind, event.data, keep)
    return rec


def _apply(rec: Recorded, kind: str, data: dict[str, Any], keep: int) -> None:
    if kind in ("sandbox_created", "sandbox_forked"):
        if kind == "sandbox_created":
            rec.checkpoints = []  # a fork child's own checkpoint comes before its forked event
        rec.live, rec.failed, rec.failure, rec.calls, rec.last_restore = True, False, None, [], None
        rec.sandbox_id = data.get("sandbox_id")
        rec.spec = SandboxSpec.model_validate(data["spec"]) if "spec" in data else None
        rec.harness_inside = bool(data.get("harness_inside", False))
        rec.recovery = "truncate" if data.get("recovery") == "truncate" else "replay"
        parent = data.get("parent_session")
        rec.lineage = tuple(data.get("lineage") or ([parent] if parent else []))
    elif kind == "sandbox_call":
        rec.calls.append(data)
    elif kind == "sandbox_checkpoint":
        rec.calls = []
        if "record" not in data:  # written before checkpoints were recorded whole: not restorable
            rec.checkpoints = []
            return
        rec.checkpoints.append(CheckpointInfo.from_json(data, checkpoint_from_record(data["record"])))
        del rec.checkpoints[: max(0, len(rec.checkpoints) - keep)]
    elif kind == "sandbox_restored":
        rec.sandbox_id, rec.failure = data["sandbox_id"], None
        rec.last_restore = ev.SandboxRestored(**data)
        if rec.last_restore.mode != "replay":
            ids = [c.checkpoint.id for c in rec.checkpoints]
            if data["checkpoint_id"] in ids:
                del rec.checkpoints[ids.index(data["checkpoint_id"]) + 1 :]
            rec.calls = []
    elif kind == "sandbox_failure":
        rec.failure = str(data.get("detail") or data.get("kind") or "failed")
    elif kind == "sandbox_adopted":
        rec.sandbox_id, rec.failure = data["sandbox_id"], None
    elif kind == "sandbox_failed":
        rec.sandbox_id, rec.failed, rec.failure = None, True, str(data.get("reason") or "failed")
    elif kind == "sandbox_destroyed":
        rec.live, rec.sandbox_id, rec.checkpoints, rec.calls = False, None, [], []


@dataclass(slots=True)
class AdoptionReport:
    """What a start-up did with the sandboxes it found (session ids; removed: container ids)."""

    adopted: list[str] = field(default_factory=list)
    restored: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    others: list[str] = field(default_factory=list)
    """Sessions whose sandbox another gateway (replica) holds: left to it."""
    seconds: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds each session's sandbox took to adopt or restore."""


class Adoption:
    """Rebuilds the manager's slots from the store and the containers at start-up (see above)."""

    def __init__(
        self,
        store: TrajectoryReader,
        slots: Slots,
        io: SandboxIO,
        lifecycle: Lifecycle,
        checkpointer: Checkpointer,
        recovery: Recovery,
        events: EventLog,
        keep: int,
    ) -> None:
        self.store, self.slots, self.io, self.lifecycle = store, slots, io, lifecycle
        self.checkpointer, self.recovery, self.events, self.keep = checkpointer, recovery, events, keep

    async def run(self) -> AdoptionReport:
        started = time.monotonic()
        report = AdoptionReport()
        owned = await self.io.op(self.io.backend.list_sandboxes, self.lifecycle.owner_labels)
        containers = {box.id: box for box in owned}
        records = [rec for rec in map(self._recorded, self._open_sessions()) if rec.live]
        report.others = [rec.session_id for rec in records if not self._ours(rec)]
        records = [rec for rec in records if self._ours(rec)]
        slots = [await self._slot(rec, containers.get(rec.sandbox_id or "")) for rec in records]
        held = {slot.sandbox_id for slot in slots}
        await asyncio.gather(*(self._take_over(slot, report) for slot in slots))
        for box in containers.values():
            if box.id not in held:
                await self._remove_leaked(box, report)
        report.seconds = time.monotonic() - started
        if owned or records or report.others:
            log.info(
                "sandboxes at start-up: %d adopted, %d restored, %d failed, %d leaked removed, %d left to "
                "other gateways (%.2fs)",
                len(report.adopted), len(report.restored), len(report.failed), len(report.removed),
                len(report.others), report.seconds,
            )  # fmt: skip
        return report

    def _ours(self, rec: Recorded) -> bool:
        """Whether this gateway holds the session's sandbox: the same gateway id, or either has none
        (a store of one gateway, or a sandbox made before gateways had ids)."""
        mine = self.lifecycle.owner_labels.get(GATEWAY_LABEL)
        return mine is None or rec.gateway is None or rec.gateway == mine

    def _open_sessions(self) -> list[str]:
        ids: list[str] = []
        after: tuple[float, str] | None = None
        while True:
            page, _ = self.store.query_sessions(
                SessionQuery(status="open", limit=500, newest_first=False, after=after)
            )
            ids += [s.id for s in page]
            if len(page) < 500:
                return ids
            after = (page[-1].created_at, page[-1].id)

    def _recorded(self, session_id: str) -> Recorded:
        return fold(session_id, self.store.get_events(session_id), self.keep)

    async def _slot(self, rec: Recorded, box: Sandbox | None) -> Slot:
        """The session's slot as it was before the restart (added to the manager's slots)."""
        spec = rec.spec or (box.spec if box is not None else None)
        if spec is None:  # events from before specs were recorded, and no container to read it from
            spec, rec.failed = SandboxSpec(image="unknown"), True
            rec.failure = "the store does not record this sandbox's spec and its container is gone"
        slot = Slot(
            rec.session_id, spec, rec.harness_inside, rec.recovery, None if rec.failed else rec.sandbox_id,
            failure=rec.failure if rec.failed else None, lineage=rec.lineage,
        )  # fmt: skip
        for info in rec.checkpoints:
            if await self.io.op(self.io.backend.has_checkpoint, info.checkpoint):
                slot.history.add(info)
        for data in rec.calls:
            slot.journal.record(self._call(data))
        slot.restores.last = rec.last_restore
        turns = self.store.get_turns(rec.session_id)
        slot.turns.last = max((t.index for t in turns if t.status != TURN_DISCARDED), default=-1)
        self.slots.add(slot)
        return slot

    def _call(self, data: dict[str, Any]) -> Call:
        call = bind_call(self.io.backend, data["op"], data["args"])
        call.turn = int(data.get("turn", -1))
        if "exit_code" in data:
            call.fingerprint = (int(data["exit_code"]), str(data["digest"]))
        return call

    async def _take_over(self, slot: Slot, report: AdoptionReport) -> None:
        """Adopt the slot's container if it runs on its network, else recover it like a failure."""
        if slot.sandbox_id is None:
            report.failed.append(slot.session_id)  # failed before the restart: it stays failed
            return
        started = time.monotonic()
        async with slot.lock:
            failure = await self._check(slot)
            if failure is None:
                adopted = ev.SandboxAdopted(
                    sandbox_id=slot.sandbox_id, address=slot.address,
                    checkpoints=len(slot.history.items), journaled_calls=len(slot.journal),
                    seconds=round(time.monotonic() - started, 4),
                )  # fmt: skip
                self.events.add(slot.session_id, None, adopted)
                report.adopted.append(slot.session_id)
            elif await self._recover(slot, failure):
                report.restored.append(slot.session_id)
            else:
                report.failed.append(slot.session_id)
        report.timings[slot.session_id] = time.monotonic() - started

    async def _check(self, slot: Slot) -> Failure | None:
        """None when the slot's container runs (its address found again), else why it cannot be adopted."""
        assert slot.sandbox_id is not None
        status = await self.io.status(slot.sandbox_id)
        if status is None:
            return Failure("sandbox_error", "the Docker engine did not answer at the gateway's start-up")
        if not status.running:
            return Failure(
                status.failure_kind, f"the sandbox stopped while the gateway was down: {status.detail}"
            )
        try:
            await self.lifecycle.locate(slot)
        except SandboxNotFound:
            return Failure("exited", "the sandbox vanished during the gateway's start-up")
        if slot.spec.network == "gateway" and slot.address is None:
            return Failure("network_lost", "the sandbox is no longer on the gateway network")
        return None

    async def _recover(self, slot: Slot, failure: Failure) -> bool:
        """Restore (or replay) as after a failure; on failure record ``sandbox_failed``. The caller
        holds the slot's lock."""
        try:
            slot.restores.unreported = await self.recovery.recover(slot, failure)
            return True
        except SandboxError as exc:
            await self.lifecycle.drop(slot)
            slot.failure = f"{failure.kind}: {failure.detail}; {exc}"
            self.events.add(slot.session_id, None, ev.SandboxFailed(slot.failure))
            log.warning(
                "session %s: sandbox lost at start-up: %s", session_tag(slot.session_id), slot.failure
            )
            return False

    async def _remove_leaked(self, box: Sandbox, report: AdoptionReport) -> None:
        """Remove a container of this store that no open session holds, and a closed session's
        checkpoints with it."""
        session_id = box.spec.labels.get("belayer.session")
        session = self.store.get_session(session_id) if session_id else None
        try:
            await self.io.op(self.io.backend.destroy, box.id)
        except SandboxNotFound:
            pass
        except SandboxError as exc:
            log.warning("could not remove leaked sandbox %s: %s", box.id, exc)
            return
        report.removed.append(box.id)
        tag = session_tag(session_id) if session_id else None
        log.warning("removed sandbox %s of session %s: no open session holds it", box.id, tag)
        if session is None or session.status == "open":
            return  # unknown, or an open session's stale container: its checkpoints are the slot's
        rec = self._recorded(session.id)
        await self.checkpointer.delete_all(session.id, rec.checkpoints)
        if rec.live:
            leaked = ev.SandboxDestroyed(box.id, stage="start-up", reason="leaked by a gateway that stopped")
            self.events.add(session.id, None, leaked)
