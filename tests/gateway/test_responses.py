"""The OpenAI Responses API through the gateway, driven by the official ``openai`` SDK over a scripted
fake engine (httpx.ASGITransport): tools over several turns, ``previous_response_id`` and full input,
prefix reuse, the stream's event sequence, stored responses (after a restart too), failover mid-stream,
and bad input answered with OpenAI errors."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine_pool.fake import FakeEngine, Fault, FaultInjector, fake_logprob
from gateway.api.openai.responses import response_id_of
from gateway.config import FailoverConfig, GatewayConfig
from gateway.gateway import Gateway
from store import layout
from tests.support import GatewayHarness, asgi_gateway

TOOLS: Any = [
    {
        "type": "function",
        "name": "bash",
        "description": "Run a shell command.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}},
        "strict": False,
    }
]
INSTRUCTIONS = "You are a careful agent."
LS = '<tool_call>\n{"name": "bash", "arguments": {"command": "ls -la"}}\n</tool_call>'
CAT = '<tool_call>\n{"name": "bash", "arguments": {"command": "cat a.txt"}}\n</tool_call>'
REPLIES = ("Listing." + LS, CAT, "The file says hi.")
TOOL_OUTPUTS = ("a.txt b.txt", "hi")
STREAM_WITH_CALL = [
    "response.created", "response.in_progress",
    "response.output_item.added", "response.function_call_arguments.delta",
    "response.function_call_arguments.done", "response.output_item.done",
    "response.completed",
]  # fmt: skip
STREAM_WITH_TEXT = [
    "response.created", "response.in_progress",
    "response.output_item.added", "response.content_part.added", "response.output_text.delta",
    "response.output_text.done", "response.content_part.done", "response.output_item.done",
    "response.completed",
]  # fmt: skip


def sdk(gw: GatewayHarness | httpx.AsyncClient, base_url: str = "http://gw/v1") -> openai.AsyncOpenAI:
    client = gw.client if isinstance(gw, GatewayHarness) else gw
    return openai.AsyncOpenAI(base_url=base_url, api_key="x", http_client=client, max_retries=0)


async def turns(client: httpx.AsyncClient, sid: str) -> list[dict[str, Any]]:
    r = await client.get(f"/api/sessions/{sid}/trajectory")
    assert r.status_code == 200, r.text
    out: list[dict[str, Any]] = r.json()["turns"]
    return out


def tool_output(call_id: str, output: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": output}


def check_reuse(gw: GatewayHarness, prev: dict[str, Any], turn: dict[str, Any], output: str) -> None:
    """`turn` extends `prev` exactly: prev's prompt + output ids, then only the tokens of the tool
    message (and the next assistant header), tokenized alone."""
    reused = len(prev["prompt_ids"]) + len(prev["output_ids"])
    [event] = [e for e in turn["events"] if e["kind"] == "prefix_reuse"]
    assert event["data"]["reused_tokens"] == reused and event["data"]["parent_turn"] == prev["index"]
    tail = f"\n<|im_start|>tool\n{output}<|im_end|>\n<|im_start|>assistant\n"
    assert turn["prompt_ids"] == prev["prompt_ids"] + prev["output_ids"] + gw.gw.tokenizer.encode(tail)
    assert turn["loss_mask"][:reused] == prev["loss_mask"]


async def test_sdk_tools_over_turns_with_previous_response_id(gateway: GatewayHarness) -> None:
    replies = gateway.queue_replies(*REPLIES)
    sid, base = await gateway.new_session(task="responses")
    client = sdk(gateway, base)

    first = await client.responses.create(
        model="policy", instructions=INSTRUCTIONS, input="What is in a.txt?", tools=TOOLS, temperature=0
    )
    assert first.status == "completed" and first.output_text == "Listing."
    message, call = first.output
    assert message.type == "message" and call.type == "function_call"
    assert (call.name, call.arguments, call.status) == ("bash", '{"command": "ls -la"}', "completed")
    assert call.call_id.startswith("call_") and call.id == "fc_" + call.call_id.removeprefix("call_")

    async with client.responses.stream(
        model="policy",
        instructions=INSTRUCTIONS,
        previous_response_id=first.id,
        input=[tool_output(call.call_id, TOOL_OUTPUTS[0])],
        tools=TOOLS,
        temperature=0,
    ) as stream:
        events = [event async for event in stream]
        second = await stream.get_final_response()
    assert [e.type for e in events] == STREAM_WITH_CALL
    assert [e.sequence_number for e in events] == list(range(len(events)))
    [call2] = second.output
    assert call2.type == "function_call" and call2.arguments == '{"command": "cat a.txt"}'
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call2.arguments and second.previous_response_id == first.id

    third = await client.responses.create(
        model="policy",
        instructions=INSTRUCTIONS,
        previous_response_id=second.id,
        input=[tool_output(call2.call_id, TOOL_OUTPUTS[1])],
        tools=TOOLS,
        temperature=0,
    )
    assert third.output_text == "The file says hi." and [o.type for o in third.output] == ["message"]

    t0, t1, t2 = await turns(gateway.client, sid)
    assert [t["prompt_ids"] for t in (t0, t1, t2)] == [r["prompt"] for r in gateway.engine.requests]
    assert [t["output_ids"] for t in (t0, t1, t2)] == replies
    check_reuse(gateway, t0, t1, TOOL_OUTPUTS[0])
    check_reuse(gateway, t1, t2, TOOL_OUTPUTS[1])
    assert [t["branch"] for t in (t0, t1, t2)] == [0, 0, 0]
    for response, turn in zip((first, second, third), (t0, t1, t2), strict=True):
        assert response.usage is not None
        assert response.usage.input_tokens == len(turn["prompt_ids"])
        assert response.usage.output_tokens == len(turn["output_ids"])
    assert (third.usage and third.usage.input_tokens_details.cached_tokens) == len(t1["prompt_ids"]) + len(
        t1["output_ids"]
    )
    prompt = gateway.gw.tokenizer.decode(t0["prompt_ids"], skip_special_tokens=False)
    assert prompt.startswith(f"<|im_start|>system\n{INSTRUCTIONS}\n\n# Tools")
    assert '"name": "bash"' in prompt and prompt.endswith(
        "What is in a.txt?<|im_end|>\n<|im_start|>assistant\n"
    )


async def test_full_input_reuses_the_same_prefix(gateway: GatewayHarness) -> None:
    """The conversation of the previous test, sent whole every time (as Codex does with store=false):
    the same prompt ids, the same reuse."""
    gateway.queue_replies(*REPLIES)
    sid, base = await gateway.new_session()
    client = sdk(gateway, base)
    conversation: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "What is in a.txt?"}]}
    ]
    outputs = []
    for k in range(3):
        r = await client.responses.create(
            model="policy", instructions=INSTRUCTIONS, input=conversation, tools=TOOLS, store=False
        )
        outputs.append(r)
        conversation += [item.model_dump(exclude_none=True) for item in r.output]
        calls = [item for item in r.output if item.type == "function_call"]
        conversation += [tool_output(c.call_id, TOOL_OUTPUTS[k]) for c in calls]
    assert outputs[-1].output_text == "The file says hi."
    t0, t1, t2 = await turns(gateway.client, sid)
    check_reuse(gateway, t0, t1, TOOL_OUTPUTS[0])
    check_reuse(gateway, t1, t2, TOOL_OUTPUTS[1])
    # each turn's input repeats the last one's: the store keeps what it adds (O(tokens) per episode)
    base, last = (layout.Turn(t["prompt_ids"], t["output_ids"], [], t["request"]) for t in (t1, t2))
    enc = layout.encode(last, base)
    assert enc.request_delta and enc.request["mk"] == "input"
    assert enc.request["m"][0] == len(t1["request"]["input"]) and "input" not in enc.request["s"]
    assert layout.decode(enc, base)[2] == t2["request"]

    # the same conversation chained with previous_response_id in another session: the same prompts
    gateway.queue_replies(*REPLIES)
    sid2, base2 = await gateway.new_session()
    client2 = sdk(gateway, base2)
    previous, pending = None, [conversation[0]]
    for k in range(3):
        r = await client2.responses.create(
            model="policy",
            instructions=INSTRUCTIONS,
            input=pending,
            tools=TOOLS,
            previous_response_id=previous,
        )
        previous = r.id
        pending = [tool_output(c.call_id, TOOL_OUTPUTS[k]) for c in r.output if c.type == "function_call"]
    assert [t["prompt_ids"] for t in await turns(gateway.client, sid2)] == [
        t["prompt_ids"] for t in (t0, t1, t2)
    ]
    # store=false: recorded, but neither retrievable nor continued
    r = await gateway.client.get(f"/s/{sid}/v1/responses/{outputs[0].id}")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_stored"


async def test_input_items_render_like_chat_messages(gateway: GatewayHarness) -> None:
    """developer → system, reasoning → <think>, assistant text + calls → one assistant message: the
    prompt is exactly the chat route's for the equivalent messages."""
    gateway.queue_replies("ok", "ok")
    items: Any = [
        {"type": "message", "role": "developer", "content": "Be terse."},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
        },
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "hmm"}],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sure."}]},
        {"type": "function_call", "call_id": "call_1", "name": "bash", "arguments": '{"command": "ls"}'},
        {
            "type": "function_call_output",
            "call_id": "call_1",
            "output": [{"type": "input_text", "text": "x"}],
        },
    ]
    a = await gateway.client.post("/v1/responses", json={"model": "policy", "input": items, "tools": TOOLS})
    assert a.status_code == 200, a.text
    chat = {
        "model": "policy",
        "tools": [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k not in ("strict", "type")}}],
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "a\nb"},
            {"role": "assistant", "content": "<think>hmm</think>Sure.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "x"},
        ],
    }  # fmt: skip
    b = await gateway.client.post("/v1/chat/completions", json=chat)
    assert b.status_code == 200, b.text
    [responses_turn] = await turns(gateway.client, a.headers["x-belayer-session"])
    [chat_turn] = await turns(gateway.client, b.headers["x-belayer-session"])
    tok = gateway.gw.tokenizer
    assert tok.decode(responses_turn["prompt_ids"], False) == tok.decode(chat_turn["prompt_ids"], False)
    assert responses_turn["prompt_ids"] == chat_turn["prompt_ids"]
    prompt = gateway.gw.tokenizer.decode(responses_turn["prompt_ids"], skip_special_tokens=False)
    assert (
        "<|im_start|>user\na\nb<|im_end|>\n<|im_start|>assistant\n<think>hmm</think>Sure.\n<tool_call>"
        in prompt
    )


