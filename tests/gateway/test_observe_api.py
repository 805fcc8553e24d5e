"""The operator's APIs: session filters and paging, the live feed over SSE, the dashboard's snapshot."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
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
from tests.support import asgi_gateway

HI = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def config(tmp_path: Path, tiny_model_dir: Path) -> GatewayConfig:
    return GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"))


async def test_sessions_are_filtered_and_paged_on_the_server(config: GatewayConfig) -> None:
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app())) as (_, client):
        ids = []
        for i in range(7):
            meta = {"task": f"t{i % 2}", "step": i}
            ids.append((await client.post("/api/sessions", json={"metadata": meta})).json()["id"])
        for i, sid in enumerate(ids[:4]):
            assert (
                await client.post(f"/api/sessions/{sid}/reward", json={"reward": i / 2})
            ).status_code == 200
        for sid in ids[5:]:
            assert (await client.post(f"/api/sessions/{sid}/close")).status_code == 200

        async def listed(query: str) -> tuple[list[str], int]:
            r = await client.get(f"/api/sessions?{query}")
            assert r.status_code == 200, r.text
            return [s["id"] for s in r.json()["data"]], r.json()["total"]

        assert await listed("") == (ids[::-1], 7)  # newest first
        assert await listed("order=asc&limit=3&offset=2") == (ids[2:5], 7)
        assert await listed("status=closed") == (ids[6:4:-1], 2)
        assert await listed("reward_min=0.5&reward_max=1&order=asc") == (ids[1:3], 2)
        assert await listed("has_reward=false&order=asc") == (ids[4:], 3)
        assert await listed("meta.task=t1&order=asc") == (ids[1::2], 3)
        assert await listed("meta.step=3") == ([ids[3]], 1)
        assert await listed("meta.task=t0&status=open&has_reward=true&order=asc") == (ids[0:4:2], 2)
        created = [s["created_at"] for s in (await client.get("/api/sessions?order=asc")).json()["data"]]
        assert await listed(f"created_after={created[5]}&order=asc") == (ids[5:], 2)
        assert await listed(f"created_before={created[1]}") == (ids[:1], 1)
        assert await listed("limit=0") == ([], 7)

        # keyset paging: each page's next_cursor gives the next one, in either order
        for order, expected in (("desc", ids[::-1]), ("asc", ids)):
            seen, cursor = [], ""
            while True:
                page = (await client.get(f"/api/sessions?order={order}&limit=3{cursor}")).json()
                seen += [s["id"] for s in page["data"]]
                if page["next_cursor"] is None:
                    break
                cursor = f"&cursor={page['next_cursor']}"
            assert seen == expected

        for query, param in [
            ("limit=1001", "limit"), ("limit=x", "limit"), ("offset=-1", "offset"), ("offset=99999999999999999999", "offset"), ("status=done", "status"),
            ("reward_min=nan", "reward_min"), ("order=up", "order"), ("has_reward=yes", "has_reward"),
            ("cursor=abc", "cursor"), ("cursor=WzFlNDAwLCJzIl0", "cursor"),
        ]:  # fmt: skip
            r = await client.get(f"/api/sessions?{query}")
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (query, r.text)


async def test_the_dashboard_state_holds_workers_totals_and_the_feed_position(config: GatewayConfig) -> None:
    engine = FakeEngine()
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as (app, client):
        long = {**HI, "messages": [{"role": "user", "content": "the same long question, " * 20}]}
        for body in (long, long, HI):  # the second finds the first's prompt in the engine's prefix cache
            assert (await client.post("/v1/chat/completions", json=body)).status_code == 200
        state = (await client.get("/api/dashboard/state")).json()
        [worker] = state["workers"]
        hits, queries = engine.stats.prefix_cache_hits, engine.stats.prefix_cache_queries
        assert 0 < hits < queries
        assert worker["prefix_cache_hit_rate"] == state["prefix_cache_hit_rate"] == round(hits / queries, 6)
        assert (worker["name"], worker["state"], worker["launched"], worker["served"]) == (
            "remote-0", "ready", False, 3,
        )  # fmt: skip
        assert worker["last_transition"]["to"] == "ready"
        assert state["totals"]["turns"] == 3 and state["totals"]["tokens_generated"] == 12
        assert state["seq"] == app.state.gateway.telemetry.seq
        assert state["gateway"]["store_bytes"] > 0 and state["sandboxes"] == []


@contextlib.asynccontextmanager
async def served(config: GatewayConfig, engine: FakeEngine) -> AsyncIterator[str]:
    """The gateway on a real socket (SSE needs a streaming transport)."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(engine.app())) as engine_http:
        pool = EnginePool(engine_http)
        pool.add_remote("http://fake-engine")
        server = uvicorn.Server(
            uvicorn.Config(build_app(config, pool=pool), host="127.0.0.1", port=free_port(), log_config=None)
        )
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                await asyncio.sleep(0.01)
            yield f"http://127.0.0.1:{server.config.port}"
        finally:
            server.should_exit = True
            await serving


async def read_events(lines: AsyncIterator[str], until: str) -> AsyncIterator[dict[str, Any]]:
    event = None
    async for line in lines:
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: ") and event is not None:
            yield {"event": event, **json.loads(line[6:])}
            if event == until:
                return


