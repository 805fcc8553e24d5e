"""The sandbox exception tree.

Every error that leaves `sandbox/` is one of these; Docker's own errors are translated at one boundary
(`sandbox.docker_backend.docker_errors`), so callers never import `docker` to catch something::

    SandboxError                                 root of everything raised by sandbox/
    ├── SandboxUnavailable (ConnectionError)     the engine does not answer
    ├── SandboxNotFound (LookupError)            unknown or already destroyed sandbox / checkpoint
    ├── SandboxFileNotFound (FileNotFoundError)  read_file on a path that does not exist
    ├── PathEscapeError (ValueError)             a file path that leaves the sandbox's root
    ├── SandboxTimeout (TimeoutError)            exec ran past its timeout; carries partial output
    ├── CheckpointError                          checkpoint (filesystem or process dump) failed
    │   └── RestoreError                         restore from a checkpoint failed
    └── ImageBuildError                          building a sandbox image failed

Example::

    try:
        result = backend.exec(sandbox.id, "make test", timeout_s=60)
    except SandboxTimeout as exc:
        partial = exc.stdout
"""

from __future__ import annotations


class SandboxError(Exception):
    """Root of every exception raised by the sandbox package."""


class SandboxUnavailable(SandboxError, ConnectionError):
    """The container engine cannot be reached."""


class SandboxNotFound(SandboxError, LookupError):
    """The sandbox (or checkpoint) does not exist, or no longer exists."""


class SandboxFileNotFound(SandboxError, FileNotFoundError):
    """A file read from a sandbox does not exist."""


class PathEscapeError(SandboxError, ValueError):
    """A file path resolves outside the sandbox's root directory."""


class SandboxTimeout(SandboxError, TimeoutError):
    """A command ran past its timeout and was killed; `stdout`/`stderr` hold what it printed."""

    def __init__(self, message: str, *, stdout: str = "", stderr: str = "") -> None:
        super().__init__(message)
        self.stdout = stdout
        self.stderr = stderr


class CheckpointError(SandboxError):
    """Taking a checkpoint (filesystem snapshot or CRIU process dump) failed."""


class RestoreError(CheckpointError):
    """Restoring a sandbox from a checkpoint failed."""


class ImageBuildError(SandboxError):
    """Building or importing a sandbox image failed."""
