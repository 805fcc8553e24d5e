"""The sandbox seam: one ABC (`SandboxBackend`) and the values that cross it.

A sandbox is an isolated container in which an agent runs commands through persistent shell
*sessions*: the working directory and shell variables set by one `exec` are there for the next one.
A checkpoint captures the sandbox's filesystem and its running processes together; `restore` brings
both back in a new sandbox, even after the original is gone.

Example::

    backend: SandboxBackend = backend_for(SandboxConfig(enabled=True))  # sandbox.backends
    box = backend.create(SandboxSpec(image="belayer-sandbox-python"))
    backend.exec(box.id, "cd /workspace && export N=1")
    ckpt = backend.checkpoint(box.id, label="turn-3")
    backend.destroy(box.id)
    box2 = backend.restore(ckpt)
    assert backend.exec(box2.id, "echo $N $(pwd)").stdout == "1 /workspace\\n"

Methods block; async callers run them in worker threads (the gateway's manager has its own bounded
pools). Implementations serialise calls on one sandbox and allow calls on different sandboxes to run
concurrently. `destroy` must not wait for a call in progress on that sandbox: it ends it.
"""

from __future__ import annotations

import abc
import io
import posixpath
import re
import tarfile
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import IO, Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.errors import PathEscapeError, SandboxArgumentError, SandboxError
from core.liveness import Liveness
from sandbox.network import SandboxNetwork

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SESSION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")

DEFAULT_SESSION = "main"
CHUNK_BYTES = 1 << 20
"""The piece size in which archives stream through the gateway (what one copy holds at a time)."""
TarStream = bytes | Iterable[bytes]
"""A tar to unpack: whole, or as pieces read one at a time (never joined)."""


