"""One history through the whole store interface (`history`), and the check that two stores read it the
same (`same_history`): the contract suite's (``test_contract.py``), and what ``test_sql.py`` builds on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from core.errors import Conflict, NotFound
from core.events import FreshPrompt, RecomputedLogprobs, TurnsDiscarded
from core.telemetry import Event, Telemetry
from store import OutputPart, SessionQuery, SessionRecord, TurnRecord
from store.base import TURN_COMPLETE, EventRecord
from store.roles import TrajectoryStore


def turn_of(sid: str, prompt: list[int], parent: int | None, ext_key: str | None = None) -> TurnRecord:
    request = {"model": "m", "messages": [{"role": "user", "content": str(prompt)}]}
    return TurnRecord(sid, prompt, [], parent, ext_key, request, 1000.0 + len(prompt))


def finish(store: TrajectoryStore, turn: TurnRecord, out: list[int]) -> None:
    turn.output_ids, turn.output_logprobs = out, [-0.5 * (i + 1) for i in range(len(out))]
    turn.status, turn.finish_reason, turn.worker = TURN_COMPLETE, "stop", "w0"
    turn.weight_segments = [(0, len(out), "v1")]
    turn.response, turn.timings = {"id": f"r{turn.id}"}, {"ttft": 0.25}
    store.finish_turn(turn)


def _events(events: list[EventRecord]) -> list[tuple[Any, ...]]:
    return [(e.session_id, e.turn_id, e.kind, e.data) for e in events]  # not the clock's ts


def history(store: TrajectoryStore, published: list[Event]) -> list[Any]:
    """One history through the whole interface; everything it read back, in order."""
    seen: list[Any] = []
    store.create_session(SessionRecord("p", 10.0, {"task": "a", "ok": True}))
    store.create_session(SessionRecord("req", 11.0, {"task": "a"}, ephemeral=True))
    t0 = store.begin_turn(turn_of("p", [1, 2, 3], None, "k0"), lambda t: FreshPrompt(f"turn {t.index}", 0))
    seen.append(store.append_outputs([OutputPart(t0.id, 0, [7, 8], [-0.5, -1.0], [(0, 2, "v1")])]))
    seen.append(store.append_outputs([OutputPart(t0.id, 5, [9], [-0.1])]))  # a gap: skipped
    finish(store, t0, [7, 8])
    t1 = store.begin_turn(turn_of("p", [1, 2, 3, 7, 8, 4], t0.id, "k1"), parent=t0)
    finish(store, t1, [5])
    t2 = store.begin_turn(turn_of("p", [1, 2, 3, 6], t0.id, "k2"))  # a new branch
    finish(store, t2, [6, 6])
    children = [SessionRecord("c1", 20.0, {"task": "b"}), SessionRecord("c2", 21.0, {})]
    seen.append([(c.parent_session, c.fork_turn) for c in store.fork("p", 1, children)])
    c0 = store.begin_turn(turn_of("c1", [1, 2, 3, 7, 8, 4, 5, 9], t1.id, "k3"))
    finish(store, c0, [3])
    store.begin_turn(turn_of("c2", [1], None))  # left running
    store.schedule_recomputation(c0, [(0, 2)])
    seen.append(store.pending_recomputations())
    store.end_recomputation(c0.id, EventRecord.of("c1", c0.id, RecomputedLogprobs([[0, [-0.5]]], "w0", 2), 1.0))
    seen.append(store.pending_recomputations())
    seen.append(store.discard_turns_after("p", 1, "restore"))
    seen.append(store.discard_turns("p", [t1.id, t2.id], "again"))
    for args in (("p", 0, []), ("nope", 0, []), ("p", 2, []), ("p", 9, [])):
        try:
            seen.append(store.fork(*args))
        except (Conflict, NotFound) as e:
            seen.append((type(e).__name__, str(e)))
    closing = store.get_session("c1")
    assert closing is not None
    closing.status, closing.closed_at, closing.reward = "closed", 30.0, 0.5
    seen.append((store.mark_closed(closing), store.mark_closed(closing)))
    store.update_session(closing)
    store.mark_exported(["c1", "c2"])
    store.add_event(EventRecord.of("p", None, TurnsDiscarded(None, [1, 2], "note"), 2.0))
    for sid in ("p", "c1", "c2", "req"):
        seen += [store.get_session(sid), store.get_turns(sid), _events(store.get_events(sid))]
    seen += [
        store.get_turn(c0.id),
        store.get_turn(10**6),
        store.turn_counts(),
        store.turn_counts(["c1", "x"]),
    ]
    seen += [store.find_turn_by_ext_keys("c1", ["k1", "k0"]), store.find_turn_by_ext_keys("c1", ["k2"])]
    seen += [store.session_and_parent("c1", ["k1", "k0"]), store.session_and_parent("none", ["k0"])]
    seen += [store.children("p"), store.closed_after(0, 10), store.last_event_id()]
    seen += [store.query_sessions(SessionQuery(metadata={"task": "a"})), store.list_sessions()]
    try:
        store.delete_session("p")
    except Conflict as e:
        seen.append(str(e))
    seen += [store.delete_session("c2"), store.delete_session("c1"), store.prune(1e12), store.list_sessions()]
    seen.append(store.failures)
    seen.append([(e.kind, e.session_id, e.turn_id, e.data) for e in published if e.kind != "feed_advanced"])
    return seen


def same_history(
    first: Callable[[Telemetry], TrajectoryStore], second: Callable[[Telemetry], TrajectoryStore]
) -> None:
    results = []
    for open_store in (first, second):
        telemetry, published = Telemetry(), list[Event]()
        telemetry.listen(published.append)
        store = open_store(telemetry)
        results.append(history(store, published))
        store.close()
    lite, other = results
    assert len(lite) == len(other)
    for i, (a, b) in enumerate(zip(lite, other, strict=True)):
        assert a == b, f"item {i}"
    assert lite[0:2] == [1, 0] and lite[-2] == 0  # the history did what it says, with no failure
