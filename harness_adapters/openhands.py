"""OpenHands (PyPI ``openhands-sdk`` + ``openhands-tools``) against a session's OpenAI endpoint: the SDK's
own ``Agent`` and ``LocalConversation`` loop, its LLM on LiteLLM's ``openai/`` provider with ``base_url``
the session URL and ``api_mode="chat"``.

**Beside the sandbox, tools in it.** OpenHands runs here, in a venv of its own under ``root`` (the SDK
needs Python 3.12+, which the sandbox images' Debian Python is not, and its ~650 MB of dependencies
would have to go into every task image), and its ``terminal`` and ``file_editor`` tools act on the
session's sandbox through the gateway's sandbox API (``plugins/belayer_openhands.py``, its module
docstring says how). The SDK's seam for this is a tool's executor: a ``ToolDefinition`` subclass
registered under its own name whose ``create`` hands OpenHands' own tool (same name, schema and
description) a Belayer executor. Its ``RemoteWorkspace`` is the other seam, but it drives an OpenHands
agent server inside the sandbox, which is the same 3.12 problem. So, as for mini-swe-agent, a
sandbox failure is the gateway's to hide (restore + replay), and forking is not offered (OpenHands'
memory is in this process, not in a checkpoint).

Its tools as the model calls them: ``terminal`` ``{"command", "is_input"?, "timeout"?, "reset"?}``,
``file_editor`` ``{"command": view|create|str_replace|insert|undo_edit, "path", "file_text"?,
"old_str"?, "new_str"?, "insert_line"?, "view_range"?}``, ``task_tracker``, and the built-in
``finish`` ``{"message"}`` (which ends the episode) and ``think``. What it sends (1.58.2): non-streamed
``POST /v1/chat/completions`` with ``model``, ``messages`` (contents as lists of text parts), ``tools``,
``reasoning_effort: "high"`` and ``prompt_cache_key`` (its conversation id); no ``tool_choice``, no
``max_tokens``, no sampling parameters. A reply with no tool call is its answer to the user: the
episode ends there. Telemetry: none is configured (no ``LMNR_*`` or
``OTEL_*`` variables), and LiteLLM's cost map is its local copy.

Prefix reuse: OpenHands sends its history back exactly as the gateway gave it (tool-call ids,
argument strings, content as text parts), tool errors included (a call to no tool it has, or with
arguments its schema refuses, comes back as an error message for that call), so every request extends
the previous one. It branches only when its condenser summarises: once the history passes 80 events it
asks the same session for a summary (a request of its own) and replaces the middle of the history with
it, keeping the first 4 events; the next request branches there.

The interpreter: ``$BELAYER_OPENHANDS_PYTHON``, else the first Python 3.12+ found as ``python3.13`` /
``python3.12`` / ``python3`` on PATH or in pyenv's versions; the packages come from PyPI, pinned.

Example::

    oh = OpenHands(Path(".cache/harness"))
    oh.install()
    outcome = oh.run(Episode("fix the test", tmp, sandbox=SandboxRef(gateway, sid)), session_base_url)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

from core.errors import HarnessError
from harness_adapters.base import Episode, HarnessAdapter, Outcome

VERSION = "1.58.2"
PACKAGES = ("openhands-sdk", "openhands-tools")
PLUGIN = Path(__file__).resolve().parent / "plugins" / "belayer_openhands.py"
REPORT = "openhands.report.json"
MIN_PYTHON = (3, 12)


def find_python() -> str:
    """A Python >= 3.12 for OpenHands' venv (see the module docstring)."""
    explicit = os.environ.get("BELAYER_OPENHANDS_PYTHON")
    candidates: list[str | None] = [explicit] if explicit else []
    candidates += [shutil.which(n) for n in ("python3.13", "python3.12", "python3")]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    if pyenv.is_dir():
        candidates += [str(p / "bin" / "python3") for p in sorted(pyenv.iterdir(), reverse=True)]
    for candidate in candidates:
        if candidate and _version(candidate) >= MIN_PYTHON:
            return candidate
    raise HarnessError(
        "OpenHands needs Python 3.12 or newer and none was found; set BELAYER_OPENHANDS_PYTHON to one"
    )


def _version(python: str) -> tuple[int, int]:
    code = "import sys; print(sys.version_info[0], sys.version_info[1])"
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=30, check=False)
        major, minor = proc.stdout.split()
        return int(major), int(minor)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return (0, 0)


class OpenHands(HarnessAdapter):
    name = "openhands"

    def __init__(self, root: Path, model: str = "policy", command_timeout_s: float = 120.0) -> None:
        super().__init__(root)
        self.model = model
        self.command_timeout_s = command_timeout_s
        self.venv = self.root / "openhands-venv"

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def installed_version(self) -> str | None:
        if not self.python.exists():
            return None
        code = (
            "import importlib.metadata as m; print(m.version('openhands-sdk'), m.version('openhands-tools'))"
        )
        proc = subprocess.run([str(self.python), "-c", code], capture_output=True, text=True, check=False)
        versions = set(proc.stdout.split()) if proc.returncode == 0 else set()
        return versions.pop() if len(versions) == 1 else None

    def install(self) -> None:
        if self.installed_version() == VERSION:
            return
        if not self.python.exists():
            venv = [find_python(), "-m", "venv", "--clear", str(self.venv)]
            subprocess.run(venv, check=True, timeout=300, capture_output=True)
        specs = [f"{p}=={VERSION}" for p in PACKAGES]
        pip = [str(self.python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *specs]
        proc = subprocess.run(pip, capture_output=True, text=True, timeout=1800, check=False)
        if proc.returncode != 0 or self.installed_version() != VERSION:
            raise HarnessError(f"pip install {' '.join(specs)} failed: {proc.stderr[-2000:]}")

    def env(self, session_base_url: str, home: Path) -> dict[str, str]:
        return {
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # don't fetch the cost map from the internet
            "OPENAI_API_KEY": "dummy",
            "OH_PERSISTENCE_DIR": str(home / ".openhands"),
            "OPENHANDS_SUPPRESS_BANNER": "1",
            "LOG_LEVEL": "WARNING",
            "LOG_TO_FILE": "false",
            "PYTHONUNBUFFERED": "1",
        }

    def command(self, episode: Episode, session_base_url: str, home: Path, inside: bool = False) -> list[str]:
        if inside:
            raise HarnessError("openhands runs beside its sandbox (its tools act on the sandbox)")
        if episode.sandbox is None:
            raise HarnessError("openhands needs the episode's sandbox (Episode.sandbox)")
        sb = episode.sandbox
        return [
            str(self.python), str(PLUGIN),
            "--base-url", session_base_url,
            "--model", self.model,
            "--gateway", sb.gateway,
            "--session", sb.session_id,
            "--cwd", sb.workdir,
            "--task", episode.task,
            "--max-iterations", str(episode.max_turns),
            "--command-timeout", f"{self.command_timeout_s:g}",
            "--output", str(home / REPORT),
        ]  # fmt: skip

    def collect(self, proc: subprocess.CompletedProcess[str], home: Path, duration_s: float) -> Outcome:
        path = home / REPORT
        report = json.loads(path.read_text()) if path.exists() else {}
        ok = proc.returncode == 0 and report.get("status") == "finished"
        return Outcome(proc.returncode, ok, proc.stdout, proc.stderr, duration_s, report)
