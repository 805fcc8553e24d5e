"""Per-session sandboxes for the gateway: tool calls, checkpoints in inference bubbles, and recovery.

`SandboxManager` owns at most one sandbox per session. It runs the blocking `SandboxBackend` in worker
threads (`asyncio.to_thread`), one operation at a time per sandbox, and is a `TurnObserver`: when a
session's LLM call starts, `AdaptivePolicy` decides whether to checkpoint the idle sandbox in that
bubble. Every decision and every checkpoint is a trajectory event.

Each checkpoint is tagged with the session and a turn index, and with `keep_through`: the last turn
the checkpoint is consistent with. A checkpoint taken in turn k's bubble holds the environment the
harness had when it asked for turn k, so:

- a harness outside the sandbox keeps turn k: it resumes by re-running turn k's tool calls;
- a harness inside the sandbox is restored *waiting for* turn k; it will retry that call, so turn k is
  discarded and the retry extends turn k-1 (prefix reuse ignores discarded turns).

On a sandbox failure (the container is gone or stopped, the exec transport breaks, a tool call hangs
past its deadline plus `exec_grace_s`), or on an explicit `restore`, the newest checkpoint is restored
into a new sandbox and the session's later turns are marked discarded (`store.discard_turns_after`).
What happens next depends on the sandbox's `recovery` mode:

- ``"replay"`` (the default for a harness outside): the manager journals every tool call (exec, file
  write) since the newest checkpoint. It restores that checkpoint, replays the journal, then runs the
  failed call again and returns its result: the harness never notices, and no turn is discarded. A
  replayed call whose exit code or output differs from the original is counted as diverged.
- ``"truncate"``: the session's later turns are discarded, and the call raises `SandboxRestored`,
  which says after which turn to resume (for harnesses that can rebuild their history).

A harness *inside* the sandbox is always truncated: its memory comes back with the checkpoint.

A watcher polls every sandbox's state (`watch_interval_s`), so a container that dies while nobody
calls into it (an OOM kill, a crash of a harness running inside) is restored at once. A harness
outside learns of it from its next tool call (`SandboxRestored`, before anything runs). While a
session's sandbox is being restored, `settled()` holds the session's next LLM request back, so that
the request is matched against the truncated trajectory.

A sandbox with ``network="gateway"`` can reach the gateway's sandbox listener (`gateway_url`) and
nothing else; it gets ``OPENAI_BASE_URL``, ``ANTHROPIC_BASE_URL`` and ``BELAYER_SESSION_URL`` pointing
at its own session, and the listener only serves that session (`session_for_address`).

Example::

    manager = SandboxManager(DockerSandboxBackend(DockerBackendConfig()), store, SandboxConfig(enabled=True))
    await manager.create("ses_1", SandboxSpec(image="belayer-sandbox-python"))
    try:
        result = await manager.exec("ses_1", "pytest -q", timeout_s=120)
    except SandboxRestored as restored:
        resume_after_turn = restored.info.keep_through
    await manager.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import (
    ImageNotFound,
    NoCheckpoint,
    NoSandbox,
    SandboxArgumentError,
    SandboxCallFailed,
    SandboxError,
    SandboxExists,
    SandboxFailed,
    SandboxFileNotFound,
    SandboxNotFound,
    SandboxRestored,
    SandboxTimeout,
    SandboxUnavailable,
)
from gateway.config import SandboxConfig
from gateway.sandboxes.policy import AdaptivePolicy, Decision
from gateway.store import EventRecord, TrajectoryStore, TurnRecord
from sandbox.backend import (
    DEFAULT_SESSION,
    Checkpoint,
    ExecResult,
    SandboxBackend,
    SandboxSpec,
    SandboxStatus,
)

log = logging.getLogger("belayer.sandbox")


# --------------------------------------------------------------------------- records
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

    def as_json(self) -> dict[str, Any]:
        c = self.checkpoint
        return {
            "id": c.id, "session_id": self.session_id, "turn_index": self.turn_index,
            "in_bubble": self.in_bubble, "keep_through": self.keep_through, "trigger": self.trigger,
            "seconds": round(self.seconds, 4), "fs_seconds": round(c.fs_seconds, 4),
            "process_seconds": round(c.process_seconds, 4), "dump_bytes": self.dump_bytes,
            "created_at": c.created_at, "location": c.location,
        }  # fmt: skip


@dataclass(frozen=True, slots=True)
class RestoreInfo:
    """What a restore did: which checkpoint, the new sandbox, and which turns it discarded."""

    checkpoint_id: str
    turn_index: int
    keep_through: int
    discarded_turns: list[int]
    sandbox_id: str
    seconds: float
    reason: str
    mode: str = "truncate"
    replayed: int = 0
    """Journaled tool calls run again after the restore (replay mode)."""
    diverged: int = 0
    """Of those, how many gave another exit code or output than the first time."""

    @property
    def resume_hint(self) -> str:
        return (
            f"restored to the checkpoint of turn {self.turn_index}: continue after turn {self.keep_through} "
            f"(turns {self.discarded_turns} were discarded)"
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "checkpoint_id": self.checkpoint_id, "turn_index": self.turn_index,
            "keep_through": self.keep_through, "discarded_turns": self.discarded_turns,
            "sandbox_id": self.sandbox_id, "seconds": round(self.seconds, 4), "reason": self.reason,
            "mode": self.mode, "replayed": self.replayed, "diverged": self.diverged,
        }  # fmt: skip


@dataclass(slots=True)
class _Call:
    """One operation on a sandbox; exec and write_file are journaled for replay."""

    op: str
    run: Callable[[str], Any]
    journaled: bool
    result: Any = None
    fingerprint: tuple[int, str] | None = None
    """Exit code and output digest of an exec, kept in the journal instead of the output itself."""

    def take(self) -> Any:
        """The result, handed to the caller once (the journal keeps only the fingerprint)."""
        if isinstance(self.result, ExecResult):
            self.fingerprint = _fingerprint(self.result)
        result, self.result = self.result, None
        return result


def _fingerprint(result: ExecResult) -> tuple[int, str]:
    return result.exit_code, hashlib.sha256(result.stdout.encode()).hexdigest()


@dataclass(slots=True)
class _Slot:
    """One session's sandbox and its recovery state."""

    session_id: str
    spec: SandboxSpec
    harness_inside: bool
    sandbox_id: str | None
    recovery: str = "replay"
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    journal: list[_Call] = field(default_factory=list)
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    running: dict[int, int] = field(default_factory=dict)  # turn id -> index, LLM calls in flight
    last_turn: int = -1
    turns_since_checkpoint: int = 0
    bytes_written: int = 0
    session_cost_s: float | None = None
    checkpointing: bool = False
    discarded_ids: set[int] = field(default_factory=set)
    last_restore: RestoreInfo | None = None
    unreported: RestoreInfo | None = None
    """A restore made while no call was in flight; the next tool call of a harness outside reports it."""
    restoring: bool = False
    address: str | None = None
    failure: str | None = None


