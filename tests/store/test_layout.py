"""Turns stored as segments of earlier turns read back exactly: prompt ids, spans and request."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from core.errors import NotFound
from store import SessionRecord, TrajectoryStore, TurnRecord
from store.layout import Turn, decode, encode, shared_prefix
from tests.store_backends import StoreBackend

TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def _request(messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"model": "policy", "messages": messages, "tools": TOOLS, "temperature": 1.0, **extra}


class Episode:
    """Writes turns like the turn runner does and remembers what it wrote, to compare with reads."""

    def __init__(self, store: TrajectoryStore, sid: str = "s") -> None:
        self.store, self.sid = store, sid
        self.written: dict[int, TurnRecord] = {}
        store.create_session(SessionRecord(sid, time.time(), {}))

    def turn(
        self,
        prompt: list[int],
        output: list[int],
        request: dict[str, Any],
        parent: TurnRecord | None = None,
        *,
        hint: bool = True,
        spans: list[tuple[int, int, int]] | None = None,
        finish: bool = True,
    ) -> TurnRecord:
        if spans is None and parent is not None:
            full = len(parent.prompt_ids) + len(parent.output_ids)
            spans = [*parent.prompt_gen_spans, (len(parent.prompt_ids), full, parent.id)]
        turn = TurnRecord(
            self.sid,
            list(prompt),
            list(spans or []),
            parent.id if parent else None,
            None,
            request,
            time.time(),
        )
        self.store.begin_turn(turn, parent=parent if hint else None)
        if finish:
            turn.output_ids, turn.output_logprobs = list(output), [-0.5] * len(output)
            turn.status, turn.response = "complete", {"message": {"role": "assistant", "content": "x"}}
            self.store.finish_turn(turn)
        self.written[turn.id] = turn
        return turn

    def extend(self, parent: TurnRecord, new: list[int], output: list[int], **kw: Any) -> TurnRecord:
        """A turn that extends `parent`: its prompt + output + `new`, its messages + two more."""
        messages = [
            *parent.request["messages"],
            {"role": "assistant", "content": f"answer {parent.id}"},
            {"role": "tool", "content": f"output {len(new)}"},
        ]
        return self.turn(
            parent.prompt_ids + parent.output_ids + new, output, _request(messages), parent, **kw
        )

    def check(self) -> None:
        """get_turns, get_turn and find_turn_by_ext_keys return what was written, exactly."""
        read = self.store.get_turns(self.sid)
        assert [t.id for t in read] == sorted(self.written)
        for t in read:
            _same(t, self.written[t.id])
            one = self.store.get_turn(t.id)
            assert one is not None
            _same(one, self.written[t.id])


def _same(read: TurnRecord, written: TurnRecord) -> None:
    assert read.prompt_ids == written.prompt_ids
    assert read.prompt_gen_spans == [tuple(s) for s in written.prompt_gen_spans]
    assert json.dumps(read.request) == json.dumps(written.request)  # key order and 1 vs 1.0 too
    assert read.output_ids == written.output_ids and read.status == written.status


def _rows(backend: StoreBackend) -> list[tuple[Any, ...]]:
    return backend.rows(
        "SELECT id, base_id, prompt_base, length(prompt_ids) / 4, request_delta FROM turns ORDER BY id"
    )


@pytest.fixture
def store(store_backend: StoreBackend) -> TrajectoryStore:
    return store_backend.open()


@pytest.mark.parametrize("hint", [True, False])
def test_a_linear_episode_stores_segments_and_reads_back_exactly(
    sql_store_backend: StoreBackend, hint: bool
) -> None:
    store_backend = sql_store_backend
    store = store_backend.open()
    ep = Episode(store)
    turn = ep.turn(list(range(100)), [500, 501, 502], _request([{"role": "user", "content": "go"}]))
    for k in range(20):
        turn = ep.extend(turn, list(range(1000 + k, 1010 + k)), [600 + k] * 5, hint=hint)
    ep.check()
    rows = _rows(store_backend)
    assert rows[0][1:4] == (None, 0, 100)
    for (tid, base, prompt_base, tail, delta), (prev, *_) in zip(rows[1:], rows, strict=False):
        assert base == prev and tail == 10 and delta == 1
        assert prompt_base == len(ep.written[prev].prompt_ids) + len(ep.written[prev].output_ids)
        assert tid in ep.written
    store.close()
    again = store_backend.open()  # durable: the next process reads the same
    ep.store = again
    ep.check()


def test_branches_and_rewrites(sql_store_backend: StoreBackend) -> None:
    store_backend = sql_store_backend
    ep = Episode(store_backend.open())
    root = ep.turn([1, 2, 3, 4], [5, 6], _request([{"role": "user", "content": "a"}]))
    second = ep.extend(root, [7, 8], [9])
    third = ep.extend(second, [10], [11])
    branch = ep.extend(root, [70, 80], [90])  # a second answer to the first turn: a new branch
    assert branch.branch != third.branch
    # no parent: stored beyond the session's previous turn, whose prompt starts the same
    orphan = ep.turn([1, 2, 3, 4, 5, 6, 50], [51], _request([{"role": "user", "content": "a"}]))
    # a rewrite: the harness edited the history, so the prompt leaves the parent's tokens at token 3
    rewritten = ep.turn([1, 2, 3, 99, 98], [97], _request([{"role": "user", "content": "edited"}]), third)
    # a prompt that shares nothing with its parent (a re-tokenized history): stored whole
    fresh = ep.turn([42] * 6, [43], {"prompt": [42] * 6}, third, spans=[])
    ep.check()
    rows = {r[0]: r for r in _rows(store_backend)}
    assert rows[branch.id][1:3] == (root.id, 6)
    assert rows[rewritten.id][1:3] == (third.id, 3)
    assert rows[fresh.id][1:3] == (None, 0)
    assert rows[orphan.id][1:3] == (branch.id, 6)


def test_discarded_turns_stay_readable_and_the_next_turn_extends_an_earlier_one(
    store: TrajectoryStore,
) -> None:
    ep = Episode(store)
    root = ep.turn([1, 2, 3], [4], _request([{"role": "user", "content": "a"}]))
    second = ep.extend(root, [5], [6])
    ep.extend(second, [7], [8])
    assert store.discard_turns_after("s", root.index, "sandbox restored") == [1, 2]
    for t in ep.written.values():
        t.status = "discarded" if t.id != root.id else t.status
    again = ep.extend(root, [50], [60])
    ep.check()
    assert [t.status for t in store.get_turns("s")] == ["complete", "discarded", "discarded", "complete"]
    assert again.prompt_ids[:5] == [1, 2, 3, 4, 50]


def test_a_child_of_a_running_turn_reads_back_once_the_parent_finishes(store: TrajectoryStore) -> None:
    ep = Episode(store)
    parent = ep.turn([1, 2, 3], [], _request([]), finish=False)
    child = ep.turn([1, 2, 3, 4, 5], [6], _request([]), parent, spans=[])
    parent.output_ids, parent.status = [4, 9], "complete"
    store.finish_turn(parent)
    ep.check()
    assert store.get_turns("s")[1].prompt_ids == child.prompt_ids


def test_a_stale_parent_hint_is_not_trusted(store: TrajectoryStore) -> None:
    ep = Episode(store)
    parent = ep.turn([1, 2, 3], [4, 5], _request([]))
    stale = TurnRecord("s", [1, 2, 3], [], None, None, {}, 0.0, id=parent.id, output_ids=[4, 5, 6])
    turn = TurnRecord("s", [1, 2, 3, 4, 5, 6, 7], [], parent.id, None, _request([]), 0.0)
    store.begin_turn(turn, parent=stale)  # its output is longer than the stored one: read the store's
    ep.written[turn.id] = turn
    ep.check()


def test_requests_round_trip_exactly() -> None:
    """Values that compare equal but print differently (1 / 1.0 / True) and key order are kept."""
    base = Turn([], [], [], {"a": 1, "messages": [{"role": "user", "content": 1}], "b": [1, 2]})
    for request in (
        {"b": [1, 2], "a": 1, "messages": [{"role": "user", "content": 1}, {"role": "x"}]},
        {"a": 1.0, "messages": [{"role": "user", "content": 1.0}], "b": [True, 2]},
        {"a": 1, "messages": [{"content": 1, "role": "user"}], "c": None},
        {"messages": "text"},
        {},
    ):
        enc = encode(Turn([], [], [], request), base)
        back = decode(enc, base if enc.has_base else None)[2]
        assert json.dumps(back) == json.dumps(request)


@pytest.mark.parametrize(("a", "b", "n"), [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2, 4], 2),
                                           (list(range(1000)), [*range(517), -1], 517)])  # fmt: skip
def test_shared_prefix(a: list[int], b: list[int], n: int) -> None:
    assert shared_prefix(a, b) == shared_prefix(b, a) == n


def test_deleting_a_session_while_a_turn_is_about_to_start(store: TrajectoryStore) -> None:
    ep = Episode(store)
    ep.turn([1], [2], _request([]))
    assert store.delete_session("s") == (1, 0)
    with pytest.raises(NotFound, match="deleted"):
        store.begin_turn(TurnRecord("s", [1], [], None, None, {}, 0.0))
