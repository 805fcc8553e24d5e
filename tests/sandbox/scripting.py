"""The sandbox tests' shared pieces: the scripted policy (step i's tool call, chosen from the prompt
alone) and an engine whose every reply takes a while (a real inference bubble)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from gateway.tokenization import ChatTokenizer
from sandbox.workloads import SHELL_COUNTER_SERVER as COUNTER_SERVER

__all__ = ["COUNTER_SERVER", "TOOLS", "LatentEngine", "scripted", "step_of"]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "run a shell command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


class LatentEngine:
    """An ASGI wrapper that makes each completion take `latency_s` first: an LLM call's bubble."""

    def __init__(self, app: Any, latency_s: float) -> None:
        self.app, self.latency_s = app, latency_s

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].endswith("/completions"):
            await asyncio.sleep(self.latency_s)
        await self.app(scope, receive, send)


def step_of(tok: ChatTokenizer, prompt: list[int]) -> int:
    """Which step a prompt asks for: the number of tool results it already holds."""
    return tok.decode(prompt).count("RESULT-")


def scripted(tok: ChatTokenizer, commands: list[str]) -> Callable[[list[int]], list[int]]:
    """A FakeEngine script: the bash call of step `step_of(prompt)`, then "All done."; retries and
    replays after a restore get the same answer."""
    eos = tok.encode(tok.eos_token)

    def script(prompt: list[int]) -> list[int]:
        step = step_of(tok, prompt)
        if step >= len(commands):
            return tok.encode("All done.") + eos
        call = {"name": "bash", "arguments": {"command": commands[step]}}
        return tok.encode(f"<tool_call>\n{json.dumps(call)}\n</tool_call>") + eos

    return script
