"""The demo's episode (`Episode`: three turns through the ``openai`` and ``anthropic`` SDKs, the last
streamed) and the ``kill -9`` of the worker serving its streamed answer, mid-answer (`Killer`)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from belayer.cli.demo.findings import Json, say
from belayer.cli.demo.processes import GatewayRun

SYSTEM = "You are a careful coding agent."
USER_TURNS = (
    "List the files in the repository.",
    "Open the failing test and tell me what it checks.",
    "Fix the bug in add() and explain the change.",
)
BASH = {
    "name": "bash",
    "description": "Run a shell command in the sandbox",
    "schema": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}
OPENAI_TOOLS = [
    {
        "type": "function",
        "function": {"name": BASH["name"], "description": BASH["description"], "parameters": BASH["schema"]},
    }
]
ANTHROPIC_TOOLS = [{"name": BASH["name"], "description": BASH["description"], "input_schema": BASH["schema"]}]
SHORT_TURN = 24  # tokens of the two turns before the streamed one


@dataclass
class Episode:
    """One session: turn 0 through the ``openai`` SDK with a tool, turn 1 through the ``anthropic`` SDK
    at the session's Anthropic base URL, turn 2 through ``openai``, streamed. SDK retries are off, so
    any error the gateway let through would reach this client."""

    session: Json
    texts: list[str] = field(default_factory=list)
    chunks: int = 0
    finish_reason: str | None = None
    streamed: threading.Event = field(default_factory=threading.Event)
    """Set once the streamed answer has ended (or failed)."""

    @property
    def id(self) -> str:
        return str(self.session["id"])

    @property
    def anthropic_base_url(self) -> str:
        return str(self.session.get("anthropic_base_url") or self.session["base_url"].removesuffix("/v1"))

    def run(self, max_tokens: int, before_stream: Callable[[], None] = lambda: None) -> None:
        from anthropic import Anthropic
        from openai import OpenAI

        oai: Any = OpenAI(base_url=self.session["base_url"], api_key="unused", max_retries=0, timeout=600)
        ant: Any = Anthropic(base_url=self.anthropic_base_url, api_key="unused", max_retries=0, timeout=600)
        history: list[Json] = [{"role": "user", "content": USER_TURNS[0]}]
        first = oai.chat.completions.create(
            model="policy", messages=[{"role": "system", "content": SYSTEM}, *history],
            tools=OPENAI_TOOLS, temperature=0.0, max_tokens=SHORT_TURN,
        )  # fmt: skip
        self.texts.append(first.choices[0].message.content or "")
        history += [
            {"role": "assistant", "content": self.texts[0]},
            {"role": "user", "content": USER_TURNS[1]},
        ]
        second = ant.messages.create(
            model="policy", system=SYSTEM, messages=history, tools=ANTHROPIC_TOOLS, max_tokens=SHORT_TURN,
            extra_body={"temperature": 0.0},  # greedy; the 2.x SDK has no argument for it
        )  # fmt: skip
        self.texts.append("".join(b.text for b in second.content if b.type == "text"))
        history += [
            {"role": "assistant", "content": self.texts[1]},
            {"role": "user", "content": USER_TURNS[2]},
        ]
        before_stream()
        try:
            stream = oai.chat.completions.create(
                model="policy", messages=[{"role": "system", "content": SYSTEM}, *history],
                tools=OPENAI_TOOLS, temperature=0.0, max_tokens=max_tokens, stream=True,
            )  # fmt: skip
            text = ""
            for chunk in stream:
                if not chunk.choices:
                    continue
                text += chunk.choices[0].delta.content or ""
                self.finish_reason = chunk.choices[0].finish_reason or self.finish_reason
                self.chunks += bool(chunk.choices[0].delta.content)
            self.texts.append(text)
        finally:
            self.streamed.set()


def new_session(url: str, run: str) -> Json:
    r = httpx.post(f"{url}/api/sessions", json={"metadata": {"task": "demo", "run": run}}, timeout=30)
    r.raise_for_status()
    session: Json = r.json()
    return session


@dataclass
class Killer:
    """``kill -9`` of the worker serving the streamed answer once the gateway has `after` of its tokens,
    at a point the demo controls, whatever the speed of the engine or of this client.

    Just before the answer is asked for (`start`), every active worker is stopped (SIGSTOP to its process
    group) and from then on runs only in short slices (SIGCONT, `slice_s`, SIGSTOP). Between slices,
    with no engine running, the demo reads how many tokens the gateway has from the serving worker
    (``in_flight_tokens`` of ``GET /api/engines``, the engine's own progress as the gateway received it).
    Once it has `after` of them, and not the whole answer, that worker is killed while stopped: provably
    in the middle of the answer. The other workers then run on. (Racing the client's reading against the
    engine failed on a fresh machine: the tiny model had finished the answer before the client read its
    32nd chunk.)"""

    gateway: GatewayRun
    episode: Episode
    after: int
    max_tokens: int
    slice_s: float = 0.02
    victim: Json | None = None
    at_token: int | None = None
    too_late: str | None = None
    """Why no worker was killed (None: one was)."""
    _frozen: list[int] = field(default_factory=list)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._frozen = [
            int(e["pid"]) for e in self.gateway.engines() if e["state"] == "ready" and e.get("pid")
        ]
        self._signal(signal.SIGSTOP)
        self._thread = threading.Thread(target=self._watch, name="demo-killer", daemon=True)
        self._thread.start()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _signal(self, sig: int) -> None:
        for pgid in self._frozen:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, sig)

    def _watch(self) -> None:
        deadline = time.monotonic() + 300
        try:
            while time.monotonic() < deadline:
                self._signal(signal.SIGCONT)
                time.sleep(self.slice_s)  # the engines' slice of time: how the demo paces them
                self._signal(signal.SIGSTOP)
                serving = next((e for e in self.gateway.engines() if e.get("in_flight_tokens")), None)
                if serving is None:
                    if self.episode.streamed.is_set():
                        self.too_late = (
                            f"the streamed answer ended before the gateway had {self.after} tokens of it"
                        )
                        return
                    continue  # not asked for yet, or still in its prompt
                tokens = max(serving["in_flight_tokens"])
                if tokens >= self.max_tokens:
                    self.too_late = f"the engine sent the whole answer ({tokens} tokens) within one slice"
                    return
                if tokens >= self.after:
                    os.kill(serving["pid"], signal.SIGKILL)
                    self._frozen.remove(int(serving["pid"]))
                    self.victim, self.at_token = serving, tokens
                    say(f"  kill -9 {serving['pid']} ({serving['name']}, serving this stream, stopped) "
                        f"after {tokens} of its tokens reached the gateway")  # fmt: skip
                    return
            self.too_late = "no worker served the streamed answer within 300 s"
        finally:
            self._signal(signal.SIGCONT)  # every worker but the killed one runs on