class SandboxSpec(BaseModel):
    """What to create: the image, the agent's shell, and the isolation limits.

    Defaults are locked down: no network, every capability dropped, no-new-privileges.
    `network` is one of:

    - ``"none"``: no interface but loopback;
    - ``"gateway"``: the one address where the gateway listens for its sandboxes, and nothing else
      (for a harness that runs inside the sandbox); see `sandbox.network.SandboxNetwork`;
    - ``"full"``: the engine's default bridge, with outbound access.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: str
    workdir: str = "/workspace"
    """Root of the file API and the sessions' start directory; created if missing."""
    shell: str = "/bin/sh"
    """Shell binary inside the image that runs the sessions (POSIX sh, dash, ash or bash)."""
    env: dict[str, str] = Field(default_factory=dict)
    memory_bytes: int = 512 * 1024 * 1024
    pids_limit: int = 256
    cpus: float = 1.0
    network: Literal["none", "gateway", "full"] = "none"
    cap_add: tuple[str, ...] = ()
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("network", mode="before")
    @classmethod
    def _network_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):  # the older boolean form
            return "full" if value else "none"
        return value

    @field_validator("workdir", "shell")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/") or "\0" in value:
            raise ValueError(f"must be an absolute path: {value!r}")
        return posixpath.normpath(value)

    @field_validator("shell")
    @classmethod
    def _no_whitespace(cls, value: str) -> str:
        if any(ch.isspace() for ch in value):
            raise ValueError(f"shell path may not contain whitespace: {value!r}")
        return value

    @field_validator("env")
    @classmethod
    def _env_names(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            check_env_name(name)
        return value


@dataclass(frozen=True, slots=True)
class Sandbox:
    """A live sandbox. `id` is the handle every other call takes."""

    id: str
    spec: SandboxSpec
    restore_phases: tuple[tuple[str, float], ...] = field(default=(), compare=False)
    """Where the restore that made this sandbox spent its time: (phase, seconds), in order, named by the
    backend (the Docker backend's: `sandbox.docker_backend.checkpoints`); empty for a created sandbox."""


@dataclass(frozen=True, slots=True)
class ExecResult:
    """The outcome of one command. Output beyond the call's limit is cut and flagged."""

    exit_code: int
    stdout: str
    stderr: str
    duration_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A restorable snapshot of a sandbox: filesystem and processes, taken together.

    `location` is backend-specific (for Docker: the directory holding the CRIU dump and metadata).
    """

    id: str
    sandbox_id: str
    label: str
    spec: SandboxSpec
    image: str
    location: str
    created_at: float
    fs_seconds: float
    process_seconds: float
    env: tuple[str, ...] = ()
    """The container's full environment (image ENV plus `spec.env`), as `NAME=value`."""
    dump_bytes: int = 0
    """Size of the process dump (what the checkpoint policy weighs its next cost by)."""
    digests: tuple[tuple[str, str], ...] = ()
    """A portable checkpoint's parts in the store and each one's SHA-256 (hex), checked before a restore
    unpacks any of them (`sandbox.checkpoint_auth`)."""
    mac: str = ""
    """The gateway's HMAC over what a restore uses of this record, digests included
    (`sandbox.checkpoint_auth`); empty where no key signed it."""


@dataclass(frozen=True, slots=True)
class SandboxStatus:
    """Whether a sandbox still runs, and why not."""

    running: bool
    exit_code: int | None = None
    oom_killed: bool = False
    detail: str = ""
    node_lost: bool = False
    """The node that held it is gone (its Ray node, or its Docker engine): `sandbox.cluster`."""

    @property
    def failure_kind(self) -> str:
        return "node_lost" if self.node_lost else "oom" if self.oom_killed else "exited"

    @property
    def liveness(self) -> Liveness:
        """In the house's words (`core.liveness`): alive, lost with its node (restorable elsewhere), dead."""
        return Liveness.ALIVE if self.running else Liveness.LOST if self.node_lost else Liveness.DEAD


class SandboxBackend(abc.ABC):
    """Creates sandboxes, runs commands in them, and checkpoints and restores them.

    Implementations: `sandbox.docker_backend.DockerSandboxBackend` and the in-memory
    `sandbox.fake.FakeSandboxBackend` (for tests of what sits above the seam).
    """

    @abc.abstractmethod
    def create(self, spec: SandboxSpec) -> Sandbox:
        """Start a sandbox from `spec.image` with its PID-1 supervisor running."""

    @abc.abstractmethod
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
        """Run `command` in the persistent shell `session` (started on first use).

        `cwd` and `env` are applied to the session before the command, as if typed there, so they
        persist. On timeout the command's processes are killed and `SandboxTimeout` is raised;
        processes started by earlier calls keep running. A non-zero exit is a result, not an error.
        """

    @abc.abstractmethod
    def read_file(self, sandbox_id: str, path: str, *, max_bytes: int | None = None) -> bytes:
        """Return a regular file's bytes; `path` is absolute under, or relative to, the workdir.

        The file's size is asked for first (for Docker, the archive's stat header): over `max_bytes`,
        `SandboxFileTooLarge` is raised before any of its bytes are read. At most one symbolic link is
        followed (its target resolved inside the sandbox); a second one, a loop, or a directory raises
        `SandboxPathRefused`."""

    @abc.abstractmethod
    def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Create or replace a file (parents are created); same path rules as `read_file`. A symbolic
        link at `path` itself is replaced, not followed; a loop of links on the way raises
        `SandboxPathRefused`."""

    @abc.abstractmethod
    def archive(self, sandbox_id: str, path: str, out: IO[bytes], *, max_bytes: int | None = None) -> int:
        """Write a tar of the directory `path` (absolute) and everything under it to `out`, taken with
        the sandbox's processes frozen so that none of them changes a file halfway through, and return
        its size. Member names start with the directory's own name (``/workspace`` → ``workspace/…``),
        as ``docker cp`` writes them.

        The tar streams through in pieces (`CHUNK_BYTES`), never whole in memory. Once more than
        `max_bytes` have come, the copy stops: a result over `max_bytes` means `out` holds only the
        start of the tar (see `copy_bounded`)."""

    @abc.abstractmethod
    def extract(self, sandbox_id: str, tar: TarStream) -> None:
        """Unpack `tar` (bytes, or pieces streamed one at a time) at the sandbox's root (member names are
        relative to ``/``). Paths resolve inside the sandbox: a link in it cannot send a file outside."""

    @abc.abstractmethod
    def checkpoint(self, sandbox_id: str, *, label: str = "") -> Checkpoint:
        """Snapshot filesystem and processes; the sandbox keeps running afterwards."""

    @abc.abstractmethod
    def restore(self, checkpoint: Checkpoint) -> Sandbox:
        """Start a new sandbox from `checkpoint`; the original need not exist any more."""

    @abc.abstractmethod
    def destroy(self, sandbox_id: str) -> None:
        """Kill and remove the sandbox. Its checkpoints stay restorable."""

    @abc.abstractmethod
    def delete_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Free the checkpoint's storage; it cannot be restored afterwards."""

    @abc.abstractmethod
    def status(self, sandbox_id: str) -> SandboxStatus:
        """Whether the sandbox runs; raises `SandboxNotFound` when it is gone altogether."""

    def list_sandboxes(self, labels: Mapping[str, str]) -> list[Sandbox]:
        """The sandboxes (running or stopped) whose spec carries every one of `labels`: after a restart,
        a gateway finds its own this way (`sandbox.sessions.adoption`); [] when the backend cannot
        tell."""
        return []

    @property
    def keeps_standbys(self) -> bool:
        """Whether this backend keeps *standby* sandboxes (`restore_standby`, `activate`): a checkpoint
        restored ahead of time and frozen, which a recovery unfreezes instead of restoring from storage
        (`sandbox.sessions.standby`). False: the manager makes none."""
        return False

    def restore_standby(self, checkpoint: Checkpoint) -> Sandbox:
        """`restore` `checkpoint` into a new sandbox and freeze it at once (its processes stop where they
        are, as ``docker pause`` stops them) until `activate`. Between the restore and the freeze its
        processes run for a moment, in its own container. `SandboxError` where `keeps_standbys` is False."""
        raise SandboxError(f"{type(self).__name__} keeps no standby sandboxes")

    def activate(self, sandbox_id: str) -> None:
        """Let a standby's processes run again: it is a sandbox like any other from then on."""
        raise SandboxError(f"{type(self).__name__} keeps no standby sandboxes")

    def has_checkpoint(self, checkpoint: Checkpoint) -> bool:
        """Whether `checkpoint`'s storage is still there to restore (e.g. after a restart)."""
        return True

    def changed_paths(self, sandbox_id: str) -> list[tuple[str, str]]:
        """What changed in the sandbox's filesystem since its image, as ``(kind, path)`` with kind
        ``added``, ``modified`` or ``deleted``, read from outside the sandbox; [] when the backend
        cannot tell."""
        return []

    def writable_bytes(self, sandbox_id: str) -> int | None:
        """How many bytes the sandbox has written to its filesystem since its image (what a checkpoint
        would commit); None when the backend cannot tell."""
        return None

    @property
    def disk_quota_bytes(self) -> int | None:
        """The disk quota each sandbox is given (its writable layer), None for none."""
        return None

    def disk_quota(self) -> tuple[bool, str]:
        """Whether the storage driver enforces `disk_quota_bytes` (writes past it fail with ENOSPC), and
        why or why not. Not enforced, it is only checked before each checkpoint
        (`sandbox.sessions.checkpoints`)."""
        return False, "this backend cannot limit a sandbox's disk"

    def processes(self, sandbox_id: str) -> list[str]:
        """Command lines of the processes running in the sandbox besides its supervisor and session
        shells (what earlier commands left behind), read from outside it; [] when the backend cannot
        tell."""
        return []

    def node_of(self, sandbox_id: str) -> str | None:
        """The address of the machine that holds the sandbox, when there are several; None otherwise."""
        return None

    def nodes(self) -> list[dict[str, Any]]:
        """The machines that hold the sandboxes, when there are several (`sandbox.cluster`): each one's
        ``node`` (address), ``state`` (alive, lost, refused), ``slots`` and ``sandboxes``; [] on one host."""
        return []

    @property
    def network(self) -> SandboxNetwork | None:
        """The network that ``network="gateway"`` sandboxes join (`sandbox.network`); None when the
        backend has none, and such sandboxes cannot be created."""
        return None

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release the backend's own resources (not the sandboxes)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def checkpoint_record(ckpt: Checkpoint) -> dict[str, Any]:
    """A checkpoint as JSON-able values (the inverse of `checkpoint_from_record`), to keep it where it
    outlives the process that took it."""
    record = asdict(ckpt)
    record["spec"] = ckpt.spec.model_dump(mode="json")
    record["env"] = list(ckpt.env)
    return record


