"""The PostgreSQL store as replicas use it: two store instances on one database are two gateways.

Every behaviour of the store interface also runs on PostgreSQL through the ``store_backend`` fixture
(test_store.py, test_layout.py, test_inflight.py, ...); these tests are about what only replicas do:
concurrent writers, the finished feed seen through another instance, a dead gateway's running turns.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest

from core.telemetry import Event, Telemetry
from store import OutputPart, SessionQuery, SessionRecord, SqliteStore, TurnRecord
from store.base import TURN_COMPLETE, TURN_INTERRUPTED, TURN_RUNNING
from store.postgres import _OWNER_CLASS, PostgresStore
from store.postgres_feed import FEED_LOCK
from tests.postgres_server import PostgresServer
from tests.support import REPO

pytestmark = pytest.mark.postgres


def _turn(sid: str, prompt: list[int], parent: int | None = None) -> TurnRecord:
    return TurnRecord(sid, prompt, [], parent, None, {"messages": []}, time.time())


def _close(store: PostgresStore, sid: str) -> None:
    session = store.get_session(sid)
    assert session is not None
    session.status, session.closed_at = "closed", time.time()
    assert store.mark_closed(session)


def _until(check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.01)  # polling another process's (or thread's) progress


@pytest.fixture
def url(postgres: PostgresServer) -> str:
    return postgres.new_database()


def test_two_gateways_create_the_schema_at_once(url: str) -> None:
    with ThreadPoolExecutor(4) as pool:
        stores = list(pool.map(lambda _: PostgresStore(url), range(4)))
    assert len({s.owner for s in stores}) == 4
    stores[0].create_session(SessionRecord("s", 0.0, {}))
    assert all(s.get_session("s") is not None for s in stores)
    assert len({s.store_id() for s in stores}) == 1  # one database, one identity
    for s in stores:
        s.close()


def test_concurrent_writers_on_two_replicas_number_one_session_without_gaps(url: str) -> None:
    a, b = PostgresStore(url), PostgresStore(url)
    a.create_session(SessionRecord("s", time.time(), {}))
    per_writer = 15

    def write(store: PostgresStore, k: int) -> list[int]:
        ids = []
        for i in range(per_writer):
            turn = store.begin_turn(_turn("s", [k, i]))
            turn.output_ids, turn.output_logprobs, turn.status = [k, i, 9], [-0.5] * 3, TURN_COMPLETE
            store.finish_turn(turn)
            ids.append(turn.id)
        return ids

    with ThreadPoolExecutor(4) as pool:  # two threads on each replica
        written = list(pool.map(lambda k: write((a, b)[k % 2], k), range(4)))
    turns = b.get_turns("s")
    assert [t.index for t in turns] == list(range(4 * per_writer))  # no index twice, none skipped
    assert sorted(t.id for t in turns) == sorted(i for ids in written for i in ids)
    by_id = {t.id: t for t in a.get_turns("s")}
    for k, ids in enumerate(written):
        for i, tid in enumerate(ids):
            assert by_id[tid].prompt_ids == [k, i] and by_id[tid].output_ids == [k, i, 9]
    a.close()
    b.close()


def test_a_session_continues_on_the_other_replica(url: str) -> None:
    """Turn 2 written by B extends turn 1 written by A: B reads A's turn to store beyond it."""
    a, b = PostgresStore(url), PostgresStore(url)
    a.create_session(SessionRecord("s", time.time(), {}))
    first = a.begin_turn(_turn("s", list(range(100))))
    first.output_ids, first.output_logprobs, first.status = [7, 8], [-0.25, -0.5], TURN_COMPLETE
    first.ext_key = "k1"
    a.finish_turn(first)
    parent = b.find_turn_by_ext_keys("s", ["k1"])
    assert parent is not None and parent.id == first.id
    second = b.begin_turn(_turn("s", [*range(100), 7, 8, 9], parent.id), parent=parent)
    assert (second.index, second.branch) == (1, 0)
    [row] = _rows(
        url, "SELECT base_id, prompt_base, length(prompt_ids) / 4 FROM turns WHERE id = %s", second.id
    )
    assert row == (first.id, 102, 1)  # stored as a segment of A's turn
    assert [t.prompt_ids for t in a.get_turns("s")] == [list(range(100)), [*range(100), 7, 8, 9]]
    a.close()
    b.close()


