"""The verify stage of an episode: the agent's work, judged somewhere the agent never was.

`VerifyStage.run` takes the session's sandbox (the agent stage) and:

1. copies its working directory out as a tar, with every process in it frozen (`SandboxBackend.archive`),
   into a temporary file (`WorkspaceCopy`); the agent's sandbox is then destroyed, or kept for
   inspection. A copy over `SandboxConfig.max_workspace_bytes` stops there and is not verified
   (``reason="workspace_too_large"``, a ``workspace_too_large`` event);
2. rewrites that copy as it goes to the verifier (`sandbox.sessions.verify_tree`): regular files,
   directories and symbolic links only (no devices, fifos or hard links), no ``__pycache__``/``*.pyc``
   (bytecode the agent could have forged), and every *protected* path back to the task's original
   content. Each protected path the agent changed, added or deleted is a ``protected_path_modified``
   event (with the size of the diff). The gateway holds a piece of the copy at a time
   (`sandbox.backend.CHUNK_BYTES`), never the whole: a large working directory costs disk, not memory;
3. with ``on_tamper="fail"`` and any such change, stops there: not verified;
4. starts a **new** sandbox from the clean image (the task's image: nothing the agent installed or
   planted outside the working directory, and none of its processes), with no network; empties its
   working directory, unpacks the rewritten copy, then the verifier's files under ``/belayer-verify``
   (a directory the agent never had), and runs ``/belayer-verify/verify.sh`` with ``/bin/sh`` under
   ``env -i``: `VERIFY_ENV` only (system ``PATH``, ``PYTHONNOUSERSITE``, ``PYTHONSAFEPATH``...), with a
   time limit;
   Before the copy, what the agent left running (``agent_processes_left``) and what it changed
   outside the working directory (``outside_workspace_modified``) are recorded: neither reaches
   this stage;
5. destroys the verifier's sandbox and returns the verdict and the output, which go to the caller
   (the reward and the report), never to the trajectory.

Example::

    plan = VerifyPlan(files={"verify.sh": (b"exit 0", 0o644)}, protected=("test_*.py",),
                      originals={"test_a.py": (b"...", 0o644)})
    outcome = await manager.verify("ses_1", plan)
    print(outcome.verified, [c.path for c in outcome.changes])
"""

from __future__ import annotations

import dataclasses
import shlex
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from core import events as ev
from core.errors import RewardFileError, SandboxError, SandboxTimeout
from sandbox.backend import ExecResult, SandboxSpec
from sandbox.sessions.io import SandboxIO
from sandbox.sessions.records import EventLog
from sandbox.sessions.state import Slot
from sandbox.sessions.verify_harbor import (
    REWARD_JSON,
    REWARD_TEXT,
    TESTS_DIR,
    harbor_tests_tar,
    read_rewards,
    reward_file,
)
from sandbox.sessions.verify_tree import (
    SPOOL_MEMORY_BYTES,
    AgentTree,
    ProtectedChange,
    WorkspaceCopy,
    files_tar,
    protect,
    write_tree,
)
from sandbox.supervisor import ROOT as SUPERVISOR_ROOT

VERIFY_DIR = "/belayer-verify"
VERIFY_PYTHON = "/usr/bin/python3"
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
VERIFY_ENV = {
    "PATH": SYSTEM_PATH,
    "HOME": f"{VERIFY_DIR}/home",
    "LANG": "C.UTF-8",
    "PYTHONNOUSERSITE": "1",
    "PYTHONSAFEPATH": "1",  # no script directory or cwd in front of sys.path
    "PYTHONDONTWRITEBYTECODE": "1",
    "BELAYER_VERIFY": VERIFY_DIR,
    "BELAYER_TESTS": f"{VERIFY_DIR}/tests",
    "BELAYER_PYTHON": VERIFY_PYTHON,
}
OnTamper = Literal["reset", "fail"]
VerifyFormat = Literal["belayer", "harbor"]
VerifyMode = Literal["clean", "shared"]


