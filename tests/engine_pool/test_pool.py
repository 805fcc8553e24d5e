"""The pool's routing state and its waiters, over scripted fake engines (no vLLM)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx

from engine_pool.fake import FakeEngine
from engine_pool.pool import READY, EnginePool, Placement, PoolSettings
from gateway.app import build_app
from gateway.config import GatewayConfig


def fake_pool(**kw: object) -> tuple[EnginePool, httpx.AsyncClient]:
    http = httpx.AsyncClient(transport=httpx.ASGITransport(FakeEngine(max_model_len=4096).app()))
    return EnginePool(http, PoolSettings(**kw)), http  # type: ignore[arg-type]


async def test_plain_requests_leave_no_affinity_and_closed_sessions_are_forgotten(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    pool, http = fake_pool()
    pool.add_remote("http://fake-engine")
    app = build_app(GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db")), pool=pool)
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with http, app.router.lifespan_context(app):
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost")
        for _ in range(30):  # one-request sessions: nothing to route back to
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        assert pool.router.remembered_sessions == 0
        sid = (await client.post("/api/sessions", json={})).json()["id"]
        for _ in range(2):
            assert (await client.post(f"/s/{sid}/v1/chat/completions", json=body)).status_code == 200
        assert pool.router.remembered_sessions == 1
        assert (await client.post(f"/api/sessions/{sid}/close")).status_code == 200
        assert pool.router.remembered_sessions == 0


async def test_affinity_is_bounded_least_recently_used_first() -> None:
    pool, http = fake_pool(max_affinity=3)
    async with http:
        pool.add_remote("http://fake-engine")
        await pool.start()
        for sid in ["a", "b", "c", "a", "d"]:
            await pool.router.acquire(Placement(sid))
        assert pool.router.remembered_sessions == 3 and set(pool.router.sessions) == {"a", "c", "d"}
        await pool.stop()


async def test_every_waiter_wakes_at_the_state_change_not_at_a_probe() -> None:
    """Ten requests wait for a worker; the moment one is registered all of them get it, although
    the pool probes only once a minute (no waiter depends on a poll or on the others)."""
    pool, http = fake_pool(probe_interval=60.0)
    async with http:
        await pool.start()
        waiters = [asyncio.create_task(pool.router.acquire(Placement(f"s{i}", wait=30.0))) for i in range(10)]
        await asyncio.sleep(0)  # all of them are waiting now
        assert not any(w.done() for w in waiters)
        started = time.monotonic()
        member = await pool.register("http://fake-engine")
        assert member.state == READY
        got = await asyncio.wait_for(asyncio.gather(*waiters), timeout=30.0)
        # Woken well inside the 60 s probe interval, so by the registration: a loaded machine may delay
        # the wake by seconds, never by half the interval.
        assert [m.name for m in got] == [member.name] * 10 and time.monotonic() - started < 30.0
        await pool.stop()
