"""A full disk (or a read-only or corrupt store) surfaces its real cause, is logged, and leaves no turn
``running``: a turn whose final write failed is shown finished and written once the store takes writes."""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from pathlib import Path

import httpx
import pytest

from core.errors import StoreError
from engine_pool.fake import FakeEngine
from gateway.config import GatewayConfig
from store import EventRecord, SessionRecord, SqliteStore, TurnRecord
from store.export import export
from tests.support import asgi_gateway

BODY = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2000}
LONG = {**BODY, "messages": [{"role": "user", "content": "a long prompt " * 800}], "max_tokens": 4}
"""Rows this size need new pages: the writes fail on a full disk."""


def fill_up(store: SqliteStore) -> None:
    """The disk is full: the database may not grow by one more page (SQLite's SQLITE_FULL)."""
    pages = store._db.execute("PRAGMA page_count").fetchone()[0]
    store._db.execute(f"PRAGMA max_page_count = {pages}")
    store._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")


def free_up(store: SqliteStore) -> None:
    store._db.execute("PRAGMA max_page_count = 1073741823")


async def test_a_full_disk_says_so_and_no_turn_stays_running(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = FakeEngine(
        max_model_len=4096, token_delay=0.0005, script=lambda p: [(p[-1] + i) % 500 + 10 for i in range(2000)]
    )
    config = GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"))
    async with asgi_gateway(config, httpx.ASGITransport(engine.app())) as (app, client):
        store: SqliteStore = app.state.gateway.store
        sid = (await client.post("/api/sessions", json={"metadata": {"pad": "x" * 20000}})).json()["id"]
        # A turn begins while there is room; the disk fills up while it streams.
        streaming = asyncio.create_task(
            client.post(f"/s/{sid}/v1/chat/completions", json={**BODY, "stream": True})
        )
        while not store.get_turns(sid):
            await asyncio.sleep(0.005)
        with caplog.at_level(logging.ERROR):
            fill_up(store)
            r = await streaming
            assert r.status_code == 200 and "database or disk is full" in r.text  # in the stream's error
            assert "cannot rollback" not in r.text
            again = await client.post(f"/s/{sid}/v1/chat/completions", json=LONG)
            assert again.status_code == 500
            assert "database or disk is full" in again.json()["error"]["message"]
        assert sum("database or disk is full" in rec.getMessage() for rec in caplog.records) >= 2
        failures = store.failures
        assert failures >= 2
        metrics = (await client.get("/metrics")).text
        assert f"belayer_store_failures_total {float(failures)}" in metrics, metrics[:2000]
        [turn] = (await client.get(f"/api/sessions/{sid}/trajectory")).json()["turns"]
        assert turn["status"] == "complete" and len(turn["output_ids"]) == 2000  # kept, shown finished
        on_disk = sqlite3.connect(tmp_path / "t.db").execute("SELECT status FROM turns").fetchall()
        assert on_disk == [("running",)]  # not written yet: the disk is full
        free_up(store)
        await client.post("/api/sessions", json={})  # the next write that succeeds ...
        r = await client.post(f"/s/{sid}/v1/chat/completions", json=LONG)
        assert r.status_code == 200, r.text
        on_disk = (
            sqlite3.connect(tmp_path / "t.db").execute("SELECT status FROM turns ORDER BY id").fetchall()
        )
        assert on_disk == [("complete",), ("complete",)]  # ... wrote the kept turn too


def test_a_read_only_store_names_the_cause(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = SqliteStore(tmp_path / "t.db")
    store._db.execute("PRAGMA query_only = ON")  # as a read-only file or mount would (root ignores chmod)
    with (
        caplog.at_level(logging.ERROR),
        pytest.raises(StoreError, match="attempt to write a readonly database"),
    ):
        store.create_session(SessionRecord("ses_1", created_at=0.0, metadata={}))
    with pytest.raises(StoreError, match="readonly database"):  # a transaction: the cause, not the rollback's
        store.add_event(EventRecord("ses_1", None, 0.0, "x", {}))
    assert store.failures == 2 and "readonly database" in caplog.text
    store.close()


def test_a_store_poisoned_by_an_older_version_reads_and_exports(tmp_path: Path) -> None:
    """Non-finite values written before the edge refused them (an inf reward, Infinity in metadata)
    read as null: the session list, trajectories and the export work, and the export is JSON."""
    path = tmp_path / "t.db"
    store = SqliteStore(path)
    store.create_session(SessionRecord("ses_1", created_at=0.0, metadata={"a": 1}))
    store._db.execute(
        "UPDATE sessions SET reward = ?, metadata = ? WHERE id = 'ses_1'", (float("inf"), '{"a": Infinity}')
    )
    turn = store.begin_turn(
        TurnRecord(
            "ses_1",
            prompt_ids=[1, 2],
            prompt_gen_spans=[],
            parent_id=None,
            ext_key=None,
            request={},
            received_at=0.0,
        )
    )
    turn.output_ids, turn.output_logprobs, turn.status = [3], [-0.5], "complete"
    store.finish_turn(turn)
    [session] = store.list_sessions()
    assert session.reward is None and session.metadata == {"a": None}
    out = tmp_path / "out.jsonl"
    assert export(store, str(out), "jsonl", None) == 1
    store.close()
    [row] = [
        json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the export"))
        for line in out.read_text().splitlines()
    ]
    assert row["reward"] is None and row["prompt_ids"] + row["response_ids"] == [1, 2, 3]
