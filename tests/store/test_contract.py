"""The contract of `TrajectoryStore` (`store.roles`), one suite that every store passes: SQLite,
PostgreSQL (marked ``postgres``: a real server, `tests.postgres_server`) and the in-memory fake
(`store.memory`), through the ``store_backend`` fixture (`tests.store_backends`): round trips bit for
bit, status rules, streamed outputs, recomputation marks, pruning, the finished feed, one history through
the whole interface that must read as it does on SQLite, and the front's order per session
(`store.front`). What only the SQL stores lay out (segments, migrations, replicas) is tested beside
them, in ``test_layout.py``, ``test_schema.py`` and ``test_postgres.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import TypeVar

from store import EventRecord, OutputPart, SessionRecord, SqliteStore, TurnRecord
from store.base import TURN_COMPLETE
from store.front import WriteFront
from store.roles import TrajectoryStore
from tests.store.history import same_history
from tests.store_backends import StoreBackend

StoreT = TypeVar("StoreT", bound=TrajectoryStore)


def _begin(store: StoreT) -> tuple[StoreT, TurnRecord]:
    """Session "s" and a running turn in it."""
    store.create_session(SessionRecord("s", time.time(), {}))
    return store, store.begin_turn(TurnRecord("s", [1, 2, 3], [], None, None, {}, 0.0))


# --- records and statuses ---------------------------------------------------------------------------


def _plain_turn(sid: str, parent: int | None = None) -> TurnRecord:
    return TurnRecord(sid, [1, 2, 3], [], parent, None, {"messages": []}, time.time())


def test_round_trip_is_bit_exact_and_durable(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    store.create_session(SessionRecord("s", time.time(), {"k": 1}))
    turn = store.begin_turn(_plain_turn("s"))
    turn.output_ids, turn.output_logprobs = [4294967295, 0, 7], [-0.1, -1e-300, -123.456789012345678]
    turn.status = "complete"
    store.finish_turn(turn)
    store.close()
    again = store_backend.open()
    [back] = again.get_turns("s")
    assert back.output_ids == [4294967295, 0, 7] and back.output_logprobs == [
        -0.1,
        -1e-300,
        -123.456789012345678,
    ]


def test_running_turns_become_interrupted_on_reopen_and_discarded_stays(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    store.create_session(SessionRecord("s", time.time(), {}))
    first = store.begin_turn(_plain_turn("s"))
    second = store.begin_turn(_plain_turn("s", first.id))
    store.discard_turns_after("s", first.index, "sandbox restored")
    second.status = "complete"
    store.finish_turn(second)  # a turn that finishes after it was discarded stays discarded
    statuses = [t.status for t in store.get_turns("s")]
    assert statuses == ["running", "discarded"]
    store.close()
    assert [t.status for t in store_backend.open().get_turns("s")] == ["interrupted", "discarded"]


def test_every_field_of_a_turn_and_a_session_round_trips(store_backend: StoreBackend) -> None:
    """Each field of `TurnRecord` and `SessionRecord` set away from its default is read back equal,
    after a restart; a field added later fails here until the test (and each store) sets it."""
    store = store_backend.open()
    session = SessionRecord(
        "s",
        12.5,
        {"task": "t", "n": 1.0},
        "closed",
        0.75,
        {"why": [1, "x"]},
        99.5,
        False,
        None,
        None,
        "g7",
        (1 << 63) - 1,
    )
    store.create_session(session)
    turn = TurnRecord(
        "s", [1, 2, 3, 4], [(1, 3, -1)], None, "ext", {"messages": [], "temperature": 1.0}, 3.25
    )
    store.begin_turn(turn)
    assert store.append_outputs([OutputPart(turn.id, 0, [9], [-0.5], [(0, 1, "v0")])]) == 1
    running = store.get_turn(turn.id)
    assert running is not None and running.weight_segments == [(0, 1, "v0")]
    turn.status, turn.output_ids, turn.output_logprobs = "complete", [9, 4294967295], [-0.5, -1e-300]
    turn.response, turn.finish_reason, turn.worker = {"message": {"role": "assistant"}}, "stop", "w0"
    turn.timings, turn.error = {"ttft": 0.125}, "none really"
    turn.weight_segments = [(0, 1, "v0"), (1, 2, "step-2")]
    store.finish_turn(turn)
    child = TurnRecord("s", [1, 2, 3, 4, 9, 4294967295, 5], [], turn.id, None, {"messages": []}, 4.0)
    store.begin_turn(child)
    sibling = TurnRecord("s", [1, 2, 3, 4, 9, 4294967295, 6], [], turn.id, None, {"messages": []}, 5.0)
    assert store.begin_turn(sibling).branch == 1  # a second answer to turn 0: a new branch
    store.close()
    again = store_backend.open(recover=False)
    assert again.get_session("s") == session
    back = again.get_turns("s")
    assert back == [turn, child, sibling]
    d = TurnRecord("x", [], [], None, None, {}, 0.0)
    written = (turn, child, sibling)
    unset = [
        f.name for f in fields(TurnRecord) if all(getattr(t, f.name) == getattr(d, f.name) for t in written)
    ]
    assert unset == [], "set every TurnRecord field in this test"
    plain = SessionRecord("x", 0.0, {})
    unset = [f.name for f in fields(SessionRecord) if getattr(session, f.name) == getattr(plain, f.name)]
    assert unset == ["ephemeral", "parent_session", "fork_turn"], "set every other SessionRecord field"
    again.close()


# --- streamed outputs and recomputations ------------------------------------------------------------


def test_a_session_is_read_with_the_turn_a_request_extends(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    store.create_session(SessionRecord("s", time.time(), {"task": "a"}))
    turns = []
    for key, status in (("k0", TURN_COMPLETE), ("k1", TURN_COMPLETE), ("k1", TURN_COMPLETE), ("k2", "error")):
        turn = store.begin_turn(_plain_turn("s", turns[-1].id if turns else None))
        turn.ext_key, turn.status, turn.output_ids = key, status, [len(turns)]
        store.finish_turn(turn)
        turns.append(turn)
    session, parent = store.session_and_parent("s", ["k0", "k1", "k2"])
    assert session is not None and (session.id, session.metadata, session.status) == ("s", {"task": "a"}, "open")
    # a later key wins over an earlier one, the newest turn among equals; an unfinished one is no parent
    assert parent is not None and (parent.id, parent.ext_key, parent.output_ids) == (turns[2].id, "k1", [2])
    assert store.session_and_parent("s", ["k1", "k0"])[1].id == turns[0].id  # type: ignore[union-attr]
    assert store.session_and_parent("s", ["k1"])[1].id == turns[2].id  # type: ignore[union-attr]
    assert store.session_and_parent("s", ["k2", "x"]) == (session, None)
    assert store.session_and_parent("s", []) == (session, None)
    assert store.session_and_parent("other", ["k0"]) == (None, None)


def test_append_outputs_grows_a_running_turn_and_a_restart_keeps_it(store_backend: StoreBackend) -> None:
    store, turn = _begin(store_backend.open())
    lps = [-0.1, -1e-300, -123.456789012345678, -2.5]
    assert store.append_outputs([OutputPart(turn.id, 0, [7, 4294967295], lps[:2])]) == 1
    assert store.append_outputs([OutputPart(turn.id, 2, [0, 9], lps[2:])]) == 1
    # a part from an earlier position replaces what was stored beyond it (a rewrite of the same prefix)
    assert store.append_outputs([OutputPart(turn.id, 3, [9], lps[3:])]) == 1
    # a gap (fewer tokens stored than the part's start) is skipped, never written with a hole
    assert store.append_outputs([OutputPart(turn.id, 9, [1], [-1.0])]) == 0
    running = store.get_turn(turn.id)
    assert running is not None and running.status == "running"
    assert running.output_ids == [7, 4294967295, 0, 9] and running.output_logprobs == lps
    store.close()  # as a kill -9 leaves it: the turn is still running on disk

    again = store_backend.open()
    back = again.get_turn(turn.id)
    assert back is not None and back.status == "interrupted"
    assert back.output_ids == [7, 4294967295, 0, 9] and back.output_logprobs == lps  # bit for bit
    again.close()


def test_append_outputs_after_the_final_write_is_skipped(store_backend: StoreBackend) -> None:
    store, turn = _begin(store_backend.open())
    other = store.begin_turn(TurnRecord("s", [1, 2, 3], [], None, None, {}, 0.0))
    turn.output_ids, turn.output_logprobs, turn.status = [5, 6], [-0.5, -0.6], TURN_COMPLETE
    store.finish_turn(turn)
    late = [OutputPart(turn.id, 0, [5], [-0.5]), OutputPart(other.id, 0, [8], [-0.8])]
    assert store.append_outputs(late) == 1  # one transaction; only the running turn's part is written
    done, running = store.get_turn(turn.id), store.get_turn(other.id)
    assert done is not None and done.output_ids == [5, 6] and done.status == TURN_COMPLETE
    assert running is not None and running.output_ids == [8]
    store.close()


def test_recomputation_marks_last_until_their_outcome_and_go_with_their_session(
    store_backend: StoreBackend,
) -> None:
    store, turn = _begin(store_backend.open())
    store.schedule_recomputation(turn, [(0, 2)])
    store.close()
    store = store_backend.open()  # a restart: still pending (its turn, left running, interrupted)
    assert store.pending_recomputations() == [(turn.id, [(0, 2)])]
    store.end_recomputation(turn.id, EventRecord("s", turn.id, 1.0, "recomputed_logprobs", {"runs": []}))
    assert store.pending_recomputations() == []
    assert [e.kind for e in store.get_events("s")] == ["turns_interrupted", "recomputed_logprobs"]
    store.schedule_recomputation(turn, [(1, 3)])
    turn.status = TURN_COMPLETE
    store.finish_turn(turn)
    store.update_session(SessionRecord("s", 0.0, {}, status="closed", closed_at=0.0))
    assert store.delete_session("s") is not None
    assert store.pending_recomputations() == []
    store.close()


# --- sessions: pruning and the finished feed --------------------------------------------------------


def test_prune_goes_in_batches_and_keeps_sessions_with_a_running_turn(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    for k in range(250):
        store.create_session(SessionRecord(f"s{k:03d}", 0.0, {}, status="closed", closed_at=1.0))
    store.begin_turn(TurnRecord("s007", [1], [], None, None, {}, 0.0))  # closed while its turn runs
    pruned = store.prune(closed_before=2.0)
    assert len(pruned) == 249 and "s007" not in pruned
    assert [s.id for s in store.list_sessions()] == ["s007"]
    store.close()


def test_a_session_closes_once_on_the_feed(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    for sid in ("a", "b", "c"):
        store.create_session(SessionRecord(sid, created_at=0.0, metadata={}))
    for sid in ("b", "a", "b", "c"):
        session = store.get_session(sid)
        assert session is not None
        session.status, session.closed_at = "closed", time.time()
        store.mark_closed(session)
    feed = store.closed_after(0, 10)
    assert [sid for _, sid in feed] == ["b", "a", "c"]  # the second close of b changed nothing
    assert store.closed_after(feed[0][0], 1) == feed[1:2] and store.closed_after(feed[-1][0], 10) == []
    assert [e.kind for e in store.get_events("b")] == ["session_closed"]
    assert store.get_session("a").closed_at is not None  # type: ignore[union-attr]
    store.close()


# --- one history through the whole interface --------------------------------------------------------


def test_one_history_reads_as_on_sqlite(store_backend: StoreBackend, tmp_path: Path) -> None:
    """The same records, ids, events, published events and errors as a SQLite store gives."""
    same_history(
        lambda t: SqliteStore(tmp_path / "reference.db", telemetry=t),
        lambda t: store_backend.open(telemetry=t),
    )


# --- the front: a session's writes in order, off the loop when the store is remote ------------------


async def test_posted_writes_commit_in_order_per_session_off_the_loop(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    if not store.front.remote:  # a local store's front writes inline: give it lanes, as a remote one has
        store.front = WriteFront(lanes=3)
    sessions = [f"s{k}" for k in range(6)]
    for sid in sessions:
        store.create_session(SessionRecord(sid, 0.0, {}))
    threads: set[str] = set()
    add = store.add_event

    def add_event(event: EventRecord) -> None:
        threads.add(threading.current_thread().name)
        add(event)

    for n in range(20):
        for sid in sessions:
            store.front.post(sid, add_event, EventRecord(sid, None, float(n), "note", {"n": n}))
    closing = [SessionRecord(sid, 0.0, {}, status="closed", closed_at=1.0) for sid in sessions]
    closed = await asyncio.gather(*(store.front.call(s.id, store.mark_closed, s) for s in closing))
    assert closed == [True] * len(sessions)
    for sid in sessions:  # each session's notes in the order posted, and its close after them
        events = store.get_events(sid)
        assert [(e.kind, e.data.get("n")) for e in events] == [
            *(("note", n) for n in range(20)),
            ("session_closed", None),
        ]
    assert threading.current_thread().name not in threads and all(
        t.startswith("belayer-store-") for t in threads
    )
    store.close()  # drains the front first
    assert not store.front.remote


async def test_a_closed_front_writes_inline_and_a_failed_post_is_logged_not_raised(
    store_backend: StoreBackend,
) -> None:
    store = store_backend.open()
    front = store.front if store.front.remote else WriteFront(lanes=1)
    store.front = front
    front.post("nope", store.add_event, EventRecord("nope", None, 0.0, "x", {"bad": float("nan")}))
    store.create_session(SessionRecord("s", 0.0, {}))
    await front.call("s", store.add_event, EventRecord("s", None, 0.0, "after", {}))  # the lane goes on
    front.close()
    front.post("s", store.add_event, EventRecord("s", None, 0.0, "inline", {}))
    assert [e.kind for e in store.get_events("s")] == ["after", "inline"]
    store.close()