def checkpoint_from_record(record: dict[str, Any]) -> Checkpoint:
    """Rebuild a checkpoint from `checkpoint_record`'s values."""
    values = dict(record)
    values["spec"] = SandboxSpec.model_validate(values["spec"])
    values["env"] = tuple(values.get("env") or ())
    values["digests"] = tuple((str(name), str(digest)) for name, digest in values.get("digests") or ())
    return Checkpoint(**values)


def check_env_name(name: str) -> str:
    """Return `name` if it is a valid shell variable name, else raise `SandboxArgumentError`."""
    if not _ENV_NAME.match(name):
        raise SandboxArgumentError(f"not a valid environment variable name: {name!r}")
    return name


def check_exec_args(session: str, timeout_s: float, max_output_bytes: int) -> None:
    """The checks every backend's `exec` makes before running anything."""
    check_session_name(session)
    if timeout_s <= 0 or max_output_bytes <= 0:
        raise SandboxArgumentError("timeout_s and max_output_bytes must be positive")


def check_session_name(name: str) -> str:
    """Return `name` if it is a valid session name (letters, digits, `_`, `-`), else raise."""
    if not _SESSION_NAME.match(name):
        raise SandboxArgumentError(f"not a valid session name: {name!r}")
    return name


def resolve_in_root(root: str, path: str) -> str:
    """Resolve `path` (absolute, or relative to `root`) lexically; refuse anything outside `root`.

    >>> resolve_in_root("/workspace", "src/../a.txt")
    '/workspace/a.txt'
    """
    if not path or "\0" in path:
        raise PathEscapeError(f"invalid path: {path!r}")
    resolved = posixpath.normpath(posixpath.join(root, path))
    if resolved == root or not resolved.startswith(root.rstrip("/") + "/"):
        raise PathEscapeError(f"path {path!r} resolves to {resolved!r}, outside {root!r}")
    return resolved


