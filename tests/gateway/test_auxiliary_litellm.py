"""Auxiliary calls passed through a real LiteLLM proxy (installed into its own venv on first use, from
PyPI), in front of a fake OpenAI-compatible model: the OpenAI and the Anthropic protocol, streamed and not."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from belayer.testing.services import (
    DEFAULT_LITELLM_SPEC,
    base_url,
    ensure_litellm,
    fake_engine_service,
    litellm_service,
    running,
)
from engine_pool.fake import FakeEngine
from gateway.config import GatewayConfig
from gateway.gateway import Gateway
from tests.support import asgi_gateway, sdk_http

pytestmark = [pytest.mark.external, pytest.mark.slow]  # minutes: make test-all

REPO = Path(__file__).resolve().parents[2]
MASTER_KEY = "sk-belayer-test"


@pytest.fixture(scope="module")
def proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A LiteLLM proxy serving model ``policy`` from a fake engine process (its chat endpoint)."""
    venv = REPO / ".cache" / "litellm-venv"
    ensure_litellm(venv, DEFAULT_LITELLM_SPEC)
    work = tmp_path_factory.mktemp("litellm")
    engine = fake_engine_service(work, tokens=6)
    services = [engine]
    with running(services):
        engine.start()
        engine.wait_ready(60)
        litellm = litellm_service(work, venv, base_url(engine), MASTER_KEY, provider="hosted_vllm")
        services.append(litellm)
        litellm.start()
        litellm.wait_ready(240)
        yield base_url(litellm)


@pytest.fixture
async def gateway(
    proxy: str, tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[tuple[httpx.AsyncClient, Gateway, object]]:
    monkeypatch.setenv("BELAYER_AUX_API_KEY", MASTER_KEY)
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "traj.db"),
        auxiliary_models={"judge-*": f"{proxy}/v1#policy"},
    )
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app()), timeout=60) as (app, client):
        yield client, app.state.gateway, app


async def test_openai_calls_pass_through_litellm(gateway: tuple[httpx.AsyncClient, Gateway, object]) -> None:
    client, gw, _ = gateway
    sid = (await client.post("/api/sessions", json={})).json()["id"]
    sdk = openai.AsyncOpenAI(base_url=f"http://localhost/s/{sid}/v1", api_key="x", http_client=client)
    messages = [{"role": "user", "content": "Is this patch right?"}]
    reply = await sdk.chat.completions.create(model="judge-v1", messages=messages)  # type: ignore[arg-type]
    text = reply.choices[0].message.content
    assert text  # the fake model's words, through LiteLLM
    stream = await sdk.chat.completions.create(model="judge-v1", messages=messages, stream=True)  # type: ignore[arg-type]
    assert "".join([c.choices[0].delta.content or "" async for c in stream if c.choices]) == text
    events = [e.data for e in gw.store.get_events(sid) if e.kind == "auxiliary_call"]
    assert [(e["provider_model"], e["status"]) for e in events] == [("policy", 200), ("policy", 200)]
    assert gw.store.get_turns(sid) == []  # not the policy's tokens: nothing in the trajectory


async def test_anthropic_calls_pass_through_litellm(
    gateway: tuple[httpx.AsyncClient, Gateway, object],
) -> None:
    client, gw, app = gateway
    sid = (await client.post("/api/sessions", json={})).json()["id"]
    http = sdk_http.AsyncClient(transport=sdk_http.ASGITransport(app), base_url="http://localhost")
    sdk = anthropic.AsyncAnthropic(base_url=f"http://localhost/s/{sid}", api_key="x", http_client=http)
    reply = await sdk.messages.create(
        model="judge-v1", max_tokens=16, messages=[{"role": "user", "content": "Is this patch right?"}]
    )
    assert reply.content[0].text  # type: ignore[union-attr]
    [event] = [e.data for e in gw.store.get_events(sid) if e.kind == "auxiliary_call"]
    assert (event["url"].endswith("/v1/messages"), event["status"]) == (True, 200)
    await http.aclose()
