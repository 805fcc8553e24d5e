"""The SQLite store on its own: bit-exact round trips and status rules."""

from __future__ import annotations

import time
from pathlib import Path

from gateway.store import SessionRecord, SqliteStore, TurnRecord


def _turn(sid: str, parent: int | None = None) -> TurnRecord:
    return TurnRecord(sid, [1, 2, 3], [], parent, None, {"messages": []}, time.time())


def test_round_trip_is_bit_exact_and_durable(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "t.db")
    store.create_session(SessionRecord("s", time.time(), {"k": 1}))
    turn = store.begin_turn(_turn("s"))
    turn.output_ids, turn.output_logprobs = [4294967295, 0, 7], [-0.1, -1e-300, -123.456789012345678]
    turn.status = "complete"
    store.finish_turn(turn)
    store.close()
    again = SqliteStore(tmp_path / "t.db")
    [back] = again.get_turns("s")
    assert back.output_ids == [4294967295, 0, 7] and back.output_logprobs == [
        -0.1,
        -1e-300,
        -123.456789012345678,
    ]


def test_running_turns_become_interrupted_on_reopen_and_discarded_stays(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "t.db")
    store.create_session(SessionRecord("s", time.time(), {}))
    first = store.begin_turn(_turn("s"))
    second = store.begin_turn(_turn("s", first.id))
    store.discard_turns_after("s", first.index, "sandbox restored")
    second.status = "complete"
    store.finish_turn(second)  # a turn that finishes after it was discarded stays discarded
    statuses = [t.status for t in store.get_turns("s")]
    assert statuses == ["running", "discarded"]
    store.close()
    assert [t.status for t in SqliteStore(tmp_path / "t.db").get_turns("s")] == ["interrupted", "discarded"]
