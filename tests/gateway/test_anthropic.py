"""The Anthropic Messages API through the official SDK, over the scripted fake engine (ASGI transport)."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from engine_pool.fake import FakeEngine, Fault, FaultInjector
from gateway.config import FailoverConfig, GatewayConfig
from gateway.http.errors import anthropic_error
from tests.support import GatewayHarness, asgi_gateway, post_body, sdk_http

TOOLS: Any = [
    {
        "name": "bash",
        "description": "run a command",
        "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
    }
]
CALL_TEXT = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
Claude = Callable[..., anthropic.AsyncAnthropic]


@pytest.fixture
async def claude(gateway: GatewayHarness) -> AsyncIterator[Claude]:
    """``claude(base_url)``: an SDK client on the gateway; a session's base URL is ``http://gw/s/{id}``."""
    http = sdk_http.AsyncClient(transport=sdk_http.ASGITransport(gateway.app), base_url="http://gw")

    def make(base_url: str = "http://gw") -> anthropic.AsyncAnthropic:
        return anthropic.AsyncAnthropic(base_url=base_url, api_key="x", http_client=http, max_retries=0)

    yield make
    await http.aclose()


async def trajectory(gw: GatewayHarness, sid: str) -> dict[str, Any]:
    r = await gw.client.get(f"/api/sessions/{sid}/trajectory")
    assert r.status_code == 200
    data: dict[str, Any] = r.json()
    return data


def prompt_text(gw: GatewayHarness) -> str:
    return gw.gw.tokenizer.decode(gw.engine.requests[-1]["prompt"], skip_special_tokens=False)


def as_param(message: Any) -> dict[str, Any]:
    """A response sent back as history, the way a harness does it."""
    return {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]}


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for frame in text.split("\n\n"):
        if frame.strip():
            name, data = frame.split("\n")
            assert name.startswith("event: ") and data.startswith("data: ")
            out.append((name[7:], json.loads(data[6:])))
    return out


async def test_text_message(gateway: GatewayHarness, claude: Claude) -> None:
    [out] = gateway.queue_replies("hello there")
    sid, _ = await gateway.new_session()
    resp = await claude(f"http://gw/s/{sid}").messages.create(
        model="policy",
        max_tokens=50,
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
            {"type": "text", "text": "You are terse."},
            {"type": "text", "text": " Really."},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
        ],
        metadata={"user_id": "u1"},
        extra_body={"temperature": 0, "top_k": 5},  # the 2.x SDK dropped them; older harnesses send them
    )
    assert resp.id.startswith("msg_") and resp.type == "message" and resp.role == "assistant"
    assert resp.model == "policy" and resp.stop_reason == "end_turn" and resp.stop_sequence is None
    assert [(b.type, getattr(b, "text", None)) for b in resp.content] == [("text", "hello there")]
    request = gateway.engine.requests[-1]
    assert resp.usage.input_tokens == len(request["prompt"]) and resp.usage.output_tokens == len(out)
    assert request["temperature"] == 0 and request["top_k"] == 5 and request["max_tokens"] == 50
    # The billing header (a per-request hash) is not rendered; system blocks join as sent, text blocks by "\n".
    expected = [{"role": "system", "content": "You are terse. Really."}, {"role": "user", "content": "a\nb"}]
    assert prompt_text(gateway) == gateway.gw.tokenizer.render(expected, None, add_generation_prompt=True)
    [turn] = (await trajectory(gateway, sid))["turns"]
    assert turn["output_ids"] == out and turn["status"] == "complete"
    assert turn["request"]["metadata"] == {"user_id": "u1"}