async def test_logprobs_and_max_output_tokens(gateway: GatewayHarness) -> None:
    [out] = gateway.queue_replies("alpha beta gamma delta")
    sid, base = await gateway.new_session()
    r = await sdk(gateway, base).responses.create(
        model="policy", input="x", include=["message.output_text.logprobs"], top_logprobs=2
    )
    [turn] = await turns(gateway.client, sid)
    [part] = r.output[0].content  # type: ignore[union-attr]
    assert part.type == "output_text" and part.logprobs is not None
    # every token of the message, EOS included (it came with the last text; the engine was not streamed)
    assert [lp.logprob for lp in part.logprobs] == turn["output_logprobs"]
    assert [lp.logprob for lp in part.logprobs] == [fake_logprob(i, t) for i, t in enumerate(out)]
    assert [lp.token for lp in part.logprobs[:-1]] == [gateway.gw.tokenizer.token_text(t) for t in out[:-1]]
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)

    gateway.queue_replies("one two three four five six")
    stream = await sdk(gateway).responses.create(model="policy", input="x", max_output_tokens=2, stream=True)
    events = [e async for e in stream]
    last = events[-1]
    assert last.type == "response.incomplete" and last.response.status == "incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    assert last.response.usage is not None and last.response.usage.output_tokens == 2
    assert gateway.engine.requests[-1]["max_tokens"] == 2


