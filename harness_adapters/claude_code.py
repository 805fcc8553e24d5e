"""Claude Code (the ``@anthropic-ai/claude-code`` npm package, its native binary) against a session.

It appends ``/v1/messages?beta=true`` to ``ANTHROPIC_BASE_URL`` itself, so the base URL is the session
root ``http://host:port/s/{id}``. What it sends (2.1.197): streamed ``POST /v1/messages`` with
``max_tokens`` 32000, ``thinking: {type: adaptive}``, ``context_management``, ``output_config.effort``,
an ``anthropic-beta`` header list, a ``system`` of three text blocks (the first a per-request billing
header) and a mid-conversation ``system`` message; plus a ``HEAD`` of the base URL. Every model name
(main and small/fast) is set to the served name, so no alias is needed. Non-essential traffic is off:
otherwise it also asks for a session title with structured output (``output_config.format``), which
the gateway rejects and which would land in the session as an extra turn.

Running as root it refuses ``--dangerously-skip-permissions``; ``acceptEdits`` plus an explicit tool
allow-list needs no prompt for the tools a script uses.

Example::

    cc = ClaudeCode(Path(".cache/harness"))
    cc.install()
    outcome = cc.run(Episode("make greet() return 'hi'", repo), "http://127.0.0.1:8000/s/ses_1/v1")
"""

from __future__ import annotations

import json
import platform
import subprocess
from pathlib import Path

from harness_adapters.base import Episode, NpmHarness, Outcome, session_root

VERSION = "2.1.197"
PACKAGE = "@anthropic-ai/claude-code"
ALLOWED_TOOLS = "Bash Read Edit Write Glob Grep"


INSIDE_BINARY = "/usr/local/bin/claude"


class ClaudeCode(NpmHarness):
    name = "claude-code"
    inside = True  # its linux binary runs in the python (Debian) sandbox image
    package, version = PACKAGE, VERSION

    def __init__(
        self, root: Path, model: str = "policy", tools: str | None = None, max_retries: int = 2
    ) -> None:
        super().__init__(root)
        self.model = model
        self.max_retries = max_retries  # its own retries of failed API calls (default 10, with backoff)
        self.tools = tools  # --tools: the built-in tools offered (None: all of them, ~21k tokens of schemas)

    def binary(self) -> Path:
        """The platform's native binary (the wrapper's ``bin/claude.exe`` is only a copy of it)."""
        arch = {"x86_64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "x64")
        native = self.prefix / "node_modules" / "@anthropic-ai" / f"claude-code-linux-{arch}" / "claude"
        return native if native.exists() else self.prefix / "node_modules" / ".bin" / "claude"

    def env(self, session_base_url: str, home: Path) -> dict[str, str]:
        return {
            "ANTHROPIC_BASE_URL": session_root(session_base_url),
            "ANTHROPIC_API_KEY": "dummy",
            "ANTHROPIC_MODEL": self.model,
            "ANTHROPIC_SMALL_FAST_MODEL": self.model,
            "ANTHROPIC_DEFAULT_HAIKU_MODEL": self.model,
            "ANTHROPIC_DEFAULT_SONNET_MODEL": self.model,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": self.model,
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
            "CLAUDE_CODE_MAX_RETRIES": str(self.max_retries),
        }

    def image_files(self) -> dict[str, Path]:
        return {INSIDE_BINARY: self.binary().resolve()}

    def command(self, episode: Episode, session_base_url: str, home: Path, inside: bool = False) -> list[str]:
        program = INSIDE_BINARY if inside else str(self.binary())
        cmd = [program, "-p", episode.task, "--model", self.model, "--output-format", "json"]
        cmd += ["--max-turns", str(episode.max_turns), "--permission-mode", "acceptEdits"]
        cmd += ["--allowedTools", ALLOWED_TOOLS, "--no-session-persistence"]
        if self.tools is not None:
            cmd += ["--tools", self.tools]
        return cmd

    def collect(self, proc: subprocess.CompletedProcess[str], home: Path, duration_s: float) -> Outcome:
        try:
            report = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {}
        except json.JSONDecodeError:
            report = {}
        ok = proc.returncode == 0 and report.get("is_error") is False
        return Outcome(proc.returncode, ok, proc.stdout, proc.stderr, duration_s, report)
