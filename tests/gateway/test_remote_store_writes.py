"""A remote store's writes (PostgreSQL: `TrajectoryStore.remote`) run in its front's lanes (`store.front`),
never on the event loop, and a request cancelled while its turn is being written leaves no turn ``running``.

The store here is SQLite given a remote store's front, with its first write of a turn held on a gate, so
that the test decides when the write ends; the real PostgreSQL path runs in ``test_contract.py`` and the
replica tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.fake import FakeEngine, Fault, FaultInjector
from gateway.config import FailoverConfig, GatewayConfig
from store import SqliteStore, TurnRecord
from store.front import WriteFront
from store.postgres import PostgresStore
from tests.postgres_server import PostgresServer
from tests.support import asgi_gateway

BODY = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


class GatedBegin:
    """Wraps a store's begin_turn: each call waits for `release`, and records that it is waiting."""

    def __init__(self, store: SqliteStore) -> None:
        self.inner = store.begin_turn
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads: list[str] = []

    def __call__(self, *args: Any, **kwargs: Any) -> TurnRecord:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.release.wait(30)
        return self.inner(*args, **kwargs)


def turns_of_the_only_session(store: SqliteStore) -> list[TurnRecord]:
    """The turns of the one session (none yet: the session is written with its first turn)."""
    sessions = store.list_sessions()
    assert len(sessions) <= 1
    return store.get_turns(sessions[0].id) if sessions else []


@contextlib.asynccontextmanager
async def gated_gateway(
    tmp_path: Path, tiny_model_dir: Path
) -> AsyncIterator[tuple[httpx.AsyncClient, SqliteStore, GatedBegin, asyncio.Task[httpx.Response]]]:
    """A gateway on a store marked remote whose turn writes wait on a gate, and a chat request that has
    reached the gate (its turn's first write is running, held)."""
    engine = FakeEngine(max_model_len=4096, script=lambda p: [11, 12, 13, 14, 15])
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"))
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as (app, client):
        store: SqliteStore = app.state.gateway.store
        store.remote = True  # as PostgreSQL: a turn's writes run in the front's lanes
        store.front = WriteFront(lanes=2)
        gate = GatedBegin(store)
        store.begin_turn = gate  # type: ignore[method-assign]
        request = asyncio.create_task(client.post("/v1/chat/completions", json=BODY))
        assert await asyncio.to_thread(gate.entered.wait, 30)
        yield client, store, gate, request


async def test_a_remote_stores_turn_writes_leave_the_event_loop_free(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    async with gated_gateway(tmp_path, tiny_model_dir) as (client, store, gate, request):
        assert (await client.get("/health")).status_code == 200  # the loop serves while the write is held
        assert turns_of_the_only_session(store) == []
        gate.release.set()
        r = await request
        assert r.status_code == 200, r.text
        assert gate.threads and gate.threads[0].startswith("belayer-store-")
        [turn] = turns_of_the_only_session(store)
        assert (turn.status, turn.output_ids) == ("complete", [11, 12, 13, 14, 15])


async def test_a_request_cancelled_while_its_turn_is_written_leaves_no_turn_running(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    async with gated_gateway(tmp_path, tiny_model_dir) as (_, store, gate, request):
        request.cancel()  # the client goes away while the turn's first write runs
        with pytest.raises(asyncio.CancelledError):
            await request
        gate.release.set()  # the write ends after its request did
        deadline = time.monotonic() + 30
        while not (turns := turns_of_the_only_session(store)) or turns[0].status == "running":
            assert time.monotonic() < deadline, "the orphaned turn stayed running"
            await asyncio.sleep(0.01)
        [turn] = turns
        assert turn.status == "aborted" and turn.output_ids == []
        assert turn.error is not None and "cancelled while its turn was being stored" in turn.error


@pytest.mark.postgres
async def test_no_write_reaches_postgresql_on_the_event_loop_in_a_failover_storm(
    postgres: PostgresServer, tiny_model_dir: Path
) -> None:
    """Sessions made, streamed through a failover each (an event per cut), rewarded and closed, at once, on
    a PostgreSQL store that refuses a write made on the event loop's thread (`PostgresStore.off_loop_only`):
    each would be a request's error here."""
    engine = FakeEngine(max_model_len=4096, script=lambda p: list(range(20, 32)))
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    n = 12
    faults.faults = {"e0": [Fault("drop_after", 4)] * n, "e1": [Fault("drop_after", 6)] * n}
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=postgres.new_database(),
        failover=FailoverConfig(max_failovers=4, no_worker_wait=5.0),
    )
    hosts = ["http://e0", "http://e1", "http://e2"]
    async with asgi_gateway(config, faults, hosts=hosts) as (app, client):
        store: PostgresStore = app.state.gateway.store
        store.off_loop_only = True

        async def episode() -> str:
            sid = (await client.post("/api/sessions", json={"metadata": {}})).json()["id"]
            r = await client.post(f"/s/{sid}/v1/chat/completions", json=BODY)
            assert r.status_code == 200, r.text
            assert (await client.post(f"/api/sessions/{sid}/reward", json={"reward": 1.0})).status_code == 200
            assert (await client.post(f"/api/sessions/{sid}/close")).status_code == 200
            return str(sid)

        sids = await asyncio.gather(*(episode() for _ in range(n)))
    reader = PostgresStore(config.store_path, recover=False)
    cuts = 2 * n - len(faults.faults["e0"]) - len(faults.faults["e1"])
    failovers = 0
    for sid in sids:
        [turn] = reader.get_turns(sid)
        assert (turn.status, len(turn.output_ids)) == ("complete", 5)
        kinds = [e.kind for e in reader.get_events(sid)]
        assert kinds[-1] == "session_closed", kinds
        failovers += kinds.count("failover")
    assert failovers >= cuts > 0  # each cut stream's event was written (off the loop)
    assert [s.reward for s in map(reader.get_session, sids)] == [1.0] * n
    reader.close()