@dataclass(frozen=True, slots=True)
class VerifyPlan:
    """What the verify stage needs from the task. Paths are relative: `files` to ``/belayer-verify``
    (``verify.sh`` is required), `originals` and `protected` to the sandbox's working directory."""

    files: dict[str, tuple[bytes, int]]
    originals: dict[str, tuple[bytes, int]] = field(default_factory=dict)
    """The task's original content (and mode) of every file that a `protected` pattern matches."""
    protected: tuple[str, ...] = ()
    """fnmatch patterns (``*`` also crosses ``/``); a pattern also protects everything under it."""
    on_tamper: OnTamper = "reset"
    timeout_s: float = 300.0
    image: str | None = None
    """The clean image to verify in; None: the image the agent's sandbox was created from."""
    keep_agent_sandbox: bool = False
    max_output_bytes: int = 1 << 20
    format: VerifyFormat = "belayer"
    """belayer: `files` under ``/belayer-verify``, ``verify.sh``'s exit code is the verdict; harbor: `files`
    under ``/tests``, ``test.sh`` runs, and the reward is read from ``/logs/verifier`` (`read_rewards`)."""
    mode: VerifyMode = "clean"
    """clean: in a new sandbox from the clean image, on a copy of the working directory; shared: in the
    agent's own sandbox, as Harbor runs its verifier (no protected paths there)."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables the verifier runs with (Harbor's ``[verifier].env``), on top of the image's."""


@dataclass(frozen=True, slots=True)
class VerifyOutcome:
    verified: bool
    exit_code: int | None
    """None: the verifier did not run (tampering with ``on_tamper="fail"``) or ran out of time."""
    output: str
    timed_out: bool
    changes: tuple[ProtectedChange, ...]
    action: Literal["none", "reset", "fail"]
    seconds: float
    agent_sandbox_kept: bool
    reason: str | None = None
    """Why the verifier did not run, when it was for want of a verdict: ``workspace_too_large``."""
    limits: dict[str, int] = field(default_factory=dict)
    """With `reason`: the figures behind it (``workspace_bytes`` read, ``max_workspace_bytes``)."""
    reward: float = 0.0
    """The RL reward: 1.0 or 0.0 by `verified` (belayer), or the reward files' (harbor; 0.0 on an error)."""
    rewards: dict[str, float] | None = None
    """Harbor's reward files, every key (None: belayer, or no valid file)."""
    format: VerifyFormat = "belayer"
    mode: VerifyMode = "clean"

    def summary(self) -> dict[str, Any]:
        """The verdict without the verifier's output (for the reward)."""
        return {
            "verified": self.verified, "exit_code": self.exit_code, "timed_out": self.timed_out,
            "tamper_action": self.action, "protected_paths_modified": [c.path for c in self.changes],
            "seconds": round(self.seconds, 3), "reason": self.reason, **self.limits,
            "reward": self.reward, "rewards": self.rewards, "format": self.format, "mode": self.mode,
        }  # fmt: skip


def verifier_tar(files: dict[str, tuple[bytes, int]]) -> bytes:
    """The verifier's files under ``/belayer-verify`` (and its empty HOME)."""
    root = VERIFY_DIR.strip("/")
    return files_tar(root, files, {root: 0o755, f"{root}/home": 0o755}, "verifier file")


def verify_command(workdir: str) -> str:
    """The verifier, run from `workdir` with nothing of the sandbox shell's environment."""
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in VERIFY_ENV.items())
    return (
        f"cd {shlex.quote(workdir)} && "
        f"/usr/bin/env -i {env} BELAYER_WORKSPACE={shlex.quote(workdir)} /bin/sh {VERIFY_DIR}/verify.sh"
    )


def outside_changes(changes: list[tuple[str, str]], workdir: str) -> list[tuple[str, str]]:
    """The changes outside `workdir` and the supervisor's directory, without the directories that
    are only listed because something under them changed.

    >>> outside_changes([("modified", "/usr"), ("added", "/usr/bin/x"), ("added", "/workspace/a"),
    ...                  ("added", "/.belayer/ctl"), ("deleted", "/etc/motd")], "/workspace")
    [('added', '/usr/bin/x'), ('deleted', '/etc/motd')]
    """
    skip = (workdir.rstrip("/"), SUPERVISOR_ROOT)
    kept = [(k, p) for k, p in changes if not any(p == s or p.startswith(s + "/") for s in skip)]
    paths = {p for _, p in kept}
    return [(k, p) for k, p in kept if not any(q.startswith(p.rstrip("/") + "/") for q in paths)]


