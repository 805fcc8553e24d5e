"""The harnesses `belayer run-episode --harness NAME` knows."""

from __future__ import annotations

from pathlib import Path

from core.errors import HarnessError
from harness_adapters.base import HarnessAdapter
from harness_adapters.claude_code import ClaudeCode
from harness_adapters.codex import Codex
from harness_adapters.mini_swe_agent import MiniSweAgent
from harness_adapters.opencode import OpenCode
from harness_adapters.openhands import OpenHands
from harness_adapters.oracle import Oracle

ADAPTERS: dict[str, type[HarnessAdapter]] = {
    ClaudeCode.name: ClaudeCode,
    Codex.name: Codex,
    MiniSweAgent.name: MiniSweAgent,
    OpenCode.name: OpenCode,
    OpenHands.name: OpenHands,
    Oracle.name: Oracle,
}


def adapter(name: str, root: Path, model: str = "policy") -> HarnessAdapter:
    """The adapter for harness `name`, installing under `root`."""
    if name not in ADAPTERS:
        raise HarnessError(f"unknown harness {name!r}; known: {', '.join(sorted(ADAPTERS))}")
    return ADAPTERS[name](root, model=model)  # type: ignore[call-arg]
