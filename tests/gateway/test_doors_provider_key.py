"""The operator's provider key and the tokens in a query string (issue 31, finding 7 and a Low item):
an external auxiliary model is served on a session's own routes only, never on a plain ``/v1`` route
(its provider's key is the operator's); plain routes sit behind the API token once one is set, unless
the operator says otherwise; and ``/api/events?token=`` takes the API token, never the admin token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from engine_pool.fake import FakeEngine
from gateway.config import GatewayConfig
from gateway.turns.auxiliary import API_KEY_ENV
from tests.support import asgi_gateway

KEY = "sk-operator-secret"
JUDGE = {"model": "judge-x", "messages": [{"role": "user", "content": "grade this"}], "max_tokens": 2}
PLAIN = [
    ("/v1/chat/completions", JUDGE),
    ("/v1/completions", {"model": "judge-x", "prompt": "grade this", "max_tokens": 2}),
    ("/v1/responses", {"model": "judge-x", "input": "grade this"}),
    ("/v1/messages", JUDGE),
]


class Provider:
    """A fake OpenAI-compatible provider that counts what reaches it, and with which key."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str | None]] = []

    def app(self) -> Starlette:
        async def answer(request: Request) -> JSONResponse:
            self.seen.append((request.url.path, request.headers.get("authorization")))
            return JSONResponse(
                {"id": "x", "object": "chat.completion", "model": "judge-large", "choices": []}
            )

        return Starlette(routes=[Route("/v1/{endpoint:path}", answer, methods=["POST"])])


@pytest.fixture
def provider() -> Provider:
    return Provider()


async def _gateway(config: GatewayConfig, provider: Provider) -> AsyncIterator[httpx.AsyncClient]:
    engine = FakeEngine(max_model_len=4096, script=lambda prompt: [11, 12])
    aux = httpx.ASGITransport(provider.app())
    async with asgi_gateway(config, httpx.ASGITransport(engine.app()), aux_transport=aux) as (_, client):
        yield client


@pytest.fixture
async def open_gateway(
    tmp_path: Path, tiny_model_dir: Path, provider: Provider, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[httpx.AsyncClient]:
    """The worst case: no API token, plain routes open, an external judge with the operator's key."""
    monkeypatch.setenv(API_KEY_ENV, KEY)
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        plain_v1="open",
        auxiliary_models={"judge-*": "http://provider.test/v1#judge-large"},
    )
    async for client in _gateway(config, provider):
        yield client


async def test_an_external_auxiliary_model_on_a_plain_route_is_refused_before_the_provider(
    open_gateway: httpx.AsyncClient, provider: Provider
) -> None:
    for path, body in PLAIN:
        r = await open_gateway.post(path, json=body)
        assert r.status_code == 403, (path, r.text)
        error = r.json()["error"]
        if path != "/v1/messages":  # Anthropic's error shape has no code
            assert (error["code"], error["param"]) == ("auxiliary_model_needs_session", "model")
        endpoint = path.removeprefix("/v1/")
        assert error["message"] == (
            "'judge-x' is an auxiliary model served by an external provider, which a plain /v1 request "
            "cannot reach; create a session (POST /api/sessions) and send it to the session's base_url, "
            f"/s/{{session}}/v1/{endpoint}"
        )
    assert provider.seen == []  # the provider, and the operator's key, were never contacted


async def test_a_sessions_own_route_still_reaches_the_external_provider_with_the_key(
    open_gateway: httpx.AsyncClient, provider: Provider
) -> None:
    sid = (await open_gateway.post("/api/sessions", json={})).json()["id"]
    r = await open_gateway.post(f"/s/{sid}/v1/chat/completions", json=JUDGE)
    assert r.status_code == 200, r.text
    assert provider.seen == [("/v1/chat/completions", f"Bearer {KEY}")]


def test_plain_v1_defaults_to_token_once_an_api_token_is_set(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("t0ken\n")
    assert GatewayConfig(model="m").plain_v1 == "open"  # a laptop: no token, nothing to guard
    assert GatewayConfig(model="m", api_token="t0ken").plain_v1 == "token"
    assert GatewayConfig(model="m", api_token_file=str(token_file)).plain_v1 == "token"
    assert (
        GatewayConfig(model="m", api_token="t0ken", plain_v1="open").plain_v1 == "open"
    )  # the operator's word
    assert GatewayConfig(model="m", api_token="t0ken", plain_v1="off").plain_v1 == "off"


def test_plain_v1_defaults_to_token_with_the_token_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("BELAYER_API_TOKEN", "t0ken")
    assert GatewayConfig(model="m").plain_v1 == "token"


async def test_a_plain_request_needs_the_token_by_default_once_one_is_set(
    tmp_path: Path, tiny_model_dir: Path, provider: Provider
) -> None:
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), api_token="t0ken")
    chat = {**JUDGE, "model": "policy"}
    async for client in _gateway(config, provider):
        r = await client.post("/v1/chat/completions", json=chat)
        assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_token")
        r = await client.get("/v1/responses/resp_x")
        assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_token")
        r = await client.get("/v1/responses/resp_x", headers={"authorization": "Bearer t0ken"})
        assert r.status_code == 404, r.text  # past the token: no such stored response


async def test_the_event_feeds_query_token_is_the_api_token_never_the_admin_token(
    tmp_path: Path, tiny_model_dir: Path, provider: Provider
) -> None:
    config = GatewayConfig(
        model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), api_token="t0ken", admin_token="adm1n"
    )
    async for client in _gateway(config, provider):
        # since=x is a 400 from the route itself: the request got past the token check
        r = await client.get("/api/events?since=x&token=adm1n")
        assert (r.status_code, r.json()["error"]["code"]) == (401, "invalid_api_token")
        r = await client.get("/api/events?since=x&token=t0ken")
        assert (r.status_code, r.json()["error"]["param"]) == (400, "since")
        r = await client.get("/api/events?since=x", headers={"authorization": "Bearer adm1n"})
        assert (r.status_code, r.json()["error"]["param"]) == (400, "since")  # in a header, it opens the API
