"""An in-memory `SandboxBackend` with scripted faults, for fast tests of what sits above the seam.

A fake sandbox holds files (absolute path → bytes) and persistent shell sessions (working directory and
variables); `exec` runs a tiny shell (`sandbox.fake_shell`: ``echo``, ``cat``, ``cd``, ``export``,
``sleep``, ``exit``, ``&&``, ``>``...). Other commands run handlers registered in `commands` (see
`CommandHandler`), or fail with 127 like an unknown command. A checkpoint is a deep copy of files and
sessions; `restore` starts a new sandbox (a new id) from it, and `restore_standby` a frozen one (its
commands refused, as on a paused container) until `activate`.

Faults are queued (`inject`) and consumed one call at a time, like `engine_pool.fake.FaultInjector`:

====== =====================================================================================
kind   what the next matching call does
====== =====================================================================================
fail   raises the operation's error at once (`CheckpointError` for checkpoint and
       delete_checkpoint, `RestoreError` for restore and restore_standby, `SandboxError`
       otherwise)
hang   never answers: blocks until `Fault.release` is set or the sandbox is destroyed, then
       raises `SandboxError` (a hung tool call; the manager's deadline gives up first)
break  the exec transport breaks: `SandboxError`, the command did not run, the sandbox still runs
kill   the container dies during the call (exit code 137) and the call raises `SandboxError`
oom    the same, killed for running out of memory
block  waits for `Fault.release`, then runs normally (for concurrency tests)
====== =====================================================================================

`kill(sandbox_id)` stops a sandbox at once (as ``docker kill`` would), for a failure while idle.
`symlink(sandbox_id, path, target)` makes a symbolic link (the file API follows at most one).
`calls` records every call as ``(operation, sandbox or checkpoint id)``; a file read records
``read_file`` when it asks for the file's size (Docker's archive stat header) and ``file_body`` only
when it goes on to take the bytes, so a test can tell that a read over its limit took none.

Example:

>>> backend = FakeSandboxBackend()
>>> box = backend.create(SandboxSpec(image="any"))
>>> backend.exec(box.id, "cd /tmp && X=1").exit_code
0
>>> backend.exec(box.id, 'echo "$X" > f; cat f; pwd').stdout == "1\\n/tmp\\n"
True
>>> backend.inject(Fault("delete_checkpoint"))        # the next deletion fails
>>> backend.delete_checkpoint(backend.checkpoint(box.id))
Traceback (most recent call last):
core.errors.CheckpointError: delete_checkpoint failed (injected fault)
"""

from __future__ import annotations

import copy
import io
import posixpath
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import IO, Literal

from core.errors import (
    CheckpointError,
    RestoreError,
    SandboxError,
    SandboxFileNotFound,
    SandboxFileTooLarge,
    SandboxNotFound,
    SandboxPathRefused,
)
from sandbox.backend import (
    DEFAULT_SESSION,
    Checkpoint,
    ChunkReader,
    ExecResult,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
    SandboxStatus,
    TarStream,
    check_exec_args,
    copy_bounded,
    resolve_in_root,
    tar_chunks,
)
from sandbox.fake_shell import (
    CommandHandler,
    ContainerState,
    FakeContainer,
    Shell,
    ShellSession,
    run_script,
    wait_any,
)
from sandbox.network import SandboxNetwork

__all__ = ["CommandHandler", "FakeNetwork", "FakeSandboxBackend", "Fault", "Shell"]

Operation = Literal[
    "create", "exec", "read_file", "file_body", "write_file", "archive", "extract", "checkpoint", "restore",
    "destroy", "delete_checkpoint", "status", "restore_standby", "activate",
]  # fmt: skip
FaultKind = Literal["fail", "hang", "break", "kill", "oom", "block"]


@dataclass(frozen=True, slots=True)
class Fault:
    """What the next call of `op` (on `sandbox_id`, or on any sandbox when None) does; see above."""

    op: Operation
    kind: FaultKind = "fail"
    sandbox_id: str | None = None
    release: threading.Event | None = None
    """For `block` (required) and `hang` (optional): set it to let the call go on, or end."""


class FakeNetwork(SandboxNetwork):
    """A gateway network in memory: sandboxes with ``network="gateway"`` get 10.99.0.N addresses."""

    GATEWAY = "10.99.0.1"

    def __init__(self) -> None:
        self._addresses: dict[str, str] = {}
        self._next = 2
        self.open_ports: set[int] = set()
        self._lock = threading.Lock()

    def attach(self, sandbox_id: str) -> None:
        with self._lock:
            self._addresses[sandbox_id] = f"10.99.0.{self._next}"
            self._next += 1

    def detach(self, sandbox_id: str) -> None:
        with self._lock:
            self._addresses.pop(sandbox_id, None)

    def address(self, sandbox_id: str) -> str | None:
        with self._lock:
            return self._addresses.get(sandbox_id)

    def gateway_address(self) -> str:
        return self.GATEWAY

    def open_gateway(self, port: int) -> None:
        with self._lock:
            self.open_ports.add(port)

    def close_gateway(self, port: int) -> None:
        with self._lock:
            self.open_ports.discard(port)