def copy_bounded(chunks: Iterable[bytes], out: IO[bytes], max_bytes: int | None) -> int:
    """Write `chunks` to `out` one at a time and return how many bytes were written; stop once more than
    `max_bytes` have been (the result is then over `max_bytes`, and `out` holds only the start).

    >>> import io
    >>> out = io.BytesIO()
    >>> copy_bounded([b"ab", b"cd", b"ef"], out, 3), out.getvalue()
    (4, b'abcd')
    """
    total = 0
    for chunk in chunks:
        out.write(chunk)
        total += len(chunk)
        if max_bytes is not None and total > max_bytes:
            break
    return total


def tar_chunks(members: Iterable[tuple[tarfile.TarInfo, IO[bytes] | None]]) -> Iterator[bytes]:
    """A tar of `members` (a header, and for a regular file its `size` bytes read from its stream), made
    piece by piece: no piece is larger than `CHUNK_BYTES`, whatever the files' sizes.

    >>> import io
    >>> info = tarfile.TarInfo("w/a.txt"); info.size = 2
    >>> tar = b"".join(tar_chunks([(info, io.BytesIO(b"hi"))]))
    >>> tarfile.open(fileobj=io.BytesIO(tar)).extractfile("w/a.txt").read()
    b'hi'
    """
    for info, data in members:
        yield info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        if not info.isreg() or info.size == 0:
            continue
        if data is None:
            raise SandboxError(f"no content for {info.name} ({info.size} bytes)")
        left = info.size
        while left:
            piece = data.read(min(CHUNK_BYTES, left))
            if not piece:
                raise SandboxError(f"{info.name} ended {left} bytes short of its {info.size}")
            left -= len(piece)
            yield piece
        if info.size % tarfile.BLOCKSIZE:
            yield tarfile.NUL * (tarfile.BLOCKSIZE - info.size % tarfile.BLOCKSIZE)
    yield tarfile.NUL * (2 * tarfile.BLOCKSIZE)


class ChunkReader(io.RawIOBase):
    """A read-only stream over pieces of bytes (what `tarfile.open(mode="r|")` reads a `TarStream` from).

    >>> ChunkReader([b"ab", b"", b"cd"]).read()
    b'abcd'
    """

    def __init__(self, chunks: Iterable[bytes]) -> None:
        super().__init__()
        self._chunks = iter(chunks)
        self._piece = b""
        self._at = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while self._at == len(self._piece):
            piece = next(self._chunks, None)
            if piece is None:
                return 0
            self._piece, self._at = piece, 0
        view = memoryview(buffer).cast("B")
        end = min(len(self._piece), self._at + len(view))
        view[: end - self._at] = memoryview(self._piece)[self._at : end]
        taken, self._at = end - self._at, end
        return taken