async def test_the_live_feed_streams_a_turn_from_a_snapshot_without_a_gap(config: GatewayConfig) -> None:
    config = config.model_copy(update={"api_token": "secret"})
    auth = {"Authorization": "Bearer secret"}
    async with served(config, FakeEngine()) as base, httpx.AsyncClient(base_url=base, timeout=30) as client:
        sid = (await client.post("/api/sessions", json={}, headers=auth)).json()["id"]
        # one turn before the snapshot, one after: the feed from the snapshot's seq has only the second
        assert (await client.post(f"/s/{sid}/v1/chat/completions", json=HI)).status_code == 200
        seq = (await client.get("/api/dashboard/state", headers=auth)).json()["seq"]
        assert (await client.post(f"/s/{sid}/v1/chat/completions", json=HI)).status_code == 200

        assert (await client.get("/api/events")).status_code == 401
        url = f"/api/events?since={seq}&session={sid}&token=secret"  # EventSource sends no headers
        async with client.stream("GET", url) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            got = [e async for e in read_events(r.aiter_lines(), until="turn_finished")]
        assert [e["event"] for e in got] == ["branch", "turn_started", "turn_finished"]  # same messages again
        assert all(e["session_id"] == sid and e["seq"] > seq for e in got)
        assert got[1]["data"]["index"] == 1 and got[-1]["data"]["status"] == "complete"
        assert [e["seq"] for e in got] == sorted(e["seq"] for e in got)

        # a kinds filter, live: the feed is open before the request is sent
        async with client.stream("GET", "/api/events?kinds=turn_finished", headers=auth) as r:
            lines = r.aiter_lines()
            assert await anext(lines) == ": belayer live feed"
            assert (await client.post("/v1/chat/completions", json=HI)).status_code == 200
            [finished] = [e async for e in read_events(lines, until="turn_finished")]
        assert finished["data"]["output_tokens"] == 4 and finished["session_id"] != sid

        r = await client.get("/api/events?since=x", headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "since"


async def test_the_trajectory_can_carry_each_output_tokens_text(config: GatewayConfig) -> None:
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app())) as (app, client):
        sid = (await client.post("/api/sessions", json={})).json()["id"]
        assert (await client.post(f"/s/{sid}/v1/chat/completions", json=HI)).status_code == 200
        plain = (await client.get(f"/api/sessions/{sid}/trajectory")).json()["turns"][0]
        turn = (await client.get(f"/api/sessions/{sid}/trajectory?token_text=1")).json()["turns"][0]
        tok = app.state.gateway.tokenizer
        assert "output_text" not in plain and len(turn["output_text"]) == len(turn["output_ids"]) == 4
        assert "".join(turn["output_text"]) == tok.decode(turn["output_ids"], skip_special_tokens=False)


async def test_export_over_http_pages_the_filtered_sessions_and_is_counted(config: GatewayConfig) -> None:
    import io

    import pyarrow.parquet as pq

    from store.export import session_rows

    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app())) as (app, client):
        ids = []
        for i in range(3):
            sid = (await client.post("/api/sessions", json={"metadata": {"i": i}})).json()["id"]
            assert (await client.post(f"/s/{sid}/v1/chat/completions", json=HI)).status_code == 200
            ids.append(sid)
        assert (await client.post(f"/api/sessions/{ids[0]}/close")).status_code == 200

        r = await client.get("/api/export?format=jsonl&status=open&order=asc&limit=1&offset=1")
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        assert (r.headers["x-total-count"], r.headers["x-row-count"]) == ("2", "1")
        [row] = [json.loads(line) for line in r.text.splitlines()]
        assert row == session_rows(app.state.gateway.store, ids[2])[0]

        r = await client.get("/api/export?format=parquet&order=asc")
        table = pq.read_table(io.BytesIO(r.content)).to_pylist()
        assert [t["session_id"] for t in table] == ids and table[0]["response_ids"] == json.loads(
            (await client.get("/api/export?meta.i=0")).text
        )["response_ids"]

        r = await client.get("/api/export?format=csv")
        assert r.status_code == 400 and r.json()["error"]["param"] == "format"
        metrics = (await client.get("/metrics")).text
        assert 'belayer_exports_total{format="jsonl"} 2.0' in metrics
        assert 'belayer_exports_total{format="parquet"} 1.0' in metrics


async def test_an_open_feed_does_not_hold_up_shutdown(config: GatewayConfig) -> None:
    """A dashboard left open must not make the gateway wait out its whole grace period: the feed
    ends with a ``shutdown`` event as soon as shutdown starts."""
    from gateway.serve.server import build_server

    config = config.model_copy(update={"port": free_port()})
    config.server.shutdown_grace_s = 60.0
    async with httpx.AsyncClient(transport=httpx.ASGITransport(FakeEngine().app())) as engine_http:
        pool = EnginePool(engine_http)
        pool.add_remote("http://fake-engine")
        server = build_server(build_app(config, pool=pool), config)
        serving = asyncio.create_task(server.serve())
        while not server.started:
            await asyncio.sleep(0.01)
        async with (
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{config.port}", timeout=30) as client,
            client.stream("GET", "/api/events") as r,
        ):
            lines = r.aiter_lines()
            assert await anext(lines) == ": belayer live feed"
            server.should_exit = True
            rest = [line async for line in lines]
        assert "event: shutdown" in rest
        await asyncio.wait_for(serving, 10)  # not the 60 s grace