async def test_stored_response_is_read_back_after_a_restart(
    tmp_path: Path, tiny_model_dir: Path, fake_engine: FakeEngine
) -> None:
    config = GatewayConfig(
        model=str(tiny_model_dir), store_path=str(tmp_path / "traj.db"), allowed_hosts=["gw"]
    )
    tok_reply = GatewayHarness  # queue replies through a harness of each gateway below
    async with asgi_gateway(config, httpx.ASGITransport(fake_engine.app())) as (app, client):
        gw = tok_reply(app, client, fake_engine)
        gw.queue_replies("Listing." + LS)
        sid, _base = await gw.new_session()
        created = await client.post(
            f"/s/{sid}/v1/responses",
            json={"model": "policy", "input": "list", "tools": TOOLS, "instructions": INSTRUCTIONS},
        )
        assert created.status_code == 200, created.text
        body = created.json()
        for path in (f"/s/{sid}/v1/responses/{body['id']}", f"/v1/responses/{body['id']}"):
            got = await client.get(path)
            assert got.status_code == 200 and got.json() == body, got.text
        plain = (await client.post("/v1/responses", json={"model": "policy", "input": "hi"})).json()
        other_sid, _ = await gw.new_session()
        r = await client.get(f"/s/{other_sid}/v1/responses/{body['id']}")  # another session's response
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"

    async with asgi_gateway(config, httpx.ASGITransport(fake_engine.app())) as (app, client):
        gw = tok_reply(app, client, fake_engine)
        got = await client.get(f"/v1/responses/{body['id']}")
        assert got.status_code == 200 and got.json() == body
        assert (await client.get(f"/v1/responses/{plain['id']}")).json()["output"][0]["content"][0]["text"]
        gw.queue_replies("Done.")
        [call] = [o for o in body["output"] if o["type"] == "function_call"]
        follow = await sdk(client, f"http://gw/s/{sid}/v1").responses.create(
            model="policy",
            instructions=INSTRUCTIONS,
            previous_response_id=body["id"],
            input=[tool_output(call["call_id"], "a.txt")],
            tools=TOOLS,
        )
        assert follow.output_text == "Done."
        t0, t1 = await turns(client, sid)
        check_reuse(gw, t0, t1, "a.txt")


