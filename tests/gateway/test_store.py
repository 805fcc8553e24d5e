"""The store on its own (SQLite and PostgreSQL): bit-exact round trips and status rules."""

from __future__ import annotations

import time
from dataclasses import fields

from store import OutputPart, SessionRecord, TurnRecord
from tests.store_backends import StoreBackend


def _turn(sid: str, parent: int | None = None) -> TurnRecord:
    return TurnRecord(sid, [1, 2, 3], [], parent, None, {"messages": []}, time.time())


def test_round_trip_is_bit_exact_and_durable(store_backend: StoreBackend) -> None:
    store = store_backend.open()
    store.create_session(SessionRecord("s", time.time(), {"k": 1}))
    turn = store.begin_turn(_turn("s"))
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
    first = store.begin_turn(_turn("s"))
    second = store.begin_turn(_turn("s", first.id))
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