class FakeSandboxBackend(SandboxBackend):
    """Sandboxes in memory, with a fault queue; see the module docstring. Thread-safe."""

    def __init__(self, images: set[str] | None = None, *, disk_quota_bytes: int | None = None) -> None:
        self.images = images
        """Images that exist (None: any name does); creating from another raises `SandboxNotFound`."""
        self._disk_quota = disk_quota_bytes
        """Checked before checkpoints only (`disk_quota_enforced` is False), like Docker on overlay2
        over a file system without project quotas."""
        self.commands: dict[str, CommandHandler] = {}
        self.faults: list[Fault] = []
        self.calls: list[tuple[str, str]] = []
        self._network = FakeNetwork()
        self._boxes: dict[str, FakeContainer] = {}
        self._snapshots: dict[str, ContainerState] = {}
        self._guard = threading.Lock()

    # ------------------------------------------------------------------ scripting the fake
    def inject(self, *faults: Fault) -> None:
        """Queue faults; each is consumed by the first call it matches."""
        with self._guard:
            self.faults.extend(faults)

    def kill(self, sandbox_id: str, *, oom: bool = False, exit_code: int = 137) -> None:
        """Stop the sandbox now, as a crash or the OOM killer would."""
        self._box(sandbox_id).stop(exit_code, oom)

    def symlink(self, sandbox_id: str, path: str, target: str) -> None:
        """Make `path` (absolute) a symbolic link to `target`, as ``ln -s target path`` in the sandbox would."""
        box = self._box(sandbox_id)
        with box.lock:
            box.state.links[posixpath.normpath(path)] = target
            box.state.files.pop(posixpath.normpath(path), None)

    @property
    def sandboxes(self) -> list[str]:
        """Ids of the sandboxes that exist (running or stopped)."""
        with self._guard:
            return list(self._boxes)

    @property
    def checkpoint_ids(self) -> list[str]:
        """Ids of the checkpoints whose storage is still held."""
        with self._guard:
            return list(self._snapshots)

    def ops(self, op: str) -> list[str]:
        """The ids that calls of `op` were made with, in order."""
        with self._guard:
            return [target for name, target in self.calls if name == op]

    @property
    def network(self) -> FakeNetwork:
        return self._network

    # ------------------------------------------------------------------ lifecycle
    def create(self, spec: SandboxSpec) -> Sandbox:
        self._enter("create", spec.image)
        if self.images is not None and spec.image not in self.images:
            raise SandboxNotFound(f"No such image: {spec.image}")
        return self._start(spec, ContainerState({}, {}))

    def destroy(self, sandbox_id: str) -> None:
        self._enter("destroy", sandbox_id)
        with self._guard:
            box = self._boxes.pop(sandbox_id, None)
        if box is None:
            raise SandboxNotFound(f"No such container: {sandbox_id}")
        box.destroyed = True
        box.ended.set()  # ends a call in progress, as removing a container ends its exec
        self._network.detach(sandbox_id)

    def list_sandboxes(self, labels: Mapping[str, str]) -> list[Sandbox]:
        with self._guard:
            boxes = list(self._boxes.values())
        return [
            Sandbox(box.id, box.spec)
            for box in boxes
            if all(box.spec.labels.get(k) == v for k, v in labels.items())
        ]

    def has_checkpoint(self, checkpoint: Checkpoint) -> bool:
        with self._guard:
            return checkpoint.id in self._snapshots

    def status(self, sandbox_id: str) -> SandboxStatus:
        box = self._box(sandbox_id)
        self._enter("status", sandbox_id)
        return box.status()

    # ------------------------------------------------------------------ exec
    def exec(
        self,
        sandbox_id: str,
        command: str,
        *,
        timeout_s: float = 30.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        session: str = DEFAULT_SESSION,
        max_output_bytes: int = 1 << 20,
    ) -> ExecResult:
        check_exec_args(session, timeout_s, max_output_bytes)
        box = self._box(sandbox_id)
        started = time.monotonic()
        with box.lock:
            self._enter("exec", sandbox_id, box)
            _require_running(box)
            state = box.state.sessions.setdefault(session, ShellSession(box.spec.workdir, dict(box.spec.env)))
            shell = Shell(box, state, started + timeout_s, timeout_s)
            if cwd is not None:
                state.cwd = shell.path(cwd)
            state.env.update(env or {})
            run_script(shell, command, self.commands)
        out, out_cut = _bounded("".join(shell.stdout), max_output_bytes)
        err, err_cut = _bounded("".join(shell.stderr), max_output_bytes)
        return ExecResult(shell.status, out, err, time.monotonic() - started, out_cut, err_cut)

    # ------------------------------------------------------------------ files
    def read_file(self, sandbox_id: str, path: str, *, max_bytes: int | None = None) -> bytes:
        box = self._box(sandbox_id)
        target = resolve_in_root(box.spec.workdir, path)
        with box.lock:
            self._enter("read_file", sandbox_id, box)  # the size first (Docker: the stat header)
            target = _follow(box.state.links, target, path, last=True)
            data = box.state.files.get(target)
            if data is None:
                if any(name.startswith(target + "/") for name in box.state.files):
                    raise SandboxPathRefused(f"{target} is a directory, not a file")
                raise SandboxFileNotFound(f"Could not find the file {target} in container {sandbox_id}")
            if max_bytes is not None and len(data) > max_bytes:
                raise SandboxFileTooLarge.of(target, len(data), max_bytes)
            self._enter("file_body", sandbox_id, box)
            return data

    def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        box = self._box(sandbox_id)
        target = resolve_in_root(box.spec.workdir, path)
        with box.lock:
            self._enter("write_file", sandbox_id, box)
            target = _follow(box.state.links, target, path, last=False)
            box.state.links.pop(target, None)  # a link at the path itself is replaced, as tar does
            box.state.files[target] = bytes(data)

    def archive(self, sandbox_id: str, path: str, out: IO[bytes], *, max_bytes: int | None = None) -> int:
        box = self._box(sandbox_id)
        root = posixpath.normpath(path)
        with box.lock:
            self._enter("archive", sandbox_id, box)
            files = {k: v for k, v in box.state.files.items() if k.startswith(root.rstrip("/") + "/")}
            if root in box.state.files:  # a file: its tar holds it alone, as the engine's does
                files = {root: box.state.files[root]}
        return copy_bounded(tar_chunks(_members(root, files)), out, max_bytes)

    def extract(self, sandbox_id: str, tar: TarStream) -> None:
        box = self._box(sandbox_id)
        stream = io.BytesIO(tar) if isinstance(tar, bytes) else ChunkReader(tar)
        with box.lock:
            self._enter("extract", sandbox_id, box)
            _require_running(box)
            with tarfile.open(fileobj=stream, mode="r|") as archive:
                for member in archive:
                    data = archive.extractfile(member) if member.isfile() else None
                    if data is not None:
                        box.state.files["/" + posixpath.normpath(member.name).lstrip("/")] = data.read()

    def writable_bytes(self, sandbox_id: str) -> int:
        box = self._box(sandbox_id)
        with box.lock:
            return sum(len(data) for data in box.state.files.values())

    @property
    def disk_quota_bytes(self) -> int | None:
        return self._disk_quota

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, sandbox_id: str, *, label: str = "") -> Checkpoint:
        box = self._box(sandbox_id)
        started = time.monotonic()
        with box.lock:
            self._enter("checkpoint", sandbox_id, box)
            if not box.running:
                raise CheckpointError(f"cannot checkpoint {sandbox_id}: {box.status().detail}")
            state = copy.deepcopy(box.state)
        ckpt_id = uuid.uuid4().hex[:16]
        with self._guard:
            self._snapshots[ckpt_id] = state
        return Checkpoint(
            id=ckpt_id, sandbox_id=sandbox_id, label=label, spec=box.spec, image=f"fake-checkpoint:{ckpt_id}",
            location=f"memory://{ckpt_id}", created_at=time.time(), fs_seconds=time.monotonic() - started,
            process_seconds=0.0, env=tuple(f"{k}={v}" for k, v in box.spec.env.items()),
            dump_bytes=sum(len(data) for data in state.files.values()),
        )  # fmt: skip

    def restore(self, checkpoint: Checkpoint) -> Sandbox:
        self._enter("restore", checkpoint.id)
        return self._restore(checkpoint)

    def _restore(self, checkpoint: Checkpoint) -> Sandbox:
        with self._guard:
            state = self._snapshots.get(checkpoint.id)
        if state is None:
            raise SandboxNotFound(f"checkpoint {checkpoint.id}: no process dump")
        return self._start(checkpoint.spec, copy.deepcopy(state))

    @property
    def keeps_standbys(self) -> bool:
        return True

    def restore_standby(self, checkpoint: Checkpoint) -> Sandbox:
        """`restore`, frozen: its commands are refused until `activate` (as on a paused container)."""
        self._enter("restore_standby", checkpoint.id)
        box = self._restore(checkpoint)
        self._box(box.id).frozen = True
        return box

    def activate(self, sandbox_id: str) -> None:
        box = self._box(sandbox_id)
        self._enter("activate", sandbox_id, box)
        if not box.frozen:
            raise SandboxError(f"container {sandbox_id} is not paused")
        box.frozen = False

    def frozen(self, sandbox_id: str) -> bool:
        """Whether the sandbox is a standby not activated yet."""
        return self._box(sandbox_id).frozen

    def delete_checkpoint(self, checkpoint: Checkpoint) -> None:
        self._enter("delete_checkpoint", checkpoint.id)
        with self._guard:
            self._snapshots.pop(checkpoint.id, None)

    # ------------------------------------------------------------------ helpers
    def _start(self, spec: SandboxSpec, state: ContainerState) -> Sandbox:
        box = FakeContainer(f"fake-{uuid.uuid4().hex[:12]}", spec, state)
        with self._guard:
            self._boxes[box.id] = box
        if spec.network == "gateway":
            self._network.attach(box.id)
        return Sandbox(id=box.id, spec=spec)

    def _box(self, sandbox_id: str) -> FakeContainer:
        with self._guard:
            box = self._boxes.get(sandbox_id)
        if box is None:
            raise SandboxNotFound(f"No such container: {sandbox_id}")
        return box

    def _enter(self, op: Operation, target: str, box: FakeContainer | None = None) -> None:
        """Record the call, then play the first queued fault that matches it."""
        with self._guard:
            self.calls.append((op, target))
            fault = next((f for f in self.faults if _matches(f, op, target, box)), None)
            if fault is not None:
                self.faults.remove(fault)
        if fault is not None:
            _play(fault, box)


