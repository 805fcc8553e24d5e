"""Routing through the gateway, on fake engines: a session's ``group`` (validated, kept across a restart,
inherited by fork children), where the group policy and round-robin place a group's sessions and the
prefix-cache hit rate each gives (``belayer_prefix_cache_hit_rate`` on ``/metrics``), and a session's
next turn after a failover."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.events import SessionMoved
from engine_pool.fake import FakeEngine, Fault, FaultInjector
from engine_pool.pool import READY, EnginePool
from engine_pool.settings import RoutingPolicy
from gateway.api.engine_metrics import HIT_RATE
from gateway.config import FailoverConfig, GatewayConfig
from gateway.gateway import Gateway
from store.base import GROUP_KEY
from tests.gateway.test_engine_metrics import ByHost, samples
from tests.support import asgi_gateway

HOSTS = ["http://e0", "http://e1"]
JSON = {"content-type": "application/json"}
PROMPT = "Every episode of this task starts with the same long instructions. " * 12


def config(tmp_path: Path, model: Path) -> GatewayConfig:
    return GatewayConfig(
        model=str(model),
        store_path=str(tmp_path / "t.db"),
        failover=FailoverConfig(stall_timeout=0.3, no_worker_wait=1.0, max_failovers=3),
    )


async def create(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await client.post("/api/sessions", json=body)
    assert r.status_code == 201, r.text
    out: dict[str, Any] = r.json()
    return out


async def turn(client: httpx.AsyncClient, sid: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """One chat turn of session `sid`; the turn as the trajectory records it."""
    body = {"model": "policy", "messages": messages, "max_tokens": 6, "temperature": 0}
    r = await client.post(f"/s/{sid}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    traj = (await client.get(f"/api/sessions/{sid}/trajectory")).json()
    last: dict[str, Any] = traj["turns"][-1]
    return last


async def test_a_sessions_group_is_shown_kept_across_a_restart_and_not_in_its_metadata(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    cfg = config(tmp_path, tiny_model_dir)
    async with asgi_gateway(cfg, httpx.ASGITransport(FakeEngine().app())) as (_, client):
        grouped = await create(client, group="g" * 200, metadata={"task": "t1"})
        plain = await create(client)
    assert (grouped["group"], grouped["metadata"], plain["group"]) == ("g" * 200, {"task": "t1"}, None)
    async with asgi_gateway(cfg, httpx.ASGITransport(FakeEngine().app())) as (app, client):
        again = (await client.get(f"/api/sessions/{grouped['id']}")).json()
        listed = (await client.get("/api/sessions?meta.task=t1")).json()["data"]
        gw: Gateway = app.state.gateway
        record = gw.store.get_session(grouped["id"])
    assert (again["group"], again["metadata"]) == ("g" * 200, {"task": "t1"})
    assert [(s["id"], s["group"]) for s in listed] == [(grouped["id"], "g" * 200)]
    assert record is not None and (record.group, record.metadata) == ("g" * 200, {"task": "t1"})


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"group": ""}, "group", "invalid_value"),
        ({"group": "g" * 201}, "group", "invalid_value"),
        ({"group": 7}, "group", "invalid_type"),
        ({"group": ["g"]}, "group", "invalid_type"),
        ({"group": True}, "group", "invalid_type"),
        ({"group": "\ud800"}, "group", "invalid_value"),
        ({"metadata": {GROUP_KEY: "g"}}, "metadata", "invalid_value"),
    ],
)
async def test_a_bad_group_gets_the_openai_400(
    tmp_path: Path, tiny_model_dir: Path, body: dict[str, Any], param: str, code: str
) -> None:
    async with asgi_gateway(config(tmp_path, tiny_model_dir), httpx.ASGITransport(FakeEngine().app())) as (
        _,
        client,
    ):
        # json.dumps writes a lone surrogate as an escape (httpx's json= could not encode it)
        r = await client.post("/api/sessions", content=json.dumps(body), headers=JSON)
        listed = (await client.get("/api/sessions")).json()["total"]
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert listed == 0


async def test_fork_children_join_the_parents_group_or_the_group_named_after_the_parent(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    async with asgi_gateway(config(tmp_path, tiny_model_dir), httpx.ASGITransport(FakeEngine().app())) as (
        _,
        client,
    ):
        children = {}
        for group in (None, "g7"):
            parent = await create(client, metadata={"task": "t1"}, **({"group": group} if group else {}))
            await turn(client, parent["id"], [{"role": "user", "content": "go"}])
            r = await client.post(f"/api/sessions/{parent['id']}/fork", json={"at_turn": 0, "n": 2})
            assert r.status_code == 201, r.text
            children[group] = (parent["id"], r.json()["data"])
            bad = await client.post(
                f"/api/sessions/{parent['id']}/fork", json={"at_turn": 0, "metadata": {GROUP_KEY: "x"}}
            )
            assert (bad.status_code, bad.json()["error"]["param"]) == (400, "metadata")
    parent_id, ungrouped = children[None]
    assert [(c["group"], c["metadata"]) for c in ungrouped] == [(parent_id, {"task": "t1"})] * 2
    _, grouped = children["g7"]
    assert [(c["group"], c["metadata"]) for c in grouped] == [("g7", {"task": "t1"})] * 2


async def run_group(
    tmp_path: Path, model: Path, routing: RoutingPolicy
) -> tuple[list[str], dict[str, float]]:
    """Four sessions of one group, each starting with the same long prompt, one after the other: the
    workers their turns ran on, and the hit rates ``/metrics`` shows (checked against the engines')."""
    e0, e1 = FakeEngine(), FakeEngine()
    engines = ByHost({"e0": e0, "e1": e1})
    (tmp_path / routing).mkdir()
    cfg = config(tmp_path / routing, model)
    async with asgi_gateway(cfg, engines, hosts=HOSTS, pool_options={"routing": routing}) as (_, client):
        workers = []
        for i in range(4):
            sid = (await create(client, group="task-7"))["id"]
            messages = [{"role": "user", "content": f"{PROMPT}Episode {i}."}]
            workers.append((await turn(client, sid, messages))["worker"])
        r = await client.get("/metrics")
    assert r.status_code == 200
    rates = {dict(labels)["worker"]: value for (_, labels), value in samples(r.text, HIT_RATE).items()}
    stats = {"remote-0": e0.stats, "remote-1": e1.stats}
    expected = {
        w: s.prefix_cache_hits / s.prefix_cache_queries for w, s in stats.items() if s.prefix_cache_queries
    }
    queries = sum(s.prefix_cache_queries for s in stats.values())
    expected["all"] = sum(s.prefix_cache_hits for s in stats.values()) / queries
    assert rates == expected
    return workers, rates


async def test_the_group_policy_keeps_a_group_on_its_first_worker_and_hits_its_prefix_cache_more(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    grouped, by_group = await run_group(tmp_path, tiny_model_dir, "group")
    spread, by_turns = await run_group(tmp_path, tiny_model_dir, "round-robin")
    assert grouped == ["remote-0"] * 4
    assert spread == ["remote-0", "remote-1", "remote-0", "remote-1"]
    assert set(by_group) == {"remote-0", "all"} and set(by_turns) == {"remote-0", "remote-1", "all"}
    # the group's first session misses on its worker; under round-robin the first on each worker does
    assert by_group["all"] > by_turns["all"] > 0


async def ready_again(pool: EnginePool, name: str, within: float = 10.0) -> None:
    """Until the worker named `name` is ready (woken by each state change: no polling)."""
    deadline = time.monotonic() + within
    while next(m for m in pool.roster.members if m.name == name).state != READY:
        left = deadline - time.monotonic()
        assert left > 0, f"{name} did not come back"
        await pool.roster.wait_change(left)


@pytest.mark.parametrize("routing", ["affinity", "group"])
async def test_after_a_failover_the_sessions_next_turn_goes_to_the_worker_that_took_it_over(
    tmp_path: Path, tiny_model_dir: Path, routing: RoutingPolicy
) -> None:
    engine = FakeEngine(step=lambda context: (sum(context[-3:]) * 31 + len(context) * 7) % 700 + 20)
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    options = {"routing": routing, "probe_interval": 0.05, "probe_timeout": 0.2}
    async with asgi_gateway(config(tmp_path, tiny_model_dir), faults, hosts=HOSTS, pool_options=options) as (
        app,
        client,
    ):
        gw: Gateway = app.state.gateway
        sid = (await create(client, group="g"))["id"]
        faults.faults["e0"] = [Fault("drop_after", 3)]
        messages = [{"role": "user", "content": "go"}]
        first = await turn(client, sid, messages)
        await ready_again(gw.pool, "remote-0")  # back, idle, and first in the pool
        messages += [
            {"role": "assistant", "content": gw.tokenizer.decode(first["output_ids"])},
            {"role": "user", "content": "again"},
        ]
        second = await turn(client, sid, messages)
        other = await turn(client, (await create(client))["id"], [{"role": "user", "content": "go"}])
        traj = (await client.get(f"/api/sessions/{sid}/trajectory")).json()
    [failover] = [e["data"] for e in traj["events"] if e["kind"] == "failover"]
    assert (failover["from_worker"], failover["to_worker"]) == ("remote-0", "remote-1")
    assert (first["worker"], second["worker"], other["worker"]) == ("remote-1", "remote-1", "remote-0")


async def test_a_session_moved_for_load_is_counted_on_metrics(tmp_path: Path, tiny_model_dir: Path) -> None:
    async with asgi_gateway(config(tmp_path, tiny_model_dir), httpx.ASGITransport(FakeEngine().app())) as (
        app,
        client,
    ):
        gw: Gateway = app.state.gateway
        before = samples((await client.get("/metrics")).text, "belayer_sessions_moved_total")
        moved = SessionMoved(
            "remote-0", "remote-1", None, 0, 0, from_outstanding=5, to_outstanding=1, why="load"
        )
        gw.telemetry.publish(moved, "ses_1")
        after = samples((await client.get("/metrics")).text, "belayer_sessions_moved_total")
    assert (before, after) == (
        {("belayer_sessions_moved_total", ()): 0.0},
        {("belayer_sessions_moved_total", ()): 1.0},
    )


async def test_a_running_turn_weighs_its_prompt_and_max_tokens_on_its_worker(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    seen: list[tuple[int, int]] = []  # the worker's load when the engine gets the turn

    class Watching(httpx.ASGITransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/generate") or "completions" in request.url.path:
                [m] = gw.pool.roster.members
                seen.append((m.outstanding, m.outstanding_tokens))
            return await super().handle_async_request(request)

    async with asgi_gateway(config(tmp_path, tiny_model_dir), Watching(FakeEngine().app())) as (app, client):
        gw: Gateway = app.state.gateway
        sid = (await create(client))["id"]
        last = await turn(client, sid, [{"role": "user", "content": PROMPT}])
        [done] = (await client.get("/api/engines")).json()["data"]
    assert seen == [(1, len(last["prompt_ids"]) + 6)]  # the prompt and max_tokens, while it runs
    assert (done["outstanding"], done["outstanding_tokens"]) == (0, 0)


async def test_the_routing_policy_is_read_and_changed_live_by_the_admin(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    cfg = config(tmp_path, tiny_model_dir).model_copy(update={"admin_token": "adm"})
    admin = {"authorization": "Bearer adm"}
    engines = ByHost({"e0": FakeEngine(), "e1": FakeEngine()})
    async with asgi_gateway(cfg, engines, hosts=HOSTS) as (app, client):
        gw: Gateway = app.state.gateway
        assert (await client.get("/api/routing")).json() == {
            "routing": "affinity", "routing_spill_factor": 2.0, "routing_spill_floor": 8192, "sessions": 0,
            "groups": 0,
        }  # fmt: skip
        sid = (await create(client, group="g"))["id"]
        assert (await turn(client, sid, [{"role": "user", "content": "hi"}]))["worker"] == "remote-0"
        r = await client.put("/api/routing", json={"routing": "round-robin"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
        for body, param in [({"routing": "random"}, "routing"), ({"routing_spill_factor": 0.5}, "routing_spill_factor"),
                            ({"routing_spill_floor": "8"}, "routing_spill_floor"), ({"policy": "group"}, "policy")]:  # fmt: skip
            r = await client.put("/api/routing", json=body, headers=admin)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert gw.pool.settings.routing == "affinity"
        r = await client.put(
            "/api/routing", json={"routing": "round-robin", "routing_spill_floor": 0}, headers=admin
        )
        assert r.json() == {
            "routing": "round-robin", "routing_spill_factor": 2.0, "routing_spill_floor": 0, "sessions": 1,
            "groups": 1,
        }  # fmt: skip
        workers = [
            (await turn(client, sid, [{"role": "user", "content": f"turn {i}"}]))["worker"] for i in range(3)
        ]
    assert workers == ["remote-0", "remote-1", "remote-0"]  # in turn, the session's worker no longer kept
