"""The demo's processes, by PID: ``belayer serve`` in its own process group (`GatewayRun`), every worker
it was seen with, and, from ``/proc``, which of their groups still hold a live process."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from belayer.cli.demo.findings import DemoFailed, Json, say
from core.net import free_port


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    state: str
    ppid: int
    pgid: int


def processes() -> list[Proc]:
    """Every process on this (Linux) machine, from ``/proc``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = (
                stat.read_text().rsplit(")", 1)[1].split()
            )  # after the command name, which may hold spaces
            found.append(Proc(int(stat.parent.name), fields[0], int(fields[1]), int(fields[2])))
    return found


def live_groups(pgids: Iterable[int]) -> list[int]:
    """Those of `pgids` that still hold a process that is not a zombie."""
    wanted = set(pgids)
    return sorted({p.pgid for p in processes() if p.pgid in wanted and p.state != "Z"})


def _rss_mb(pid: int) -> float:
    with contextlib.suppress(OSError, ValueError, StopIteration):
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
        return int(line.split()[1]) / 1024
    return 0.0


def _port(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        return int(argv[argv.index("--port") + 1])
    return None


@dataclass
class GatewayRun:
    """``belayer serve --workers 2 --shadows 1`` in its own process group, with every worker PID it
    was seen with (the workers are process groups of their own, launched by the gateway)."""

    model_dir: str
    worker_kind: str
    tmp: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    worker_pids: set[int] = field(default_factory=set)
    ready: bool = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.tmp / "gateway.log"

    def start(self) -> None:
        argv = [sys.executable, "-m", "belayer.cli", "serve", "--model", self.model_dir,
                "--workers", "2", "--shadows", "1", "--worker-kind", self.worker_kind,
                "--port", str(self.port), "--store", str(self.tmp / "trajectories.db"),
                "--log-dir", str(self.tmp / "logs")]  # fmt: skip
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def exit_cause(self) -> str:
        """The gateway's own last words (a start-up error is one line on its stderr, in the log)."""
        try:
            lines = [x for x in self.log.read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return ""
        return lines[-1].strip() if lines else ""

    def wait_ready(self, timeout: float, every: float = 10.0) -> None:
        """Until ``/health`` answers 200 (the gateway listens once its workers are up), with a progress
        line every `every` seconds from the worker processes themselves."""
        assert self.proc is not None
        started = last = time.monotonic()
        while not self._healthy():
            if self.proc.poll() is not None:
                cause = self.exit_cause()
                raise DemoFailed(
                    f"the gateway exited with {self.proc.returncode} while starting"
                    + (f": {cause}" if cause else "")
                )
            now = time.monotonic()
            if now - started > timeout:
                raise DemoFailed(f"the gateway was not ready after {timeout:.0f} s")
            kids = self._workers_launched()
            if now - last >= every:
                last = now
                say(f"  {now - started:3.0f} s: {self._start_progress(kids)}")
            time.sleep(0.25)
        self.ready = True

    def _healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def _workers_launched(self) -> list[int]:
        """The gateway's child processes (its workers, each the leader of its own process group),
        remembered: every one is checked at the end."""
        if self.proc is None:
            return []
        kids = [p.pid for p in processes() if p.ppid == self.proc.pid]
        self.worker_pids.update(kids)
        return kids

    def _start_progress(self, kids: list[int]) -> str:
        answering = 0
        for pid in kids:
            port = _port(pid)
            with contextlib.suppress(httpx.HTTPError):
                answering += (
                    port is not None and httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).is_success
                )
        groups = set(kids)  # a worker's own children (vLLM's engine core) count too
        rss = sum(_rss_mb(p.pid) for p in processes() if p.pgid in groups) / 1024
        return f"{len(kids)} worker processes loading the model, {answering} answering, {rss:.1f} GB resident"

    def get(self, path: str) -> Any:
        r = httpx.get(f"{self.url}{path}", timeout=30)
        r.raise_for_status()
        return r.json()

    def engines(self) -> list[Json]:
        engines: list[Json] = self.get("/api/engines")["data"]
        self.worker_pids.update(e["pid"] for e in engines if e.get("pid"))
        return engines

    def stop(self) -> list[int]:
        """SIGTERM the gateway's group (it stops its workers), SIGKILL it after 60 s, or after 3 s while
        it is still starting (it acts on SIGTERM only once its workers are up); then every worker group
        it was seen with must be gone: those left 10 s later are killed (SIGKILL) and returned."""
        if self.proc is not None:
            self._workers_launched()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            deadline = time.monotonic() + (60 if self.ready else 3)
            while self.proc.poll() is None and time.monotonic() < deadline:
                self._workers_launched()  # one still starting may launch workers meanwhile
                time.sleep(0.2)
            if self.proc.poll() is None:
                self._workers_launched()
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        deadline = time.monotonic() + 10
        while (left := live_groups(self.worker_pids)) and time.monotonic() < deadline:
            time.sleep(0.2)  # the gateway stops its workers on the way out
        for pgid in left:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)  # the whole group: a worker's own children too
        return left