def _matches(fault: Fault, op: str, target: str, box: FakeContainer | None) -> bool:
    return fault.op == op and fault.sandbox_id in (None, target, box.id if box else None)


def _play(fault: Fault, box: FakeContainer | None) -> None:
    what = f"{fault.op} on {box.id}" if box else fault.op
    if fault.kind == "block":
        if fault.release is None:
            raise ValueError("a 'block' fault needs a release event")
        fault.release.wait()
        return
    if fault.kind == "hang":
        wait_any(fault.release or threading.Event(), box.ended if box else threading.Event(), None)
        raise SandboxError(f"{what}: the connection to the engine was lost")
    if fault.kind in ("kill", "oom") and box is not None:
        box.stop(137, fault.kind == "oom")
        raise SandboxError(f"{what} failed: {box.status().detail}")
    if fault.kind == "break":
        raise SandboxError(f"{what}: the exec transport broke (connection reset)")
    error = {
        "checkpoint": CheckpointError, "delete_checkpoint": CheckpointError, "restore": RestoreError,
        "restore_standby": RestoreError,
    }  # fmt: skip
    raise error.get(fault.op, SandboxError)(f"{what} failed (injected fault)")


def _members(root: str, files: dict[str, bytes]) -> Iterator[tuple[tarfile.TarInfo, IO[bytes] | None]]:
    top = posixpath.dirname(root)
    if root not in files:  # a directory's own entry first (a file's tar holds the file alone)
        yield _tar_info(posixpath.relpath(root, top), tarfile.DIRTYPE, 0), None
    for name, data in sorted(files.items()):
        yield _tar_info(posixpath.relpath(name, top), tarfile.REGTYPE, len(data)), io.BytesIO(data)


