"""The sandbox seam: one ABC (`SandboxBackend`) and the values that cross it.

A sandbox is an isolated container in which an agent runs commands through persistent shell
*sessions*: the working directory and shell variables set by one `exec` are there for the next one.
A checkpoint captures the sandbox's filesystem and its running processes together; `restore` brings
both back in a new sandbox, even after the original is gone.

Example::

    backend: SandboxBackend = DockerSandboxBackend(DockerBackendConfig())
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
import posixpath
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator

from core.errors import PathEscapeError, SandboxArgumentError
from sandbox.network import SandboxNetwork

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_SESSION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")

DEFAULT_SESSION = "main"


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


@dataclass(frozen=True, slots=True)
class SandboxStatus:
    """Whether a sandbox still runs, and why not."""

    running: bool
    exit_code: int | None = None
    oom_killed: bool = False
    detail: str = ""

    @property
    def failure_kind(self) -> str:
        return "oom" if self.oom_killed else "exited"


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
    def read_file(self, sandbox_id: str, path: str) -> bytes:
        """Return a regular file's bytes; `path` is absolute under, or relative to, the workdir."""

    @abc.abstractmethod
    def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        """Create or replace a file (parents are created); same path rules as `read_file`."""

    @abc.abstractmethod
    def archive(self, sandbox_id: str, path: str) -> bytes:
        """A tar of the directory `path` (absolute) and everything under it, taken with the sandbox's
        processes frozen so that none of them changes a file halfway through. Member names start with
        the directory's own name (``/workspace`` → ``workspace/…``), as ``docker cp`` writes them."""

    @abc.abstractmethod
    def extract(self, sandbox_id: str, tar: bytes) -> None:
        """Unpack `tar` at the sandbox's root (member names are relative to ``/``). Paths resolve inside
        the sandbox: a link in it cannot send a file outside."""

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
        a gateway finds its own this way (`gateway.sandboxes.adoption`); [] when the backend cannot
        tell."""
        return []

    def has_checkpoint(self, checkpoint: Checkpoint) -> bool:
        """Whether `checkpoint`'s storage is still there to restore (e.g. after a restart)."""
        return True

    def changed_paths(self, sandbox_id: str) -> list[tuple[str, str]]:
        """What changed in the sandbox's filesystem since its image, as ``(kind, path)`` with kind
        ``added``, ``modified`` or ``deleted``, read from outside the sandbox; [] when the backend
        cannot tell."""
        return []

    def processes(self, sandbox_id: str) -> list[str]:
        """Command lines of the processes running in the sandbox besides its supervisor and session
        shells (what earlier commands left behind), read from outside it; [] when the backend cannot
        tell."""
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
