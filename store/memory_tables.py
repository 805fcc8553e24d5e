"""What the in-memory store (`store.memory`) holds, as a database would (`MemoryTables`), the queries its
methods share, and the values as they read back from a database (uint32 token ids, float64 logprobs,
JSON through JSON, a non-finite reward as None).
"""

from __future__ import annotations

import copy
import json
import math
import threading
import uuid
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from store import schema
from store.base import (
    TURN_DISCARDED,
    TURN_INTERRUPTED,
    TURN_RUNNING,
    EventRecord,
    SessionQuery,
    SessionRecord,
    TurnRecord,
)


@dataclass
class MemoryTables:
    """What a database would hold, and the queries on it that the store's methods share; the
    `MemoryStore` instances opened on it share it (call its methods under `lock`)."""

    sessions: dict[str, SessionRecord] = field(default_factory=dict)
    turns: dict[int, TurnRecord] = field(default_factory=dict)
    events: dict[int, EventRecord] = field(default_factory=dict)
    exported: dict[str, float] = field(default_factory=dict)
    recomputations: dict[int, tuple[str, list[tuple[int, int]], float]] = field(default_factory=dict)
    """Turn id -> (session id, spans, scheduled at)."""
    store_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    last_turn_id: int = 0
    last_event_id: int = 0
    lock: threading.RLock = field(default_factory=threading.RLock)

    def own_turns(self, session_id: str) -> list[TurnRecord]:
        """The turns stored in this session (a fork child's shared ones are its parent's), by index."""
        return sorted((t for t in self.turns.values() if t.session_id == session_id), key=turn_index)

    def shared(self, session_id: str) -> list[TurnRecord]:
        """A fork child's shared turns: its parent's (through its own parent) up to the fork turn."""
        session = self.sessions.get(session_id)
        if session is None or session.parent_session is None or session.fork_turn is None:
            return []
        upto = session.fork_turn
        parents = [*self.shared(session.parent_session), *self.own_turns(session.parent_session)]
        return [t for t in parents if t.index <= upto]

    def turns_of(self, session_id: str) -> list[TurnRecord]:
        """The session's turns as they read: a fork child's shared ones, then its own."""
        return [*self.shared(session_id), *self.own_turns(session_id)]

    def next_index_and_branch(self, turn: TurnRecord) -> tuple[int, int]:
        """As `store.sql.writes.SqlWrites._next_index_and_branch`: the next index; the parent's branch
        when the parent is that branch's newest turn (shared turns included), else a new branch."""
        own = self.own_turns(turn.session_id)
        shared = self.shared(turn.session_id)
        index = max([t.index + 1 for t in [*shared, *own]], default=0)
        new_branch = max([t.branch + 1 for t in [*shared, *own]], default=0)
        parent = self.turns.get(turn.parent_id) if turn.parent_id is not None else None
        if parent is None:
            return index, new_branch
        newest = max([t.id for t in own if t.branch == parent.branch], default=None)
        if newest is None and parent.id in {t.id for t in shared}:
            newest = max(t.id for t in shared if t.branch == parent.branch)
        return index, parent.branch if newest == parent.id else new_branch

    def delete(self, ids: set[str]) -> tuple[int, int]:
        """The sessions, their turns, events, export marks and recomputations; (turns, events) deleted."""
        t = self
        turns = [i for i, turn in t.turns.items() if turn.session_id in ids]
        events = [i for i, event in t.events.items() if event.session_id in ids]
        for i in turns:
            del t.turns[i]
        for i in events:
            del t.events[i]
        for turn_id in [i for i, (sid, _, _) in t.recomputations.items() if sid in ids]:
            del t.recomputations[turn_id]
        for sid in ids:
            t.exported.pop(sid, None)
            t.sessions.pop(sid, None)
        return len(turns), len(events)

    def interrupt_running(self) -> list[tuple[str, int, int]]:
        """Mark the running turns interrupted (a restart); (session id, index, output tokens) of each."""
        running = [t for t in self.turns.values() if t.status == TURN_RUNNING]
        for t in running:
            t.status = TURN_INTERRUPTED
        return [(t.session_id, t.index, len(t.output_ids)) for t in running]

    def discard(self, session_id: str, which: Callable[[TurnRecord], bool]) -> list[int]:
        """Mark the session's own turns that `which` picks (not yet discarded) discarded; their indices."""
        marked = [t for t in self.own_turns(session_id) if t.status != TURN_DISCARDED and which(t)]
        for t in marked:
            t.status = TURN_DISCARDED
        return sorted(t.index for t in marked)

    def prunable(self, closed_before: float, exported_only: bool) -> list[str]:
        """The sessions `TrajectoryStore.prune` deletes, oldest first."""
        running = {turn.session_id for turn in self.turns.values() if turn.status == TURN_RUNNING}
        parents = {s.parent_session for s in self.sessions.values()}
        return [
            s.id
            for s in sorted(self.sessions.values(), key=lambda s: s.created_at)
            if s.status != "open"
            and (s.closed_at if s.closed_at is not None else s.created_at) < closed_before
            and s.id not in running | parents
            and (s.id in self.exported or not exported_only)
        ]

    def query(self, query: SessionQuery) -> tuple[list[SessionRecord], int]:
        """`TrajectoryStore.query_sessions`: one page of copies, and how many match in all."""
        found = [session_copy(s) for s in self.sessions.values() if matches(s, query)]
        found.sort(key=lambda s: (s.created_at, s.id), reverse=query.newest_first)
        page = found
        if query.after is not None:  # keyset paging: after the cursor in the list's order
            after = query.after
            page = [
                s
                for s in found
                if ((s.created_at, s.id) < after if query.newest_first else (s.created_at, s.id) > after)
            ]
        return page[query.offset : query.offset + query.limit], len(found)

    def turn_counts(self, ids: list[str] | None) -> dict[str, tuple[int, int]]:
        """Turns and branches of each session (or of `ids`'); a fork child counts the turns it shares."""
        wanted = set(self.sessions) if ids is None else set(ids)
        counts: dict[str, tuple[int, int]] = {}
        for sid in ({t.session_id for t in self.turns.values()} | set(self.sessions)) & wanted:
            turns = self.turns_of(sid)
            if turns:
                counts[sid] = (len(turns), len({t.branch for t in turns}))
        return counts