def test_the_finished_feed_through_another_replica(url: str) -> None:
    a, b = PostgresStore(url), PostgresStore(url)
    sids = [f"s{k:02d}" for k in range(40)]
    for sid in sids:
        a.create_session(SessionRecord(sid, time.time(), {}))
    seen: list[tuple[int, str]] = []
    done = threading.Event()

    def follow() -> None:  # a trainer's follower on replica B, cursor by cursor
        cursor = 0
        while not (done.is_set() and len(seen) == len(sids)):
            page = b.closed_after(cursor, 7)
            seen.extend(page)
            cursor = page[-1][0] if page else cursor
            if not page:
                time.sleep(0.005)  # nothing new yet: poll again

    follower = threading.Thread(target=follow)
    follower.start()
    with ThreadPoolExecutor(4) as pool:  # closes on both replicas at once
        list(pool.map(lambda k: _close((a, b)[k % 2], sids[k]), range(len(sids))))
    done.set()
    follower.join(30)
    assert not follower.is_alive()
    assert sorted(sid for _, sid in seen) == sids  # none skipped, none twice
    assert [i for i, _ in seen] == sorted(i for i, _ in seen)
    assert b.last_event_id() >= seen[-1][0]
    a.close()
    b.close()


def test_a_close_that_commits_late_is_not_skipped_by_the_feed(url: str) -> None:
    """A close in flight holds the feed lock to its commit: a later close waits, and takes a larger id,
    so a reader past the later one has not missed the earlier one."""
    a, b = PostgresStore(url), PostgresStore(url)
    for sid in ("x", "y"):
        a.create_session(SessionRecord(sid, time.time(), {}))
    with psycopg.connect(url) as slow:  # close X as mark_closed does, and hold the commit
        slow.execute("UPDATE sessions SET status = 'closed' WHERE id = 'x'")
        slow.execute("SELECT pg_advisory_xact_lock(%s)", (FEED_LOCK,))
        slow.execute(
            "INSERT INTO events (session_id, turn_id, ts, kind, data) VALUES ('x', NULL, 0, 'session_closed', '{}')"
        )
        closing = threading.Thread(target=_close, args=(b, "y"))
        closing.start()
        _until(lambda: _waiting_on_advisory_lock(url), "B's close waits for the feed lock")
        assert b.closed_after(0, 10) == []  # nothing committed: nothing to skip yet
        slow.commit()
    closing.join(30)
    feed = a.closed_after(0, 10)
    assert [sid for _, sid in feed] == ["x", "y"] and feed[0][0] < feed[1][0]
    a.close()
    b.close()


