"""Ownership: the trainer side holds a token, the harness side holds a capability URL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from engine_pool.fake import FakeEngine
from gateway.config import GatewayConfig
from tests.support import app_routes, asgi_gateway

TOKEN = {"authorization": "Bearer t0ken"}
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture
async def locked(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[tuple[Starlette, httpx.AsyncClient]]:
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        api_token="t0ken",
        admin_token="adm1n",
        public_url="https://gw.example",
    )
    engine = FakeEngine(max_model_len=4096, script=lambda prompt: [11, 12])
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as pair:
        yield pair


async def test_every_api_route_needs_the_token(locked: tuple[Starlette, httpx.AsyncClient]) -> None:
    app, client = locked
    routes = app_routes(app, "/api/")
    assert len(routes) >= 15 and ("GET", "/api/sessions") in routes
    for method, path in routes:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic t0ken"}):
            r = await client.request(method, path, headers=headers, json={})
            assert r.status_code == 401, (method, path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_token"
    assert (await client.get("/health")).status_code == 200  # needs none


async def test_a_harness_needs_only_its_session_url(locked: tuple[Starlette, httpx.AsyncClient]) -> None:
    _, client = locked
    r = await client.post("/api/sessions", json={}, headers={"authorization": "BEARER t0ken"})  # any case
    assert r.status_code == 201
    session = r.json()
    assert len(session["id"]) == len("ses_") + 32  # 128 random bits
    assert session["base_url"] == f"https://gw.example/s/{session['id']}/v1"  # never the request's Host
    chat = await client.post(f"/s/{session['id']}/v1/chat/completions", json=CHAT)  # no token
    assert chat.status_code == 200, chat.text
    messages = await client.post(f"/s/{session['id']}/v1/messages", json=CHAT)
    assert messages.status_code == 200, messages.text
    # ... but nobody without the token learns which sessions exist
    assert (await client.get("/api/sessions")).status_code == 401
    listed = await client.get("/api/sessions", headers=TOKEN)
    assert [s["id"] for s in listed.json()["data"]] == [session["id"]]
    guessed = await client.post("/s/ses_0000/v1/chat/completions", json=CHAT)
    assert guessed.status_code == 404


async def test_a_cross_site_text_plain_post_is_refused(locked: tuple[Starlette, httpx.AsyncClient]) -> None:
    _, client = locked
    sid = (await client.post("/api/sessions", json={}, headers=TOKEN)).json()["id"]
    r = await client.post(
        f"/s/{sid}/v1/chat/completions",
        content=b'{"model": "policy", "messages": []}',
        headers={"content-type": "text/plain"},
    )
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    # A route that reads no body refuses it too: no cross-site form or text/plain POST reaches any route.
    r = await client.post(
        f"/api/sessions/{sid}/close", content=b"", headers={**TOKEN, "content-type": "text/plain"}
    )
    assert r.status_code == 415
    assert (await client.get(f"/api/sessions/{sid}", headers=TOKEN)).json()["status"] == "open"


async def test_rewards_are_final_once_closed_unless_an_admin_overrides(
    locked: tuple[Starlette, httpx.AsyncClient],
) -> None:
    _, client = locked
    sid = (await client.post("/api/sessions", json={}, headers=TOKEN)).json()["id"]
    assert (
        await client.post(f"/api/sessions/{sid}/reward", json={"reward": 0.5}, headers=TOKEN)
    ).status_code == 200
    assert (
        await client.post(f"/api/sessions/{sid}/reward", json={"reward": 0.7}, headers=TOKEN)
    ).status_code == 200
    assert (await client.post(f"/api/sessions/{sid}/close", headers=TOKEN)).status_code == 200
    late = await client.post(f"/api/sessions/{sid}/reward", json={"reward": 1.0}, headers=TOKEN)
    assert late.status_code == 409 and late.json()["error"]["code"] == "reward_final"
    forced = await client.post(
        f"/api/sessions/{sid}/reward", json={"reward": 1.0, "override": True}, headers=TOKEN
    )
    assert forced.status_code == 403 and "admin token" in forced.json()["error"]["message"]
    assert (await client.get(f"/api/sessions/{sid}", headers=TOKEN)).json()["reward"] == 0.7
    admin = {"authorization": "Bearer adm1n"}  # the admin token opens the API too
    forced = await client.post(
        f"/api/sessions/{sid}/reward", json={"reward": 1.0, "override": True}, headers=admin
    )
    assert forced.status_code == 200 and forced.json()["reward"] == 1.0


@pytest.mark.parametrize(
    ("plain_v1", "headers", "status"),
    [("open", {}, 200), ("token", {}, 401), ("token", TOKEN, 200), ("off", TOKEN, 403)],
)
async def test_plain_v1_requests_open_behind_the_token_or_off(
    tmp_path: Path, tiny_model_dir: Path, plain_v1: str, headers: dict[str, str], status: int
) -> None:
    config = GatewayConfig(
        model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), api_token="t0ken", plain_v1=plain_v1
    )
    engine = FakeEngine(max_model_len=4096, script=lambda prompt: [11, 12])
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as (_, client):
        for url, body in [("/v1/chat/completions", CHAT), ("/v1/messages", CHAT)]:
            r = await client.post(url, json=body, headers=headers)
            assert r.status_code == status, (url, r.text)
        assert (await client.get("/v1/models")).status_code == 200


async def test_allowed_hosts_check_the_host_and_build_base_urls(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = GatewayConfig(
        model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), allowed_hosts=["gw", "gateway.internal"]
    )
    engine = FakeEngine(max_model_len=4096)
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as (_, client):
        r = await client.post("/api/sessions", json={}, headers={"host": "gateway.internal:8000"})
        assert r.json()["base_url"].startswith("http://gateway.internal:8000/s/ses_")
        evil: dict[str, Any] = {"host": "attacker.example"}
        r = await client.post("/api/sessions", json={}, headers=evil)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        a = await client.post("/v1/messages", json=CHAT, headers=evil)
        assert a.status_code == 400 and a.json()["type"] == "error"  # in the protocol's own shape


async def test_without_a_public_url_the_host_header_is_not_trusted(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), port=8123)
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app())) as (_, client):
        r = await client.post("/api/sessions", json={}, headers={"host": "10.9.9.9:8123"})
        assert r.json()["base_url"].startswith("http://127.0.0.1:8123/s/ses_")