async def test_streamed_text_matches_non_streamed(gateway: GatewayHarness, claude: Claude) -> None:
    out = gateway.encode_reply("same tokens either way, ünïcödé 🤖")
    gateway.engine.outputs += [list(out), list(out)]
    client = claude()
    msgs: Any = [{"role": "user", "content": "x"}]
    full = await client.messages.create(model="policy", max_tokens=64, messages=msgs)
    async with client.messages.stream(model="policy", max_tokens=64, messages=msgs) as stream:
        text = "".join([t async for t in stream.text_stream])
        final = await stream.get_final_message()
    assert text == "same tokens either way, ünïcödé 🤖" == full.content[0].text  # type: ignore[union-attr]
    assert final.content[0].text == text and final.stop_reason == "end_turn"  # type: ignore[union-attr]
    assert final.usage.output_tokens == len(out) and final.usage.input_tokens == full.usage.input_tokens


async def test_stream_event_sequence_with_tool_use(gateway: GatewayHarness) -> None:
    gateway.queue_replies("Listing." + CALL_TEXT)
    body = {"model": "policy", "max_tokens": 64, "stream": True, "tools": TOOLS,
            "messages": [{"role": "user", "content": "ls"}]}  # fmt: skip
    r = await gateway.client.post("/v1/messages", json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert [k for k, _ in itertools.groupby(names)] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_stop",  # text, one delta per token
        "content_block_start", "content_block_delta", "content_block_stop",  # tool_use
        "message_delta", "message_stop",
    ]  # fmt: skip
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    blocks = [d for n, d in events if n == "content_block_start"]
    assert [(b["index"], b["content_block"]["type"]) for b in blocks] == [(0, "text"), (1, "tool_use")]
    tool = blocks[1]["content_block"]
    assert tool["id"].startswith("toolu_") and tool["name"] == "bash" and tool["input"] == {}
    deltas = [d for n, d in events if n == "content_block_delta"]
    assert "".join(d["delta"]["text"] for d in deltas if d["index"] == 0) == "Listing."
    partial = "".join(d["delta"]["partial_json"] for d in deltas if d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"command": "ls -la"}
    end = events[-2][1]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert end["usage"]["input_tokens"] == start["usage"]["input_tokens"] > 0
    assert end["usage"]["output_tokens"] == len(gateway.encode_reply("Listing." + CALL_TEXT))


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_use_turns_reuse_the_exact_prefix(
    gateway: GatewayHarness, claude: Claude, stream: bool
) -> None:
    gateway.queue_replies("Let me look.\n" + CALL_TEXT, "Found two files.")
    gateway.queue_replies("Done.", eos=False)
    sid, _ = await gateway.new_session()
    client = claude(f"http://gw/s/{sid}")

    async def ask(messages: list[dict[str, Any]], **kw: Any) -> Any:
        args: Any = {"model": "policy", "max_tokens": 100, "system": "be brief", "tools": TOOLS, **kw}
        if not stream:
            return await client.messages.create(messages=messages, **args)  # type: ignore[arg-type]
        async with client.messages.stream(messages=messages, **args) as s:  # type: ignore[arg-type]
            return await s.get_final_message()

    msgs: list[dict[str, Any]] = [{"role": "user", "content": "list files"}]
    m1 = await ask(msgs)
    assert m1.stop_reason == "tool_use"
    [text, call] = m1.content
    assert text.text == "Let me look.\n" and (call.name, call.input) == ("bash", {"command": "ls -la"})
    result = {"type": "tool_result", "tool_use_id": call.id, "content": "a.py b.py"}
    msgs += [as_param(m1), {"role": "user", "content": [result]}]
    m2 = await ask(msgs)
    assert m2.stop_reason == "end_turn" and m2.content[0].text == "Found two files."
    msgs += [as_param(m2), {"role": "user", "content": "thanks"}]
    m3 = await ask(msgs, max_tokens=2)
    assert m3.stop_reason == "max_tokens" and m3.usage.output_tokens == 2

    t = await trajectory(gateway, sid)
    turns = t["turns"]
    assert [x["parent_index"] for x in turns] == [None, 0, 1] and [x["branch"] for x in turns] == [0, 0, 0]
    assert [e["kind"] for e in t["events"] if e["kind"] in ("fresh_prompt", "prefix_reuse", "branch")] == [
        "fresh_prompt", "prefix_reuse", "prefix_reuse"
    ]  # fmt: skip
    for prev, cur in itertools.pairwise(turns):
        base = prev["prompt_ids"] + prev["output_ids"]
        assert cur["prompt_ids"][: len(base)] == base  # generated tokens are never re-tokenized
    assert [m.usage.input_tokens for m in (m1, m2, m3)] == [len(x["prompt_ids"]) for x in turns]
    assert "<|im_start|>tool\na.py b.py<|im_end|>" in prompt_text(gateway)


