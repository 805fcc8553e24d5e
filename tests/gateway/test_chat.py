"""Chat completions through the gateway over a scripted fake engine (httpx.ASGITransport)."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from engine_pool.fake import fake_logprob
from store import SqliteStore
from tests.support import GatewayHarness

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        },
    }
]
CALL_TEXT = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'


def sdk(gw: GatewayHarness, base_url: str = "http://gw/v1") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key="x", http_client=gw.client, max_retries=0)


async def trajectory(gw: GatewayHarness, sid: str) -> dict[str, Any]:
    r = await gw.client.get(f"/api/sessions/{sid}/trajectory")
    assert r.status_code == 200
    data: dict[str, Any] = r.json()
    return data


async def test_greedy_tokens_and_logprobs_recorded(gateway: GatewayHarness) -> None:
    [out] = gateway.queue_replies("hello there")
    sid, base = await gateway.new_session(task="t")
    resp = await sdk(gateway, base).chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert resp.choices[0].message.content == "hello there"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and resp.usage.completion_tokens == len(out)
    [turn] = (await trajectory(gateway, sid))["turns"]
    assert turn["output_ids"] == out
    assert turn["output_logprobs"] == [fake_logprob(i, t) for i, t in enumerate(out)]
    assert [c.logprob for c in resp.choices[0].logprobs.content] == turn["output_logprobs"]  # type: ignore[union-attr]
    assert len(resp.choices[0].logprobs.content[0].top_logprobs) == 2  # type: ignore[union-attr]
    assert turn["prompt_ids"] == gateway.engine.requests[-1]["prompt"]
    assert turn["loss_mask"] == [0] * len(turn["prompt_ids"]) + [1] * len(out)
    assert turn["worker"] == "remote-0" and turn["status"] == "complete"
    assert set(turn["timings"]) >= {"queue_ms", "ttft_ms", "total_ms"}
    assert turn["request"]["messages"] == [{"role": "user", "content": "hi"}]


async def test_tool_call_non_streamed_and_streamed_agree(gateway: GatewayHarness) -> None:
    reply = gateway.encode_reply("Listing." + CALL_TEXT)
    gateway.engine.outputs += [list(reply), list(reply)]
    client = sdk(gateway)
    msgs: Any = [{"role": "user", "content": "ls"}]
    full = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)  # type: ignore[arg-type]
    msg = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Listing."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []] == [
        ("bash", {"command": "ls -la"})
    ]  # type: ignore[union-attr]

    stream = await client.chat.completions.create(
        model="policy", messages=msgs, tools=TOOLS, stream=True, stream_options={"include_usage": True}
    )  # type: ignore[arg-type]
    text, calls, finish, usage = "", [], None, None
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            calls += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert text == "Listing." and finish == "tool_calls"
    assert [(c.index, c.function.name, json.loads(c.function.arguments or "")) for c in calls] == [
        (0, "bash", {"command": "ls -la"})
    ]  # type: ignore[union-attr]
    assert (
        usage is not None
        and usage.completion_tokens == len(reply)
        and usage.prompt_tokens == full.usage.prompt_tokens
    )  # type: ignore[union-attr]


async def test_malformed_tool_json_is_content_and_an_event(gateway: GatewayHarness) -> None:
    bad = '<tool_call>\n{"name": "bash", "arguments": {oops}}\n</tool_call>'
    gateway.queue_replies(bad)
    sid, base = await gateway.new_session()
    resp = await sdk(gateway, base).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "x"}], tools=TOOLS
    )  # type: ignore[arg-type]
    assert resp.choices[0].message.content == bad
    assert not resp.choices[0].message.tool_calls and resp.choices[0].finish_reason == "stop"
    events = (await trajectory(gateway, sid))["events"]
    assert [e["kind"] for e in events] == ["fresh_prompt", "tool_call_parse_error"]


async def test_named_tool_choice_forces_the_call(gateway: GatewayHarness) -> None:
    # The engine continues after the forced prefix '<tool_call>\n{"name": "bash", "arguments": '.
    gateway.queue_replies('{"command": "pwd"}}\n</tool_call>')
    resp = await sdk(gateway).chat.completions.create(
        model="policy",
        messages=[{"role": "user", "content": "x"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "bash"}},
    )
    [call] = resp.choices[0].message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("bash", {"command": "pwd"})  # type: ignore[union-attr]
    prompt = gateway.engine.requests[-1]["prompt"]
    assert gateway.gw.tokenizer.decode(prompt, skip_special_tokens=False).endswith(
        '<tool_call>\n{"name": "bash", "arguments": '
    )


async def test_tool_choice_none_returns_raw_text(gateway: GatewayHarness) -> None:
    gateway.queue_replies(CALL_TEXT)
    resp = await sdk(gateway).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none"
    )  # type: ignore[arg-type]
    assert resp.choices[0].message.content == CALL_TEXT and not resp.choices[0].message.tool_calls


async def test_stop_string_trims_and_tokens_stay_exact(gateway: GatewayHarness) -> None:
    out = gateway.encode_reply("alpha beta gamma", eos=False)
    gateway.engine.outputs += [list(out), list(out)]
    client = sdk(gateway)
    msgs: Any = [{"role": "user", "content": "x"}]
    full = await client.chat.completions.create(model="policy", messages=msgs, stop=[" gam"])
    streamed = "".join(
        [
            c.choices[0].delta.content or ""
            async for c in await client.chat.completions.create(
                model="policy", messages=msgs, stop=[" gam"], stream=True
            )
            if c.choices
        ]
    )
    assert full.choices[0].message.content == streamed == "alpha beta"
    assert gateway.engine.requests[-1]["stop"] == [" gam"]


async def test_length_finish_reason_and_max_tokens(gateway: GatewayHarness) -> None:
    gateway.queue_replies("one two three four five six")
    resp = await sdk(gateway).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "x"}], max_completion_tokens=2
    )
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 2  # type: ignore[union-attr]
    assert gateway.engine.requests[-1]["max_tokens"] == 2


async def test_default_max_tokens_is_rest_of_context(gateway: GatewayHarness) -> None:
    gateway.queue_replies("ok")
    resp = await sdk(gateway).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "x"}]
    )
    assert gateway.engine.requests[-1]["max_tokens"] == 4096 - resp.usage.prompt_tokens  # type: ignore[union-attr]


async def test_stream_and_non_stream_give_same_tokens(gateway: GatewayHarness) -> None:
    out = gateway.encode_reply("same tokens either way, ünïcödé 🤖")
    gateway.engine.outputs += [list(out), list(out)]
    sid, base = await gateway.new_session()
    client = sdk(gateway, base)
    msgs: Any = [{"role": "user", "content": "x"}]
    full = await client.chat.completions.create(model="policy", messages=msgs)
    chunks = [
        c
        async for c in await client.chat.completions.create(
            model="policy", messages=msgs, stream=True, logprobs=True
        )
    ]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.content == streamed == "same tokens either way, ünïcödé 🤖"
    streamed_lps = [
        lp.logprob
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for lp in c.choices[0].logprobs.content or []
    ]
    t0, t1 = (await trajectory(gateway, sid))["turns"]
    assert t0["output_ids"] == t1["output_ids"] == out
    assert streamed_lps == t1["output_logprobs"]


async def test_completions_with_text_and_token_prompts(gateway: GatewayHarness) -> None:
    out = gateway.encode_reply("done", eos=False)
    gateway.engine.outputs += [list(out), list(out), list(out)]
    client = sdk(gateway)
    a = await client.completions.create(model="policy", prompt="def f():", max_tokens=8, logprobs=1)
    ids = gateway.gw.tokenizer.encode("def f():")
    b = await client.completions.create(model="policy", prompt=ids, max_tokens=8)
    assert a.choices[0].text == b.choices[0].text == "done"
    assert gateway.engine.requests[0]["prompt"] == gateway.engine.requests[1]["prompt"] == ids
    assert a.choices[0].logprobs.token_logprobs == [fake_logprob(i, t) for i, t in enumerate(out)]  # type: ignore[union-attr]
    s = await client.completions.create(model="policy", prompt=ids, max_tokens=8, stream=True)
    assert "".join([c.choices[0].text async for c in s]) == "done"


async def test_models_lists_served_names(gateway: GatewayHarness) -> None:
    models = await sdk(gateway).models.list()
    assert [m.id for m in models.data] == ["policy"]


async def test_plain_v1_request_gets_its_own_session(gateway: GatewayHarness) -> None:
    gateway.queue_replies("x")
    r = await gateway.client.post(
        "/v1/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": "a"}]}
    )
    sid = r.headers["x-belayer-session"]
    session = (await gateway.client.get(f"/api/sessions/{sid}")).json()
    assert session["num_turns"] == 1 and session["status"] == "closed"


@pytest.mark.parametrize("stream", [False, True])
async def test_turn_is_durable_when_response_completes(gateway: GatewayHarness, stream: bool) -> None:
    [out] = gateway.queue_replies("durable")
    sid, _ = await gateway.new_session()
    body = {"model": "policy", "messages": [{"role": "user", "content": "a"}], "stream": stream}
    async with gateway.client.stream("POST", f"/s/{sid}/v1/chat/completions", json=body) as r:
        await r.aread()
    # A second, independent connection to the store file sees the finished turn.
    other = SqliteStore(gateway.gw.config.store_path)
    [turn] = other.get_turns(sid)
    other.close()
    assert turn.status == "complete" and turn.output_ids == out
