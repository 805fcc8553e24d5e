"""Values that cannot round-trip are refused at the edge, on every JSON route, and nothing is stored.

Each case here answered a 500 (and some poisoned the store for every later reader) before the body
check in ``gateway.http.bodies``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from core.net import free_port
from engine_pool.fake import FakeEngine
from engine_pool.pool import EnginePool
from gateway.app import build_app
from gateway.config import GatewayConfig
from sandbox.config import SandboxConfig
from sandbox.fake import FakeSandboxBackend
from tests.support import GatewayHarness, asgi_gateway, post_body

MSG = [{"role": "user", "content": "hi"}]
DEEP = (
    b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "extra": '
    + b"[" * 1000
    + b"]" * 1000
    + b"}"
)


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": MSG, "max_tokens": 2, **kw}


def messages(**kw: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": MSG, "max_tokens": 2, **kw}


async def sessions_readable(gw: GatewayHarness) -> list[dict[str, Any]]:
    r = await gw.client.get("/api/sessions")
    assert r.status_code == 200, r.text
    data: list[dict[str, Any]] = r.json()["data"]
    for s in data:
        t = await gw.client.get(f"/api/sessions/{s['id']}/trajectory")
        assert t.status_code == 200, t.text
    return data


@pytest.mark.parametrize("reward", [b"1e400", b"-1e400", b"NaN", b"Infinity", b"-Infinity"])
async def test_a_non_finite_reward_is_refused_and_not_stored(gateway: GatewayHarness, reward: bytes) -> None:
    sid, _ = await gateway.new_session()
    r = await post_body(gateway.client, f"/api/sessions/{sid}/reward", b'{"reward": ' + reward + b"}")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] in ("invalid_value", "invalid_json")
    assert "finite" in r.json()["error"]["message"] or "not a JSON number" in r.json()["error"]["message"]
    assert [s["reward"] for s in await sessions_readable(gateway)] == [None]


@pytest.mark.parametrize(
    ("url", "raw"),
    [
        ("/v1/chat/completions", b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "foo": NaN}'),
        ("/v1/chat/completions", b'{"model": "policy", "messages": [{"role": "user", "content": "x"}], "foo": 1e400}'),
        ("/v1/messages", b'{"model": "policy", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "metadata": {"user_id": 1e999}}'),
        ("/api/sessions", b'{"metadata": {"x": -1e400}}'),
    ],
)  # fmt: skip
async def test_non_finite_numbers_in_ignored_fields_are_refused(
    gateway: GatewayHarness, url: str, raw: bytes
) -> None:
    gateway.queue_replies("ok")
    r = await post_body(gateway.client, url, raw)
    assert r.status_code == 400, r.text
    assert await sessions_readable(gateway) == []


SURROGATE_BODIES = [
    ("/v1/chat/completions", chat(messages=[{"role": "user", "content": "\ud800"}])),
    ("/v1/chat/completions", chat(model="policy\udfff")),
    ("/v1/chat/completions", chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"\ud800": 1}}}])),
    ("/v1/messages", messages(system="\ud800")),
    ("/v1/messages", messages(messages=[{"role": "user", "content": [{"type": "text\ud800", "text": "x"}]}])),
    ("/v1/completions", {"model": "policy", "prompt": "\ud800", "max_tokens": 2}),
    ("/api/sessions", {"metadata": {"task": "\ud800"}}),
]  # fmt: skip


@pytest.mark.parametrize(("url", "body"), SURROGATE_BODIES)
async def test_lone_surrogates_are_refused_with_a_clear_message(
    gateway: GatewayHarness, url: str, body: dict[str, Any]
) -> None:
    gateway.queue_replies("ok")
    # httpx's json= would refuse to encode a lone surrogate; the escaped form is valid JSON.
    r = await post_body(gateway.client, url, json.dumps(body).encode())
    assert r.status_code == 400, r.text
    assert "surrogate" in r.json()["error"]["message"]
    assert await sessions_readable(gateway) == []


@pytest.mark.parametrize(
    "url",
    ["/v1/chat/completions", "/v1/messages", "/v1/completions", "/api/sessions", "/v1/messages/count_tokens"],
)
async def test_deep_nesting_is_a_400_on_every_json_route(gateway: GatewayHarness, url: str) -> None:
    r = await post_body(gateway.client, url, DEEP)
    assert r.status_code == 400, r.text
    assert "deeper than" in r.text
    sid, _ = await gateway.new_session()
    r = await post_body(
        gateway.client,
        f"/api/sessions/{sid}/reward",
        b'{"reward": 1, "info": ' + b"[" * 100 + b"]" * 100 + b"}",
    )
    assert r.status_code == 400 and "deeper than" in r.text


@pytest.mark.parametrize("media", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
async def test_cross_site_media_types_are_refused(gateway: GatewayHarness, media: str) -> None:
    for url in ("/api/sessions", "/v1/chat/completions", "/v1/messages"):
        r = await gateway.client.post(url, content=b'{"metadata": {}}', headers={"content-type": media})
        assert r.status_code == 415, (url, r.text)
    assert await sessions_readable(gateway) == []


async def test_after_an_unexpected_500_the_keep_alive_connection_still_serves(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A bug answers a 500 in the protocol's format, and the client's next request on the same
    connection is served (it used to be reset: the server closed the connection after the 500)."""
    engine_http = httpx.AsyncClient(transport=httpx.ASGITransport(FakeEngine().app()))
    pool = EnginePool(engine_http)
    pool.add_remote("http://fake-engine")
    app = build_app(GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db")), pool=pool)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None))
    serving = asyncio.create_task(server.serve())
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            while not server.started:
                await asyncio.sleep(0.01)
            store = app.state.gateway.store
            real = store.query_sessions

            def broken_once(*_: Any) -> Any:
                store.query_sessions = real
                raise RuntimeError("a bug")

            store.query_sessions = broken_once
            r = await client.get("/api/sessions")
            assert r.status_code == 500 and r.json()["error"]["message"].startswith(
                "internal error (RuntimeError)"
            )
            again = await client.get("/api/sessions")  # same pooled connection
            assert again.status_code == 200 and again.json() == {
                "data": [],
                "total": 0,
                "limit": 100,
                "offset": 0,
                "next_cursor": None,
            }
            assert client._transport._pool.connections and len(client._transport._pool.connections) == 1  # type: ignore[attr-defined]
    finally:
        server.should_exit = True
        await serving
        await engine_http.aclose()


async def endless_post(client: httpx.AsyncClient, url: str) -> tuple[httpx.Response, int]:
    """POST an endless body (chunked, no length); the response, and how many bytes were sent."""
    sent = 0

    async def endless() -> Any:
        nonlocal sent
        while True:
            sent += 64 * 1024
            yield b" " * (64 * 1024)

    headers = {"content-type": "application/json"}
    r = await asyncio.wait_for(client.post(url, content=endless(), headers=headers), timeout=10)
    return r, sent


async def test_optional_bodies_stop_at_the_size_limit(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The two routes whose body may be empty (a session, a sandbox) used to read all of it before the
    size limit applied: here, forever. Now they stop just past the limit."""
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        max_body_bytes=256 * 1024,
        sandbox=SandboxConfig(enabled=True, sandbox_port=None),
    )
    engine = httpx.ASGITransport(FakeEngine().app())
    async with asgi_gateway(config, engine, sandbox_backend=FakeSandboxBackend()) as (_, client):
        sid = (await client.post("/api/sessions", json={})).json()["id"]
        for url in ("/api/sessions", f"/api/sessions/{sid}/sandbox"):
            r, sent = await endless_post(client, url)
            assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", url
            assert sent <= 256 * 1024 + 2 * 64 * 1024  # the limit, and not much more was read


async def test_the_verify_route_answers_bad_input_with_a_400_that_names_the_field(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        sandbox=SandboxConfig(enabled=True, sandbox_port=None),
    )
    engine = httpx.ASGITransport(FakeEngine().app())
    async with asgi_gateway(config, engine, sandbox_backend=FakeSandboxBackend()) as (_, client):
        sid = (
            await client.post("/api/sessions", json={"sandbox": {"image": "belayer-sandbox-busybox"}})
        ).json()["id"]
        url = f"/api/sessions/{sid}/sandbox/verify"
        ok_file = {"path": "verify.sh", "content": "ZXhpdCAw"}
        for body, param in [
            ({}, "files"),
            ({"files": []}, "files"),
            ({"files": [{"path": "other.sh", "content": "ZXhpdCAw"}]}, "files"),
            ({"files": [{"path": "verify.sh", "content": "not base64!"}]}, "files"),
            ({"files": [ok_file], "originals": [{"path": "a", "content": "%%%"}]}, "originals"),
            ({"files": [ok_file], "on_tamper": "ignore"}, "on_tamper"),
            ({"files": [ok_file], "timeout_s": 0}, "timeout_s"),
            ({"files": [ok_file], "unknown": 1}, "unknown"),
        ]:
            r = await client.post(url, json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] is not None and param in r.json()["error"]["param"], (
                body,
                r.text,
            )
        r = await client.post("/api/sessions/no-such/sandbox/verify", json={"files": [ok_file]})
        assert r.status_code == 404 and r.json()["error"]["type"], r.text
