"""The ``oracle`` harness: a Harbor task's reference solution (``solution/solve.sh``) run in the episode's
sandbox, as Harbor's OracleAgent runs it; it makes no model call. For checking a task (its image, its
tests and its solution agree: reward 1.0) before an RL run spends episodes on it.

It runs beside the sandbox, through the session's capability URL only (like any harness beside it): one
command unpacks solution/ at ``/solution`` (a tar, base64 in the command, unpacked by the sandbox's own
busybox), one runs ``/solution/solve.sh`` by its path (its ``#!`` line picks the interpreter) from the
working directory, with ``DEBIAN_FRONTEND=noninteractive`` and ``[solution].env``, its output to
``/logs/agent/oracle.txt``, within the task's agent time limit (at most an hour: the exec route's).

Example::

    belayer run-episode --harness oracle --task datasets/hello-world     # reward 1.0, or the task is broken
"""

from __future__ import annotations

import base64
import io
import subprocess
import tarfile
import time
from pathlib import Path
from typing import Any

import httpx

from core.errors import HarnessError
from harness_adapters.base import Episode, HarnessAdapter, Outcome
from harness_adapters.harbor_task import load_harbor, resolve_env
from sandbox.supervisor import BUSYBOX

LOG = "/logs/agent/oracle.txt"
MAX_EXEC_S = 3600.0


class Oracle(HarnessAdapter):
    name = "oracle"

    def __init__(self, root: Path, model: str = "policy") -> None:
        super().__init__(root)
        self.model = model  # unused: the oracle asks no model

    def install(self) -> None:
        """Nothing to install: solve.sh runs with what the task's image has."""

    def command(self, episode: Episode, session_base_url: str, home: Path, inside: bool = False) -> list[str]:
        raise HarnessError("the oracle runs no program of its own: it runs solution/solve.sh in the sandbox")

    def env(self, session_base_url: str, home: Path) -> dict[str, str]:
        return {}

    def collect(self, proc: subprocess.CompletedProcess[str], home: Path, duration_s: float) -> Outcome:
        return Outcome(proc.returncode, proc.returncode == 0, proc.stdout, proc.stderr, duration_s)

    def run(self, episode: Episode, session_base_url: str) -> Outcome:
        if episode.sandbox is None or episode.task_dir is None:
            raise HarnessError("the oracle needs the episode's sandbox and its task directory")
        solution = episode.task_dir / "solution"
        if not (solution / "solve.sh").is_file():
            raise HarnessError(f"task {episode.task_dir} has no solution/solve.sh for the oracle to run")
        env = {"DEBIAN_FRONTEND": "noninteractive"}
        if (episode.task_dir / "task.toml").is_file():
            env |= resolve_env(load_harbor(episode.task_dir)[0].solution_env, "solution.env")
        sb = episode.sandbox
        started = time.monotonic()
        with httpx.Client(
            base_url=f"{sb.gateway}/s/{sb.session_id}/sandbox", timeout=MAX_EXEC_S + 120
        ) as http:
            unpack = _exec(http, _unpack_command(solution), timeout_s=120)
            if unpack["exit_code"] != 0:
                raise HarnessError(
                    f"could not unpack solution/ in the sandbox: {unpack['stdout']}{unpack['stderr']}"
                )
            timeout = min(episode.timeout_s, MAX_EXEC_S)
            ran = _exec(
                http, f"{BUSYBOX} mkdir -p /logs/agent && /solution/solve.sh > {LOG} 2>&1",
                timeout_s=timeout, cwd=sb.workdir, env=env,
            )  # fmt: skip
            log = _exec(http, f"{BUSYBOX} tail -c 65536 {LOG}", timeout_s=60)["stdout"]
        code = int(ran["exit_code"]) if ran.get("exit_code") is not None else -1
        report = {"solve_exit_code": code, "timed_out": bool(ran.get("timed_out")), "error": ran.get("error")}
        return Outcome(code, code == 0, log, str(ran.get("error") or ""), time.monotonic() - started, report)


def _unpack_command(solution: Path) -> str:
    """A command that writes solution/ to /solution (modes kept) with nothing but the sandbox's busybox."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(solution), arcname="solution", filter=_as_root)
    data = base64.encodebytes(buf.getvalue()).decode()
    return f"{BUSYBOX} base64 -d <<'BELAYER_SOLUTION' | {BUSYBOX} tar -x -C /\n{data}BELAYER_SOLUTION\n"


def _as_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _exec(http: httpx.Client, command: str, *, timeout_s: float, **extra: Any) -> dict[str, Any]:
    """One command through the capability URL; a refused or timed-out one as ``{"error": ...}``."""
    body = {"command": command, "timeout_s": timeout_s, "max_output_bytes": 1 << 20, **extra}
    response = http.post("/exec", json=body)
    if response.status_code == 200:
        return dict(response.json())
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        error = {"message": response.text[:500], "code": None}
    timed_out = "time" in str(error.get("code") or "") or "timed out" in str(error.get("message", ""))
    return {
        "exit_code": None,
        "stdout": "",
        "stderr": "",
        "error": error.get("message"),
        "timed_out": timed_out,
    }