def _tree_bytes(location: str) -> int:
    root = Path(location)
    if not root.is_dir():
        return 0
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


# --------------------------------------------------------------------------- the manager
class SandboxManager:
    """Sandboxes per session, their checkpoints, and recovery. See the module docstring."""

    def __init__(
        self,
        backend: SandboxBackend,
        store: TrajectoryStore,
        settings: SandboxConfig | None = None,
        engine_load: Callable[[], float] | None = None,
    ) -> None:
        self.backend = backend
        self.store = store
        self.settings = settings or SandboxConfig()
        self.policy = AdaptivePolicy(self.settings.policy)
        self._engine_load = engine_load or (lambda: 1.0)
        self._slots: dict[str, _Slot] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._watcher: asyncio.Task[None] | None = None
        self.gateway_url: str | None = None
        """Where sandboxes with network="gateway" reach the gateway (set by the app's listener)."""

    # ------------------------------------------------------------------ lifecycle
    async def create(
        self, session_id: str, spec: SandboxSpec, *, harness_inside: bool = False, recovery: str = "replay"
    ) -> str:
        """Start the session's sandbox; returns its id. `recovery`: "replay" or "truncate" (see above)."""
        if recovery not in ("replay", "truncate"):
            raise SandboxArgumentError(f"recovery must be 'replay' or 'truncate', not {recovery!r}")
        if session_id in self._slots and self._slots[session_id].sandbox_id is not None:
            raise SandboxExists(f"session {session_id} already has a sandbox; DELETE it first")
        labels = {**spec.labels, "belayer.session": session_id}
        spec = spec.model_copy(update={"labels": labels, "env": self._gateway_env(session_id, spec)})
        try:
            box = await asyncio.to_thread(self.backend.create, spec)
        except SandboxNotFound as e:
            raise ImageNotFound(
                f"cannot create the sandbox: {e}; build it with `belayer sandbox build-image`"
            ) from e
        slot = _Slot(session_id, spec, harness_inside, box.id, "truncate" if harness_inside else recovery)
        self._slots[session_id] = slot
        await self._locate(slot)
        self._event(
            session_id, None, "sandbox_created",
            {"sandbox_id": box.id, "image": spec.image, "network": spec.network, "address": slot.address},
        )  # fmt: skip
        self._ensure_watcher()
        return box.id

    def _gateway_env(self, session_id: str, spec: SandboxSpec) -> dict[str, str]:
        if spec.network != "gateway":
            return spec.env
        if self.gateway_url is None:
            raise SandboxError(
                "network='gateway' needs the gateway's sandbox listener, which is not running here "
                "(it needs a Docker engine and iptables as root); use network='none'"
            )
        url = f"{self.gateway_url}/s/{session_id}"
        defaults = {
            "BELAYER_SESSION_URL": url, "OPENAI_BASE_URL": f"{url}/v1", "ANTHROPIC_BASE_URL": url,
            "OPENAI_API_KEY": "belayer", "ANTHROPIC_API_KEY": "belayer",
        }  # fmt: skip
        return {**defaults, **spec.env}

    async def _locate(self, slot: _Slot) -> None:
        slot.address = None
        if slot.spec.network == "gateway" and slot.sandbox_id is not None:
            slot.address = await asyncio.to_thread(self.backend.address, slot.sandbox_id)

    def session_for_address(self, address: str) -> str | None:
        """The session whose sandbox has this address on the gateway network, if any."""
        return next((s.session_id for s in self._slots.values() if s.address == address), None)

    async def settled(self, session_id: str) -> None:
        """Return once the session's sandbox is not being restored (the trajectory is truncated)."""
        slot = self._slots.get(session_id)
        if slot is not None and slot.restoring:
            async with slot.lock:
                pass

    async def destroy(self, session_id: str) -> None:
        """Remove the session's sandbox and all its checkpoints."""
        slot = self._slot(session_id)
        async with slot.lock:
            self._slots.pop(session_id, None)
            box = slot.sandbox_id
            await self._drop_sandbox(slot)
            for info in slot.checkpoints:
                await self._delete(info)
        self._event(session_id, None, "sandbox_destroyed", {"sandbox_id": box})

    async def close(self) -> None:
        """Wait for checkpoints in progress, then destroy every sandbox (and its checkpoints)."""
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for session_id in list(self._slots):
            await self.destroy(session_id)

    def has_sandbox(self, session_id: str) -> bool:
        return session_id in self._slots

    def describe(self, session_id: str) -> dict[str, Any]:
        slot = self._slot(session_id)
        return {
            "session_id": session_id,
            "sandbox_id": slot.sandbox_id,
            "status": "failed" if slot.failure else "running",
            "failure": slot.failure,
            "image": slot.spec.image,
            "harness_inside": slot.harness_inside,
            "network": slot.spec.network,
            "gateway_url": (
                f"{self.gateway_url}/s/{session_id}"
                if slot.spec.network == "gateway" and self.gateway_url
                else None
            ),
            "recovery": slot.recovery,
            "journaled_calls": len(slot.journal),
            "checkpoints": [c.as_json() for c in slot.checkpoints],
            "last_restore": slot.last_restore.as_json() if slot.last_restore else None,
        }

    def checkpoints(self, session_id: str) -> list[CheckpointInfo]:
        return list(self._slot(session_id).checkpoints)

    def release_checkpoints(self, session_id: str) -> list[CheckpointInfo]:
        """Hand the session's checkpoints to the caller: the manager forgets them and will not delete them."""
        slot = self._slot(session_id)
        released, slot.checkpoints = slot.checkpoints, []
        return released

    def sandbox_id(self, session_id: str) -> str:
        return self._live(self._slot(session_id))

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
        raises `SandboxRestored` (or `SandboxFailed` when there is no checkpoint)."""

        def call(box: str) -> ExecResult:
            return self.backend.exec(
                box, command, timeout_s=timeout_s, cwd=cwd, env=env, session=shell_session,
                max_output_bytes=max_output_bytes,
            )  # fmt: skip

        result: ExecResult = await self._guarded(
            session_id, _Call("exec", call, True), timeout_s + self.settings.exec_grace_s
        )
        return result

    async def read_file(self, session_id: str, path: str) -> bytes:
        data: bytes = await self._guarded(
            session_id, _Call("read_file", lambda box: self.backend.read_file(box, path), False), None
        )
        return data

    async def write_file(self, session_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        def call(box: str) -> None:
            self.backend.write_file(box, path, data, mode=mode)

        await self._guarded(session_id, _Call("write_file", call, True), None)
        self._slot(session_id).bytes_written += len(data)

    async def _guarded(self, session_id: str, call: _Call, deadline: float | None) -> Any:
        """Run `call` in a thread under the slot's lock; turn sandbox failures into recovery."""
        slot = self._slot(session_id)
        async with slot.lock:
            if slot.unreported is not None and slot.recovery == "truncate" and not slot.harness_inside:
                info, slot.unreported = slot.unreported, None
                raise SandboxRestored(
                    f"the sandbox failed ({info.reason}) before this call and was {info.resume_hint}; "
                    "nothing of this call ran",
                    info,
                )
            slot.unreported = None
            box = self._live(slot)
            failure = await self._attempt(slot, box, call, deadline)
            if failure is None:
                return call.take()
            info = await self._recover_locked(slot, *failure)
            if info.mode == "replay":
                retry = await self._attempt(slot, info.sandbox_id, call, deadline)
                if retry is None:
                    return call.take()
                # The replayed calls or this one break it again: restore without replaying anything.
                self._event(
                    slot.session_id, None, "sandbox_failure",
                    {"kind": retry[0], "detail": retry[1], "sandbox_id": slot.sandbox_id, "after_replay": True},
                )  # fmt: skip
                replayed = info.replayed
                info = await self._restore_locked(slot, None, f"failed again after a replay: {retry[1]}")
                raise SandboxCallFailed(
                    f"this call broke the sandbox again after a restore and a replay of the "
                    f"{replayed} tool calls before it ({retry[1]}); the sandbox was, without replaying, "
                    f"{info.resume_hint}"
                )
        raise SandboxRestored(f"the sandbox failed ({failure[1]}); it was {info.resume_hint}", info)

    async def _attempt(
        self, slot: _Slot, box: str, call: _Call, deadline: float | None
    ) -> tuple[str, str] | None:
        """Run `call` once; None when the sandbox held up (the result is in `call.result`), else the
        failure's kind and detail. The command's own errors (timeout, bad path...) propagate."""
        try:
            work = asyncio.to_thread(call.run, box)
            call.result = await (asyncio.wait_for(work, deadline) if deadline is not None else work)
        except SandboxTimeout:
            if call.journaled:  # it ran, and what it did until the kill is part of the state
                slot.journal.append(call)
            raise
        except (SandboxArgumentError, SandboxFileNotFound, SandboxUnavailable):
            raise  # the caller's problem, or the engine's: the sandbox is fine
        except TimeoutError:
            return "tool_hang", f"{call.op} did not return within {deadline:g}s"
        except SandboxError as exc:
            status = await self._status(box)
            if status is not None and not status.running:
                return status.failure_kind, f"{call.op} failed: {status.detail}"
            return "sandbox_error", f"{call.op} failed: {exc}"
        if call.journaled:
            slot.journal.append(call)
        return None

    # ------------------------------------------------------------------ checkpoints and restore
    async def checkpoint(self, session_id: str, *, trigger: str = "explicit") -> CheckpointInfo:
        """Checkpoint now (waits for the sandbox's current operation)."""
        slot = self._slot(session_id)
        async with slot.lock:
            return await self._checkpoint_locked(slot, trigger, None)

    async def restore(
        self, session_id: str, checkpoint_id: str | None = None, *, reason: str = "explicit"
    ) -> RestoreInfo:
        """Restore the newest (or the given) checkpoint into a new sandbox; truncate the trajectory."""
        slot = self._slot(session_id)
        async with slot.lock:
            return await self._restore_locked(slot, checkpoint_id, reason)

    async def _checkpoint_locked(
        self, slot: _Slot, trigger: str, bubble: TurnRecord | None
    ) -> CheckpointInfo:
        box = self._live(slot)
        running = bubble.index if bubble is not None else (max(slot.running.values(), default=None))
        turn_index = running if running is not None else slot.last_turn
        started = time.monotonic()
        ckpt = await asyncio.to_thread(
            self.backend.checkpoint, box, label=f"{slot.session_id}/turn-{turn_index}"
        )
        seconds = time.monotonic() - started
        dump_bytes = await asyncio.to_thread(_tree_bytes, ckpt.location)
        in_bubble = running is not None and (bubble is None or bubble.id in slot.running)
        keep = turn_index - 1 if (running is not None and slot.harness_inside) else turn_index
        info = CheckpointInfo(
            ckpt, slot.session_id, turn_index, in_bubble, keep, seconds, dump_bytes, trigger
        )
        slot.checkpoints.append(info)
        slot.journal = []
        slot.turns_since_checkpoint = 0
        slot.bytes_written = 0
        slot.session_cost_s = seconds
        self.policy.observe_checkpoint(seconds=seconds, dump_bytes=dump_bytes)
        self._event(slot.session_id, bubble.id if bubble else None, "sandbox_checkpoint", info.as_json())
        while len(slot.checkpoints) > self.settings.keep_checkpoints:
            await self._delete(slot.checkpoints.pop(0))
        return info

    async def _restore_locked(self, slot: _Slot, checkpoint_id: str | None, reason: str) -> RestoreInfo:
        if not slot.checkpoints:
            raise NoCheckpoint(f"session {slot.session_id} has no checkpoint to restore")
        chosen = slot.checkpoints[-1] if checkpoint_id is None else None
        for i, candidate in enumerate(slot.checkpoints):
            if candidate.checkpoint.id == checkpoint_id:
                chosen = candidate
                for newer in slot.checkpoints[i + 1 :]:  # they belong to the branch being discarded
                    await self._delete(newer)
                del slot.checkpoints[i + 1 :]
        if chosen is None:
            raise NoCheckpoint(f"session {slot.session_id} has no checkpoint {checkpoint_id!r}")
        started = time.monotonic()
        slot.restoring, slot.unreported, slot.journal = True, None, []
        try:
            box = await self._restore_sandbox(slot, chosen)
        finally:
            slot.restoring = False
        seconds = time.monotonic() - started
        discarded = self.store.discard_turns_after(
            slot.session_id, chosen.keep_through, f"sandbox restore: {reason}"
        )
        slot.discarded_ids |= set(slot.running)  # in flight now: discarded again when they finish
        slot.last_turn = chosen.keep_through
        slot.turns_since_checkpoint = 0
        info = RestoreInfo(
            chosen.checkpoint.id, chosen.turn_index, chosen.keep_through, discarded, box, seconds, reason
        )
        slot.last_restore = info
        self._event(slot.session_id, None, "sandbox_restored", info.as_json())
        return info

    async def _replay_locked(self, slot: _Slot, reason: str) -> RestoreInfo:
        """Restore the newest checkpoint (or, with none, start again from the image) and run the
        journal again; the trajectory stays whole."""
        chosen = slot.checkpoints[-1] if slot.checkpoints else None
        started = time.monotonic()
        slot.restoring = True
        try:
            box = await self._restore_sandbox(slot, chosen)
            diverged = 0
            for call in slot.journal:
                try:
                    again = await asyncio.to_thread(call.run, box)
                except SandboxTimeout:
                    continue  # it timed out the first time too
                if isinstance(again, ExecResult) and call.fingerprint != _fingerprint(again):
                    diverged += 1
        finally:
            slot.restoring = False
        info = RestoreInfo(
            chosen.checkpoint.id if chosen else "", chosen.turn_index if chosen else -1, slot.last_turn,
            [], box, time.monotonic() - started, reason, "replay", len(slot.journal), diverged,
        )  # fmt: skip
        slot.last_restore = info
        self._event(slot.session_id, None, "sandbox_restored", info.as_json())
        return info

    async def _restore_sandbox(self, slot: _Slot, chosen: CheckpointInfo | None) -> str:
        """Replace the slot's sandbox: restored from `chosen`, or (None) started afresh from its spec."""
        await self._drop_sandbox(slot)
        try:
            if chosen is None:
                box = await asyncio.to_thread(self.backend.create, slot.spec)
            else:
                box = await asyncio.to_thread(self.backend.restore, chosen.checkpoint)
        except SandboxError as exc:
            what = f"restore of checkpoint {chosen.checkpoint.id}" if chosen else "a fresh sandbox"
            slot.failure = f"{what} failed: {exc}"
            raise
        slot.sandbox_id, slot.failure = box.id, None
        await self._locate(slot)
        return box.id

    async def _drop_sandbox(self, slot: _Slot) -> None:
        """Remove the slot's sandbox, if any (a failed one may be gone already)."""
        if slot.sandbox_id is not None:
            with contextlib.suppress(SandboxError):
                await asyncio.to_thread(self.backend.destroy, slot.sandbox_id)
        slot.sandbox_id, slot.address = None, None

    async def _recover_locked(self, slot: _Slot, kind: str, detail: str) -> RestoreInfo:
        self._event(
            slot.session_id,
            None,
            "sandbox_failure",
            {"kind": kind, "detail": detail, "sandbox_id": slot.sandbox_id},
        )
        log.warning("session %s: sandbox %s failed: %s", slot.session_id, slot.sandbox_id, detail)
        if self.settings.auto_restore and slot.recovery == "replay":
            return await self._replay_locked(slot, f"{kind}: {detail}")
        if self.settings.auto_restore and slot.checkpoints:
            return await self._restore_locked(slot, None, f"{kind}: {detail}")
        await self._drop_sandbox(slot)
        slot.failure = f"{kind}: {detail}"
        raise SandboxFailed(
            f"the sandbox failed ({detail}) and there is no checkpoint to restore; "
            "create a new sandbox or a new session"
        )

    async def _delete(self, info: CheckpointInfo) -> None:
        with contextlib.suppress(SandboxError):
            await asyncio.to_thread(self.backend.delete_checkpoint, info.checkpoint)

    # ------------------------------------------------------------------ the watcher
    def _ensure_watcher(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """Poll every idle sandbox; restore one that stopped (see the module docstring)."""
        while True:
            await asyncio.sleep(self.settings.watch_interval_s)
            for slot in list(self._slots.values()):
                if slot.sandbox_id is None or slot.lock.locked():
                    continue  # failed already, or a call in progress will see the failure itself
                status = await self._status(slot.sandbox_id)
                if status is None or status.running:
                    continue
                try:
                    await self._recover_stopped(slot, status)
                except SandboxError as exc:
                    log.warning("session %s: recovery failed: %s", slot.session_id, exc)

    async def _recover_stopped(self, slot: _Slot, status: SandboxStatus) -> None:
        async with slot.lock:
            box = slot.sandbox_id
            if box is None or self._slots.get(slot.session_id) is not slot:
                return
            status = await self._status(box) or status  # re-check under the lock
            if status.running:
                return
            info = await self._recover_locked(slot, status.failure_kind, f"sandbox stopped: {status.detail}")
            slot.unreported = info

    async def _status(self, box: str) -> SandboxStatus | None:
        """The sandbox's state; a vanished container counts as stopped, an unreachable engine as unknown."""
        try:
            return await asyncio.to_thread(self.backend.status, box)
        except SandboxNotFound:
            return SandboxStatus(running=False, detail="the container no longer exists")
        except SandboxError:
            return None

    # ------------------------------------------------------------------ TurnObserver: the bubble
    def turn_started(self, turn: TurnRecord) -> None:
        slot = self._slots.get(turn.session_id)
        if slot is None or slot.sandbox_id is None:
            return
        slot.running[turn.id] = turn.index
        slot.last_turn = max(slot.last_turn, turn.index)
        slot.turns_since_checkpoint += 1
        decision = self.policy.decide(
            prompt_tokens=len(turn.prompt_ids),
            engine_load=self._engine_load(),
            turns_since_checkpoint=slot.turns_since_checkpoint,
            last_dump_bytes=slot.checkpoints[-1].dump_bytes if slot.checkpoints else 0,
            bytes_written_since=slot.bytes_written,
            session_cost_s=slot.session_cost_s,
        )
        busy = slot.checkpointing or slot.lock.locked()
        action = "busy" if decision.checkpoint and busy else decision.action
        self._event(
            turn.session_id, turn.id, "sandbox_checkpoint_decision", _decision_json(decision, action, slot)
        )
        if decision.checkpoint and not busy:
            slot.checkpointing = True
            self._spawn(self._bubble_checkpoint(slot, turn, decision))

    def turn_finished(self, turn: TurnRecord) -> None:
        slot = self._slots.get(turn.session_id)
        if slot is None:
            return
        slot.running.pop(turn.id, None)
        if turn.id in slot.discarded_ids:  # it finished after a restore had discarded it
            slot.discarded_ids.discard(turn.id)
            self.store.discard_turns(turn.session_id, [turn.id], "finished after a sandbox restore")
        total_ms, ttft_ms = turn.timings.get("total_ms"), turn.timings.get("ttft_ms")
        if total_ms is not None:
            self.policy.observe_turn(
                prompt_tokens=len(turn.prompt_ids), output_tokens=len(turn.output_ids),
                seconds=total_ms / 1000, ttft_s=ttft_ms / 1000 if ttft_ms is not None else None,
            )  # fmt: skip

    async def _bubble_checkpoint(self, slot: _Slot, turn: TurnRecord, decision: Decision) -> None:
        try:
            async with slot.lock:
                if slot.sandbox_id is None or self._slots.get(slot.session_id) is not slot:
                    return
                if turn.id not in slot.running:  # the bubble is over: the harness may act again
                    self._event(
                        slot.session_id, turn.id, "sandbox_checkpoint_skipped", {"reason": "bubble over"}
                    )
                    return
                await self._checkpoint_locked(slot, decision.action, turn)
        except SandboxError as exc:
            log.warning("session %s: checkpoint in turn %d failed: %s", slot.session_id, turn.index, exc)
            self._event(slot.session_id, turn.id, "sandbox_checkpoint_failed", {"error": str(exc)})
        finally:
            slot.checkpointing = False

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("sandbox background task failed", exc_info=task.exception())

    async def idle(self) -> None:
        """Wait until no background checkpoint is running (tests, benchmarks, shutdown)."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    # ------------------------------------------------------------------ helpers
    def _slot(self, session_id: str) -> _Slot:
        slot = self._slots.get(session_id)
        if slot is None:
            raise NoSandbox(
                f"session {session_id} has no sandbox; create one with POST /api/sessions/{session_id}/sandbox"
            )
        return slot

    def _live(self, slot: _Slot) -> str:
        if slot.sandbox_id is None:
            raise SandboxFailed(f"the session's sandbox failed earlier ({slot.failure}) and was not restored")
        return slot.sandbox_id

    def _event(self, session_id: str, turn_id: int | None, kind: str, data: dict[str, Any]) -> None:
        self.store.add_event(EventRecord(session_id, turn_id, time.time(), kind, data))


def _decision_json(d: Decision, action: str, slot: _Slot) -> dict[str, Any]:
    return {
        "action": action,
        "predicted_bubble_s": round(d.predicted_bubble_s, 4),
        "predicted_cost_s": round(d.predicted_cost_s, 4),
        "turns_since_checkpoint": slot.turns_since_checkpoint,
        "reason": d.reason,
    }
