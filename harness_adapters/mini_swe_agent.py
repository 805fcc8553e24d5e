"""mini-swe-agent (PyPI ``mini-swe-agent``) against a session's OpenAI endpoint, through LiteLLM's
``openai/`` provider with ``api_base`` set to the session base URL.

It lives in a venv of its own (it pins LiteLLM and friends). With ``Episode.sandbox`` set, its commands
run in that Belayer sandbox (``plugins/belayer_mini_env.py``) instead of the local shell. Its default config (``mini.yaml``, 2.x)
asks for a ``bash`` tool call per step (``{"command": ...}``), not a fenced ```bash block (that is
``mini_textbased.yaml``), and it finishes when a command prints ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``.
What it sends: non-streamed ``POST /v1/chat/completions`` with ``model``, ``messages`` and ``tools``
only (no ``max_tokens``, no sampling parameters).

Example::

    mini = MiniSweAgent(Path(".cache/harness"))
    mini.install()
    outcome = mini.run(Episode("make greet() return 'hi'", repo), "http://127.0.0.1:8000/s/ses_1/v1")
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from core.errors import HarnessError
from harness_adapters.base import Episode, HarnessAdapter, Outcome

VERSION = "2.4.6"
PLUGINS = Path(__file__).resolve().parent / "plugins"
TRAJECTORY = "mini.traj.json"


class MiniSweAgent(HarnessAdapter):
    name = "mini-swe-agent"

    def __init__(self, root: Path, model: str = "policy") -> None:
        super().__init__(root)
        self.model = model
        self.venv = self.root / "mini-venv"

    @property
    def executable(self) -> Path:
        return self.venv / "bin" / "mini"

    def installed_version(self) -> str | None:
        if not self.executable.exists():
            return None
        py = str(self.venv / "bin" / "python")
        code = "import importlib.metadata as m; print(m.version('mini-swe-agent'))"
        proc = subprocess.run([py, "-c", code], capture_output=True, text=True, check=False)
        return proc.stdout.strip() if proc.returncode == 0 else None

    def install(self) -> None:
        if self.installed_version() == VERSION:
            return
        if not (self.venv / "bin" / "python").exists():
            subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True, timeout=300)
        pip = [str(self.venv / "bin" / "python"), "-m", "pip", "install", "-q", f"mini-swe-agent=={VERSION}"]
        proc = subprocess.run(pip, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0 or self.installed_version() != VERSION:
            raise HarnessError(f"pip install mini-swe-agent=={VERSION} failed: {proc.stderr[-2000:]}")

    def env(self, session_base_url: str, home: Path) -> dict[str, str]:
        return {
            "PYTHONPATH": str(PLUGINS),  # belayer_mini_env, for commands run in a Belayer sandbox
            "OPENAI_API_KEY": "dummy",
            "MSWEA_CONFIGURED": "1",  # skip the first-run setup prompt
            "MSWEA_SILENT_STARTUP": "1",
            "MSWEA_GLOBAL_CONFIG_DIR": str(home / "mini-swe-agent"),
            "MSWEA_COST_TRACKING": "ignore_errors",  # 'policy' has no price
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # don't fetch the cost map from the internet
        }

    def command(self, episode: Episode, session_base_url: str, home: Path, inside: bool = False) -> list[str]:
        if inside:
            raise HarnessError("mini-swe-agent runs beside its sandbox (its environment is the sandbox)")
        where: list[str] = []
        if episode.sandbox is not None:
            sb = episode.sandbox
            where = [
                "-c", "environment.environment_class=belayer_mini_env.BelayerEnvironment",
                "-c", f"environment.gateway={sb.gateway}",
                "-c", f"environment.session={sb.session_id}",
                "-c", f"environment.cwd={sb.workdir}",
            ]  # fmt: skip
        return [
            str(self.executable),
            "--model", f"openai/{self.model}",
            "-c", "mini.yaml",
            "-c", f"model.model_kwargs.api_base={session_base_url}",
            "-c", f"agent.step_limit={episode.max_turns}",
            "--yolo", "--exit-immediately",
            "--task", episode.task,
            "--output", str(home / TRAJECTORY),
            *where,
        ]  # fmt: skip

    def collect(self, proc: subprocess.CompletedProcess[str], home: Path, duration_s: float) -> Outcome:
        path = home / TRAJECTORY
        report = json.loads(path.read_text()) if path.exists() else {}
        info = report.get("info", {})
        ok = proc.returncode == 0 and info.get("exit_status") == "Submitted"
        summary = {k: v for k, v in info.items() if k != "config"} | {"messages": report.get("messages", [])}
        return Outcome(proc.returncode, ok, proc.stdout, proc.stderr, duration_s, summary)