async def test_tool_result_error_and_text_blocks(gateway: GatewayHarness, claude: Claude) -> None:
    gateway.queue_replies("Retrying.")
    msgs: Any = [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "use bash", "signature": "sig"},
            {"type": "text", "text": "Running."},
            {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "go"}},
            {"type": "tool_use", "id": "toolu_2", "name": "bash", "input": {"command": "ls"}},
        ]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
             "content": [{"type": "text", "text": "go: command"}, {"type": "text", "text": "not found"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "a.py"},
            {"type": "text", "text": "fix it"},
        ]},
    ]  # fmt: skip
    resp = await claude().messages.create(model="policy", max_tokens=20, messages=msgs, tools=TOOLS)
    assert resp.content[0].text == "Retrying."  # type: ignore[union-attr]
    prompt = prompt_text(gateway)
    assert "<|im_start|>assistant\n<think>use bash</think>Running.\n<tool_call>" in prompt
    assert "<|im_start|>tool\nError: go: command\nnot found<|im_end|>" in prompt
    assert "<|im_start|>tool\na.py<|im_end|>\n<|im_start|>user\nfix it<|im_end|>" in prompt


async def test_generated_think_text_round_trips_as_a_thinking_block(
    gateway: GatewayHarness, claude: Claude
) -> None:
    """Generated ``<think>`` text comes back in the text block; a harness that splits it into a thinking
    block and text still matches the turn (``<think>{thinking}</think>{text}`` is the generated text)."""
    gateway.queue_replies("<think>plan</think>Answer.", "ok")
    sid, _ = await gateway.new_session()
    client = claude(f"http://gw/s/{sid}")
    m1 = await client.messages.create(
        model="policy", max_tokens=20, messages=[{"role": "user", "content": "q"}]
    )
    assert m1.content[0].text == "<think>plan</think>Answer."  # type: ignore[union-attr]
    split = {"role": "assistant", "content": [{"type": "thinking", "thinking": "plan", "signature": "s"},
                                              {"type": "text", "text": "Answer."}]}  # fmt: skip
    msgs: Any = [{"role": "user", "content": "q"}, split, {"role": "user", "content": "more"}]
    await client.messages.create(model="policy", max_tokens=20, messages=msgs)
    t0, t1 = (await trajectory(gateway, sid))["turns"]
    assert t1["parent_index"] == 0 and t1["prompt_ids"][: len(t0["prompt_ids"]) + len(t0["output_ids"])] == (
        t0["prompt_ids"] + t0["output_ids"]
    )


async def test_stop_sequence(gateway: GatewayHarness, claude: Claude) -> None:
    out = gateway.encode_reply("alpha beta gamma", eos=False)
    gateway.engine.outputs += [list(out), list(out)]
    client = claude()
    args: Any = {"model": "policy", "max_tokens": 50, "messages": [{"role": "user", "content": "x"}],
                 "stop_sequences": ["zzz", " gam"]}  # fmt: skip
    full = await client.messages.create(**args)
    assert full.content[0].text == "alpha beta"
    assert full.stop_reason == "stop_sequence" and full.stop_sequence == " gam"
    assert gateway.engine.requests[-1]["stop"] == ["zzz", " gam"]
    async with client.messages.stream(**args) as stream:
        final = await stream.get_final_message()
    assert final.content[0].text == "alpha beta"  # type: ignore[union-attr]
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == " gam"


