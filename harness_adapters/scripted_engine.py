"""A scripted "policy" for harness tests: a fake vLLM engine that plays an agent's turns in the tiny
model's token space, so that a real harness (Claude Code, mini-swe-agent) runs a whole episode.

Each request's prompt ids are decoded with the model's own tokenizer; the reply is chosen by how many
assistant turns the prompt already holds (turn 0, 1, 2…; the last one repeats), so side requests and
retries cannot shift the script. Several scripts can share one engine: a prompt plays the first script
whose ``marker`` it contains; a prompt that matches none (a harness's side query: a title, a summary)
gets ``FALLBACK``. Every reply is the encoded text plus the EOS id, logged with its prompt.

Forks (``fork_turn``, ``fork_answers``): a forked session's first call repeats its parent's prompt
exactly, so the engine tells them apart by session, which the gateway names in each engine request's
``X-Request-Id`` (`engine_request_id`). The first session to ask at script turn ``fork_turn`` (the
parent) gets ``turns[fork_turn]``; each other session asking with exactly that prompt (a fork child
retrying its parent's call) gets the next of ``fork_answers``, in order of the sessions' first arrival
(the last repeats), and keeps it when it asks again. A request that names no session counts as a new
one. Give each answer a marker of its own and put a script with that marker before this one: from
then on each child plays its own.

A failover resubmits the prompt plus the tokens already generated: when the prompt ends with the
start of this turn's reply, the engine answers only the rest (logged with ``resumed`` = tokens kept).
``crash`` (``--crash TURN:TOKENS``) makes the engine *process* exit after streaming TOKENS tokens of
script turn TURN (before answering, for a non-streamed request): a real engine death mid-episode.
Never in a resubmission, and with ``--crash-once FILE`` only in the first engine to get there, so
that several engines behind one gateway give exactly one failover.

Example (a Hermes tool call, then a final answer)::

    script = Script(marker="TASK-7", turns=[tool_call("bash", {"command": "ls"}), "Done."])
    engine = ScriptedEngine.load(".cache/tiny-model", [script])
    uvicorn.run(engine.fake().app(), port=8100)

or ``python -m harness_adapters.scripted_engine --model-dir DIR --script s.json --port 8100 --log out.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from engine_pool.fake import FakeEngine
from gateway.policy.tokenization import ChatTokenizer

ASSISTANT = "<|im_start|>assistant\n"
FALLBACK = "OK."


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One Hermes-style call, exactly as the tiny template renders it.

    >>> print(tool_call("bash", {"command": "ls"}))
    <tool_call>
    {"name": "bash", "arguments": {"command": "ls"}}
    </tool_call>
    """
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


class Script(BaseModel):
    """What the scripted policy says: ``turns[k]`` answers a prompt holding k assistant turns."""

    turns: list[str] = Field(min_length=1)
    marker: str | None = Field(default=None, description="text every main-loop prompt contains")
    fork_turn: int | None = Field(default=None, ge=0, description="the turn a fork's children diverge at")
    fork_answers: list[str] = Field(default_factory=list, description="later requests' answers there")


class ScriptFile(BaseModel):
    scripts: list[Script] = Field(min_length=1)


@dataclass(frozen=True, slots=True)
class Emission:
    prompt_ids: list[int]
    output_ids: list[int]
    turn: int | None  # None: the fallback answer to a side request
    script: int | None = None  # which script answered
    resumed: int = 0  # tokens of the reply already in the prompt (a failover's resubmission)
    session: str | None = None  # the session the gateway named in the request's id


