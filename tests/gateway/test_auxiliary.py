"""Auxiliary model calls (a harness's small/fast model, a judge): routed to the policy in a side
session, passed through to an external OpenAI-compatible provider, or refused with a clear error."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

from engine_pool.fake import FakeEngine
from gateway.config import FailoverConfig, GatewayConfig
from gateway.gateway import Gateway
from tests.support import asgi_gateway, sdk_http

AUX = {
    "claude-haiku-*": "policy",
    "judge-*": "http://provider.test/v1#judge-large",
    "gpt-4o-mini*": "reject",
}


class Env:
    def __init__(self, app: Any, client: httpx.AsyncClient, engine: FakeEngine, provider: FakeEngine) -> None:
        self.app, self.client, self.engine, self.provider = app, client, engine, provider
        self.gw: Gateway = app.state.gateway


@pytest.fixture
async def env(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Env]:
    engine, provider = FakeEngine(max_model_len=8192), FakeEngine(model="judge-large")
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "traj.db"),
        failover=FailoverConfig(no_worker_wait=0.3),
        auxiliary_models=AUX,
    )
    aux = httpx.ASGITransport(provider.app())
    async with asgi_gateway(config, httpx.ASGITransport(engine.app()), aux_transport=aux) as (app, client):
        yield Env(app, client, engine, provider)


async def session(env: Env) -> str:
    return str((await env.client.post("/api/sessions", json={})).json()["id"])


async def test_policy_route_records_the_call_in_a_side_session(env: Env) -> None:
    sid = await session(env)
    tok = env.gw.tokenizer
    env.engine.outputs = [tok.encode("A title.") + tok.encode(tok.eos_token)]
    http = sdk_http.AsyncClient(transport=sdk_http.ASGITransport(env.app), base_url="http://localhost")
    sdk = anthropic.AsyncAnthropic(base_url=f"http://localhost/s/{sid}", api_key="x", http_client=http)
    reply = await sdk.messages.create(
        model="claude-haiku-4-5", max_tokens=16, messages=[{"role": "user", "content": "Title this."}]
    )
    assert (reply.model, reply.content[0].text) == ("claude-haiku-4-5", "A title.")  # type: ignore[union-attr]
    assert env.gw.store.get_turns(sid) == []  # the episode's own trajectory is untouched
    side = env.gw.store.get_session(f"{sid}-aux")
    assert side is not None and side.metadata == {"auxiliary_of": sid, "auxiliary_model": "claude-haiku-4-5"}
    [turn] = env.gw.store.get_turns(side.id)
    assert turn.prompt_ids == env.engine.requests[-1]["prompt"]  # recorded, token for token
    assert tok.decode(turn.output_ids) == "A title."


async def test_external_route_passes_through_and_is_logged(env: Env) -> None:
    sid = await session(env)
    sdk = openai.AsyncOpenAI(base_url=f"http://localhost/s/{sid}/v1", api_key="x", http_client=env.client)
    messages = [{"role": "user", "content": "Is this patch correct?"}]
    reply = await sdk.chat.completions.create(model="judge-v1", messages=messages, max_tokens=4)  # type: ignore[arg-type]
    assert env.provider.requests[-1]["model"] == "judge-large"  # the configured provider model
    assert env.provider.requests[-1]["messages"] == messages
    assert reply.model == "judge-large" and reply.choices[0].message.content
    stream = await sdk.chat.completions.create(model="judge-v1", messages=messages, max_tokens=4, stream=True)  # type: ignore[arg-type]
    chunks = [c async for c in stream]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reply.choices[0].message.content
    assert env.gw.store.get_turns(sid) == [] and env.gw.store.get_session(f"{sid}-aux") is None
    events = [e for e in env.gw.store.get_events(sid) if e.kind == "auxiliary_call"]
    assert [(e.data["model"], e.data["provider_model"], e.data["status"]) for e in events] == [
        ("judge-v1", "judge-large", 200),
        ("judge-v1", "judge-large", 200),
    ]


async def test_refused_and_unknown_models_get_clear_errors(env: Env) -> None:
    sid = await session(env)
    body = {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}]}
    r = await env.client.post(f"/s/{sid}/v1/chat/completions", json=body)
    assert (r.status_code, r.json()["error"]["code"], r.json()["error"]["param"]) == (
        400, "auxiliary_model_refused", "model",
    )  # fmt: skip
    assert "--aux-model 'gpt-4o-mini*=policy'" in r.json()["error"]["message"]
    r = await env.client.post(f"/s/{sid}/v1/messages", json={**body, "max_tokens": 8})
    assert (r.status_code, r.json()["type"], r.json()["error"]["type"]) == (
        400,
        "error",
        "invalid_request_error",
    )
    r = await env.client.post(f"/s/{sid}/v1/messages/count_tokens", json=body)  # refused there too
    assert (r.status_code, r.json()["error"]["type"]) == (400, "invalid_request_error")
    assert "auxiliary model" in r.json()["error"]["message"]
    r = await env.client.post(f"/s/{sid}/v1/chat/completions", json={**body, "model": "nobody"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "model_not_found")
    assert env.engine.requests == [] and env.provider.requests == []


async def test_an_unreachable_provider_is_a_clear_502_not_an_engine_outage(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        auxiliary_models={"judge": "http://127.0.0.1:9/v1"},
    )
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app())) as (_, client):
        sid = (await client.post("/api/sessions", json={})).json()["id"]  # external models: session routes only
        r = await client.post(
            f"/s/{sid}/v1/chat/completions", json={"model": "judge", "messages": [{"role": "user", "content": "x"}]}
        )
        assert r.status_code == 502
        error = r.json()["error"]
        assert error["code"] == "auxiliary_provider_unavailable" and error["param"] == "model"
        assert "auxiliary provider at http://127.0.0.1:9/v1 is unreachable" in error["message"]
        # The policy's engines are fine: a policy request on the same gateway is served.
        ok = await client.post(
            "/v1/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": "x"}]}
        )
        assert ok.status_code == 200, ok.text


def test_bad_routes_are_refused_at_start_up(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="auxiliary route for 'x' must be"):
        GatewayConfig(model=str(tiny_model_dir), auxiliary_models={"x": "litellm"})
    assert (
        json.loads(GatewayConfig(model="m", auxiliary_models=AUX).model_dump_json())["auxiliary_models"]
        == AUX
    )


async def test_text_completions_are_routed_like_chat(env: Env) -> None:
    sid = await session(env)
    env.engine.outputs.append(env.gw.tokenizer.encode("A title."))
    r = await env.client.post(
        f"/s/{sid}/v1/completions",
        json={"model": "claude-haiku-4-5", "prompt": "Title this.", "max_tokens": 8},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "A title."
    assert env.gw.store.get_turns(sid) == []  # recorded in the side session, not the episode's
    assert len(env.gw.store.get_turns(f"{sid}-aux")) == 1
    r = await env.client.post(
        f"/s/{sid}/v1/completions", json={"model": "judge-v1", "prompt": [5, 6], "max_tokens": 2}
    )
    assert r.status_code == 200 and env.provider.requests[-1]["model"] == "judge-large"
    r = await env.client.post(f"/s/{sid}/v1/completions", json={"model": "gpt-4o-mini", "prompt": "x"})
    assert (r.status_code, r.json()["error"]["code"]) == (400, "auxiliary_model_refused")
