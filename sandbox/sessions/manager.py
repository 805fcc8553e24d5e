"""Per-session sandboxes for the gateway: tool calls, checkpoints in inference bubbles, and recovery.

`SandboxManager` owns at most one sandbox per session. It runs the blocking `SandboxBackend` in its own
bounded thread pools (`io`), one operation at a time per sandbox, and is a `TurnObserver`: when a
session's LLM call starts, `AdaptivePolicy` decides whether to checkpoint the idle sandbox in that
bubble. Every decision, checkpoint, failure and restore is a trajectory event. The parts, one concern
each:

- `state`: a session's `Slot` (its sandbox, journal, checkpoints, turns in flight, restores);
- `lifecycle`: creating, replacing and dropping a slot's sandbox, and the gateway network's env;
- `checkpoints`: taking checkpoints tagged with turns (`keep_through`), retention, deletion;
- `fork`: a session's sandbox copied into fork children, from its checkpoint at a turn (`recovery`);
- `journal` and `recovery`: tool calls under the slot's lock, replay or truncation after a failure;
- `watcher`: restores a sandbox that stopped while idle;
- `adoption`: at start-up, takes back the sandboxes a gateway on the same store left running (killed
  or shut down), restores those that died meanwhile, removes leaked ones (`adopt`);
- `bubbles`: the checkpoint decisions in inference bubbles;
- `standby`: with ``sandbox.standby``, the newest checkpoint restored ahead of time and frozen, which a
  recovery unfreezes instead of restoring from storage;
- `verify`: the verify stage, in a new sandbox from a copy of the agent's working directory;
- `views`: what the API and the dashboard show of a sandbox;
- `io`: the executors.

Example::

    config = SandboxConfig(enabled=True)
    manager = SandboxManager(backend_for(config), store, config)
    await manager.create("ses_1", SandboxSpec(image="belayer-sandbox-python"))
    try:
        result = await manager.exec("ses_1", "pytest -q", timeout_s=120)
    except SandboxRestored as restored:
        resume_after_turn = restored.info.keep_through
    await manager.close()
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from core import events as ev
from core.errors import SandboxArgumentError, SandboxExists
from core.tasks import TaskOwner
from sandbox.backend import DEFAULT_SESSION, ExecResult, SandboxBackend, SandboxSpec
from sandbox.config import SandboxConfig
from sandbox.network import SandboxNetwork
from sandbox.sessions.adoption import GATEWAY_LABEL, STORE_LABEL, Adoption, AdoptionReport
from sandbox.sessions.bubbles import BubbleObserver
from sandbox.sessions.checkpoints import Checkpointer
from sandbox.sessions.forks import Forks, restorable
from sandbox.sessions.io import SandboxIO
from sandbox.sessions.journal import Call, exec_call, write_call
from sandbox.sessions.lifecycle import Lifecycle
from sandbox.sessions.policy import AdaptivePolicy
from sandbox.sessions.records import CheckpointInfo, EventLog
from sandbox.sessions.recovery import Recovery
from sandbox.sessions.standby import Standbys
from sandbox.sessions.state import RecoveryMode, Slot, Slots
from sandbox.sessions.verify import VerifyOutcome, VerifyPlan, VerifyStage
from sandbox.sessions.views import brief, describe
from sandbox.sessions.watcher import Watcher
from store import TrajectoryStore, TurnRecord

__all__ = ["CheckpointInfo", "SandboxManager", "VerifyOutcome", "VerifyPlan"]


class SandboxManager:
    """Sandboxes per session, their checkpoints, and recovery. See the module docstring."""

    def __init__(
        self,
        backend: SandboxBackend,
        store: TrajectoryStore,
        settings: SandboxConfig | None = None,
        engine_load: Callable[[], float] | None = None,
        *,
        gateway_id: str | None = None,
    ) -> None:
        """`gateway_id`: this gateway among replicas on `store` (a label of its sandboxes: `adopt` takes
        back only its own); None: the only gateway on `store`."""
        self.backend = backend
        self.store = store
        self.settings = settings or SandboxConfig()
        self.policy = AdaptivePolicy(self.settings.policy)
        self.gateway_url: str | None = None
        """Where sandboxes with network="gateway" reach the gateway (set by the app's listener)."""
        self.io = SandboxIO(backend, self.settings)
        self._slots = Slots()
        events = EventLog(store)
        self._events = events
        # at start-up, `adopt` finds this store's sandboxes by these, and of them this gateway's own
        owner = {STORE_LABEL: store.store_id(), **({GATEWAY_LABEL: gateway_id} if gateway_id else {})}
        self._lifecycle = Lifecycle(self.io, owner, self._take_address)
        # standbys are made and removed among the checkpoints' background work: `idle` and `close` wait
        self._checkpoint_tasks = TaskOwner("sandbox-checkpoints")
        self._standbys = Standbys(
            self.io, self._slots, events, self.policy, self._checkpoint_tasks, enabled=self.settings.standby
        )
        self._checkpointer = Checkpointer(
            self.io, events, self.policy, self.settings.keep_checkpoints, self._standbys
        )
        self._recovery = Recovery(self.io, self._lifecycle, self._checkpointer, events, self.settings)
        self._bubbles = BubbleObserver(
            self._slots, self.policy, self._checkpointer, events, self._checkpoint_tasks,
            engine_load or (lambda: 1.0),
        )  # fmt: skip
        self.watcher = Watcher(self._slots, self.io, self._recovery)
        self._verify = VerifyStage(self.io, events, owner)
        self._watch_task = TaskOwner("sandbox-watcher")
        self._adoption = Adoption(
            store, self._slots, self.io, self._lifecycle, self._checkpointer, self._recovery, events,
            self.settings.keep_checkpoints,
        )  # fmt: skip
        self._forks = Forks(self._slots, self._lifecycle, self._checkpointer, self._recovery, events)
        self.adoption: AdoptionReport | None = None
        """What `adopt` did at start-up."""

    @property
    def network(self) -> SandboxNetwork | None:
        """The gateway network of the backend (the sandbox listener serves it), if any."""
        return self.io.network

    # ------------------------------------------------------------------ lifecycle
    async def create(
        self, session_id: str, spec: SandboxSpec, *, harness_inside: bool = False, recovery: str = "replay"
    ) -> str:
        """Start the session's sandbox; returns its id. `recovery`: "replay" or "truncate" (see
        `sandbox.sessions.recovery`)."""
        mode = _recovery_mode(recovery)
        if self._slots.live(session_id):
            raise SandboxExists(f"session {session_id} already has a sandbox; DELETE it first")
        slot = await self._lifecycle.start(
            session_id, spec, harness_inside=harness_inside, recovery=mode, gateway_url=self.gateway_url
        )
        self._slots.add(slot)
        created = ev.SandboxCreated(
            sandbox_id=slot.sandbox_id, image=spec.image, network=spec.network, address=slot.address,
            **restorable(slot),
        )  # fmt: skip
        self._events.add(session_id, None, created)
        self._ensure_watcher()
        return slot.live()

    async def adopt(self) -> AdoptionReport:
        """At start-up, before any other call: take back the sandboxes of the open sessions that a gateway
        on this store left (killed, or shut down), restore those that died meanwhile, and remove the
        ones no open session holds (`sandbox.sessions.adoption`)."""
        self.adoption = await self._adoption.run()
        if len(self._slots):
            self._ensure_watcher()
        return self.adoption

    def listener_port(self) -> int | None:
        """The port of the sandbox listener that the gateway-network sandboxes were given (in their
        environment), None when no such sandbox is here: a restarted gateway listens there again."""
        for slot in self._slots:
            url = slot.spec.env.get("BELAYER_SESSION_URL") if slot.spec.network == "gateway" else None
            if url:
                with contextlib.suppress(ValueError):
                    return urlsplit(url).port
        return None

    async def fork(self, session_id: str, children: list[str], at_turn: int) -> None:
        """Give each child session a sandbox restored from this session's state at turn `at_turn`
        (`Forks.fork`: all or nothing)."""
        await self._forks.fork(session_id, children, at_turn)
        self._ensure_watcher()

    def lineage_of(self, session_id: str) -> tuple[str, ...]:
        """The sessions a fork child's sandbox descends from, parent first (empty for any other)."""
        slot = self._slots.get(session_id)
        return slot.lineage if slot is not None else ()

    async def destroy(self, session_id: str) -> None:
        """Remove the session's sandbox and all its checkpoints."""
        slot = self._slots.require(session_id)
        async with slot.lock:
            box = slot.sandbox_id
            await self._retire(slot)
        self._events.add(session_id, None, ev.SandboxDestroyed(box))

    async def _retire(self, slot: Slot) -> None:
        """Under the slot's lock: the session has no sandbox any more (nor standby, nor checkpoints)."""
        self._slots.remove(slot)
        await self._standbys.close(slot)
        await self._lifecycle.drop(slot)
        await self._checkpointer.delete_all(slot.session_id, slot.history.release())

    async def close(self) -> None:
        """Wait for checkpoints in progress, destroy every sandbox (and its checkpoints), stop the pools."""
        await self._watch_task.close()
        await self._checkpoint_tasks.join()
        for session_id in self._slots.sessions():
            await self.destroy(session_id)
        await self._checkpoint_tasks.close()  # any started meanwhile found no sandbox
        self.io.close()

    async def detach(self) -> None:
        """Wait for the checkpoints in progress, stop the watcher and the pools, and leave every sandbox
        and checkpoint as it is (``keep_on_shutdown``, or a crash in tests): the next gateway on this
        store adopts them (`adopt`)."""
        await self._watch_task.close()
        await self._checkpoint_tasks.join()  # a dump finishes, and its checkpoint is recorded
        await self._checkpoint_tasks.close()
        for slot in self._slots:  # a later `close` has nothing left to destroy
            self._slots.remove(slot)
        self.io.close()

    def has_sandbox(self, session_id: str) -> bool:
        return session_id in self._slots

    def sandbox_id(self, session_id: str) -> str:
        return self._slots.require(session_id).live()

    async def owner_of(self, address: str) -> str | None:
        """The session whose sandbox has this address on the gateway network, if any. A restored
        sandbox's processes run (and call the gateway) before the restore has recorded its new
        address: with an unknown address, wait for the restores in progress, then look again.
        With none in progress, an unknown address is answered at once."""
        owner = self._slots.session_for_address(address)
        if owner is None:
            for slot in self._slots:
                if slot.restores.in_progress:
                    async with slot.lock:
                        pass
            owner = self._slots.session_for_address(address)
        return owner

    def _take_address(self, slot: Slot) -> None:
        """`slot`'s sandbox was just found at its address: no other slot holds it any more (its container
        stopped, and Docker gave the address to this one), so the listener maps it to `slot` alone."""
        for other in self._slots:
            if other is not slot and other.address == slot.address:
                other.address = None

    async def settled(self, session_id: str) -> None:
        """Return once the session's sandbox is not being restored (the trajectory is truncated)."""
        slot = self._slots.get(session_id)
        if slot is not None and slot.restores.in_progress:
            async with slot.lock:
                pass

    def describe(self, session_id: str) -> dict[str, Any]:
        """The session's sandbox in full (`sandbox.sessions.views.describe`)."""
        return describe(self._slots.require(session_id), self.gateway_url)

    def views(self) -> list[dict[str, Any]]:
        """Every sandbox in brief (the dashboard): its state (running, restoring, failed) and counts."""
        node_of = self.backend.node_of
        return [brief(slot, node_of(slot.sandbox_id) if slot.sandbox_id else None) for slot in self._slots]

    def stats(self) -> dict[str, int]:
        """Counters for metrics: sandboxes, checkpoints taken, restores, standbys made and used, and leaked
        checkpoint deletions."""
        return {
            "sandboxes": len(self._slots),
            "checkpoints_taken": self._checkpointer.taken,
            "checkpoint_delete_failures": self._checkpointer.delete_failures,
            "restores": self._recovery.restores,
            "replays": self._recovery.replays,
            "standbys_made": self._standbys.made,
            "standbys_used": self._standbys.used,
            "background_failures": self._checkpoint_tasks.failures + self._watch_task.failures,
        }

    # ------------------------------------------------------------------ tool calls
    async def exec(
        self,
        session_id: str,
        command: str,
        *,
        timeout_s: float = 30.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        shell_session: str = DEFAULT_SESSION,
        max_output_bytes: int = 1 << 20,
    ) -> ExecResult:
        """Run a command in the session's sandbox. A failure of the sandbox itself restores it and
        replays (the call just answers), or raises `SandboxRestored` (or `SandboxFailed` when there is
        no checkpoint)."""

        call = exec_call(
            self.backend, command, timeout_s=timeout_s, cwd=cwd, env=env, session=shell_session,
            max_output_bytes=max_output_bytes,
        )  # fmt: skip
        result: ExecResult = await self._run(session_id, call, timeout_s + self.settings.exec_grace_s)
        return result

    async def read_file(self, session_id: str, path: str) -> bytes:
        """A file's bytes; over ``sandbox.max_read_bytes``, `SandboxFileTooLarge` before any is read."""
        limit = self.settings.max_read_bytes

        def run(box: str) -> bytes:
            return self.backend.read_file(box, path, max_bytes=limit)

        call = Call("read_file", run, journaled=False)
        data: bytes = await self._run(session_id, call, None)
        return data

    async def write_file(self, session_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        await self._run(session_id, write_call(self.backend, path, data, mode), None)
        self._slots.require(session_id).history.bytes_since += len(data)

    async def _run(self, session_id: str, call: Call, deadline: float | None) -> Any:
        return await self._recovery.run(self._slots.require(session_id), call, deadline)

    # ------------------------------------------------------------------ checkpoints and restore
    async def checkpoint(self, session_id: str, *, trigger: str = "explicit") -> CheckpointInfo:
        """Checkpoint now (waits for the sandbox's current operation)."""
        slot = self._slots.require(session_id)
        async with slot.lock:
            return await self._checkpointer.take(slot, trigger, None)

    async def restore(
        self, session_id: str, checkpoint_id: str | None = None, *, reason: str = "explicit"
    ) -> ev.SandboxRestored:
        """Restore the newest (or the given) checkpoint into a new sandbox; truncate the trajectory."""
        slot = self._slots.require(session_id)
        async with slot.lock:
            return await self._recovery.restore(slot, checkpoint_id, reason)

    def checkpoints(self, session_id: str) -> list[CheckpointInfo]:
        return list(self._slots.require(session_id).history.items)

    def release_checkpoints(self, session_id: str) -> list[CheckpointInfo]:
        """Hand the session's checkpoints to the caller: the manager forgets them and will not delete them
        (a standby of one is removed, in the background)."""
        slot = self._slots.require(session_id)
        released = slot.history.release()
        self._standbys.prune(slot)
        return released

    # ------------------------------------------------------------------ the verify stage
    async def verify(self, session_id: str, plan: VerifyPlan) -> VerifyOutcome:
        """The verify stage (`sandbox.sessions.verify`, `VerifyStage.run`): copy the agent's working
        directory out with its processes frozen, destroy its sandbox (unless `plan.keep_agent_sandbox`),
        and judge the copy in a new sandbox from the clean image; with ``plan.mode == "shared"``, run
        the verifier in the agent's sandbox itself first."""
        return await self._verify.run(self._slots.require(session_id), plan, self._retire)

    # ------------------------------------------------------------------ TurnObserver: the bubble
    def turn_started(self, turn: TurnRecord) -> None:
        self._bubbles.turn_started(turn)

    async def turn_ending(self, turn: TurnRecord) -> None:
        await self._bubbles.hold(turn)

    def turn_finished(self, turn: TurnRecord) -> None:
        self._bubbles.turn_finished(turn)

    async def idle(self) -> None:
        """Wait until no background checkpoint (or standby's making or removal) is running (tests,
        benchmarks, shutdown)."""
        await self._checkpoint_tasks.join()

    # ------------------------------------------------------------------ helpers
    def _ensure_watcher(self) -> None:
        if self._watch_task.running == 0:
            self._watch_task.every(self.settings.watch_interval_s, self.watcher.sweep, "watcher")


def _recovery_mode(recovery: str) -> RecoveryMode:
    if recovery == "replay":
        return "replay"
    if recovery == "truncate":
        return "truncate"
    raise SandboxArgumentError(f"recovery must be 'replay' or 'truncate', not {recovery!r}")
