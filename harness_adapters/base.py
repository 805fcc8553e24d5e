"""The harness seam: install a real agent program, point it at one gateway session, run it on a task
directory, and collect what it reports. The harness itself runs unchanged; only its command line and
environment name the session URL.

Example::

    adapter = ClaudeCode(root=Path(".cache/harness"))
    adapter.install()                                        # idempotent
    outcome = adapter.run(Episode(task="fix hello.py", workdir=repo), session_base_url)
    assert outcome.ok, outcome.stderr

``session_base_url`` is what ``POST /api/sessions`` returns (``http://host:port/s/{id}/v1``); each
adapter derives the form its harness wants from it.
"""

from __future__ import annotations

import abc
import json
import os
import shlex
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import HarnessError


@dataclass(frozen=True, slots=True)
class SandboxRef:
    """The session's sandbox, for a harness beside it that runs its commands there: through the routes
    under the session's capability URL, ``{gateway}/s/{session_id}/sandbox/...`` (`gateway.api.sandbox`),
    which need no API token. A harness is never given the token."""

    gateway: str  # the gateway's root URL
    session_id: str
    workdir: str = "/workspace"


@dataclass(frozen=True, slots=True)
class Episode:
    task: str
    workdir: Path
    max_turns: int = 8
    timeout_s: float = 180.0
    home: Path | None = None  # the harness's HOME (its config and state); a fresh temp dir if None
    sandbox: SandboxRef | None = None  # run the harness's commands in this sandbox (harnesses beside)
    task_dir: Path | None = None  # the task's directory here (the oracle reads its solution/ from it)


@dataclass(frozen=True, slots=True)
class Outcome:
    returncode: int
    ok: bool  # the harness says the episode finished without an error
    stdout: str
    stderr: str
    duration_s: float
    report: dict[str, Any] = field(default_factory=dict)  # the harness's own summary, parsed


class HarnessAdapter(abc.ABC):
    """One agent program. Subclasses say how to install it, how to call it and how to read its result.

    A harness with ``inside = True`` runs inside the task's sandbox (`belayer run-episode`): its
    `image_files` are added to the python sandbox image, and `inside_script` starts it there with
    `program(inside=True)`. Others run beside the sandbox, with `Episode.sandbox` naming it.
    """

    name: str
    inside: bool = False

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()  # where installs go, e.g. .cache/harness

    @abc.abstractmethod
    def install(self) -> None:
        """Install the harness under ``root`` unless it is already there."""

    @abc.abstractmethod
    def command(
        self, episode: Episode, session_base_url: str, home: Path, inside: bool = False
    ) -> list[str]: ...

    def image_files(self) -> dict[str, Path]:
        """Files (container path → host path) a sandbox image needs to run this harness inside."""
        raise HarnessError(f"{self.name} does not run inside a sandbox")

    def inside_script(self, episode: Episode, session_base_url: str, home: str, out_dir: str) -> str:
        """A shell script that runs the harness in the sandbox: stdout, stderr and the exit code go
        to files in `out_dir`."""
        env = self.env(session_base_url, Path(home)) | {"HOME": home, "LANG": "C.UTF-8"}
        argv = self.command(episode, session_base_url, Path(home), inside=True)
        lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
        lines += [
            f"mkdir -p {shlex.quote(home)} {shlex.quote(out_dir)}",
            f"cd {shlex.quote(str(episode.workdir))}",
            f"{shlex.join(argv)} </dev/null >{out_dir}/stdout 2>{out_dir}/stderr",
            f"echo $? >{out_dir}/rc",
        ]
        return "\n".join(lines) + "\n"

    @abc.abstractmethod
    def env(self, session_base_url: str, home: Path) -> dict[str, str]:
        """Variables added to a minimal environment: the session URL, a dummy key, telemetry off."""

    @abc.abstractmethod
    def collect(self, proc: subprocess.CompletedProcess[str], home: Path, duration_s: float) -> Outcome: ...

    def run(self, episode: Episode, session_base_url: str) -> Outcome:
        with tempfile.TemporaryDirectory(prefix=f"{self.name}-home-") as tmp:
            home = episode.home or Path(tmp)
            home.mkdir(parents=True, exist_ok=True)
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home), "LANG": "C.UTF-8"}
            env |= self.env(session_base_url, home)
            start = time.monotonic()
            proc = subprocess.run(
                self.command(episode, session_base_url, home),
                cwd=episode.workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=episode.timeout_s,
                check=False,
            )
            return self.collect(proc, home, time.monotonic() - start)


class NpmHarness(HarnessAdapter):
    """A harness shipped as an npm package with a native binary, installed under ``root/<name>``."""

    package: str
    version: str

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.prefix = self.root / self.name

    @abc.abstractmethod
    def binary(self) -> Path:
        """The platform's native binary inside the install."""

    def installed_version(self) -> str | None:
        manifest = self.prefix / "node_modules" / self.package / "package.json"
        if not manifest.exists() or not self.binary().exists():
            return None
        version: str = json.loads(manifest.read_text())["version"]
        return version

    def install(self) -> None:
        if self.installed_version() == self.version:
            return
        self.prefix.mkdir(parents=True, exist_ok=True)
        spec = f"{self.package}@{self.version}"
        cmd = ["npm", "install", "--prefix", str(self.prefix), "--no-audit", "--no-fund", spec]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0 or self.installed_version() != self.version:
            raise HarnessError(f"npm install {spec} failed: {proc.stderr[-2000:]}")


def session_root(session_base_url: str) -> str:
    """``http://h/s/{id}/v1`` → ``http://h/s/{id}`` (for clients that append ``/v1/...`` themselves)."""
    return session_base_url.rstrip("/").removesuffix("/v1")
