"""Mid-stream failover with the fake engine: failures injected at the transport, like a killed worker."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.fake import FakeEngine, Fault, FaultInjector
from gateway.config import FailoverConfig, GatewayConfig
from gateway.gateway import Gateway
from tests.support import asgi_gateway

HOSTS = ["e0", "e1", "e2"]


def step(context: list[int]) -> int:
    return (sum(context[-3:]) * 31 + len(context) * 7) % 700 + 20


class Rig:
    def __init__(
        self, app: Any, client: httpx.AsyncClient, engine: FakeEngine, faults: FaultInjector
    ) -> None:
        self.app, self.client, self.engine, self.faults = app, client, engine, faults

    @property
    def gw(self) -> Gateway:
        gw: Gateway = self.app.state.gateway
        return gw

    async def chat(
        self, stream: bool, max_tokens: int = 12, session: str | None = None
    ) -> tuple[str, dict[str, Any]]:
        sid = session or (await self.client.post("/api/sessions", json={})).json()["id"]
        body = {
            "model": "policy",
            "messages": [{"role": "user", "content": "go"}],
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": stream,
            "logprobs": True,
        }
        r = await self.client.post(f"/s/{sid}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            assert '"error"' not in r.text
            text = "".join(
                json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                for line in r.text.splitlines()
                if line.startswith("data: {") and '"choices":[{' in line
            )
        else:
            text = r.json()["choices"][0]["message"]["content"] or ""
        turn = (await self.client.get(f"/api/sessions/{sid}/trajectory")).json()
        return text, turn

    def reference(self, prompt: list[int], max_tokens: int) -> list[int]:
        return self.engine.greedy(prompt, max_tokens)


@pytest.fixture
async def rig(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Rig]:
    engine = FakeEngine(step=step, max_model_len=4096)
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        failover=FailoverConfig(stall_timeout=0.3, no_worker_wait=1.0, max_failovers=3),
        admin_token="s3cret",
    )
    probes = {"probe_interval": 0.05, "probe_timeout": 0.2}
    hosts = [f"http://{h}" for h in HOSTS]
    async with asgi_gateway(config, faults, hosts=hosts, pool_options=probes) as (app, client):
        yield Rig(app, client, engine, faults)


def failovers(traj: dict[str, Any]) -> list[dict[str, Any]]:
    return [e["data"] for e in traj["events"] if e["kind"] == "failover"]


def check_exact(rig: Rig, traj: dict[str, Any], max_tokens: int) -> None:
    [turn] = traj["turns"]
    assert turn["status"] == "complete"
    assert turn["output_ids"] == rig.reference(turn["prompt_ids"], max_tokens)
    # Logprobs are positional in the fake engine: a resumed request restarts at position 0, so only the
    # token ids (never the logprobs' origin) are compared across the failover; each is still recorded.
    assert len(turn["output_logprobs"]) == len(turn["output_ids"])


@pytest.mark.parametrize("stream", [True, False])
async def test_failure_mid_stream_is_invisible(rig: Rig, stream: bool) -> None:
    rig.faults.faults["e0"] = [Fault("drop_after", 5)]
    text, traj = await rig.chat(stream, max_tokens=12)
    check_exact(rig, traj, 12)
    [fo] = failovers(traj)
    expected_index = (
        5  # streamed from the engine either way: a non-streamed request keeps its partial tokens too
    )
    assert (fo["token_index"], fo["from_worker"], fo["to_worker"]) == (expected_index, "remote-0", "remote-1")
    assert text == rig.gw.tokenizer.decode(traj["turns"][0]["output_ids"])
    resumed = rig.engine.requests[-1]
    assert (
        resumed["prompt"] == traj["turns"][0]["prompt_ids"] + traj["turns"][0]["output_ids"][:expected_index]
    )
    assert resumed["max_tokens"] == 12 - expected_index


async def test_failure_before_first_token(rig: Rig) -> None:
    rig.faults.faults["e0"] = [Fault("refuse")]
    _, traj = await rig.chat(True)
    check_exact(rig, traj, 12)
    assert [(f["token_index"], f["to_worker"]) for f in failovers(traj)] == [(0, "remote-1")]


async def test_failure_in_the_last_token(rig: Rig) -> None:
    rig.faults.faults["e0"] = [Fault("drop_after", 11)]
    _, traj = await rig.chat(True, max_tokens=12)
    check_exact(rig, traj, 12)
    assert rig.engine.requests[-1]["max_tokens"] == 1
    assert traj["turns"][0]["finish_reason"] == "length"


async def test_two_failures_in_one_request(rig: Rig) -> None:
    rig.faults.faults["e0"] = [Fault("drop_after", 3)]
    rig.faults.faults["e1"] = [Fault("drop_after", 4)]
    _, traj = await rig.chat(True, max_tokens=12)
    check_exact(rig, traj, 12)
    first, second = failovers(traj)
    assert (first["token_index"], first["from_worker"], first["to_worker"]) == (3, "remote-0", "remote-1")
    # remote-2, or remote-0 once a probe has let it back in (on a busy machine the second failure
    # can come after that probe)
    assert (second["token_index"], second["from_worker"]) == (7, "remote-1")
    assert second["to_worker"] in ("remote-0", "remote-2")


async def test_stall_confirmed_by_probe_fails_over(rig: Rig) -> None:
    rig.faults.faults["e0"] = [Fault("stall_after", 4)]
    rig.faults.hung.add("e0")
    _, traj = await rig.chat(True)
    check_exact(rig, traj, 12)
    [fo] = failovers(traj)
    assert fo["token_index"] == 4 and "sent no token" in fo["error"] and fo["detect_ms"] >= 300


async def test_slow_but_healthy_worker_is_not_failed_over(rig: Rig) -> None:
    rig.engine.token_delay = 0.5  # slower than the stall timeout, but /health answers
    _, traj = await rig.chat(True, max_tokens=2)
    check_exact(rig, traj, 2)
    assert failovers(traj) == [] and rig.gw.pool.roster.members[0].state == "ready"


async def test_no_worker_left_waits_then_503(rig: Rig) -> None:
    rig.faults.down.update(HOSTS)
    sid = (await rig.client.post("/api/sessions", json={})).json()["id"]
    body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "max_tokens": 4}
    r = await rig.client.post(f"/s/{sid}/v1/chat/completions", json=body)
    assert r.status_code == 503 and "within 1s" in r.json()["error"]["message"]
    assert "remote-0=unhealthy" in r.json()["error"]["message"]


async def test_request_waits_for_a_worker_to_come_back(rig: Rig) -> None:
    pool = rig.gw.pool
    rig.gw.runner.failover.config = FailoverConfig(
        stall_timeout=0.3, no_worker_wait=30.0
    )  # robust on a busy machine
    for m in pool.roster.members[1:]:
        m.state = "dead"  # only e0 is left in the pool
    rig.faults.faults["e0"] = [Fault("drop_after", 2)]
    rig.faults.hung.add("e0")  # ... and it fails its probes for a while
    back: list[float] = []

    def come_back() -> None:
        back.append(time.time())
        rig.faults.hung.discard("e0")

    waiter = asyncio.get_running_loop().call_later(0.3, come_back)
    _, traj = await rig.chat(True, max_tokens=6)
    waiter.cancel()
    check_exact(rig, traj, 6)
    [fo] = failovers(traj)
    [event] = [e for e in traj["events"] if e["kind"] == "failover"]
    assert (fo["from_worker"], fo["to_worker"]) == ("remote-0", "remote-0")
    # it resumed on the worker once it came back (the event is written at the resumed first token),
    # not before: on a busy machine the stream's start may take longer than the 0.3 s, so no fixed bound
    assert back and event["ts"] >= back[0]


async def test_engine_4xx_is_not_retried(rig: Rig) -> None:
    rig.engine.reject_next = "bad sampling parameter"
    sid = (await rig.client.post("/api/sessions", json={})).json()["id"]
    r = await rig.client.post(
        f"/s/{sid}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "x"}]},
    )
    assert r.status_code == 400 and len(rig.engine.requests) == 1
    assert all(m.state == "ready" for m in rig.gw.pool.roster.members)


async def test_failover_disabled_fails_the_request(rig: Rig) -> None:
    rig.gw.runner.failover.config = FailoverConfig(enabled=False)
    rig.faults.faults["e0"] = [Fault("drop_after", 3)]
    sid = (await rig.client.post("/api/sessions", json={})).json()["id"]
    r = await rig.client.post(
        f"/s/{sid}/v1/chat/completions",
        json={"model": "policy", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8},
    )
    assert r.status_code == 503
    [turn] = (await rig.client.get(f"/api/sessions/{sid}/trajectory")).json()["turns"]
    # the tokens decoded before the loss stay recorded (streamed from the engine), on a turn marked error
    assert turn["status"] == "error" and len(turn["output_ids"]) == 3


async def test_register_engine_needs_admin_token_then_routes(rig: Rig) -> None:
    r = await rig.client.post("/api/engines", json={"url": "http://e3"})
    assert (
        r.status_code == 403
        and r.json()["error"]["code"] == "forbidden"
        and "admin token" in r.json()["error"]["message"]
    )
    r = await rig.client.post(
        "/api/engines", json={"url": "http://e3"}, headers={"authorization": "Bearer nope"}
    )
    assert r.status_code == 403
    r = await rig.client.post(
        "/api/engines", json={"url": "http://e3"}, headers={"authorization": "Bearer s3cret"}
    )
    assert r.status_code == 201
    assert {k: r.json()[k] for k in ("name", "url", "state", "max_model_len")} == {
        "name": "remote-3", "url": "http://e3", "state": "ready", "max_model_len": 4096,
    }  # fmt: skip
    for m in rig.gw.pool.roster.members[:3]:
        m.state = "dead"
    _, traj = await rig.chat(True, max_tokens=4)
    assert traj["turns"][0]["worker"] == "remote-3"
    check_exact(rig, traj, 4)


async def test_failover_is_invisible_in_an_anthropic_stream(rig: Rig) -> None:
    rig.faults.faults["e0"] = [Fault("drop_after", 4)]
    sid = (await rig.client.post("/api/sessions", json={})).json()["id"]
    body = {
        "model": "policy",
        "max_tokens": 10,
        "stream": True,
        "messages": [{"role": "user", "content": "go"}],
    }
    r = await rig.client.post(f"/s/{sid}/v1/messages", json=body)
    assert r.status_code == 200
    kinds = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert "error" not in kinds and kinds[-1] == "message_stop"
    text = "".join(
        json.loads(line[6:])["delta"].get("text", "")
        for line in r.text.splitlines()
        if line.startswith("data: ") and '"content_block_delta"' in line
    )
    traj = (await rig.client.get(f"/api/sessions/{sid}/trajectory")).json()
    check_exact(rig, traj, 10)
    assert text == rig.gw.tokenizer.decode(traj["turns"][0]["output_ids"])
    assert [(f["token_index"], f["to_worker"]) for f in failovers(traj)] == [(4, "remote-1")]


async def test_a_switch_is_reported_once_its_first_token_went_on_to_the_client(rig: Rig) -> None:
    """The failover event (its store write, its publish) comes after the new worker's first token went on
    to the client, not before it: that work is not in the client's lost time. Its ``resumed_at`` is
    still when the token arrived."""
    telemetry = rig.gw.telemetry
    streamed_then: list[int] = []
    telemetry.listen(
        lambda e: streamed_then.append(telemetry.tokens_streamed) if e.kind == "failover" else None
    )
    rig.faults.faults["e0"] = [Fault("drop_after", 5)]
    _, traj = await rig.chat(True, max_tokens=12)
    check_exact(rig, traj, 12)
    [fo] = failovers(traj)
    assert fo["token_index"] == 5
    assert len(streamed_then) == 1 and streamed_then[0] > 5  # 5 before the loss, then the resumed one
    assert fo["noticed_at"] <= fo["resubmitted_at"] <= fo["resumed_at"]
