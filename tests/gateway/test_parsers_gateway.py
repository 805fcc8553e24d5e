"""The model-family parsers through the in-process gateway: ``--tool-call-parser qwen3_coder
--reasoning-parser qwen3`` on the chat, Messages and Responses routes over the scripted fake engine.
The trajectory keeps the engine's exact ids; only the text's presentation changes."""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import AddedToken, Tokenizer

from belayer.testing.tiny_model import QWEN3_CODER_TEMPLATE, build_tiny
from core.errors import ConfigError
from engine_pool.fake import FakeEngine
from gateway.api.openai.protocol import Message
from gateway.api.openai.serving import normalize_messages
from gateway.config import FailoverConfig, GatewayConfig
from gateway.policy.tokenization import ChatTokenizer
from tests.support import GatewayHarness, asgi_gateway, serve_config

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
            },
        },
    }
]
THOUGHT = "\nThe user wants files.\n"
REPLY = (
    f"<think>{THOUGHT}</think>\n\nListing."
    "<tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n"
    "<parameter=timeout>\n30\n</parameter>\n</function>\n</tool_call>"
)
ARGS = '{"command": "ls -la", "timeout": 30}'


@pytest.fixture
def qwen_model_dir(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """The tiny model's tokenizer with the Qwen3-Coder-style XML template (``build-tiny --template
    qwen3_coder`` writes the same; the fake engine needs no weights)."""
    out = tmp_path / "qwen-tiny"
    out.mkdir()
    for name in ("tokenizer.json", "generation_config.json", "config.json"):
        shutil.copy(tiny_model_dir / name, out / name)
    cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    (out / "chat_template.jinja").write_text(QWEN3_CODER_TEMPLATE)
    return out


@pytest.fixture
async def qwen_gateway(tmp_path: Path, qwen_model_dir: Path) -> AsyncIterator[GatewayHarness]:
    engine = FakeEngine(max_model_len=4096)
    config = GatewayConfig(
        model=str(qwen_model_dir),
        store_path=str(tmp_path / "traj.db"),
        failover=FailoverConfig(no_worker_wait=0.3, stall_timeout=1.0),
        allowed_hosts=["gw"],
        tool_call_parser="qwen3_coder",
        reasoning_parser="qwen3",
    )
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as (app, client):
        yield GatewayHarness(app, client, engine)


async def turns(gw: GatewayHarness, sid: str) -> list[dict[str, Any]]:
    r = await gw.client.get(f"/api/sessions/{sid}/trajectory")
    assert r.status_code == 200
    result: list[dict[str, Any]] = r.json()["turns"]
    return result


def sse_data(text: str) -> list[dict[str, Any]]:
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


async def test_chat_reasoning_and_xml_tool_calls(qwen_gateway: GatewayHarness) -> None:
    gw = qwen_gateway
    [ids] = gw.queue_replies(REPLY)
    sid, base = await gw.new_session()
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
    r = await gw.client.post(
        f"{base}/chat/completions", json={"model": "policy", "messages": msgs, "tools": TOOLS}
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls"
    assert message["content"] == "\n\nListing."
    assert message["reasoning_content"] == message["reasoning"] == THOUGHT
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "bash", "arguments": ARGS}
    [turn] = await turns(gw, sid)
    assert turn["output_ids"] == ids  # the engine's exact ids, think tags and all
    assert turn["prompt_ids"] == gw.engine.requests[-1]["prompt"]
    assert turn["response"]["message"]["reasoning_content"] == THOUGHT

    # the harness sends the message back, reasoning and all: the next turn extends this one
    gw.queue_replies("<think>ok</think>Done.")
    msgs += [message, {"role": "tool", "tool_call_id": call["id"], "content": "a.py"}]
    r = await gw.client.post(
        f"{base}/chat/completions", json={"model": "policy", "messages": msgs, "tools": TOOLS}
    )
    assert r.json()["choices"][0]["message"]["content"] == "Done."
    first, second = await turns(gw, sid)
    assert second["parent_index"] == 0 and second["branch"] == 0
    assert second["prompt_ids"][: len(first["prompt_ids"]) + len(ids)] == first["prompt_ids"] + ids


async def test_chat_stream_deltas(qwen_gateway: GatewayHarness) -> None:
    gw = qwen_gateway
    [ids] = gw.queue_replies(REPLY)
    sid, base = await gw.new_session()
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": "go"}],
        "tools": TOOLS,
        "stream": True,
    }
    r = await gw.client.post(f"{base}/chat/completions", json=body)
    assert r.status_code == 200, r.text
    deltas = [c["choices"][0]["delta"] for c in sse_data(r.text) if c["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert reasoning == THOUGHT and content == "\n\nListing."
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "bash", ARGS)
    ]
    # every reasoning delta comes before the first content delta, and no tag reaches either
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, key=lambda k: k != "reasoning_content")
    assert "<" not in reasoning + content
    [turn] = await turns(gw, sid)
    assert turn["output_ids"] == ids


