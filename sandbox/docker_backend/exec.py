"""The Docker backend's commands: one `exec` runs the supervisor's client (`sandbox.supervisor`), which
hands the command to a persistent shell session in the sandbox and reports its output, exit code and
whether it timed out; `parse_client_output` reads that report.
"""

from __future__ import annotations

import contextlib
import math
import shlex
import time

import docker.errors
import requests

from core.errors import SandboxError, SandboxTimeout
from sandbox import supervisor
from sandbox.backend import ExecResult, SandboxSpec, check_env_name, check_exec_args
from sandbox.docker_backend.containers import Containers
from sandbox.docker_backend.engine import DockerEngine, docker_errors
from sandbox.docker_backend.files import Files

_MAX_ARG_BYTES = 100_000  # one argv string may not exceed 128 KiB (MAX_ARG_STRLEN)


class Exec:
    """Commands in a sandbox's shell sessions, one at a time per sandbox."""

    def __init__(self, engine: DockerEngine, containers: Containers, files: Files) -> None:
        self._engine = engine
        self._api = engine.api
        self._containers = containers
        self._files = files

    def run(
        self, sandbox_id: str, command: str, *, timeout_s: float, cwd: str | None, env: dict[str, str] | None,
        session: str, max_output_bytes: int,
    ) -> ExecResult:  # fmt: skip
        """See `SandboxBackend.exec` (whose defaults `DockerSandboxBackend.exec` fills in)."""
        check_exec_args(session, timeout_s, max_output_bytes)
        spec = self._engine.spec(sandbox_id)
        script = build_script(command, cwd=cwd, env=env or {})
        with self._engine.lock(sandbox_id):
            started = time.monotonic()
            argv = self._client_argv(sandbox_id, spec, session, script, timeout_s, max_output_bytes)
            with docker_errors():
                exec_id = self._api.exec_create(sandbox_id, argv, user="0:0", workdir="/")["Id"]
                out, err = self._api.exec_start(exec_id, demux=True)
            elapsed = time.monotonic() - started
        try:
            return parse_client_output(out or b"", err or b"", max_output_bytes, elapsed, timeout_s)
        except SandboxTimeout:
            raise
        except SandboxError as exc:
            raise SandboxError(f"{exc}{self._failure_note(sandbox_id)}") from exc

    def _failure_note(self, sandbox_id: str) -> str:
        """Why the exec client may have failed: the container stopped, or its process slots ran out."""
        with contextlib.suppress(docker.errors.DockerException, requests.RequestException):
            self._api.wait(sandbox_id, timeout=1)  # a dying container: its state lags the broken exec
        try:
            status = self._containers.status(sandbox_id)
            if not status.running:
                return f"; {status.detail}"
            current = len(self._api.top(sandbox_id).get("Processes") or [])  # listed from the host
        except (SandboxError, docker.errors.DockerException):
            return ""
        limit = self._engine.spec(sandbox_id).pids_limit
        if limit - current > 4:  # an exec needs a few processes itself
            return ""
        return (
            f"; the sandbox is out of process slots ({current} processes, pids_limit {limit}): "
            "processes started by earlier commands hold them"
        )

    def _client_argv(
        self,
        sandbox_id: str,
        spec: SandboxSpec,
        session: str,
        script: str,
        timeout_s: float,
        max_output_bytes: int,
    ) -> list[str]:
        arg = script
        if len(script.encode()) > _MAX_ARG_BYTES:
            self._files.upload(sandbox_id, supervisor.large_script_path(session), script.encode(), 0o644)
            arg = supervisor.LARGE_SCRIPT
        timeout_cs = str(max(1, math.ceil(timeout_s * 100)))
        return [
            supervisor.BUSYBOX, "sh", supervisor.CLIENT, session, spec.shell, spec.workdir,
            timeout_cs, str(max_output_bytes), arg,
        ]  # fmt: skip


def build_script(command: str, *, cwd: str | None, env: dict[str, str]) -> str:
    """The text a session shell sources: apply cwd and env (they persist), then the command."""
    lines = []
    if cwd is not None:
        lines.append(f"cd -- {shlex.quote(cwd)} || return 1")
    lines.extend(f"export {check_env_name(k)}={shlex.quote(v)}" for k, v in env.items())
    lines.append(command)
    return "\n".join(lines)


def parse_client_output(out: bytes, err: bytes, limit: int, elapsed: float, timeout_s: float) -> ExecResult:
    """Split the exec client's output into an `ExecResult`, or raise `SandboxTimeout`."""
    cut = err.rfind(supervisor.TRAILER.encode())
    if cut < 0:
        raise SandboxError(f"sandbox exec client failed: {err[-2000:].decode(errors='replace')}")
    fields = dict(item.split("=", 1) for item in err[cut + len(supervisor.TRAILER) :].decode().split())
    stdout, stderr = out.decode(errors="replace"), err[:cut].decode(errors="replace")
    if fields["timeout"] == "1":
        raise SandboxTimeout(f"command timed out after {timeout_s:g}s", stdout=stdout, stderr=stderr)
    rc = fields.get("rc", "")
    return ExecResult(
        exit_code=int(rc) if rc.lstrip("-").isdigit() else 255,
        stdout=stdout,
        stderr=stderr,
        duration_s=elapsed,
        stdout_truncated=_cut(fields.get("out"), stdout, limit),
        stderr_truncated=_cut(fields.get("err"), stderr, limit),
    )


def _cut(size: str | None, shown: str, limit: int) -> bool:
    """Whether output was cut at `limit`; a size the client could not measure (no process left to
    fork under `pids_limit`) counts as cut when the output reaches the limit."""
    if size is not None and size.isdigit():
        return int(size) > limit
    return len(shown.encode()) >= limit
