"""A scripted "policy" for harness tests: a fake vLLM engine that plays an agent's turns in the tiny
model's token space, so that a real harness (Claude Code, mini-swe-agent) runs a whole episode.

Each request's prompt ids are decoded with the model's own tokenizer; the reply is chosen by how many
assistant turns the prompt already holds (turn 0, 1, 2…; the last one repeats), so side requests and
retries cannot shift the script. Several scripts can share one engine: a prompt plays the first script
whose ``marker`` it contains; a prompt that matches none (a harness's side query: a title, a summary)
gets ``FALLBACK``. Every reply is the encoded text plus the EOS id, logged with its prompt.

Example (a Hermes tool call, then a final answer)::

    script = Script(marker="TASK-7", turns=[bash_call("ls"), "Done."])
    engine = ScriptedEngine.load(".cache/tiny-model", [script])
    uvicorn.run(engine.fake().app(), port=8100)

or ``python -m harness_adapters.scripted_engine --model-dir DIR --script s.json --port 8100 --log out.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from engine_pool.fake import FakeEngine
from gateway.tokenization import ChatTokenizer

ASSISTANT = "<|im_start|>assistant\n"
FALLBACK = "OK."


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One Hermes-style call, exactly as the tiny template renders it."""
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


class Script(BaseModel):
    """What the scripted policy says: ``turns[k]`` answers a prompt holding k assistant turns."""

    turns: list[str] = Field(min_length=1)
    marker: str | None = Field(default=None, description="text every main-loop prompt contains")


class ScriptFile(BaseModel):
    scripts: list[Script] = Field(min_length=1)


@dataclass(frozen=True, slots=True)
class Emission:
    prompt_ids: list[int]
    output_ids: list[int]
    turn: int | None  # None: the fallback answer to a side request
    script: int | None = None  # which script answered


@dataclass(slots=True)
class ScriptedEngine:
    tokenizer: ChatTokenizer
    scripts: list[Script]
    eos_id: int
    emitted: list[Emission] = field(default_factory=list)
    log_path: Path | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def load(
        cls, model_dir: str | Path, scripts: list[Script], log_path: Path | None = None
    ) -> ScriptedEngine:
        tok = ChatTokenizer.load(model_dir)
        return cls(tok, scripts, tok.encode(tok.eos_token)[0], log_path=log_path)

    def reply(self, prompt: list[int]) -> list[int]:
        text = self.tokenizer.decode(prompt, skip_special_tokens=False)
        which = next((i for i, s in enumerate(self.scripts) if s.marker is None or s.marker in text), None)
        turn: int | None = None
        answer = FALLBACK
        if which is not None:
            turns = self.scripts[which].turns
            turn = min(max(text.count(ASSISTANT) - 1, 0), len(turns) - 1)
            answer = turns[turn]
        out = [*self.tokenizer.encode(answer), self.eos_id]
        self._record(Emission(list(prompt), out, turn, which))
        return out

    def _record(self, emission: Emission) -> None:
        with self._lock:
            self.emitted.append(emission)
            if self.log_path is not None:
                with self.log_path.open("a") as f:
                    row = {"prompt_ids": emission.prompt_ids, "output_ids": emission.output_ids}
                    extra = {"turn": emission.turn, "script": emission.script}
                    f.write(json.dumps({**row, **extra}) + "\n")

    def fake(self, model: str = "scripted", max_model_len: int = 65536) -> FakeEngine:
        return FakeEngine(model=model, script=self.reply, max_model_len=max_model_len)


def read_log(path: Path) -> list[Emission]:
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [Emission(r["prompt_ids"], r["output_ids"], r["turn"], r.get("script")) for r in rows]


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    p = argparse.ArgumentParser(description="serve a scripted agent policy as a fake vLLM engine")
    p.add_argument("--model-dir", required=True)
    p.add_argument("--script", required=True, help="JSON file: {scripts: [{turns: [...], marker}, ...]}")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-model-len", type=int, default=65536)
    p.add_argument("--log", help="append each emission (prompt_ids, output_ids) as a JSON line")
    args = p.parse_args(argv)
    scripts = ScriptFile.model_validate_json(Path(args.script).read_text()).scripts
    engine = ScriptedEngine.load(args.model_dir, scripts, Path(args.log) if args.log else None)
    app = engine.fake(max_model_len=args.max_model_len).app()
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