async def test_messages_thinking_block(qwen_gateway: GatewayHarness) -> None:
    gw = qwen_gateway
    gw.queue_replies(REPLY, REPLY)
    sid, base = await gw.new_session()
    anthropic_tools = [{"name": "bash", "input_schema": TOOLS[0]["function"]["parameters"]}]
    body: dict[str, Any] = {"model": "policy", "max_tokens": 200, "tools": anthropic_tools,
            "messages": [{"role": "user", "content": "list files"}]}  # fmt: skip
    url = base.removesuffix("/v1") + "/v1/messages"
    r = await gw.client.post(url, json=body)
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    assert [b["type"] for b in blocks] == ["thinking", "text", "tool_use"]
    assert blocks[0]["thinking"] == THOUGHT and blocks[0]["signature"]
    assert blocks[1]["text"] == "\n\nListing."
    assert blocks[2]["name"] == "bash" and blocks[2]["input"] == {"command": "ls -la", "timeout": 30}
    assert r.json()["stop_reason"] == "tool_use"
    r = await gw.client.post(url, json={**body, "stream": True})
    events = [(e.get("type"), e) for e in sse_data(r.text)]
    thinking = "".join(e["delta"]["thinking"] for t, e in events if t == "content_block_delta"
                       and e["delta"]["type"] == "thinking_delta")  # fmt: skip
    assert thinking == THOUGHT
    starts = [e["content_block"]["type"] for t, e in events if t == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    # Claude Code sends the blocks back as they came: the next turn extends the first one
    gw.queue_replies("Done.")
    result = {"type": "tool_result", "tool_use_id": blocks[2]["id"], "content": "a.py"}
    messages = [
        *body["messages"],
        {"role": "assistant", "content": blocks},
        {"role": "user", "content": [result]},
    ]
    r = await gw.client.post(url, json={**body, "messages": messages})
    assert r.status_code == 200, r.text
    _, second, third = await turns(gw, sid)  # the streamed turn made the same reply: the latest is matched
    assert third["parent_index"] == 1 and third["branch"] == second["branch"]
    base_ids = second["prompt_ids"] + second["output_ids"]
    assert third["prompt_ids"][: len(base_ids)] == base_ids


async def test_responses_reasoning_item(qwen_gateway: GatewayHarness) -> None:
    gw = qwen_gateway
    gw.queue_replies(REPLY, "Done.", REPLY)
    sid, base = await gw.new_session()
    tools = [{"type": "function", "name": "bash", "parameters": TOOLS[0]["function"]["parameters"]}]
    body = {"model": "policy", "input": "list files", "tools": tools}
    r = await gw.client.post(f"{base}/responses", json=body)
    assert r.status_code == 200, r.text
    output = r.json()["output"]
    assert [o["type"] for o in output] == ["reasoning", "message", "function_call"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert output[1]["content"][0]["text"] == "\n\nListing."
    assert output[2]["name"] == "bash" and output[2]["arguments"] == ARGS
    stored = await gw.client.get(f"{base}/responses/{r.json()['id']}")
    assert stored.json()["output"] == output

    # a next turn by previous_response_id extends the first one (its reasoning rendered back as generated)
    follow = {"model": "policy", "tools": tools, "previous_response_id": r.json()["id"],
              "input": [{"type": "function_call_output", "call_id": output[2]["call_id"], "output": "a.py"}]}  # fmt: skip
    r = await gw.client.post(f"{base}/responses", json=follow)
    assert r.status_code == 200, r.text
    first, second = await turns(gw, sid)
    assert second["parent_index"] == 0 and second["branch"] == 0
    assert second["prompt_ids"][: len(first["prompt_ids"] + first["output_ids"])] == (
        first["prompt_ids"] + first["output_ids"]
    )

    r = await gw.client.post(f"{base}/responses", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    assert kinds[2:4] == ["response.output_item.added", "response.reasoning_text.delta"]
    text = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert text == THOUGHT
    [done] = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert done["text"] == THOUGHT
    assert events[-1]["type"] == "response.completed"
    assert [o["type"] for o in events[-1]["response"]["output"]] == ["reasoning", "message", "function_call"]


async def test_forced_tool_choice_opens_an_xml_call(qwen_gateway: GatewayHarness) -> None:
    """A named tool_choice starts the turn with Qwen3-Coder's opening (not Hermes JSON); the model's
    continuation is parsed as a call, with no reasoning split off."""
    gw = qwen_gateway
    [ids] = gw.queue_replies("<parameter=command>\npwd\n</parameter>\n</function>\n</tool_call>")
    sid, base = await gw.new_session()
    body = {"model": "policy", "messages": [{"role": "user", "content": "where?"}], "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "bash"}}}  # fmt: skip
    r = await gw.client.post(f"{base}/chat/completions", json=body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert [c["function"] for c in message["tool_calls"]] == [
        {"name": "bash", "arguments": '{"command": "pwd"}'}
    ]
    assert "reasoning_content" not in message and message["content"] is None
    prefix = gw.gw.tokenizer.encode("<tool_call>\n<function=bash>\n")
    prompt = gw.engine.requests[-1]["prompt"]
    assert prompt[-len(prefix) :] == prefix
    [turn] = await turns(gw, sid)
    assert turn["prompt_ids"] == prompt and turn["output_ids"] == ids


async def test_xml_template_renders_the_calls_it_parses(qwen_gateway: GatewayHarness) -> None:
    """The Qwen3-Coder-style template renders a parsed call back in the XML the parser reads (same name,
    same typed arguments), and tool results as <tool_response> turns; a three-turn session reuses
    every earlier turn's exact ids."""
    gw = qwen_gateway
    replies = gw.queue_replies(REPLY, "<think>next</think>Found a.py.", "Bye.")
    sid, base = await gw.new_session()
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "list"},
    ]
    for _ in range(3):
        r = await gw.client.post(
            f"{base}/chat/completions", json={"model": "policy", "messages": msgs, "tools": TOOLS}
        )
        message = r.json()["choices"][0]["message"]
        msgs.append(message)
        for call in message.get("tool_calls") or []:
            msgs.append({"role": "tool", "tool_call_id": call["id"], "content": "a.py"})
        msgs.append({"role": "user", "content": "go on"})
    all_turns = await turns(gw, sid)
    assert [t["output_ids"] for t in all_turns] == replies
    assert [t["parent_index"] for t in all_turns] == [None, 0, 1]
    for prev, cur in itertools.pairwise(all_turns):
        base_ids = prev["prompt_ids"] + prev["output_ids"]
        assert cur["prompt_ids"][: len(base_ids)] == base_ids
    tok = gw.gw.tokenizer
    # as the gateway renders a request: reasoning_content back in <think>, arguments parsed
    rendered = tok.render(normalize_messages([Message.model_validate(m) for m in msgs[:4]]), TOOLS, False)
    assert (
        "<|im_start|>assistant\n<think>\nThe user wants files.\n</think>\n\nListing.\n<tool_call>\n<function=bash>\n"
        "<parameter=command>\nls -la\n</parameter>\n<parameter=timeout>\n30\n</parameter>\n</function>\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\na.py\n</tool_response><|im_end|>\n"
    ) in rendered


def test_xml_template_extends_each_prefix(qwen_model_dir: Path, tmp_path: Path) -> None:
    """Prefix reuse needs it: each conversation's rendering starts with the rendering of its prefixes."""
    tok = ChatTokenizer.load(qwen_model_dir)
    call = {
        "id": "c",
        "type": "function",
        "function": {"name": "bash", "arguments": {"command": "ls", "n": 2}},
    }
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "<think>t</think>b", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c", "content": "out"},
        {"role": "user", "content": "c"},
    ]
    for k in range(1, len(msgs)):
        assert tok.render(msgs, TOOLS, True).startswith(tok.render(msgs[:k], TOOLS, False))
    assert "<parameter=command>\nls\n</parameter>\n<parameter=n>\n2\n</parameter>\n" in tok.render(
        msgs, TOOLS, False
    )
    with pytest.raises(ConfigError, match="one of: hermes, qwen3_coder"):
        build_tiny(tmp_path / "nope", template="nope")
    assert not (tmp_path / "nope" / "model.safetensors").exists()


def test_serve_flags_and_config_keys(tiny_model_dir: Path, tmp_path: Path) -> None:
    """``--tool-call-parser``/``--reasoning-parser`` as ``vllm serve`` spells them; also TOML keys."""

    def config_of(argv: list[str]) -> GatewayConfig:
        return serve_config("--model", str(tiny_model_dir), *argv)

    plain = config_of([])
    assert (plain.tool_call_parser, plain.reasoning_parser) == ("hermes", None)
    config = config_of(["--tool-call-parser", "llama3_json", "--reasoning-parser", "deepseek_r1"])
    assert (config.tool_call_parser, config.reasoning_parser) == ("llama3_json", "deepseek_r1")
    toml = tmp_path / "belayer.toml"
    toml.write_text('tool_call_parser = "mistral"\nreasoning_parser = "qwen3"\n')
    config = config_of(["--config", str(toml)])
    assert (config.tool_call_parser, config.reasoning_parser) == ("mistral", "qwen3")
    with pytest.raises(ConfigError, match="--tool-call-parser"):
        config_of(["--tool-call-parser", "pythonic"])


async def test_mistral_tag_as_a_special_token(tmp_path: Path, tiny_model_dir: Path) -> None:
    """In Mistral's tokenizers ``[TOOL_CALLS]`` is a special token, which decoding usually skips: with
    ``--tool-call-parser mistral`` a chat turn decodes special tokens as text (EOS aside), as vLLM does."""
    model = tmp_path / "mistral-tiny"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    tokenizer = Tokenizer.from_file(str(model / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True, normalized=False)])
    tokenizer.save(str(model / "tokenizer.json"))
    tok = ChatTokenizer.load(model)
    reply = '[TOOL_CALLS][{"name": "bash", "arguments": {"command": "ls"}}]'
    assert tok.encode("[TOOL_CALLS]") == [tok.vocab_size - 1]
    skipped = tok.detokenizer()
    assert "".join(skipped.step(t) for t in tok.encode(reply)) == reply.removeprefix("[TOOL_CALLS]")
    engine = FakeEngine(max_model_len=4096)
    config = GatewayConfig(model=str(model), store_path=str(tmp_path / "t.db"), allowed_hosts=["gw"],
                           tool_call_parser="mistral")  # fmt: skip
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as (app, client):
        gw = GatewayHarness(app, client, engine)
        [ids] = gw.queue_replies(reply)
        sid, base = await gw.new_session()
        body = {"model": "policy", "messages": [{"role": "user", "content": "ls"}], "tools": TOOLS}
        r = await client.post(f"{base}/chat/completions", json=body)
        message = r.json()["choices"][0]["message"]
        assert message["content"] is None
        [call] = message["tool_calls"]
        assert call["function"] == {"name": "bash", "arguments": '{"command": "ls"}'}
        assert len(call["id"]) == 9 and call["id"].isalnum()
        [turn] = await turns(gw, sid)
        assert turn["output_ids"] == ids and ids[0] == tok.vocab_size - 1 and ids[-1] in tok.eos_ids


async def test_a_reasoning_reply_resent_in_another_branch_keeps_its_tokens(
    qwen_gateway: GatewayHarness,
) -> None:
    """A harness that rewrites an earlier message but re-sends a reasoning reply (reasoning_content
    and all) still has that reply recognised as the turn's generated tokens, not rewritten history."""
    gw = qwen_gateway
    [first_ids, _] = gw.queue_replies("<think>hm</think>Sure.", "Ok.")
    sid, base = await gw.new_session()
    r = await gw.client.post(f"{base}/chat/completions",
                             json={"model": "policy", "messages": [{"role": "user", "content": "a"}]})  # fmt: skip
    reply = r.json()["choices"][0]["message"]
    assert (reply["reasoning_content"], reply["content"]) == ("hm", "Sure.")
    msgs = [{"role": "user", "content": "a, edited"}, reply, {"role": "user", "content": "b"}]
    r = await gw.client.post(f"{base}/chat/completions", json={"model": "policy", "messages": msgs})
    assert r.status_code == 200, r.text
    first, second = gw.gw.store.get_turns(sid)
    assert second.parent_id is None  # a new branch: the first message changed
    [(a, b, source)] = second.prompt_gen_spans
    assert source == first.id and second.prompt_ids[a:b] == first.output_ids == first_ids
