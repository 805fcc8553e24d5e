"""Every bad input gets a 4xx in OpenAI's error format, says what to change, and records nothing."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support import GatewayHarness, post_body

MSG = [{"role": "user", "content": "hi"}]


def body(**kw: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": MSG, **kw}


CASES: list[tuple[str, Any, int, str | None, str]] = [
    # (name, request body or raw bytes, status, param, text the message must contain)
    ("malformed json", b'{"model": "policy", "messages": [', 400, None, "not valid JSON"),
    ("empty body", b"", 400, None, "empty"),
    ("not an object", b"[1, 2]", 400, None, "JSON object"),
    ("missing messages", {"model": "policy"}, 400, "messages", "messages"),
    ("messages wrong type", body(messages="hi"), 400, "messages", "messages"),
    ("bad role", body(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role", "role"),
    ("temperature type", body(temperature="hot"), 400, "temperature", "temperature"),
    ("temperature range", body(temperature=5), 400, "temperature", "temperature"),
    ("max_tokens zero", body(max_tokens=0), 400, "max_tokens", "max_tokens"),
    ("unknown model", body(model="gpt-9"), 404, "model", "policy"),
    ("n=2", body(n=2), 400, "n", "n=1"),
    (
        "response_format",
        body(response_format={"type": "json_object"}),
        400,
        "response_format",
        "not supported",
    ),
    ("logit_bias", body(logit_bias={"5": 10}), 400, "logit_bias", "logit_bias"),
    ("legacy functions", body(functions=[{"name": "f"}]), 400, "functions", "tools"),
    ("top_logprobs without logprobs", body(top_logprobs=3), 400, "top_logprobs", "logprobs=true"),
    (
        "image part",
        body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400,
        "messages[0].content[0]",
        "text-only",
    ),
    (
        "text part without text",
        body(messages=[{"role": "user", "content": [{"type": "text"}]}]),
        400,
        "messages[0].content[0].text",
        "needs its 'text'",
    ),
    ("tool_choice without tools", body(tool_choice="required"), 400, "tool_choice", "tools"),
    (
        "named tool not offered",
        body(
            tools=[{"type": "function", "function": {"name": "a"}}],
            tool_choice={"type": "function", "function": {"name": "b"}},
        ),
        400,
        "tool_choice",
        "'b'",
    ),
    (
        "prompt over context",
        body(messages=[{"role": "user", "content": "word " * 5000}]),
        400,
        "messages",
        "maximum context length is 4096",
    ),
    ("completion over context", body(max_tokens=4090), 400, "messages", "maximum context length"),
]


@pytest.mark.parametrize(("name", "payload", "status", "param", "text"), CASES, ids=[c[0] for c in CASES])
async def test_chat_bad_input(
    gateway: GatewayHarness, name: str, payload: Any, status: int, param: str | None, text: str
) -> None:
    sid, _ = await gateway.new_session()
    url = f"/s/{sid}/v1/chat/completions"
    r = await post_body(gateway.client, url, payload)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and text in err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 else "service_unavailable")
    turns = (await gateway.client.get(f"/api/sessions/{sid}/trajectory")).json()["turns"]
    assert turns == [] and gateway.engine.requests == []


async def test_body_over_size_limit(gateway: GatewayHarness) -> None:
    r = await gateway.client.post(
        "/v1/chat/completions", json=body(messages=[{"role": "user", "content": "x" * 300_000}])
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert "--max-body-bytes" in r.json()["error"]["message"]


async def test_unknown_session(gateway: GatewayHarness) -> None:
    r = await gateway.client.post("/s/ses_nope/v1/chat/completions", json=body())
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    assert "POST /api/sessions" in r.json()["error"]["message"]
    assert (await gateway.client.get("/api/sessions/ses_nope/trajectory")).status_code == 404


async def test_unknown_route_and_method(gateway: GatewayHarness) -> None:
    r = await gateway.client.post("/v1/embeddings", json={})
    assert r.status_code == 404 and "error" in r.json()
    r = await gateway.client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


async def test_completions_bad_prompts(gateway: GatewayHarness) -> None:
    for prompt, text in (([], "empty"), ([1, 999999], "outside the vocabulary"), (["a", "b"], "one prompt")):
        r = await gateway.client.post("/v1/completions", json={"model": "policy", "prompt": prompt})
        assert r.status_code == 400 and text in r.json()["error"]["message"], r.text
    r = await gateway.client.post("/v1/completions", json={"model": "policy", "prompt": "x", "echo": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    assert gateway.engine.requests == []
    assert (await gateway.client.get("/api/sessions")).json()["data"] == []


async def test_no_healthy_engine_is_503(gateway: GatewayHarness) -> None:
    gateway.gw.pool.roster.members[0].state = "dead"
    for stream in (False, True):
        r = await gateway.client.post("/v1/chat/completions", json=body(stream=stream))
        assert r.status_code == 503, r.text
        assert (
            r.json()["error"]["code"] == "engine_unavailable"
            and "no healthy inference worker" in r.json()["error"]["message"]
        )


@pytest.mark.parametrize("stream", [False, True])
async def test_engine_rejection_is_400_not_retried(gateway: GatewayHarness, stream: bool) -> None:
    gateway.engine.reject_next = "prompt contains a forbidden token"
    sid, _ = await gateway.new_session()
    r = await gateway.client.post(f"/s/{sid}/v1/chat/completions", json=body(stream=stream))
    assert r.status_code == 400 and "forbidden token" in r.json()["error"]["message"]
    assert len(gateway.engine.requests) == 1
    [turn] = (await gateway.client.get(f"/api/sessions/{sid}/trajectory")).json()["turns"]
    assert turn["status"] == "error" and turn["output_ids"] == []


async def test_sessions_api_bad_input(gateway: GatewayHarness) -> None:
    r = await gateway.client.post("/api/sessions", json={"metadata": "nope"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata"
    r = await gateway.client.post("/api/sessions", json={"bogus": 1})
    assert r.status_code == 400
    sid, _ = await gateway.new_session()
    r = await gateway.client.post(f"/api/sessions/{sid}/reward", json={"reward": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reward"