# --------------------------------------------------------------------------- the stage
class VerifyStage:
    """Runs `VerifyPlan`s for the sandbox manager (it holds the session's slot lock meanwhile)."""

    def __init__(self, io: SandboxIO, events: EventLog, labels: dict[str, str] | None = None) -> None:
        self.io = io
        self.events = events
        self.labels = labels or {}
        """Labels of the verify sandboxes too (the store's identity: one leaked by a crash is removed)."""

    async def run(
        self, slot: Slot, plan: VerifyPlan, retire: Callable[[Slot], Awaitable[None]]
    ) -> VerifyOutcome:
        """The verify stage of `slot`'s session (`SandboxManager.verify`); `retire` removes its sandbox
        (unless `plan.keep_agent_sandbox`), under the slot's lock. Only ``protected_path_modified`` events
        are recorded. The outcome's ``seconds`` is the whole stage: the copy out and the agent sandbox's
        removal included."""
        started, session_id, kept = time.monotonic(), slot.session_id, plan.keep_agent_sandbox
        async with slot.lock:
            box, spec = slot.live(), slot.spec
            if plan.mode == "shared":  # Harbor's way: in the agent's own sandbox, then as below
                outcome = await self.shared(box, spec, plan, kept)
            else:
                agent_tar = await self.copy_out(session_id, box, spec.workdir)
            if not kept:
                await retire(slot)
        if not kept:
            self.events.add(session_id, None, ev.SandboxDestroyed(box, stage="verify"))
        if plan.mode != "shared":
            outcome = await self.judge(session_id, spec, plan, agent_tar, kept)
        return dataclasses.replace(outcome, seconds=time.monotonic() - started)

    async def copy_out(self, session_id: str, agent_box: str, workdir: str) -> WorkspaceCopy:
        """The agent's working directory, copied with its processes frozen, to a temporary file, up to
        `SandboxIO.max_workspace_bytes` (a larger one is a ``workspace_too_large`` event, and stops the
        copy). What the agent left running, and what it changed outside the working directory (neither
        reaches the verify stage), are events."""
        backend = self.io.backend
        left = await self.io.op(backend.processes, agent_box)
        if left:
            self.events.add(session_id, None, ev.AgentProcessesLeft(len(left), left[:20]))
        outside = outside_changes(await self.io.op(backend.changed_paths, agent_box), workdir)
        if outside:
            paths = [f"{kind} {path}" for kind, path in outside[:50]]
            self.events.add(session_id, None, ev.OutsideWorkspaceModified(len(outside), paths))
        limit = self.io.max_workspace_bytes
        spool = tempfile.SpooledTemporaryFile(SPOOL_MEMORY_BYTES, prefix="belayer-verify-")  # noqa: SIM115 - judge closes it
        try:
            size = await self.io.op(backend.archive, agent_box, workdir, spool, max_bytes=limit)
        except BaseException as exc:
            spool.close()
            if isinstance(exc, OSError) and not isinstance(exc, SandboxError):  # the gateway's own disk
                raise SandboxError(f"could not copy {workdir} out to a temporary file: {exc}") from exc
            raise
        copy = WorkspaceCopy(spool, size, limit)
        if copy.too_large:
            self.events.add(session_id, None, ev.WorkspaceTooLarge(size, limit, workdir))
        return copy

    async def judge(
        self, session_id: str, spec: SandboxSpec, plan: VerifyPlan, copy: WorkspaceCopy, kept: bool
    ) -> VerifyOutcome:
        """Rewrite `copy` (protected paths reset) and run the verifier on it; `copy` is closed."""
        started = time.monotonic()
        try:
            if copy.too_large:
                return _too_large(copy, spec.workdir, time.monotonic() - started, kept, plan)
            tree = await self.io.op(AgentTree, copy.tar, spec.workdir)  # reads the file: off the loop
            changes = await self.io.op(protect, tree, plan.originals, plan.protected)
            action: Literal["none", "reset", "fail"] = "none" if not changes else plan.on_tamper
            for change in changes:
                modified = ev.ProtectedPathModified(**change.as_json(), action=plan.on_tamper)
                self.events.add(session_id, None, modified)
            if action == "fail":
                return _outcome(_Verdict(False, None, "", False), plan, changes, action, started, kept)
            workspace = write_tree(tree, spec.workdir, plan.originals, plan.protected)
            verdict = await self._run(spec, plan, workspace)
            return _outcome(verdict, plan, changes, action, started, kept)
        finally:
            copy.close()

    async def shared(self, box: str, spec: SandboxSpec, plan: VerifyPlan, kept: bool) -> VerifyOutcome:
        """Run the verifier in the agent's own sandbox `box`, as Harbor does (``mode="shared"``): what the
        agent left there (its processes, files outside the working directory) is still there."""
        started = time.monotonic()
        verdict = await self._execute(box, spec.workdir, plan)
        return _outcome(verdict, plan, [], "none", started, kept)

    async def _run(self, agent_spec: SandboxSpec, plan: VerifyPlan, workspace: Iterator[bytes]) -> _Verdict:
        backend = self.io.backend
        spec = SandboxSpec(
            image=plan.image or agent_spec.image, workdir=agent_spec.workdir, network="none",
            memory_bytes=agent_spec.memory_bytes, pids_limit=agent_spec.pids_limit, cpus=agent_spec.cpus,
            labels={**self.labels, "belayer.stage": "verify"},
            env=agent_spec.env if plan.format == "harbor" else {},
        )  # fmt: skip
        box = await self.io.op(backend.create, spec)
        try:
            clear = f"find {shlex.quote(spec.workdir)} -mindepth 1 -delete"
            await self.io.op(backend.exec, box.id, clear, timeout_s=120)
            await self.io.op(backend.extract, box.id, workspace)
            return await self._execute(box.id, spec.workdir, plan)
        finally:
            await self.io.op(backend.destroy, box.id)

    async def _execute(self, box: str, workdir: str, plan: VerifyPlan) -> _Verdict:
        """Put the verifier's files in `box` (which holds the working directory to judge) and run it."""
        backend = self.io.backend
        if plan.format == "belayer":
            await self.io.op(backend.extract, box, verifier_tar(plan.files))
            code, output, timed_out = await self._exec(box, verify_command(workdir), plan)
            return _Verdict(code == 0, code, output, timed_out)
        # Harbor: stale reward files go first (the agent may have written some), then the tests
        cleared = await self.io.op(backend.exec, box, f"rm -f {REWARD_JSON} {REWARD_TEXT}", timeout_s=60)
        if cleared.exit_code != 0:
            note = f"[belayer] could not remove stale reward files: {cleared.stdout}{cleared.stderr}"
            return _Verdict(False, None, note, False, reason="reward_file_invalid")
        await self.io.op(backend.extract, box, harbor_tests_tar(plan.files))
        code, output, timed_out = await self._exec(box, f"{TESTS_DIR}/test.sh", plan, cwd=workdir)
        if timed_out:
            return _Verdict(False, None, output, True, reason="verifier_timed_out")
        try:
            found = (
                await reward_file(self.io, box, REWARD_JSON),
                await reward_file(self.io, box, REWARD_TEXT),
            )
            reward, rewards = read_rewards(*found)
        except RewardFileError as exc:
            note = f"\n[belayer] no reward: {exc}"
            return _Verdict(False, code, output + note, False, reason=exc.reason, rewards=exc.rewards)
        return _Verdict(reward >= 1.0, code, output, False, reward=reward, rewards=rewards)

    async def _exec(
        self, box: str, command: str, plan: VerifyPlan, cwd: str | None = None
    ) -> tuple[int | None, str, bool]:
        backend = self.io.backend

        def run(sandbox_id: str) -> ExecResult:
            return backend.exec(
                sandbox_id, command, timeout_s=plan.timeout_s, session="verify", cwd=cwd,
                env=dict(plan.env) or None, max_output_bytes=plan.max_output_bytes,
            )  # fmt: skip

        try:
            result = await self.io.call(run, box, long=True, deadline=plan.timeout_s + 60)
        except (SandboxTimeout, TimeoutError) as exc:
            note = f"\n[belayer] the verifier ran over its time limit ({plan.timeout_s:g}s)"
            return None, getattr(exc, "stdout", "") + note, True
        return result.exit_code, result.stdout + result.stderr, False


