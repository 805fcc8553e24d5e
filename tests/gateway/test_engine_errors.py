"""Engine errors are classified: a request that makes healthy workers fail is the request's error, and
no worker is fenced for it; the engine registry refuses bad and duplicate URLs and can remove a worker."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette

from engine_pool.fake import FakeEngine, FaultInjector
from engine_pool.pool import DEAD, READY, Placement
from gateway.config import FailoverConfig, GatewayConfig
from gateway.gateway import Gateway
from tests.support import asgi_gateway

POISON = "please crash"
ADMIN = {"authorization": "Bearer s3cret"}


@pytest.fixture
async def pool_of_three(
    tmp_path: Path, tiny_model_dir: Path
) -> AsyncIterator[tuple[Starlette, httpx.AsyncClient, FakeEngine]]:
    engine = FakeEngine(max_model_len=4096)
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        failover=FailoverConfig(stall_timeout=0.3, no_worker_wait=1.0),
        admin_token="s3cret",
    )
    hosts = ["http://e0", "http://e1", "http://e2"]
    async with asgi_gateway(config, faults, hosts=hosts, pool_options={"probe_interval": 0.05}) as (
        app,
        client,
    ):
        tok = app.state.gateway.tokenizer
        poison_ids = tok.encode(POISON)
        engine.poison = lambda prompt: any(
            prompt[i : i + len(poison_ids)] == poison_ids for i in range(len(prompt))
        )
        yield app, client, engine


def gateway_of(app: Starlette) -> Gateway:
    gw: Gateway = app.state.gateway
    return gw


@pytest.mark.parametrize("stream", [False, True])
async def test_a_poison_request_fences_no_worker_and_others_are_served(
    pool_of_three: tuple[Starlette, httpx.AsyncClient, FakeEngine], stream: bool
) -> None:
    app, client, engine = pool_of_three
    pool = gateway_of(app).pool
    body = {
        "model": "policy",
        "messages": [{"role": "user", "content": POISON}],
        "max_tokens": 3,
        "stream": stream,
    }
    for _ in range(3):  # again and again: still no worker is taken out
        r = await client.post("/v1/chat/completions", json=body)  # streamed too: fails before its first token
        assert r.status_code == 500, r.text
        error = r.json()["error"]
        assert error["code"] == "engine_request_failed" and "do not retry it unchanged" in error["message"]
    assert [m.state for m in pool.roster.members] == [READY] * 3
    posted = [q for q in engine.requests if "prompt_logprobs" not in q]
    assert len(posted) == 2  # tried on exactly two workers once; then refused from the gateway's memory
    engine.outputs.append(gateway_of(app).tokenizer.encode("fine"))
    ok = await client.post(
        "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert ok.status_code == 200 and "fine" in ok.text


async def test_a_poison_request_on_the_only_worker_is_its_own_error(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    engine = FakeEngine(max_model_len=4096, poison=lambda prompt: True)
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"))
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as (app, client):
        body = {"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_request_failed"
        a = await client.post("/v1/messages", json=body)
        assert a.status_code == 500 and a.json()["error"]["type"] == "api_error"
        assert [m.state for m in gateway_of(app).pool.roster.members] == [READY]


@pytest.mark.parametrize(
    ("url", "status", "says"),
    [
        ("127.0.0.1:8001", 400, "needs a scheme and a host"),
        ("ftp://e9", 400, "needs a scheme and a host"),
        ("http://", 400, "engine URL"),
        ("http://[::1", 400, "is not a URL"),
        ("http://e9/?x=1", 400, "query"),
        ("http://e0", 409, "in the pool already"),
        ("http://e0/", 409, "in the pool already"),
    ],
)
async def test_the_registry_refuses_bad_and_duplicate_urls(
    pool_of_three: tuple[Starlette, httpx.AsyncClient, FakeEngine], url: str, status: int, says: str
) -> None:
    app, client, _ = pool_of_three
    r = await client.post("/api/engines", json={"url": url}, headers=ADMIN)
    assert r.status_code == status and says in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "url"
    assert len(gateway_of(app).pool.roster.members) == 3  # nothing half-added


async def test_delete_drains_then_removes_a_worker(
    pool_of_three: tuple[Starlette, httpx.AsyncClient, FakeEngine],
) -> None:
    app, client, _ = pool_of_three
    pool = gateway_of(app).pool
    assert (await client.delete("/api/engines/e1")).status_code == 403
    missing = await client.delete("/api/engines/nope", headers=ADMIN)
    assert missing.status_code == 404 and "remote-0" in missing.json()["error"]["message"]
    bad = await client.delete("/api/engines/remote-1?drain_s=x", headers=ADMIN)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "drain_s"
    async with pool.lease(Placement(exclude=frozenset({"remote-0", "remote-2"}))) as busy:  # one request in flight
        assert busy.name == "remote-1"
        removal = asyncio.create_task(client.delete("/api/engines/remote-1", headers=ADMIN))
        while busy.state != "draining":
            await asyncio.sleep(0.01)
        assert (
            not removal.done()
            and busy.state == "draining"
            and pool.pick(Placement(exclude=frozenset({"remote-0", "remote-2"}))) is None
        )
    r = await removal
    assert r.status_code == 200 and r.json()["state"] == DEAD
    assert [m.name for m in pool.roster.members] == ["remote-0", "remote-2"]
    again = await client.post("/api/engines", json={"url": "http://e1"}, headers=ADMIN)  # may come back
    assert again.status_code == 201 and again.json()["name"] == "remote-3"
