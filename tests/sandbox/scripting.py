"""The sandbox tests' shared pieces: the scripted policy (step i's tool call, chosen from the prompt
alone); an engine whose every reply takes a while is ``engine_pool.fake.LatentEngine``."""

from __future__ import annotations

import json
from collections.abc import Callable

from gateway.policy.tokenization import ChatTokenizer
from sandbox.workloads import SHELL_COUNTER_SERVER as COUNTER_SERVER

__all__ = ["COUNTER_SERVER", "TOOLS", "scripted", "step_of"]

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