@dataclass(frozen=True, slots=True)
class _Verdict:
    verified: bool
    exit_code: int | None
    output: str
    timed_out: bool
    reward: float | None = None
    rewards: dict[str, float] | None = None
    reason: str | None = None


def _outcome(
    verdict: _Verdict,
    plan: VerifyPlan,
    changes: list[ProtectedChange],
    action: Literal["none", "reset", "fail"],
    started: float,
    kept: bool,
) -> VerifyOutcome:
    reward = verdict.reward if verdict.reward is not None else (1.0 if verdict.verified else 0.0)
    return VerifyOutcome(
        verdict.verified, verdict.exit_code, verdict.output, verdict.timed_out, tuple(changes), action,
        time.monotonic() - started, kept, reason=verdict.reason, reward=reward, rewards=verdict.rewards,
        format=plan.format, mode=plan.mode,
    )  # fmt: skip


def _too_large(
    copy: WorkspaceCopy, workdir: str, seconds: float, kept: bool, plan: VerifyPlan
) -> VerifyOutcome:
    note = (
        f"[belayer] not verified: {workdir} is over sandbox.max_workspace_bytes ({copy.limit} bytes); "
        f"its copy was stopped after {copy.size} bytes"
    )
    limits = {"workspace_bytes": copy.size, "max_workspace_bytes": copy.limit or 0}
    return VerifyOutcome(
        False, None, note, False, (), "none", seconds, kept, reason="workspace_too_large", limits=limits,
        format=plan.format, mode=plan.mode,
    )  # fmt: skip
