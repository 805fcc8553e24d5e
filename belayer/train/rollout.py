"""One episode of the RL demo's task through a Belayer session, with the official ``openai`` SDK.

The session is the episode: it is created with the GRPO group in its metadata, the policy's two turns
go to the session's own base URL (the gateway templates, tokenizes and records them), the verifier's
reward is attached, and the session is closed, which puts it on the finished feed the trainer reads.

Example::

    async with AsyncBelayer(url) as gw:
        result = await run_episode(gw, Prompt("red"), group="g7", step=2, max_tokens=48)
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from belayer.client import AsyncBelayer, AsyncSession
from belayer.train import task

MODEL = "policy"
"""The model name the episodes ask for (any name that no ``--aux-model`` pattern routes elsewhere)."""


Tool = Callable[[str | None], Awaitable[str]]
"""The ``lookup`` tool: the called key (None: unreadable) to the answer the policy is shown."""


async def in_process(key: str | None) -> str:
    """The tool without a sandbox: the table, read in this process."""
    return task.tool_answer(key)


@dataclass(frozen=True, slots=True)
class Played:
    """What `play` saw of one episode."""

    reward: float
    calls: list[tuple[str, str]]
    """The policy's tool calls: (name, JSON arguments)."""
    answer: str | None
    """The policy's final answer; None without a tool call."""
    returned: str | None
    """What the tool returned; None without a tool call."""


@dataclass(frozen=True, slots=True)
class EpisodeResult:
    session: str
    group: str
    key: str
    reward: float
    calls: list[tuple[str, str]]
    answer: str | None
    tool_answer_wrong: bool = False
    """The tool (in a sandbox) answered other than the table holds: the sandbox lost its state."""


async def newest_rows(gw: AsyncBelayer, metadata: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The export rows of the sessions whose metadata matches, one per session: its newest branch (a
    session whose history was rewritten has several), by session id. Nothing is marked exported."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rows.jsonl"
        await gw.export(path, metadata=metadata, mark=False)
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    newest: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["session_id"] not in newest or row["branch"] > newest[row["session_id"]]["branch"]:
            newest[row["session_id"]] = row
    return newest


async def play(
    s: AsyncSession,
    prompt: task.Prompt,
    *,
    max_tokens: int,
    temperature: float = 1.0,
    seed: int | None = None,
    timeout: float = 600.0,
    tool: Tool = in_process,
    sampling: str | None = None,
) -> Played:
    """Play `prompt` in the open session `s` through the ``openai`` SDK, calling `tool` for a tool call.
    `sampling` (``"keyed"``: ``core.keyed``) goes in each turn's body (the SDK's ``extra_body``); None:
    the gateway's. The SDK makes no retries of its own: an error the gateway lets through reaches the
    caller."""
    from openai import AsyncOpenAI

    oai = AsyncOpenAI(base_url=s.openai_base_url, api_key="belayer", max_retries=0, timeout=timeout)
    try:
        messages: list[dict[str, Any]] = prompt.messages()
        request: dict[str, Any] = {"model": MODEL, "messages": messages, "tools": task.TOOLS,
                                   "temperature": temperature, "max_tokens": max_tokens}  # fmt: skip
        if seed is not None:
            request["seed"] = seed
        if sampling is not None:
            request["extra_body"] = {"sampling": sampling}
        first = await oai.chat.completions.create(**request)
        message = first.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []
                 if c.type == "function"]  # fmt: skip
        returned = answer = None
        if calls:
            returned = await tool(task.called_key(calls))
            messages.append(message.model_dump(exclude_none=True))
            tool_call_id = message.tool_calls[0].id if message.tool_calls else "call_0"
            messages.append({"role": "tool", "tool_call_id": tool_call_id, "content": returned})
            second = await oai.chat.completions.create(**request)
            answer = second.choices[0].message.content
    finally:
        await oai.close()
    return Played(task.reward(prompt.key, calls, returned, answer), calls, answer, returned)


async def run_episode(
    gw: AsyncBelayer,
    prompt: task.Prompt,
    *,
    group: str,
    step: int,
    max_tokens: int,
    temperature: float = 1.0,
    seed: int | None = None,
    sandbox: Mapping[str, Any] | None = None,
    live: set[str] | None = None,
    session_seed: int | None = None,
    sampling: str | None = None,
    metadata: Mapping[str, Any] | None = None,
) -> EpisodeResult:
    """Run `prompt` as one episode in a new session of `group` (metadata: ``group``, ``key``, ``step``,
    the trainer's step when it started, and `metadata`'s); its reward attached, the session closed.
    `session_seed` is the session's seed, `sampling` each turn's (`play`): with ``"keyed"`` and no
    request `seed`, the episode's tokens are a function of the policy and `session_seed` alone.

    With `sandbox` (a sandbox spec, ``{"image": ...}``) the session gets its own sandbox: the episode's
    first command writes the tool's table there (`task.setup_command`), and the tool runs in it
    (`task.lookup_command`). The session's id is in `live` while it is open and set up."""
    meta = {"group": group, "key": prompt.key, "step": step, **(metadata or {})}
    async with gw.session(metadata=meta, sandbox=sandbox, seed=session_seed) as s:

        async def sandboxed(key: str | None) -> str:
            return str((await s.exec(task.lookup_command(key)))["stdout"]).strip()

        tool = in_process if sandbox is None else sandboxed
        if sandbox is not None:
            await s.exec(task.setup_command())

        if live is not None:
            live.add(s.id)
        try:
            played = await play(s, prompt, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                tool=tool, sampling=sampling)  # fmt: skip
        finally:
            if live is not None:
                live.discard(s.id)
        wrong = played.returned is not None and played.returned != task.tool_answer(
            task.called_key(played.calls)
        )
        await s.reward(
            played.reward,
            {"calls": len(played.calls), "answer": played.answer, "tool_answer": played.returned},
        )
    return EpisodeResult(
        s.id, group, prompt.key, played.reward, played.calls, played.answer, tool_answer_wrong=wrong
    )


async def lookup_episode(
    s: AsyncSession, raw_prompt: list[dict[str, Any]], sampling_params: dict[str, Any]
) -> float:
    """The task's episode as verl's and TRL's adapters call one: the prompt's messages in, the reward out."""
    temperature = float(sampling_params.get("temperature", 1.0))
    return (await play(s, task.Prompt.of(raw_prompt), max_tokens=40, temperature=temperature)).reward