async def test_tool_choice(gateway: GatewayHarness, claude: Claude) -> None:
    client = claude()
    msgs: Any = [{"role": "user", "content": "x"}]
    # tool: the assistant turn is forced to start '<tool_call>\n{"name": "bash", "arguments": '.
    gateway.queue_replies('{"command": "pwd"}}\n</tool_call>')
    resp = await client.messages.create(
        model="policy",
        max_tokens=50,
        messages=msgs,
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "bash"},
    )
    assert prompt_text(gateway).endswith('<tool_call>\n{"name": "bash", "arguments": ')
    [call] = resp.content
    assert (call.type, call.name, call.input) == ("tool_use", "bash", {"command": "pwd"})  # type: ignore[union-attr]
    assert resp.stop_reason == "tool_use"
    # any: forced to call some tool.
    gateway.queue_replies('bash", "arguments": {"command": "id"}}\n</tool_call>')
    resp = await client.messages.create(
        model="policy", max_tokens=50, messages=msgs, tools=TOOLS, tool_choice={"type": "any"}
    )
    assert prompt_text(gateway).endswith('<tool_call>\n{"name": "')
    assert [(b.name, b.input) for b in resp.content] == [("bash", {"command": "id"})]  # type: ignore[union-attr]
    # none: the tools stay in the prompt, calls are not parsed.
    gateway.queue_replies(CALL_TEXT)
    resp = await client.messages.create(
        model="policy", max_tokens=50, messages=msgs, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert resp.content[0].text == CALL_TEXT and resp.stop_reason == "end_turn"  # type: ignore[union-attr]
    assert "<tools>" in prompt_text(gateway)


async def test_count_tokens_equals_a_real_requests_prompt(gateway: GatewayHarness, claude: Claude) -> None:
    client = claude()
    msgs: Any = [{"role": "user", "content": "count me"}]
    args: Any = {"model": "policy", "messages": msgs, "system": "sys", "tools": TOOLS}
    counted = await client.messages.count_tokens(**args)
    forced = await client.messages.count_tokens(**args, tool_choice={"type": "any"})
    assert gateway.engine.requests == [] and (await gateway.client.get("/api/sessions")).json()["data"] == []
    gateway.queue_replies("ok", 'bash", "arguments": {}}')
    real = await client.messages.create(max_tokens=10, **args)
    assert counted.input_tokens == real.usage.input_tokens == len(gateway.engine.requests[-1]["prompt"])
    real = await client.messages.create(max_tokens=10, tool_choice={"type": "any"}, **args)
    assert forced.input_tokens == real.usage.input_tokens > counted.input_tokens

    # In a session the count follows prefix reuse, exactly as the next turn's prompt will be built.
    gateway.queue_replies("first", "second")
    sid, _ = await gateway.new_session()
    session = claude(f"http://gw/s/{sid}")
    m1 = await session.messages.create(max_tokens=10, **args)
    args["messages"] = [*msgs, as_param(m1), {"role": "user", "content": "again"}]
    counted = await session.messages.count_tokens(**args)
    assert len((await trajectory(gateway, sid))["turns"]) == 1
    m2 = await session.messages.create(max_tokens=10, **args)
    t1 = (await trajectory(gateway, sid))["turns"][1]
    assert counted.input_tokens == m2.usage.input_tokens == len(t1["prompt_ids"]) and t1["parent_index"] == 0


async def test_model_aliases(gateway: GatewayHarness, claude: Claude) -> None:
    gateway.queue_replies("hi")
    with pytest.raises(anthropic.NotFoundError):
        await claude().messages.create(
            model="claude-haiku-4-5", max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    gateway.gw.config.model_aliases["claude-*"] = "policy"
    resp = await claude().messages.create(
        model="claude-haiku-4-5", max_tokens=5, messages=[{"role": "user", "content": "x"}]
    )
    assert resp.model == "claude-haiku-4-5" and resp.content[0].text == "hi"  # type: ignore[union-attr]


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "policy", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **kw}


def user(*blocks: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(blocks)}]


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
CASES: list[tuple[str, Any, int, str, str]] = [
    # (name, request body or raw bytes, status, Anthropic error type, text the message must contain)
    ("malformed json", b'{"model": "policy", "messages": [', 400, "invalid_request_error", "not valid JSON"),
    ("missing max_tokens", {"model": "policy", "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_request_error", "max_tokens"),
    ("empty messages", body(messages=[]), 400, "invalid_request_error", "messages"),
    ("tool role in messages", body(messages=[{"role": "tool", "content": "x"}]), 400,
     "invalid_request_error", "messages.0.role"),
    ("temperature over 1", body(temperature=1.5), 400, "invalid_request_error", "temperature"),
    ("tool_use without id", body(messages=[{"role": "assistant", "content": [
        {"type": "tool_use", "name": "bash", "input": {}}]}, {"role": "user", "content": "x"}]), 400,
     "invalid_request_error", "messages.0.content.0.tool_use.id"),
    ("image block", body(messages=user({"type": "text", "text": "see"}, IMAGE)), 400,
     "invalid_request_error", "content block messages[0].content[1] of type 'image'"),
    ("document in a tool result", body(messages=user({"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document", "source": {}}]})), 400, "invalid_request_error",
     "messages[0].content[0].content[0] of type 'document'"),
    ("redacted thinking", body(messages=[{"role": "assistant", "content": [
        {"type": "redacted_thinking", "data": "xx"}]}, {"role": "user", "content": "x"}]), 400,
     "invalid_request_error", "of type 'redacted_thinking' is not supported in an assistant message"),
    ("tool_use from the user", body(messages=user({"type": "tool_use", "id": "t", "name": "bash", "input": {}})),
     400, "invalid_request_error", "messages.0: `tool_use` blocks can only be in `assistant` messages"),
    ("assistant prefill", body(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]),
     400, "invalid_request_error", "prefill"),
    ("tool_choice any without tools", body(tool_choice={"type": "any"}), 400, "invalid_request_error", "tools"),
    ("tool_choice names an unknown tool", body(tools=TOOLS, tool_choice={"type": "tool", "name": "web"}), 400,
     "invalid_request_error", "'web'"),
    ("server tool", body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400,
     "invalid_request_error", "server tool"),
    ("mcp servers", body(mcp_servers=[{"type": "url", "url": "http://x", "name": "x"}]), 400,
     "invalid_request_error", "mcp_servers"),
    ("prompt over context", body(messages=[{"role": "user", "content": "word " * 5000}]), 400,
     "invalid_request_error", "maximum context length is 4096"),
    ("unknown model", body(model="claude-opus-4"), 404, "not_found_error", "policy"),
]  # fmt: skip
# Checks of generation parameters, which count_tokens neither takes nor needs.
GENERATION_ONLY = {"missing max_tokens", "temperature over 1", "prompt over context"}


