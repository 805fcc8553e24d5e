"""A gateway started beside an engine that is still loading waits for it, says so, and serves once it
answers: no crash, no crash loop (it used to exit 0.1 s after start)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import httpx
import pytest

from engine_pool.fake import FakeEngine, FaultInjector
from gateway.config import FailoverConfig, GatewayConfig
from tests.support import asgi_gateway

HI = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def test_an_engine_still_loading_is_waited_for(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    faults = FaultInjector(httpx.ASGITransport(FakeEngine().app()))
    faults.down.add("loading")  # refuses connections, as a server still loading its weights does
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        failover=FailoverConfig(no_worker_wait=0.2),
    )
    caplog.set_level(logging.INFO, "belayer.engine_pool")
    async with asgi_gateway(config, faults, hosts=("http://loading",)) as (app, client):
        health = await client.get("/health")
        assert health.status_code == 503
        assert health.json()["status"] == "starting" and health.json()["starting_workers"] == ["remote-0"]
        r = await client.post("/v1/chat/completions", json=HI)
        assert r.status_code == 503 and "starting" in r.json()["error"]["message"], r.text

        while "not answering yet" not in caplog.text:  # progress in the log, with backoff
            await asyncio.sleep(0.05)
        faults.down.clear()  # the engine is up
        pool = app.state.gateway.pool
        async with asyncio.timeout(15):
            while not pool.roster.ready():
                await pool.roster.wait_change(1.0)
        assert (await client.get("/health")).json()["status"] == "ok"
        assert (await client.post("/v1/chat/completions", json=HI)).status_code == 200
    assert "remote-0: starting -> ready (answering after" in caplog.text
