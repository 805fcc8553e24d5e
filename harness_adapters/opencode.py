"""OpenCode (the ``opencode-ai`` npm package, its native Bun binary) against a session's OpenAI endpoint.

It runs inside the task's sandbox (its tools work on the local filesystem). The provider is OpenCode's
built-in ``@ai-sdk/openai-compatible`` with ``baseURL`` = the session's ``/v1`` URL, given inline
(``OPENCODE_CONFIG_CONTENT``), so nothing is fetched at run time. What it sends (1.18.33): streamed
``POST /v1/chat/completions`` with ``max_tokens`` (the model's ``limit.output``), ``tools``,
``tool_choice: auto`` and ``stream_options.include_usage``; no sampling parameters. ``--title`` skips
its title side request; the models.dev fetch, autoupdate, sharing and LSP downloads are off. Its tools
(``bash``: command; ``edit``: filePath, oldString, newString; ``read``: filePath; ``write``; ``glob``;
``grep``) are allowed without asking; ``webfetch``, ``task`` (sub-agents), ``todowrite`` and ``skill``
are denied, which also takes them out of the prompt.

Its step limit (``agent.build.steps``) is soft: past it OpenCode asks for text but still runs tool
calls, so the episode's wall-clock timeout is what bounds a policy that never stops calling tools.

Example::

    oc = OpenCode(Path(".cache/harness"))
    oc.install()
    script = oc.inside_script(Episode("fix the test", Path("/workspace")), url, "/root", "/tmp/out")
"""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path
from typing import Any

from harness_adapters.base import Episode, NpmHarness, Outcome

VERSION = "1.18.33"
PACKAGE = "opencode-ai"
INSIDE_BINARY = "/usr/local/bin/opencode"
PROVIDER = "belayer"


class OpenCode(NpmHarness):
    name = "opencode"
    inside = True
    package, version = PACKAGE, VERSION

    def __init__(self, root: Path, model: str = "policy", max_output_tokens: int = 4096) -> None:
        super().__init__(root)
        self.model = model
        self.max_output_tokens = max_output_tokens

    def binary(self) -> Path:
        arch = {"x86_64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "x64")
        return self.prefix / "node_modules" / f"opencode-linux-{arch}" / "bin" / "opencode"

    def image_files(self) -> dict[str, Path]:
        return {INSIDE_BINARY: self.binary().resolve()}

    def config(self, session_base_url: str, max_turns: int) -> dict[str, Any]:
        deny = {tool: "deny" for tool in ("webfetch", "task", "todowrite", "skill")}
        limit = {"context": 65536, "output": self.max_output_tokens}
        return {
            "$schema": "https://opencode.ai/config.json",
            "provider": {
                PROVIDER: {
                    "npm": "@ai-sdk/openai-compatible",
                    "name": "Belayer",
                    "options": {"baseURL": session_base_url, "apiKey": "belayer"},
                    "models": {self.model: {"name": self.model, "limit": limit}},
                }
            },
            "model": f"{PROVIDER}/{self.model}",
            "small_model": f"{PROVIDER}/{self.model}",
            "autoupdate": False,
            "share": "disabled",
            "snapshot": False,
            "permission": {"*": "allow", **deny},
            "agent": {"build": {"steps": max_turns}},
        }

    def env(self, session_base_url: str, home: Path) -> dict[str, str]:
        return {
            "XDG_CONFIG_HOME": str(home / ".config"),
            "XDG_DATA_HOME": str(home / ".local" / "share"),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "XDG_STATE_HOME": str(home / ".local" / "state"),
            "OPENCODE_DISABLE_MODELS_FETCH": "1",
            "OPENCODE_DISABLE_AUTOUPDATE": "1",
            "OPENCODE_DISABLE_SHARE": "1",
            "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
            "OPENCODE_DISABLE_PROJECT_CONFIG": "1",  # a repository's opencode.json cannot change the setup
        }

    def command(self, episode: Episode, session_base_url: str, home: Path, inside: bool = False) -> list[str]:
        program = INSIDE_BINARY if inside else str(self.binary())
        config = json.dumps(self.config(session_base_url, episode.max_turns))
        # `env` puts the config in the environment without a file (the script exports the rest)
        return ["env", f"OPENCODE_CONFIG_CONTENT={config}", program, "run", "-m", f"{PROVIDER}/{self.model}",
                "--format", "json", "--title", "episode", episode.task]  # fmt: skip

    def collect(self, proc: subprocess.CompletedProcess[str], home: Path, duration_s: float) -> Outcome:
        events = []
        for line in proc.stdout.splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        errors = [e for e in events if e.get("type") == "error"]
        texts = [e["part"].get("text", "") for e in events if e.get("type") == "text"]
        tools = [e["part"].get("tool") for e in events if e.get("type") == "tool_use"]
        steps = sum(1 for e in events if e.get("type") == "step_finish")
        report = {"steps": steps, "tools": tools, "result": texts[-1] if texts else "", "errors": errors}
        ok = proc.returncode == 0 and not errors
        return Outcome(proc.returncode, ok, proc.stdout, proc.stderr, duration_s, report)