@pytest.mark.parametrize(("name", "payload", "status", "kind", "text"), CASES, ids=[c[0] for c in CASES])
async def test_bad_input_gets_anthropic_errors(
    gateway: GatewayHarness, name: str, payload: Any, status: int, kind: str, text: str
) -> None:
    sid, _ = await gateway.new_session()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        if path.endswith("count_tokens") and name in GENERATION_ONLY:
            continue
        url = f"/s/{sid}{path}"
        r = await post_body(gateway.client, url, payload)
        assert r.status_code == status, r.text
        err = r.json()
        assert (
            set(err) == {"type", "error"}
            and err["type"] == "error"
            and set(err["error"]) == {"type", "message"}
        )
        assert err["error"]["type"] == kind and text in err["error"]["message"], err
    assert (await trajectory(gateway, sid))["turns"] == [] and gateway.engine.requests == []


async def test_session_errors(gateway: GatewayHarness, claude: Claude) -> None:
    msgs: Any = [{"role": "user", "content": "x"}]
    with pytest.raises(anthropic.NotFoundError) as missing:
        await claude("http://gw/s/ses_nope").messages.create(model="policy", max_tokens=5, messages=msgs)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert "POST /api/sessions" in missing.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        await claude("http://gw/s/ses_nope").messages.count_tokens(model="policy", messages=msgs)
    sid, _ = await gateway.new_session()
    await gateway.client.post(f"/api/sessions/{sid}/close")
    with pytest.raises(anthropic.ConflictError) as closed:
        await claude(f"http://gw/s/{sid}").messages.create(model="policy", max_tokens=5, messages=msgs)
    assert closed.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    r = await gateway.client.post(
        "/v1/messages", json=body(messages=[{"role": "user", "content": "x" * 300_000}])
    )
    assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"
    r = await gateway.client.get("/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    # The OpenAI routes keep OpenAI's shape.
    r = await gateway.client.post("/v1/chat/completions", json={"model": "nope", "messages": msgs})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def test_no_healthy_engine_is_overloaded(gateway: GatewayHarness, claude: Claude) -> None:
    gateway.gw.pool.roster.members[0].state = "dead"
    for stream in (False, True):
        r = await gateway.client.post("/v1/messages", json=body(stream=stream))
        assert r.status_code == 503, r.text
        assert r.json()["error"]["type"] == "overloaded_error" and r.json()["type"] == "error"
    with pytest.raises(anthropic.APIStatusError) as e:
        await claude().messages.create(**body())
    assert e.value.status_code == 503 and e.value.body["error"]["type"] == "overloaded_error"  # type: ignore[index]


def test_anthropic_error_types_by_status() -> None:
    kinds = {s: anthropic_error(s, {"error": {"message": "m"}})["error"]["type"] for s in (400, 404, 409, 413, 500, 503, 504, 529)}  # fmt: skip
    assert kinds == {400: "invalid_request_error", 404: "not_found_error", 409: "invalid_request_error",
                     413: "invalid_request_error", 500: "api_error", 503: "overloaded_error",
                     504: "timeout_error", 529: "overloaded_error"}  # fmt: skip


async def test_engine_lost_mid_stream_is_an_error_event(tmp_path: Path, tiny_model_dir: Path) -> None:
    engine = FakeEngine(max_model_len=4096)
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"),
                           failover=FailoverConfig(enabled=False))  # fmt: skip
    async with asgi_gateway(config, faults, hosts=["http://e0"]) as (app, client):
        tok = app.state.gateway.tokenizer
        engine.outputs.append(tok.encode("one two three four five six"))
        faults.faults["e0"] = [Fault("drop_after", after=3)]
        r = await client.post("/v1/messages", json=body(stream=True))
        assert r.status_code == 200
        events = sse_events(r.text)
        assert [n for n, _ in events][:3] == ["message_start", "ping", "content_block_start"]
        name, data = events[-1]
        assert name == "error" and data["type"] == "error" and data["error"]["type"] == "overloaded_error"
        assert "message_stop" not in [n for n, _ in events]


async def test_mid_conversation_system_message(gateway: GatewayHarness, claude: Claude) -> None:
    """Claude Code (beta mid-conversation-system-2026-04-07) sends ``system`` messages inside ``messages``."""
    gateway.queue_replies("ok")
    msgs: Any = [
        {"role": "user", "content": "task"},
        {"role": "system", "content": [{"type": "text", "text": "agents:"}, {"type": "text", "text": "- a"}]},
    ]
    await claude().messages.create(model="policy", max_tokens=8, system="top", messages=msgs)
    expected = [
        {"role": "system", "content": "top"},
        {"role": "user", "content": "task"},
        {"role": "system", "content": "agents:\n- a"},
    ]
    assert prompt_text(gateway) == gateway.gw.tokenizer.render(expected, None, add_generation_prompt=True)
