"""The RL demo's task: call a tool with the right argument, then answer with what it returned.

An episode is two turns. The user names a key; the policy must call ``lookup`` with that key (the
gateway parses its ``<tool_call>`` into an OpenAI tool call), the tool answers with the key's value,
and the policy must answer with exactly that value. The verifier is programmatic: a quarter for the
call of the right key, three quarters for an answer that is what the tool returned, so rewards lie in
[0, 1]:

>>> reward("red", [("lookup", '{"key": "red"}')], TABLE["red"], TABLE["red"])
1.0
>>> reward("red", [("lookup", '{"key": "blue"}')], TABLE["blue"], TABLE["blue"])
0.75
>>> reward("red", [("lookup", '{"key": "red"}')], TABLE["red"], "nine")
0.25
>>> reward("red", [], None, "seven")
0.0

Why the weights: the tiny model learns to copy the tool's answer (a few tokens back) within a minute
of training, but not the key from the user's message (some twenty tokens back) in this budget, even
with clean supervision (measured: the right key's probability stays at chance after 400 supervised
steps). So the answer is what RL can teach it here; the key is scored, and reported, all the same.

The keys are written in the user's message as in the call (``key: "red"``: the same tokens, and no
two keys share their first token). The right call is a copy from the prompt, the right answer a copy from the tool's message: both are
within a 2-layer model's reach. The randomly initialised tiny model never emits a tool call, so the
trainer first gives it a short supervised warm-up (`warm_up_episodes`) on episodes that are right only
``correct`` of the time (the other keys and answers drawn at random): the warmed-up policy has the
format and a weak preference for the right choices, and reinforcement learning has to do the rest.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass
from typing import Any

KEYS = ("red", "blue", "green", "black", "white", "pink", "orange", "cyan")
VALUES = ("seven", "three", "nine", "four", "eight", "five", "two", "six")
TABLE = dict(zip(KEYS, VALUES, strict=True))
"""The tool's table: what ``lookup(key)`` returns."""
UNKNOWN = "unknown"
"""The tool's answer to a key it does not hold (or a call it cannot read)."""

SYSTEM = "Look up the key with the tool, then answer with the value it returns."
TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "The value of a key",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}
TOOLS = [TOOL]


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of the task (a GRPO group runs it G times)."""

    key: str

    @classmethod
    def of(cls, messages: list[dict[str, Any]]) -> Prompt:
        """The prompt whose `messages` these are (a trainer's dataset carries the messages).

        >>> Prompt.of(Prompt("cyan").messages())
        Prompt(key='cyan')
        """
        return cls(json.loads(messages[-1]["content"].removeprefix("key: ")))

    def messages(self) -> list[dict[str, Any]]:
        return [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"key: {json.dumps(self.key)}"},
        ]


def prompts(rng: random.Random, n: int) -> list[Prompt]:
    return [Prompt(rng.choice(KEYS)) for _ in range(n)]


def called_key(calls: list[tuple[str, str]]) -> str | None:
    """The key of the first ``lookup`` call, or None (no call, another tool, unreadable arguments).

    >>> called_key([("lookup", '{"key": "gold"}')]), called_key([("lookup", "{oops")]), called_key([])
    ('gold', None, None)
    """
    for name, arguments in calls[:1]:
        try:
            args = json.loads(arguments)
        except ValueError:
            return None
        if name == "lookup" and isinstance(args, dict) and isinstance(args.get("key"), str):
            return str(args["key"])
    return None


def tool_answer(key: str | None) -> str:
    return TABLE.get(key or "", UNKNOWN)


TABLE_DIR = "/workspace/table"
"""With sandboxes: where the episode's first command writes the table, one file per key."""


def setup_command() -> str:
    """With sandboxes: the episode's first command, which writes the tool's table into its sandbox (so a
    sandbox that dies must come back with it: restored from a checkpoint, or this command replayed).

    >>> setup_command()[:58]
    'mkdir -p /workspace/table && cd /workspace/table && echo s'
    """
    writes = " && ".join(f"echo {value} > {key}" for key, value in TABLE.items())
    return f"mkdir -p {TABLE_DIR} && cd {TABLE_DIR} && {writes}"


def lookup_command(key: str | None) -> str:
    """With sandboxes: the tool call as a command in the episode's sandbox, whose output is the answer.
    A key that is not a plain lower-case word never reaches the shell.

    >>> lookup_command("red")
    'cat /workspace/table/red 2>/dev/null || echo unknown'
    >>> lookup_command("red; rm -rf /"), lookup_command(None)
    ('echo unknown', 'echo unknown')
    """
    if key is None or re.fullmatch(r"[a-z]{1,32}", key) is None:
        return f"echo {UNKNOWN}"
    return f"cat {TABLE_DIR}/{key} 2>/dev/null || echo {UNKNOWN}"


def reward(key: str, calls: list[tuple[str, str]], returned: str | None, answer: str | None) -> float:
    """A quarter for a ``lookup`` of the prompt's key, three quarters for a final answer equal to what
    the tool returned (`returned`; None when there was no call: then no answer can earn it)."""
    right_call = called_key(calls) == key
    faithful = returned is not None and answer is not None and answer.strip() == returned
    return 0.25 * right_call + 0.75 * faithful


def call_text(key: str) -> str:
    """What the policy writes to call the tool (the Hermes form the gateway parses)."""
    return '<tool_call>\n{"name": "lookup", "arguments": {"key": ' + json.dumps(key) + "}}\n</tool_call>"


@dataclass(frozen=True, slots=True)
class WarmUpEpisode:
    """A synthetic episode for the supervised warm-up: the prompt's key, the key called, the answer."""

    key: str
    called: str
    answer: str


def warm_up_episodes(rng: random.Random, n: int, correct: float) -> list[WarmUpEpisode]:
    """`n` episodes whose call, and separately whose answer, is right with probability `correct` (else
    drawn uniformly: right by chance 1/len(KEYS) of the time too)."""
    out = []
    for _ in range(n):
        key = rng.choice(KEYS)
        called = key if rng.random() < correct else rng.choice(KEYS)
        answer = TABLE[called] if rng.random() < correct else rng.choice(VALUES)
        out.append(WarmUpEpisode(key, called, answer))
    return out
