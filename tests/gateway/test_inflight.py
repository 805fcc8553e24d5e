"""Running turns' tokens reach the store while they stream (``gateway.turns.inflight``), and logprob
recomputations are marked pending until done (``gateway.turns.recompute``), so a gateway that dies loses
neither. The crash itself, with real processes, is in ``test_gateway_crash.py``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TypeVar

import httpx

from engine_pool.fake import FakeEngine, Fault, FaultInjector, fake_logprob
from gateway.config import FailoverConfig, GatewayConfig, InflightConfig
from gateway.turns.inflight import InflightWriter
from store import SessionRecord, SqliteStore, TurnRecord
from store.base import TURN_COMPLETE
from store.roles import TrajectoryStore
from tests.support import asgi_gateway

StoreT = TypeVar("StoreT", bound=TrajectoryStore)


def _turn(session: str = "s") -> TurnRecord:
    return TurnRecord(session, [1, 2, 3], [], None, None, {}, 0.0)


def _store(path: Path) -> tuple[SqliteStore, TurnRecord]:
    return _begin(SqliteStore(path))


def _begin(store: StoreT) -> tuple[StoreT, TurnRecord]:
    """Session "s" and a running turn in it."""
    store.create_session(SessionRecord("s", time.time(), {}))
    return store, store.begin_turn(_turn())


async def _until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        await asyncio.sleep(0.01)


# --- the writer -------------------------------------------------------------------------------------


async def test_writer_writes_by_tokens_or_interval_and_stops_with_the_turn(tmp_path: Path) -> None:
    store, turn = _store(tmp_path / "t.db")
    writer = InflightWriter(store, InflightConfig(flush_interval_s=3600.0, flush_tokens=100))

    def stored() -> list[int]:
        t = store.get_turn(turn.id)
        assert t is not None
        return t.output_ids

    writer.track(turn)
    turn.output_ids += list(range(99))
    turn.output_logprobs += [-1.0] * 99
    writer.progressed(turn)  # 99 < flush_tokens and the interval is an hour: nothing is due
    await asyncio.sleep(0.05)
    assert stored() == []
    turn.output_ids.append(99)
    turn.output_logprobs.append(-1.0)
    writer.progressed(turn)  # the 100th new token makes a write due
    await _until(lambda: writer.written(turn.id) == 100, "a write after 100 tokens")
    assert stored() == list(range(100))
    writer.untrack(turn)
    await writer.close()
    store.close()

    store, turn = _store(tmp_path / "u.db")
    writer = InflightWriter(store, InflightConfig(flush_interval_s=0.01, flush_tokens=10_000))
    writer.track(turn)
    turn.output_ids += [3, 4]
    turn.output_logprobs += [-0.3, -0.4]
    writer.progressed(turn)  # few tokens, but the interval passes
    await _until(lambda: writer.written(turn.id) == 2, "a write after the interval")
    await writer.close()
    store.close()


async def test_writer_off_writes_nothing(tmp_path: Path) -> None:
    store, turn = _store(tmp_path / "t.db")
    writer = InflightWriter(store, InflightConfig(enabled=False, flush_interval_s=0.01, flush_tokens=1))
    writer.track(turn)
    turn.output_ids.append(1)
    turn.output_logprobs.append(-0.1)
    writer.progressed(turn)
    assert writer.written(turn.id) is None
    await writer.close()
    store.close()


# --- through the gateway ----------------------------------------------------------------------------


def step(context: list[int]) -> int:
    return (sum(context[-3:]) * 31 + len(context) * 7) % 700 + 20


class Gate(httpx.AsyncBaseTransport):
    """In front of the engine: after `at` streamed events of the first generation, waits until
    `ready()` (the gateway has written those tokens to the store) before sending more, like a slow
    engine, so the test sees a running turn's tokens on disk at a known point."""

    def __init__(self, inner: httpx.AsyncBaseTransport, at: int) -> None:
        self.inner, self.at = inner, at
        self.ready: Callable[[], bool] = lambda: True
        self.passed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if (
            request.url.path != "/v1/completions"
            or self.passed
            or not json.loads(request.content).get("stream")
        ):
            return response
        self.passed = True
        return httpx.Response(
            response.status_code, headers=response.headers, stream=_Gated(response, self), request=request
        )


