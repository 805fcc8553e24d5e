"""Codex CLI (the ``@openai/codex`` npm package, its static native binary) against a session's Responses API.

It runs inside the task's sandbox (its ``exec_command`` tool runs in the container's shell). Its
provider is configured inline with ``-c`` overrides (``model_provider = "belayer"``,
``[model_providers.belayer]`` with ``base_url`` = the session's ``/v1`` URL and ``wire_api =
"responses"``), so no config file is needed, and ``CODEX_HOME`` is a fresh directory under the
harness's HOME. What it sends (0.171.0): streamed ``POST /v1/responses`` with ``store: false`` (its
whole input every time), ``reasoning: {summary: auto}``, ``parallel_tool_calls``, ``prompt_cache_key``
and ``client_metadata``, and the function tools ``exec_command`` (cmd, workdir, ...), ``write_stdin``,
``request_user_input`` and ``view_image``; no sampling parameters.

What would otherwise reach the network or be refused is off: the update check, analytics, feedback,
hosted web search, and the features whose tools the gateway refuses (a ``namespace`` tool, image
generation: ``multi_agent``, ``goals``, ``image_generation``) or that talk to OpenAI's services
(apps, plugins, tool suggestions); under ``strace``, a 15 s run connected to the provider URL only.
Its own sandbox and approvals are off (``-s danger-full-access``, ``approval_policy = "never"``):
the Belayer sandbox is the boundary. ``--ephemeral``: no session files. It has no step limit of its
own; the episode's wall-clock timeout bounds it. A reply cut at ``max_output_tokens`` (status
``incomplete``) fails its turn (exit 1), as Claude Code's does.

Example::

    codex = Codex(Path(".cache/harness"))
    codex.install()
    script = codex.inside_script(Episode("fix the test", Path("/workspace")), url, "/root", "/tmp/out")
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from harness_adapters.base import Episode, NpmHarness, Outcome

VERSION = "0.171.0"
PACKAGE = "@openai/codex"
INSIDE_BINARY = "/usr/local/bin/codex"
INSIDE_RG = "/usr/local/bin/rg"  # its file search shells out to ripgrep, shipped beside it
PROVIDER = "belayer"
# features that add a tool the gateway refuses, or that would reach outside the sandbox
DISABLED_FEATURES = (
    "multi_agent",
    "goals",
    "image_generation",
    "apps",
    "plugins",
    "remote_plugin",
    "tool_suggest",
)


def _toml(value: object) -> str:
    """A `-c key=value` value: TOML, which JSON's strings, numbers and booleans also are."""
    return json.dumps(value)


class Codex(NpmHarness):
    name = "codex"
    inside = True  # its static (musl) binary runs in the python (Debian) sandbox image
    package, version = PACKAGE, VERSION

    def __init__(self, root: Path, model: str = "policy", context_window: int = 65536) -> None:
        super().__init__(root)
        self.model = model
        self.context_window = context_window

    def install(self) -> None:
        """`npm install @openai/codex@VERSION` into ``root/codex`` unless it is there: a few minutes the
        first time (about 420 MB, the native binaries of its platform package), then nothing."""
        if self.installed_version() == self.version:
            return
        sys.stderr.write(
            f"[codex] npm install {self.package}@{self.version} into {self.prefix} (~420 MB, once)\n"
        )
        started = time.monotonic()
        super().install()
        sys.stderr.write(f"[codex] installed in {time.monotonic() - started:.1f}s\n")

    def vendor(self) -> Path:
        arch = {"x86_64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(platform.machine(), "x64")
        triple = {"x64": "x86_64", "arm64": "aarch64"}[arch] + "-unknown-linux-musl"
        return self.prefix / "node_modules" / "@openai" / f"codex-linux-{arch}" / "vendor" / triple

    def binary(self) -> Path:
        return self.vendor() / "bin" / "codex"

    def image_files(self) -> dict[str, Path]:
        return {
            INSIDE_BINARY: self.binary().resolve(),
            INSIDE_RG: (self.vendor() / "codex-path" / "rg").resolve(),
        }

    def config(self, session_base_url: str) -> dict[str, object]:
        """The `-c` overrides: the provider, and everything that would fetch or ask turned off."""
        return {
            "model": self.model,
            "model_provider": PROVIDER,
            f"model_providers.{PROVIDER}.name": "Belayer",
            f"model_providers.{PROVIDER}.base_url": session_base_url,
            f"model_providers.{PROVIDER}.wire_api": "responses",
            "model_context_window": self.context_window,
            "approval_policy": "never",
            "sandbox_mode": "danger-full-access",
            "web_search": "disabled",
            "check_for_update_on_startup": False,
            "analytics.enabled": False,
            "feedback.enabled": False,
            **{f"features.{feature}": False for feature in DISABLED_FEATURES},
        }

    def env(self, session_base_url: str, home: Path) -> dict[str, str]:
        return {"CODEX_HOME": str(home / ".codex")}

    def command(self, episode: Episode, session_base_url: str, home: Path, inside: bool = False) -> list[str]:
        program = INSIDE_BINARY if inside else str(self.binary())
        overrides = [
            arg for k, v in self.config(session_base_url).items() for arg in ("-c", f"{k}={_toml(v)}")
        ]
        # `mkdir` first: CODEX_HOME must exist (the script runs it under `sh -c`, then the harness)
        return ["sh", "-c", 'mkdir -p "$CODEX_HOME" && exec "$@"', "codex", program, "exec", *overrides,
                "--skip-git-repo-check", "--ephemeral", "-s", "danger-full-access", "--json", episode.task]  # fmt: skip

    def collect(self, proc: subprocess.CompletedProcess[str], home: Path, duration_s: float) -> Outcome:
        """Its ``--json`` stream: ``thread.started``, then per turn ``turn.started``, ``item.started`` /
        ``item.completed`` (agent_message, command_execution, reasoning, ...) and ``turn.completed`` with
        the usage, or ``turn.failed`` / ``error``."""
        events: list[dict[str, Any]] = []
        for line in proc.stdout.splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                events.append(event)
        items = [e.get("item") or {} for e in events if e.get("type") == "item.completed"]
        texts = [str(i.get("text", "")) for i in items if i.get("type") == "agent_message"]
        runs = [i for i in items if i.get("type") == "command_execution"]
        tools = [
            str(i.get("type")) for i in items if i.get("type") not in ("agent_message", "reasoning", "error")
        ]
        # `error` events: its retries ("Reconnecting...") and its last word; a failed turn ends the episode
        errors = [e for e in events if e.get("type") == "turn.failed"]
        error_events = [str(e.get("message", "")) for e in events if e.get("type") == "error"]
        warnings = [str(i.get("message", "")) for i in items if i.get("type") == "error"]
        usage = [e.get("usage") or {} for e in events if e.get("type") == "turn.completed"]
        report = {
            "tools": tools,
            "commands": [str(i.get("command", "")) for i in runs],
            "outputs": [str(i.get("aggregated_output", "")) for i in runs],
            "exit_codes": [i.get("exit_code") for i in runs],
            "result": texts[-1] if texts else "",
            "errors": errors,
            "error_events": error_events,
            "warnings": warnings,
            "usage": usage[-1] if usage else {},
            "turns": sum(1 for e in events if e.get("type") == "turn.completed"),
        }
        ok = proc.returncode == 0 and not errors and bool(usage)
        return Outcome(proc.returncode, ok, proc.stdout, proc.stderr, duration_s, report)
