"""The shared SQL layer (`store.sql`): its spelling per database, and what SQLite does with the queries
it is given (the history every store must read the same way is in ``test_contract.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from store import SessionRecord, SqliteStore
from store.postgres import PostgresStore
from store.sql import Tx
from tests.store.history import finish, turn_of


class _Recorder:
    """A connection that records what it is asked to run (the SQL text is what is under test)."""

    def __init__(self) -> None:
        self.ran: list[tuple[str, Any]] = []

    def execute(self, sql: str, args: Any, /) -> Any:
        self.ran.append((sql, args))
        return None


def test_each_dialect_spells_a_list_and_its_markers() -> None:
    lite, pg = SqliteStore.dialect, PostgresStore.dialect
    assert lite.among("id", [3, 1]) == ("id IN (?,?)", (3, 1))
    assert lite.among("id", []) == ("id IN ()", ())
    assert pg.among("id", (3, 1)) == ("id = ANY(?)", ([3, 1],))
    assert (lite.flag(True), pg.flag(True), lite.listed, pg.listed) == (
        1,
        True,
        "ephemeral = 0",
        "NOT ephemeral",
    )
    for dialect, want in ((lite, "SELECT 1 WHERE a = ? AND b = ?"), (pg, "SELECT 1 WHERE a = %s AND b = %s")):
        conn = _Recorder()
        Tx(conn, dialect).execute("SELECT 1 WHERE a = ? AND b = ?", (1, 2))
        assert conn.ran == [(want, (1, 2))]


def test_finding_a_turn_by_its_keys_searches_an_index_not_every_turn(tmp_path: Path) -> None:
    """Each turn of each session looks its parent up by key (prefix reuse): a scan of the whole table
    there made a gateway's CPU per turn grow with the store (`belayer bench scale`)."""
    store = SqliteStore(tmp_path / "t.db")
    store.create_session(SessionRecord("s1", created_at=0.0, metadata={}))
    turn = store.begin_turn(turn_of("s1", [1, 2], None, ext_key="k1"))
    finish(store, turn, [3])
    ran: list[str] = []
    store._db.set_trace_callback(ran.append)
    try:
        found = store.find_turn_by_ext_keys("s1", ["k0", "k1"])
    finally:
        store._db.set_trace_callback(None)
    assert found is not None and found.id == turn.id
    lookups = [sql for sql in ran if "ext_key IN" in sql]
    assert lookups, ran
    for sql in lookups:
        plan = " ".join(str(row[3]) for row in store._db.execute(f"EXPLAIN QUERY PLAN {sql}"))
        assert "SCAN turns" not in plan, plan
    store.close()


def test_a_plain_session_is_asked_about_forks_once(tmp_path: Path) -> None:
    """Whether a session is a fork child is fixed when it is created: a turn's parent lookup asks the
    database once per session, not at every turn (a query a turn, on the event loop, at scale)."""
    store = SqliteStore(tmp_path / "t.db")
    store.create_session(SessionRecord("s1", created_at=0.0, metadata={}))
    finish(store, store.begin_turn(turn_of("s1", [1, 2], None, ext_key="k1")), [3])
    ran: list[str] = []
    store._db.set_trace_callback(ran.append)
    try:
        for _ in range(3):
            assert store.find_turn_by_ext_keys("s1", ["k1"]) is not None
    finally:
        store._db.set_trace_callback(None)
    assert sum("FROM sessions" in sql for sql in ran) <= 1, ran  # (its first turn may have asked)
    store.delete_session("s1")  # forgotten with the session
    assert "s1" not in store._plain
    store.close()
