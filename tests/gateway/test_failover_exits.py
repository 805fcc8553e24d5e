"""Failover from a launched worker whose process died, noticed by the pool's watch of its processes
(``engine_pool.workers.exits``), not by a stall, a health probe or the broken connection: the stream is cut at
once (cause ``dead``, the watch's reason as the error) and resumes on another worker with exactly the
tokens of an undisturbed run. Real fake-worker processes behind the gateway; no probe round runs, and the
stall timeout is longer than the test may take."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.fake import ENGINE_CORE_ENV, ENGINE_CORE_TITLE, TOKEN_DELAY_ENV
from engine_pool.pool import DEAD, DRAINING, EnginePool, PoolMember
from engine_pool.workers.exits import vital
from gateway.app import build_app, build_pool
from gateway.config import FailoverConfig, GatewayConfig
from store import TurnRecord
from tests.support import client_root

TOKENS = 150  # at 10 ms a token, over a second of reply left when the worker dies after 5


class Turns:
    """A turn observer that keeps the turns started (their output ids grow as they stream)."""

    def __init__(self) -> None:
        self.started: list[TurnRecord] = []

    def turn_started(self, turn: TurnRecord) -> None:
        self.started.append(turn)

    async def turn_ending(self, turn: TurnRecord) -> None:
        pass

    def turn_finished(self, turn: TurnRecord) -> None:
        pass


@contextlib.asynccontextmanager
async def launched_gateway(
    tmp_path: Path, model: Path, turns: Turns
) -> AsyncIterator[tuple[httpx.AsyncClient, EnginePool]]:
    config = GatewayConfig(
        model=str(model), worker_kind="fake", workers=2, shadows=0, store_path=str(tmp_path / "t.db"),
        log_dir=str(tmp_path / "logs"), worker_start_timeout=60.0,
        failover=FailoverConfig(stall_timeout=600.0, no_worker_wait=60.0),
    )  # fmt: skip
    async with httpx.AsyncClient(timeout=None) as http:
        pool = build_pool(config, http)
        pool.settings.probe_interval = 3600.0  # no probe round: only the watch (or the connection) can notice
        app = build_app(config, pool=pool, observers=[turns])
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url=client_root(config), timeout=120
            ) as client,
        ):
            yield client, pool


async def chat(client: httpx.AsyncClient) -> tuple[str, dict[str, Any]]:
    """A streamed greedy reply of `TOKENS` tokens in a new session: its session id and its trajectory."""
    sid = (await client.post("/api/sessions", json={})).json()["id"]
    body = {"model": "policy", "messages": [{"role": "user", "content": "count"}], "temperature": 0,
            "max_tokens": TOKENS, "stream": True, "logprobs": True}  # fmt: skip
    r = await client.post(f"/s/{sid}/v1/chat/completions", json=body)
    assert r.status_code == 200 and '"error"' not in r.text, r.text[-500:]
    return sid, (await client.get(f"/api/sessions/{sid}/trajectory")).json()


async def serving(turns: Turns, pool: EnginePool, after: int = 5) -> PoolMember:
    """The worker streaming the only turn, once it has `after` tokens (looked at until it has)."""
    async with asyncio.timeout(60):
        while not turns.started or len(turns.started[0].output_ids) < after:
            await asyncio.sleep(0.005)
    member = pool.roster.live(turns.started[0].worker or "")
    assert member is not None and member.process is not None and member.process.pid is not None
    return member


async def failed_over(
    tmp_path: Path, model: Path, kill: Any
) -> tuple[PoolMember, int, dict[str, Any], list[int], list[int]]:
    """A reply whose worker `kill(member)` kills after 5 tokens: (the worker, the pid killed, the
    failover event, the turn's output ids, an undisturbed rerun's)."""
    turns = Turns()
    async with launched_gateway(tmp_path, model, turns) as (client, pool):
        reply = asyncio.create_task(chat(client))
        member = await serving(turns, pool)
        pid = kill(member)
        _, trajectory = await reply
        _, again = await chat(client)  # on the pool that is left, undisturbed
        assert member.state in (DRAINING, DEAD)  # fenced (out of routing) when the watch fired
    [event] = [e["data"] for e in trajectory["events"] if e["kind"] == "failover"]
    return member, pid, event, trajectory["turns"][0]["output_ids"], again["turns"][0]["output_ids"]


@pytest.fixture(autouse=True)
def fast_fake_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_DELAY_ENV, "0.01")


async def test_a_killed_worker_is_noticed_by_its_exit_and_its_stream_resumes_exactly(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    def kill_reaper(member: PoolMember) -> int:  # `kill -9` of the pid the pool shows: the server follows
        assert member.process is not None and member.process.pid is not None
        os.kill(member.process.pid, signal.SIGKILL)
        return member.process.pid

    member, pid, event, output, undisturbed = await failed_over(tmp_path, tiny_model_dir, kill_reaper)
    assert event["cause"] == "dead" and event["from_worker"] == member.name
    # the watch's reason, not the connection's error: no stall wait, no probe, no broken socket needed
    assert (
        event["error"]
        == f"worker {member.name}: the reaper (pid {pid}) exited; the reaper: killed by SIGKILL"
    )
    assert event["to_worker"] not in (None, member.name) and 5 <= event["token_index"] < TOKENS
    assert event["noticed_at"] <= event["resubmitted_at"] <= event["resumed_at"]
    assert output == undisturbed and len(output) == TOKENS


async def test_a_dead_engine_core_under_a_lingering_server_is_a_failover_too(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server streams on after its engine-core stand-in died (as vLLM's API server lingers): only
    the watch tells the gateway, and the turn resumes elsewhere."""
    monkeypatch.setenv(ENGINE_CORE_ENV, "1")

    def kill_engine_core(member: PoolMember) -> int:
        assert member.process is not None and member.process.pid is not None
        [core] = [pid for pid, what in vital(member.process.pid) if what == ENGINE_CORE_TITLE]
        os.kill(core, signal.SIGKILL)
        return core

    member, core, event, output, undisturbed = await failed_over(tmp_path, tiny_model_dir, kill_engine_core)
    assert event["cause"] == "dead" and event["from_worker"] == member.name
    assert event["error"] == f"worker {member.name}: {ENGINE_CORE_TITLE} (pid {core}) exited"
    assert event["to_worker"] not in (None, member.name) and 5 <= event["token_index"] < TOKENS
    assert output == undisturbed and len(output) == TOKENS