def _waiting_on_advisory_lock(url: str) -> bool:
    rows = _rows(url, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")
    return bool(rows[0][0])


def _rows(url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url) as conn:
        return conn.execute(sql, args).fetchall()


_HOLDER = """
import sys, time
from store import SessionRecord, TurnRecord
from store.postgres import PostgresStore
store = PostgresStore(sys.argv[1])
store.create_session(SessionRecord("s", time.time(), {}))
turn = store.begin_turn(TurnRecord("s", [1, 2, 3], [], None, None, {}, 0.0))
store.schedule_recomputation(turn, [(0, 2)])
print(turn.id, flush=True)
time.sleep(600)
"""


def test_a_dead_gateways_running_turns_are_interrupted_a_live_ones_are_not(url: str) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, f"{url}?application_name=holder"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert holder.stdout is not None
        turn_id = int(holder.stdout.readline())
        live = PostgresStore(url)  # another gateway starts while the holder runs: its turn stays running
        assert [t.status for t in live.get_turns("s")] == [TURN_RUNNING]
        assert live.pending_recomputations() == []  # the holder's own, not claimed
        new = live.begin_turn(_turn("s", [1, 2, 3, 4]))  # a turn in the session: the holder is alive
        assert [t.status for t in live.get_turns("s")] == [TURN_RUNNING, TURN_RUNNING]
    finally:
        holder.kill()  # kill -9: PostgreSQL drops its connections, and its owner lock with them
        holder.wait()
    # the next turn in that session finds the holder's turn orphaned; this replica's own stays running
    _until(lambda: _holder_connections(url) == 0, "the killed holder's connections are gone")
    live.begin_turn(_turn("s", [1, 2, 3, 5]))
    statuses = {t.id: t.status for t in live.get_turns("s")}
    assert statuses[turn_id] == TURN_INTERRUPTED and statuses[new.id] == TURN_RUNNING
    assert live.pending_recomputations() == [(turn_id, [(0, 2)])]  # claimed from the dead holder
    other = PostgresStore(url)
    assert other.pending_recomputations() == []  # claimed by `live`, which is alive
    assert other.delete_session("s") is None  # `live`'s running turn keeps the session
    other.close()
    live.close()  # now every running turn's gateway is gone: nothing keeps the session
    last = PostgresStore(url, recover=False)
    # 3 turns, and the one event: the holder's turn interrupted (when `live` began its turn)
    assert last.delete_session("s") == (3, 1) and last.get_session("s") is None
    last.close()


def test_a_sweep_interrupts_a_gone_gateways_running_turns_with_their_tokens(url: str) -> None:
    telemetry = Telemetry()
    seen: list[Event] = []
    telemetry.listen(seen.append)
    live = PostgresStore(url, telemetry)
    gone = PostgresStore(url)
    gone.create_session(SessionRecord("s", time.time(), {}))
    orphan = gone.begin_turn(_turn("s", [1, 2, 3]))
    assert gone.append_outputs([OutputPart(orphan.id, 0, [7, 8, 9], [-0.5, -0.25, -0.125])]) == 1
    kept = live.begin_turn(_turn("s", [1, 2, 4]))
    assert live.sweep_orphans() == 0  # both gateways are alive: nothing is swept
    assert _owner_locked(url, gone.owner)
    gone.close()  # its owner lock is released, as when its process dies
    _until(lambda: not _owner_locked(url, gone.owner), "the closed store's owner lock released")
    assert live.sweep_orphans() == 1
    assert live.sweep_orphans() == 0  # once
    turns = {t.id: t for t in live.get_turns("s")}
    assert turns[orphan.id].status == TURN_INTERRUPTED and turns[kept.id].status == TURN_RUNNING
    assert turns[orphan.id].output_ids == [7, 8, 9]
    assert turns[orphan.id].output_logprobs == [-0.5, -0.25, -0.125]
    data = {"turn_indices": [0], "output_tokens": [3], "reason": "gateway_gone"}
    assert [(e.kind, e.data) for e in live.get_events("s")] == [("turns_interrupted", data)]
    assert [(e.kind, e.session_id, e.data) for e in seen if e.kind == "turns_interrupted"] == [
        ("turns_interrupted", "s", data)
    ]
    live.close()
    assert SqliteStore(":memory:").sweep_orphans() == 0  # one gateway per file: nothing to sweep


def _owner_locked(url: str, owner: int) -> bool:
    """Whether a store holds owner lock `owner` (the server releases it once it sees the close)."""
    rows = _rows(
        url,
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = %s AND objid = %s "
        "AND objsubid = 2 AND granted",
        _OWNER_CLASS,
        owner,
    )
    return bool(rows[0][0])


def _holder_connections(url: str) -> int:
    rows = _rows(url, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'holder'")
    return int(rows[0][0])


def test_queries_page_and_filter_as_on_sqlite(url: str, tmp_path: Path) -> None:
    pg, lite = PostgresStore(url), SqliteStore(tmp_path / "t.db")
    metas: list[dict[str, Any]] = [
        {"task": "a", "n": 1}, {"task": "b", "n": 1.5}, {"task": "a", "ok": True}, {"ok": False},
        {"task": "é", "nested": {"x": 1}}, {"task": None}, {}, {"task": "a", "n": 2},
    ]  # fmt: skip
    for store in (pg, lite):
        for k, meta in enumerate(metas):
            status = "closed" if k % 3 else "open"
            store.create_session(
                SessionRecord(f"s{k}", 100.0 + k // 2, meta, status, reward=k / 4 if k % 2 else None)
            )
        store.create_session(SessionRecord("req_x", 50.0, {"task": "a"}, "closed", ephemeral=True))
    queries = [
        SessionQuery(),
        SessionQuery(metadata={"task": "a"}),
        SessionQuery(metadata={"n": "1"}),
        SessionQuery(metadata={"n": "1.5"}),
        SessionQuery(metadata={"ok": "1"}),
        SessionQuery(metadata={"ok": "0"}),
        SessionQuery(metadata={"task": "é"}),
        SessionQuery(status="closed", has_reward=True, reward_min=0.5),
        SessionQuery(created_after=101.0, created_before=103.0, newest_first=False),
        SessionQuery(limit=3, offset=2),
        SessionQuery(limit=3, after=(102.0, "s5")),
        SessionQuery(limit=3, after=(101.0, "s2"), newest_first=False),
    ]
    for q in queries:
        (got, n), (want, m) = pg.query_sessions(q), lite.query_sessions(q)
        assert ([s.id for s in got], n) == ([s.id for s in want], m), q
    assert [s.id for s in pg.list_sessions()] == [s.id for s in lite.list_sessions()]
    pg.close()
    lite.close()


def test_a_fork_is_read_and_extended_through_another_replica(url: str) -> None:
    a, b = PostgresStore(url), PostgresStore(url)
    a.create_session(SessionRecord("p", time.time(), {}))
    parent = None
    for i in range(3):
        turn = a.begin_turn(_turn("p", list(range(10 * (i + 1))), parent))
        turn.output_ids, turn.output_logprobs, turn.status = [7] * 3, [-0.1] * 3, TURN_COMPLETE
        a.finish_turn(turn)
        parent = turn.id
    a.fork("p", 1, [SessionRecord("c", time.time(), {})])
    assert [t.index for t in b.get_turns("c")] == [0, 1] and b.children("p") == ["c"]
    shared = b.get_turns("c")[1]
    child = b.begin_turn(_turn("c", [*shared.prompt_ids, *shared.output_ids, 5], shared.id), parent=shared)
    assert child.index == 2 and a.turn_counts("c") == {"c": (3, 1)}
    assert _rows(url, "SELECT count(*) FROM turns WHERE session_id = 'c'") == [(1,)]  # shared, not copied
    a.close()
    b.close()


def test_a_bad_url_and_a_newer_schema_are_refused(url: str, postgres: PostgresServer) -> None:
    from core.errors import StoreError

    port = postgres.url.rsplit(":", 1)[1].split("/")[0]
    with pytest.raises(StoreError, match="cannot open trajectory store"):
        PostgresStore(f"postgresql://postgres@127.0.0.1:{port}/no_such_db", connect_timeout=5)
    PostgresStore(url).close()
    with psycopg.connect(url) as conn:
        conn.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    with pytest.raises(StoreError, match="schema version 99, newer"):
        PostgresStore(url)


def test_prune_and_export_take_a_database_url(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from belayer.cli import main

    now = time.time()
    store = PostgresStore(url)
    store.create_session(SessionRecord("old", now - 30 * 86400, {}, "closed", closed_at=now - 9 * 86400))
    store.create_session(SessionRecord("recent", now - 86400, {}, "closed", closed_at=now - 3600))
    for sid in ("old", "recent"):
        turn = store.begin_turn(_turn(sid, [1, 2, 3]))
        turn.output_ids, turn.output_logprobs, turn.status = [4], [-0.5], TURN_COMPLETE
        store.finish_turn(turn)
    assert main(["export", "--store", url, "--format", "jsonl", "--out", str(tmp_path / "o.jsonl")]) == 0
    assert [line.count('"session_id"') for line in (tmp_path / "o.jsonl").read_text().splitlines()] == [1, 1]
    assert main(["store", "prune", "--store", url, "--older-than", "7d"]) == 0
    assert "pruned 1 sessions" in capsys.readouterr().out
    assert [s.id for s in store.list_sessions()] == ["recent"]
    store.close()


def test_bench_store_writes_through_postgres_in_the_same_run(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from belayer.bench.store import main

    main(["--turns", "4", "--episodes", "2", "--postgres", url])  # (4 turns: too few for its 10x target)
    figures = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert figures["pg_round_trip_exact"] == "true" and figures["new_round_trip_exact"] == "true"
    assert float(figures["pg_write_ms_per_turn"]) > 0 and float(figures["pg_2_replicas_wall_ms_per_turn"]) > 0


def test_a_close_on_one_replica_wakes_the_feed_of_another(url: str) -> None:
    """Replica B's telemetry hub hears of A's closes (NOTIFY at commit), not of its own twice."""
    from core.telemetry import Telemetry

    hub = Telemetry()
    heard: list[Event] = []
    hub.listen(heard.append)
    a, b = PostgresStore(url), PostgresStore(url, hub)
    for sid in ("x", "y"):
        a.create_session(SessionRecord(sid, time.time(), {}))
    _close(a, "x")
    _until(lambda: [e.kind for e in heard] == ["feed_advanced"], "B hears of A's close")
    _close(b, "y")  # B's own close: published as session_closed by B's store itself
    _until(lambda: "session_closed" in [e.kind for e in heard], "B's own close published")
    a.close()
    b.close()  # joins the listener thread
    assert [e.kind for e in heard] == ["feed_advanced", "session_closed", "session_updated"]