HOSTS = ["e0", "e1"]


def step(context: list[int]) -> int:
    return (sum(context[-3:]) * 31 + len(context) * 7) % 700 + 20


@pytest.fixture
async def faulty(
    tmp_path: Path, tiny_model_dir: Path
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient, FakeEngine, FaultInjector]]:
    engine = FakeEngine(step=step, max_model_len=4096)
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        failover=FailoverConfig(stall_timeout=0.3, no_worker_wait=1.0, max_failovers=3),
    )
    probes = {"probe_interval": 0.05, "probe_timeout": 0.2}
    async with asgi_gateway(config, faults, hosts=[f"http://{h}" for h in HOSTS], pool_options=probes) as (
        app,
        client,
    ):
        yield app.state.gateway, client, engine, faults


@pytest.mark.parametrize("stream", [True, False])
async def test_failover_mid_stream_is_invisible(
    faulty: tuple[Gateway, httpx.AsyncClient, FakeEngine, FaultInjector], stream: bool
) -> None:
    gw, client, engine, faults = faulty
    faults.faults["e0"] = [Fault("drop_after", 5)]
    sid = (await client.post("/api/sessions", json={})).json()["id"]
    body = {"model": "policy", "input": "go", "temperature": 0, "max_output_tokens": 12, "stream": stream}
    r = await client.post(f"/s/{sid}/v1/responses", json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert not [e for e in events if e["type"] in ("error", "response.failed")]
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        final = events[-1]["response"]
    else:
        final = r.json()
        text = final["output"][0]["content"][0]["text"]
    [turn] = await turns(client, sid)
    assert turn["status"] == "complete"
    assert turn["output_ids"] == engine.greedy(turn["prompt_ids"], 12)
    assert text == gw.tokenizer.decode(turn["output_ids"])
    assert final["usage"]["output_tokens"] == len(turn["output_ids"]) == 12
    assert final["status"] == "incomplete"  # 12 tokens, no EOS: cut by max_output_tokens
    [fo] = [e["data"] for e in turn["events"] if e["kind"] == "failover"]
    at = 5  # streamed from the engine either way: a non-streamed request keeps its partial tokens too
    assert (fo["token_index"], fo["from_worker"], fo["to_worker"]) == (at, "remote-0", "remote-1")
    assert engine.requests[-1]["prompt"] == turn["prompt_ids"] + turn["output_ids"][:at]


def good(**fields: Any) -> dict[str, Any]:
    return {"model": "policy", "input": "hi", **fields}


BAD: list[tuple[str, Any, int, str, str | None]] = [
    ("unknown item type", good(input=[{"type": "item_reference", "id": "x"}]), 400, "unsupported_item", "input[0].type"),
    ("image part", good(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), 400,
     "unsupported_content", "input[0].content[0]"),
    ("text part without text", good(input=[{"role": "user", "content": [{"type": "input_text"}]}]), 400,
     "missing_required_parameter", "input[0].content[0].text"),
    ("function_call without call_id", good(input=[{"type": "function_call", "name": "f", "arguments": "{}"}]),
     400, "invalid_value", "input[0].call_id"),
    ("input not a list", good(input=5), 400, "invalid_type", "input"),
    ("content a number", good(input=[{"role": "user", "content": 5}]), 400, "invalid_type", "input[0].content"),
    ("input missing", {"model": "policy"}, 400, "invalid_value", "input"),
    ("max_output_tokens as text", good(max_output_tokens="many"), 400, None, "max_output_tokens"),
    ("temperature too high", good(temperature=3), 400, "invalid_value", "temperature"),
    ("tool name with spaces", good(tools=[{"type": "function", "name": "bad name"}]), 400, "invalid_value",
     "tools[0].name"),
    ("tool parameters not an object schema", good(tools=[{"type": "function", "name": "f",
     "parameters": {"type": "string"}}]), 400, "invalid_function_parameters", "tools[0].parameters"),
    ("tool parameters not an object", good(tools=[{"type": "function", "name": "f", "parameters": [1]}]), 400,
     "invalid_type", "tools[0].parameters"),
    ("hosted tool", good(tools=[{"type": "web_search"}]), 400, "unsupported_tool", "tools[0].type"),
    ("duplicate tool", good(tools=[{"type": "function", "name": "f"}] * 2), 400, None, "tools[1].name"),
    ("tool_choice names no tool", good(tools=TOOLS, tool_choice={"type": "function", "name": "nope"}), 400, None,
     "tool_choice"),
    ("tool_choice without tools", good(tool_choice="required"), 400, None, "tool_choice"),
    ("allowed_tools choice", good(tools=TOOLS, tool_choice={"type": "allowed_tools", "mode": "auto", "tools": []}),
     400, "unsupported_tool_choice", "tool_choice"),
    ("structured output", good(text={"format": {"type": "json_schema", "name": "x", "schema": {}}}), 400,
     "unsupported_parameter", "text.format"),
    ("background", good(background=True), 400, "unsupported_parameter", "background"),
    ("unknown previous response", good(previous_response_id="resp_nope"), 404, "response_not_found",
     "previous_response_id"),
    ("forged previous response", good(previous_response_id="resp_" + "0" * 24 + "1"), 404, "response_not_found",
     "previous_response_id"),
    ("unknown model", good(model="gpt-9"), 404, "model_not_found", "model"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "body", "status", "code", "param"), BAD, ids=[b[0] for b in BAD])
async def test_bad_input_is_an_openai_error(
    gateway: GatewayHarness, name: str, body: Any, status: int, code: str | None, param: str | None
) -> None:
    sid, _ = await gateway.new_session()
    for path in ("/v1/responses", f"/s/{sid}/v1/responses"):
        r = await gateway.client.post(path, json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}
        assert err["type"] == ("invalid_request_error") and err["message"]
        assert code is None or err["code"] == code, err
        assert param is None or err["param"] == param, err
    assert gateway.engine.requests == []
    assert await turns(gateway.client, sid) == []


async def test_bad_response_ids_on_get(gateway: GatewayHarness) -> None:
    gateway.queue_replies("ok", "ok")
    sid, base = await gateway.new_session()
    r = await sdk(gateway, base).responses.create(model="policy", input="x")
    forged = r.id[:5] + ("1" if r.id[5] == "0" else "0") + r.id[6:]
    for path, code in [
        (f"/v1/responses/{forged}", "response_not_found"),
        ("/v1/responses/resp_zz", "response_not_found"),
        ("/v1/responses/resp_" + "f" * 60, "response_not_found"),
        (f"/s/no-such-session/v1/responses/{r.id}", "session_not_found"),
    ]:
        got = await gateway.client.get(path)
        assert got.status_code == 404 and got.json()["error"]["code"] == code, (path, got.text)
    # a chat turn of the same session is not a response, even under a well-formed id
    await gateway.client.post(f"/s/{sid}/v1/chat/completions", json={"model": "policy", "messages": [
        {"role": "user", "content": "x"}]})  # fmt: skip
    _t0, t1 = await turns(gateway.client, sid)
    chat_id = response_id_of(sid, t1["id"])
    got = await gateway.client.get(f"/v1/responses/{chat_id}")
    assert got.status_code == 404
    with pytest.raises(openai.NotFoundError):
        await sdk(gateway, base).responses.create(model="policy", input="x", previous_response_id=chat_id)


async def test_a_failed_response_reads_failed_and_cannot_be_continued(gateway: GatewayHarness) -> None:
    gateway.engine.reject_next = "prompt too odd"
    sid, base = await gateway.new_session()
    r = await gateway.client.post(f"/s/{sid}/v1/responses", json={"model": "policy", "input": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "engine_rejected"
    [turn] = await turns(gateway.client, sid)
    rid = response_id_of(sid, turn["id"])
    got = (await gateway.client.get(f"/s/{sid}/v1/responses/{rid}")).json()
    assert got["status"] == "failed" and "prompt too odd" in got["error"]["message"] and got["output"] == []
    with pytest.raises(openai.ConflictError) as err:
        await sdk(gateway, base).responses.create(model="policy", input="y", previous_response_id=rid)
    assert err.value.code == "response_not_completed"


async def test_tool_choice_forces_the_named_function(gateway: GatewayHarness) -> None:
    # The engine continues after the forced prefix '<tool_call>\n{"name": "bash", "arguments": '.
    gateway.queue_replies('{"command": "pwd"}}\n</tool_call>')
    r = await sdk(gateway).responses.create(
        model="policy", input="where am I", tools=TOOLS, tool_choice={"type": "function", "name": "bash"}
    )
    [call] = r.output
    assert call.type == "function_call" and (call.name, call.arguments) == ("bash", '{"command": "pwd"}')
    prompt = gateway.gw.tokenizer.decode(gateway.engine.requests[-1]["prompt"], skip_special_tokens=False)
    assert prompt.endswith('<|im_start|>assistant\n<tool_call>\n{"name": "bash", "arguments": ')
    assert r.tool_choice.type == "function"  # type: ignore[union-attr]


CODEX_TOOLS: Any = [
    {"type": "function", "name": "exec_command", "description": "Runs a command in a PTY.", "strict": False,
     "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}, "workdir": {"type": "string"}},
                    "required": ["cmd"], "additionalProperties": False}},
    {"type": "function", "name": "write_stdin", "description": "Writes to a session.", "strict": False,
     "parameters": {"type": "object", "properties": {"chars": {"type": "string"}}, "additionalProperties": False}},
]  # fmt: skip


def codex_request(items: list[Any]) -> dict[str, Any]:
    """A request shaped as Codex CLI 0.171 sends it (captured from the real binary, trimmed): the whole
    conversation every time (store: false), streamed, with its reasoning and client metadata fields."""
    return {
        "model": "policy", "stream": True, "input": items, "tools": CODEX_TOOLS, "tool_choice": "auto",
        "parallel_tool_calls": True, "reasoning": {"summary": "auto"}, "store": False,
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "01a22e2b-bcad",
        "client_metadata": {"turn_id": "01a22e2b-663d", "session_id": "01a22e2b-6628"},
    }  # fmt: skip


async def test_a_codex_shaped_conversation_streams_and_reuses_its_prefix(gateway: GatewayHarness) -> None:
    call = '<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "echo hi > hello.txt"}}\n</tool_call>'
    gateway.queue_replies(call, "Done.")
    sid, _ = await gateway.new_session()
    items: list[Any] = [
        {"type": "message", "id": "msg_1", "role": "developer",
         "content": [{"type": "input_text", "text": "You are a coding agent running in the Codex CLI."}]},
        {"type": "message", "id": "msg_2", "role": "user",
         "content": [{"type": "input_text", "text": "<environment_context>\n  <cwd>/w</cwd>\n</environment_context>"}]},
        {"type": "message", "id": "msg_3", "role": "user", "content": [{"type": "input_text", "text": "create hello.txt"}]},
    ]  # fmt: skip
    r = await gateway.client.post(f"/s/{sid}/v1/responses", json=codex_request(items))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    names = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names == [e["type"] for e in events] == STREAM_WITH_CALL
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["name"], i["arguments"]) for i in done] == [("exec_command", '{"cmd": "echo hi > hello.txt"}')]
    completed = events[-1]["response"]
    assert completed["store"] is False and completed["output"] == done
    # Codex appends the item as it got it (with its id and status) and the command's output
    output = {
        "type": "function_call_output",
        "id": "fco_1",
        "call_id": done[0]["call_id"],
        "output": "exit 0",
    }
    r = await gateway.client.post(f"/s/{sid}/v1/responses", json=codex_request([*items, done[0], output]))
    assert r.status_code == 200 and '"response.completed"' in r.text
    t0, t1 = await turns(gateway.client, sid)
    check_reuse(gateway, t0, t1, "exit 0")
    # Codex's default tools include a namespace of sub-agent tools and the hosted web search, which the
    # gateway cannot run: refused by name (a Codex set-up disables them: --disable multi_agent,
    # -c web_search=disabled)
    for extra in ({"type": "namespace", "name": "multi_agent_v1", "tools": []}, {"type": "web_search"}):
        body = {**codex_request(items), "tools": [*CODEX_TOOLS, extra]}
        r = await gateway.client.post(f"/s/{sid}/v1/responses", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "tools[2].type", r.text
        assert extra["type"] in r.json()["error"]["message"]


async def test_a_fork_child_continues_its_parents_response(gateway: GatewayHarness) -> None:
    """A harness restored into a fork child still holds the parent's response id: the child resolves it
    (a turn it shares), reuses its tokens, and another session does not see it."""
    gateway.queue_replies("Listing." + LS, "child one", "child two")
    parent, base = await gateway.new_session()
    first = await sdk(gateway, base).responses.create(model="policy", input="list", tools=TOOLS)
    r = await gateway.client.post(f"/api/sessions/{parent}/fork", json={"at_turn": 0, "n": 2})
    assert r.status_code == 201, r.text
    children = [c["id"] for c in r.json()["data"]]
    [call] = [o for o in first.output if o.type == "function_call"]
    for child, text in zip(children, ("child one", "child two"), strict=True):
        got = await gateway.client.get(f"/s/{child}/v1/responses/{first.id}")
        assert got.status_code == 200 and got.json()["id"] == first.id
        reply = await sdk(gateway, f"http://gw/s/{child}/v1").responses.create(
            model="policy",
            input=[tool_output(call.call_id, "a.txt")],
            tools=TOOLS,
            previous_response_id=first.id,
        )
        assert reply.output_text == text
        shared, own = await turns(gateway.client, child)
        check_reuse(gateway, shared, own, "a.txt")
    stranger, _ = await gateway.new_session()
    assert (await gateway.client.get(f"/s/{stranger}/v1/responses/{first.id}")).status_code == 404