def _tar_info(name: str, kind: bytes, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mode, info.mtime = kind, size, 0o755 if kind == tarfile.DIRTYPE else 0o644, 0
    return info


def _follow(links: dict[str, str], target: str, asked: str, *, last: bool) -> str:
    """`target` with the symbolic links on its way resolved (and the last component's too, when `last`),
    at most one of them: a second link, or a loop, is refused, as the Docker backend refuses them."""
    followed = 0
    parts = target.strip("/").split("/")
    at = 0
    while at < len(parts) - (0 if last else 1):
        prefix = "/" + "/".join(parts[: at + 1])
        link = links.get(prefix)
        if link is None:
            at += 1
            continue
        followed += 1
        if followed > 1:
            raise SandboxPathRefused.links(asked)
        resolved = posixpath.normpath(posixpath.join(posixpath.dirname(prefix), link))
        parts = [*resolved.strip("/").split("/"), *parts[at + 1 :]]
        at = 0
    return "/" + "/".join(parts)


def _require_running(box: FakeContainer) -> None:
    if not box.running:
        raise SandboxError(f"container {box.id} is not running; {box.status().detail}")
    if box.frozen:
        raise SandboxError(f"container {box.id} is paused, unpause the container first")


def _bounded(text: str, limit: int) -> tuple[str, bool]:
    raw = text.encode()
    if len(raw) <= limit:
        return text, False
    return raw[:limit].decode(errors="replace"), True
