"""``GET /metrics`` moves by exactly what happened: a failover after a dead worker, one after a stall,
checkpoints inside and outside a bubble, and a restore that discards a turn (fake engines behind a
fault injector, fake sandboxes: in process, no sleeps)."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine_pool.face import Placement
from engine_pool.fake import FakeEngine, Fault, FaultInjector, autoregressive
from gateway.config import FailoverConfig, GatewayConfig
from gateway.gateway import Gateway
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.fake import FakeSandboxBackend
from tests.support import asgi_gateway

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]
CHAT = "/s/{session_id}/v1/chat/completions"


async def scrape(client: httpx.AsyncClient) -> Samples:
    r = await client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def moved(before: Samples, after: Samples) -> dict[str, float]:
    """Every sample that changed, as ``name{a="b"}``: how much."""
    out = {}
    for key, value in after.items():
        delta = value - before.get(key, 0.0)
        if delta and not key[0].endswith(("_sum", "_created")):
            name, labels = key
            shown = ",".join(f'{k}="{v}"' for k, v in sorted(labels))
            out[f"{name}{{{shown}}}" if shown else name] = delta
    return out


async def chat(client: httpx.AsyncClient, sid: str, text: str, history: list[dict[str, Any]]) -> str:
    """A streamed chat turn; the reply's text (the conversation grows by the request and reply)."""
    history.append({"role": "user", "content": text})
    body = {"model": "policy", "messages": history, "stream": True, "max_tokens": 12, "temperature": 0}
    content = []
    async with client.stream("POST", f"/s/{sid}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                content.append(delta.get("content") or "")
    history.append({"role": "assistant", "content": "".join(content)})
    return "".join(content)


async def test_metrics_count_failovers_stalls_checkpoints_and_restores_exactly(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    engine = FakeEngine(max_model_len=4096, step=autoregressive, token_delay=0.01)
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        failover=FailoverConfig(stall_timeout=0.5, no_worker_wait=5.0),
        sandbox=SandboxConfig(enabled=True, sandbox_port=None, policy=PolicySettings(mode="never")),
    )
    async with asgi_gateway(
        config, faults, hosts=("http://e0", "http://e1", "http://e2"), sandbox_backend=FakeSandboxBackend()
    ) as (app, client):
        gw: Gateway = app.state.gateway
        r = await client.post("/api/sessions", json={"sandbox": {"image": "belayer-sandbox-busybox"}})
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        before = await scrape(client)
        history: list[dict[str, Any]] = []

        # turn 0: its worker's connection drops after 4 tokens
        doomed = gw.pool.pick(Placement(sid))
        assert doomed is not None
        faults.faults[httpx.URL(doomed.client.base_url).host] = [Fault("drop_after", 4)]
        await chat(client, sid, "first", history)
        first = await client.post(f"/api/sessions/{sid}/sandbox/checkpoints", json={})
        assert first.status_code in (200, 201), first.text

        # turn 1: its worker hangs after 3 tokens (and fails its health probe); a checkpoint is taken
        # inside the bubble, while the turn waits
        stuck = gw.pool.pick(Placement(sid))
        assert stuck is not None
        stuck_host = httpx.URL(stuck.client.base_url).host
        faults.faults[stuck_host] = [Fault("stall_after", 3)]
        faults.hung.add(stuck_host)
        turn = asyncio.create_task(chat(client, sid, "second", history))
        while not gw.store.get_turns(sid)[1:]:  # the turn is stored before its engine call
            await asyncio.sleep(0.01)
        inside = await client.post(f"/api/sessions/{sid}/sandbox/checkpoints", json={})
        assert inside.status_code in (200, 201) and inside.json()["in_bubble"] is True, inside.text
        await turn
        faults.hung.discard(stuck_host)

        # a restore of the first checkpoint discards turn 1
        r = await client.post(
            f"/api/sessions/{sid}/sandbox/restore", json={"checkpoint_id": first.json()["id"]}
        )
        assert r.status_code == 200 and r.json()["discarded_turns"] == [1], r.text
        after = await scrape(client)
        traj_turns = gw.store.get_turns(sid)
        events = [e for e in gw.store.get_events(sid) if e.kind == "failover"]
        states = Counter(m.state for m in gw.pool.roster.members)

    assert [e.data["cause"] for e in events] == ["dead", "stall"]
    generated = sum(len(t.output_ids) for t in traj_turns)
    prompts = sum(len(t.prompt_ids) for t in traj_turns)
    reused = traj_turns[1].prompt_ids[: len(traj_turns[0].prompt_ids)] == traj_turns[0].prompt_ids
    delta = moved(before, after)
    expected = {
        'belayer_failovers_total{cause="dead"}': 1,
        'belayer_failovers_total{cause="stall"}': 1,
        'belayer_failover_detection_seconds_count{cause="dead"}': 1,
        'belayer_failover_detection_seconds_count{cause="stall"}': 1,
        'belayer_failover_lost_seconds_count{cause="dead"}': 1,
        'belayer_failover_lost_seconds_count{cause="stall"}': 1,
        "belayer_failover_resumed_tokens_total": sum(e.data["token_index"] for e in events),
        'belayer_turns_total{outcome="complete"}': 2,
        'belayer_tokens_total{kind="generated"}': generated,
        'belayer_tokens_total{kind="prompt"}': prompts,
        'belayer_prompts_total{kind="fresh_prompt"}': 1,
        'belayer_prompts_total{kind="prefix_reuse"}': 1,
        "belayer_time_to_first_token_seconds_count": 2,
        "belayer_turn_duration_seconds_count": 2,
        "belayer_inter_token_latency_seconds_count": generated - 2,
        'belayer_gateway_added_seconds_count{protocol="openai"}': 2,
        'belayer_worker_transitions_total{from_state="ready",to_state="unhealthy"}': 2,
        'belayer_checkpoints_total{result="taken"}': 2,
        "belayer_checkpoints_in_bubble_total": 1,
        "belayer_checkpoint_duration_seconds_count": 2,
        'belayer_restores_total{mode="truncate"}': 1,
        'belayer_restore_duration_seconds_count{mode="truncate"}': 1,
        "belayer_turns_discarded_total": 1,
    }
    assert reused and generated == 24
    assert {k: delta.get(k) for k in expected} == expected
    assert delta['belayer_tokens_total{kind="reused"}'] > 0
    # the requests, by route template (no session id in any label)
    requests = {k: v for k, v in delta.items() if k.startswith("belayer_http_requests_total")}
    assert (
        requests[
            f'belayer_http_requests_total{{method="POST",protocol="openai",route="{CHAT}",status="200"}}'
        ]
        == 2
    )
    assert not any(sid in k for k in delta)
    # what is read at scrape time
    assert after[("belayer_sessions_open", frozenset())] == 1
    assert after[("belayer_sandboxes", frozenset({("state", "running")}))] == 1
    assert after[("belayer_store_size_bytes", frozenset())] > 0
    workers = {dict(labels)["state"]: v for (n, labels), v in after.items() if n == "belayer_workers"}
    assert sum(workers.values()) == sum(states.values()) == 3 and workers["ready"] >= 1


async def test_metrics_can_be_switched_off(tmp_path: Path, tiny_model_dir: Path) -> None:
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), metrics=False)
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app())) as (_, client):
        r = await client.get("/metrics")
        assert r.status_code == 404 and "--no-metrics" in r.json()["error"]["message"]
        r = await client.post(
            "/v1/chat/completions", json={"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert r.status_code == 200