def stored_json(value: Any) -> Any:
    """`value` as it reads back from a JSON column."""
    return None if value is None else schema.load_json(schema.dump_json(value))


def started(turn: TurnRecord) -> TurnRecord:
    """A new turn as stored: what it was asked, its outputs not yet (they stream, then it ends)."""
    return replace(
        turn,
        prompt_ids=stored_ids(turn.prompt_ids),
        prompt_gen_spans=[(int(a), int(b), int(c)) for a, b, c in turn.prompt_gen_spans],
        request=stored_json(turn.request),
        timings=stored_json(turn.timings),
        output_ids=[],
        output_logprobs=[],
        response=None,
        finish_reason=None,
        worker=None,
        error=None,
        weight_segments=[],
    )


def stored_end(stored: TurnRecord, turn: TurnRecord) -> TurnRecord:
    """`stored` with `turn`'s end (`TrajectoryStore.finish_turn`); a discarded turn stays discarded."""
    return replace(
        stored,
        status=stored.status if stored.status == TURN_DISCARDED else turn.status,
        ext_key=turn.ext_key,
        output_ids=stored_ids(turn.output_ids),
        output_logprobs=stored_floats(turn.output_logprobs),
        response=stored_json(turn.response),
        finish_reason=turn.finish_reason,
        worker=turn.worker,
        timings=stored_json(turn.timings),
        error=turn.error,
        weight_segments=stored_segments(turn.weight_segments),
    )


def stored_ids(ids: list[int]) -> list[int]:
    return array("I", ids).tolist()


def stored_floats(values: list[float]) -> list[float]:
    return array("d", values).tolist()


def stored_segments(segments: list[tuple[int, int, str]]) -> list[tuple[int, int, str]]:
    return [(int(a), int(b), str(v)) for a, b, v in segments]


def metadata_text(value: Any) -> str | None:
    """A metadata value as text, as SQLite's ``json_extract`` gives it (`SessionQuery.metadata`)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "1" if value else "0"
    return json.dumps(value, separators=(",", ":"))


def turn_index(turn: TurnRecord) -> int:
    return turn.index


def session_copy(stored: SessionRecord) -> SessionRecord:
    """A copy to hand out; a non-finite reward reads as None (as the SQL stores read one)."""
    session = copy.deepcopy(stored)
    if session.reward is not None and not math.isfinite(session.reward):
        session.reward = None
    return session


def matches(s: SessionRecord, q: SessionQuery) -> bool:
    """Whether a stored session is in `q`'s list (before paging)."""
    checks = (
        not s.ephemeral,
        q.status is None or s.status == q.status,
        q.has_reward is None or (s.reward is not None) == q.has_reward,
        q.reward_min is None or (s.reward is not None and s.reward >= q.reward_min),
        q.reward_max is None or (s.reward is not None and s.reward <= q.reward_max),
        q.created_after is None or s.created_at >= q.created_after,
        q.created_before is None or s.created_at < q.created_before,
    )
    metadata = (k in s.metadata and metadata_text(s.metadata[k]) == text for k, text in q.metadata.items())
    return all(checks) and all(metadata)