@dataclass(slots=True)
class ScriptedEngine:
    tokenizer: ChatTokenizer
    scripts: list[Script]
    eos_id: int
    emitted: list[Emission] = field(default_factory=list)
    log_path: Path | None = None
    crash_at: tuple[int, int] | None = None  # (script turn, tokens streamed): exit the process there
    crash_once: Path | None = None  # created by the engine that crashes; none crashes if it exists
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _assistant: list[int] = field(default_factory=list)
    _crash_memo: tuple[list[int], bool] | None = None
    # script -> (the fork turn's prompt, each session that asked with it -> its place in order of arrival)
    _fork_requests: dict[int, tuple[list[int], dict[object, int]]] = field(default_factory=dict)

    @classmethod
    def load(
        cls, model_dir: str | Path, scripts: list[Script], log_path: Path | None = None
    ) -> ScriptedEngine:
        tok = ChatTokenizer.load(model_dir)
        return cls(tok, scripts, tok.encode(tok.eos_token)[0], log_path=log_path)

    def reply(self, prompt: list[int], session: str | None = None) -> list[int]:
        turn, which, out = self._answer(prompt)
        resumed = self._already_generated(prompt, out)
        if not resumed and which is not None and turn == self.scripts[which].fork_turn:
            out = self._fork_answer(which, prompt, out, session)
        self._record(Emission(list(prompt), out[resumed:], turn, which, resumed, session))
        return out[resumed:]

    def _answer(self, prompt: list[int]) -> tuple[int | None, int | None, list[int]]:
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        which = next((i for i, s in enumerate(self.scripts) if s.marker is None or s.marker in text), None)
        turn: int | None = None
        answer = FALLBACK
        if which is not None:
            turns = self.scripts[which].turns
            turn = min(max(text.count(ASSISTANT) - 1, 0), len(turns) - 1)
            answer = turns[turn]
        return turn, which, [*self.tokenizer.encode(answer), self.eos_id]

    def _fork_answer(self, which: int, prompt: list[int], out: list[int], session: str | None) -> list[int]:
        """The parent's answer at the fork turn to the first session, a child's to each other one asking
        with exactly that prompt (another prompt there, a side query, gets the parent's answer)."""
        with self._lock:
            first, sessions = self._fork_requests.setdefault(which, (prompt, {}))
            if prompt != first:
                return out
            seen = sessions.setdefault(object() if session is None else session, len(sessions))
        answers = self.scripts[which].fork_answers
        if seen == 0 or not answers:
            return out
        return [*self.tokenizer.encode(answers[min(seen, len(answers)) - 1]), self.eos_id]

    def _already_generated(self, prompt: list[int], out: list[int]) -> int:
        """How many of `out`'s tokens end the prompt, after its last assistant header."""
        if not self._assistant:
            self._assistant = self.tokenizer.encode(ASSISTANT)
        h = len(self._assistant)
        starts = [i + h for i in range(len(prompt) - h, -1, -1) if prompt[i : i + h] == self._assistant]
        if not starts:
            return 0
        partial = prompt[starts[0] :]
        return len(partial) if partial and out[: len(partial)] == partial else 0

    def crash_hook(self, prompt: list[int], sent: int | None) -> None:
        """`FakeEngine.crash`: exit the process at `crash_at` (the first time only, being dead after)."""
        if self.crash_at is None:
            return
        turn, tokens = self.crash_at
        if self._crash_memo is None or self._crash_memo[0] is not prompt:  # once per request
            at, _, out = self._answer(prompt)
            self._crash_memo = (prompt, at == turn and not self._already_generated(prompt, out))
        if not self._crash_memo[1] or (sent is not None and sent < tokens):
            return
        if self.crash_once is not None:
            try:
                self.crash_once.open("x").close()
            except FileExistsError:
                return
        os._exit(17)

    def _record(self, emission: Emission) -> None:
        with self._lock:
            self.emitted.append(emission)
            if self.log_path is not None:
                with self.log_path.open("a") as f:
                    row = {"prompt_ids": emission.prompt_ids, "output_ids": emission.output_ids}
                    extra = {
                        "turn": emission.turn,
                        "script": emission.script,
                        "resumed": emission.resumed,
                        "session": emission.session,
                    }
                    f.write(json.dumps({**row, **extra}) + "\n")

    def fake(
        self, model: str = "scripted", max_model_len: int = 65536, token_delay: float = 0.0
    ) -> FakeEngine:
        crash = self.crash_hook if self.crash_at is not None else None
        return FakeEngine(
            model=model,
            session_script=self.reply,
            max_model_len=max_model_len,
            token_delay=token_delay,
            crash=crash,
        )


def read_log(path: Path) -> list[Emission]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [
        Emission(
            r["prompt_ids"],
            r["output_ids"],
            r["turn"],
            r.get("script"),
            r.get("resumed", 0),
            r.get("session"),
        )
        for r in rows
    ]


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(description="serve a scripted agent policy as a fake vLLM engine")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--script", required=True, help="JSON file: {scripts: [{turns: [...], marker}, ...]}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-model-len", type=int, default=65536)
    p.add_argument("--log", help="append each emission (prompt_ids, output_ids) as a JSON line")
    p.add_argument("--crash", help="TURN:TOKENS: exit after streaming TOKENS tokens of script turn TURN")
    p.add_argument("--crash-once", help="a file: only the engine that creates it crashes")
    p.add_argument("--token-delay", type=float, default=0.0, help="seconds per streamed token")
    args = p.parse_args(argv)
    scripts = ScriptFile.model_validate_json(Path(args.script).read_text()).scripts
    engine = ScriptedEngine.load(args.model_dir, scripts, Path(args.log) if args.log else None)
    if args.crash:
        turn, tokens = (int(x) for x in args.crash.split(":"))
        engine.crash_at = (turn, tokens)
        engine.crash_once = Path(args.crash_once) if args.crash_once else None
    app = engine.fake(max_model_len=args.max_model_len, token_delay=args.token_delay).app()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