class _Gated(httpx.AsyncByteStream):
    def __init__(self, response: httpx.Response, gate: Gate) -> None:
        self.response, self.gate = response, gate

    async def __aiter__(self) -> AsyncIterator[bytes]:
        n = 0
        async for part in self.response.aiter_raw():
            yield part
            n += part.count(b"data: {")
            if n >= self.gate.at:
                await _until(self.gate.ready, "the running turn's tokens in the store")
                self.gate.at = 1 << 30


async def test_a_streaming_turn_is_on_disk_while_it_runs_and_a_failover_keeps_it_a_prefix(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """Worker e0 dies after 30 tokens, e1 resumes: the tokens seen on disk while the turn ran (20 of
    them at a point the test holds the stream, before the failover) are a prefix of the final output,
    which is the uninterrupted greedy one."""
    engine = FakeEngine(step=step, max_model_len=4096)
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    faults.faults["e0"] = [Fault("drop_after", after=30)]
    gate = Gate(faults, at=20)
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        failover=FailoverConfig(stall_timeout=1.0, no_worker_wait=2.0),
        inflight=InflightConfig(flush_interval_s=0.01, flush_tokens=1),
    )
    hosts = ["http://e0", "http://e1"]
    async with asgi_gateway(config, gate, hosts=hosts, timeout=30.0) as (app, client):
        store = app.state.gateway.store
        sid = (await client.post("/api/sessions", json={})).json()["id"]
        seen: list[list[int]] = []

        def ready() -> bool:
            turns = store.get_turns(sid)
            if turns and turns[-1].status == "running" and turns[-1].output_ids:
                seen.append(turns[-1].output_ids)
            return bool(seen) and len(seen[-1]) >= 20

        gate.ready = ready
        body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "temperature": 0,
                "max_tokens": 80, "stream": True}  # fmt: skip
        r = await client.post(f"/s/{sid}/v1/chat/completions", json=body)
        assert r.status_code == 200 and '"error"' not in r.text
        turn = store.get_turns(sid)[-1]
    assert turn.status == TURN_COMPLETE and turn.output_ids == engine.greedy(turn.prompt_ids, 80)
    assert turn.output_logprobs[:30] == [fake_logprob(i, t) for i, t in enumerate(turn.output_ids[:30])]
    assert seen and len(seen[-1]) >= 20
    for snapshot in seen:
        assert snapshot == turn.output_ids[: len(snapshot)]
    assert [e.kind for e in SqliteStore(tmp_path / "t.db").get_events(sid)].count("failover") == 1


async def test_a_recomputation_left_pending_is_redone_at_start(tmp_path: Path, tiny_model_dir: Path) -> None:
    db = tmp_path / "t.db"
    store = SqliteStore(db)
    store.create_session(SessionRecord("s", time.time(), {}))
    turn = store.begin_turn(_turn())
    turn.output_ids, turn.output_logprobs, turn.status = [9], [-0.9], TURN_COMPLETE
    store.finish_turn(turn)
    store.schedule_recomputation(turn, [(1, 3)])  # the gateway that scheduled it died here
    store.close()

    engine = FakeEngine(max_model_len=4096)
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(db))
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as (app, _):
        await app.state.gateway.runner.idle()
        events = app.state.gateway.store.get_events("s")
        pending = app.state.gateway.store.pending_recomputations()
    kinds = [e.kind for e in events]
    assert kinds == ["recompute_resumed", "recomputed_logprobs"] and pending == []
    runs = events[-1].data["runs"]
    assert runs == [[1, [fake_logprob(-2, 2), fake_logprob(-3, 3)]]]  # the engine's own prompt logprobs
