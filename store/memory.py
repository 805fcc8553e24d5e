"""An in-memory `TrajectoryStore`: the store's fake, so the logic above the store is tested in milliseconds.

It keeps the interface's contract as the SQL stores do, and the store tests hold it to that
(``tests/store/test_contract.py`` runs one suite over SQLite, PostgreSQL and this store, one history
through the whole interface among it):

- ids as the databases give them: turn and event ids from counters that never go back, so an event id
  is a feed cursor (`closed_after`); a turn's index and branch chosen as `store.sql.writes` chooses them;
- values as they read back from a database: token ids as uint32 and logprobs as float64, JSON values
  through JSON (a non-finite number is refused with the same ``ValueError``), a non-finite reward read
  as None; every record read is a copy, and the caller's records are never kept;
- each method is one transaction: it checks before it changes anything, and its events are published
  (``telemetry``) after it, as `store.sql.core` does.

Fork children share their parent's turns (read through the parent, never copied), and several instances
over one `MemoryTables` (`store.memory_tables`: the data, and the queries the methods share) are a restart on the same data: a new instance marks the running turns it finds
interrupted, as a reopened SQLite store does. Nothing can fail but a use after `close` (a `StoreError`).

>>> from store.base import SessionRecord, TurnRecord
>>> store = MemoryStore()
>>> _ = store.create_session(SessionRecord("s", created_at=0.0, metadata={}))
>>> turn = store.begin_turn(TurnRecord("s", [1, 2], [], None, None, {}, 0.0))
>>> (turn.id, turn.index, turn.branch), store.get_turns("s")[0].status
((1, 0, 0), 'running')
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

from core import events as ev
from core.errors import NotFound, StoreError
from core.telemetry import Telemetry
from store import schema
from store.base import (
    TURN_COMPLETE,
    TURN_RUNNING,
    EventRecord,
    OutputPart,
    SessionQuery,
    SessionRecord,
    TurnRecord,
    fork_point,
    has_forks,
)
from store.front import WriteFront
from store.memory_tables import (
    MemoryTables,
    session_copy,
    started,
    stored_end,
    stored_floats,
    stored_ids,
    stored_json,
    stored_segments,
)
from store.roles import TrajectoryStore


class MemoryStore(TrajectoryStore):
    """The store's fake. Safe to share between threads (one lock)."""

    def __init__(
        self,
        tables: MemoryTables | None = None,
        telemetry: Telemetry | None = None,
        recover: bool = True,
        lanes: int = 0,
    ) -> None:
        """`tables`: the data of an earlier instance (a restart); ``recover=False`` leaves running turns as
        they are, as `store.sqlite.SqliteStore` does; `lanes` > 0: a fake of a remote store, whose
        `front` runs writes off the event loop, as PostgreSQL's does."""
        self.tables = tables if tables is not None else MemoryTables()
        self.front = WriteFront(lanes)
        self.remote = lanes > 0
        self.telemetry = telemetry
        self.failures = 0
        self._closed = False
        if recover:
            with self._transaction() as published:
                for event in schema.interrupted_events(self.tables.interrupt_running()):
                    self._insert_event(published, event)

    # --- transactions and records -------------------------------------------------------------------

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[list[EventRecord]]:
        """Under the lock: a method's reads and changes; the events it recorded are published after."""
        published: list[EventRecord] = []
        with self.tables.lock:
            if self._closed:
                self.failures += 1
                raise StoreError("trajectory store error: Cannot operate on a closed store. (memory)")
            yield published
        if self.telemetry is not None:
            for ev in published:
                self.telemetry.publish_record(ev.kind, ev.data, ev.session_id, ev.turn_id, ev.ts)

    def _insert_event(self, published: list[EventRecord], event: EventRecord) -> None:
        self.tables.last_event_id += 1
        self.tables.events[self.tables.last_event_id] = replace(event, data=stored_json(event.data))
        published.append(event)

    def _publish_session(self, kind: type[ev.SessionChanged], session: SessionRecord) -> None:
        if self.telemetry is not None and not session.ephemeral:
            self.telemetry.publish(kind(session.status, session.reward, session.metadata), session.id)

    def _insert_sessions(self, sessions: list[SessionRecord]) -> None:
        """All of them, or (one is there already) none."""
        ids = [s.id for s in sessions]
        if len(set(ids)) < len(ids) or any(sid in self.tables.sessions for sid in ids):
            self.failures += 1
            raise StoreError("trajectory store error: UNIQUE constraint failed: sessions.id (memory)")
        for session in sessions:
            metadata, info = stored_json(session.metadata), stored_json(session.reward_info)
            self.tables.sessions[session.id] = replace(session, metadata=metadata, reward_info=info)

    # --- sessions -----------------------------------------------------------------------------------

    def create_session(self, session: SessionRecord) -> SessionRecord:
        with self._transaction():
            self._insert_sessions([session])
        self._publish_session(ev.SessionCreated, session)
        return session

    def get_session(self, session_id: str) -> SessionRecord | None:
        with self._transaction():
            stored = self.tables.sessions.get(session_id)
            return session_copy(stored) if stored is not None else None

    def list_sessions(self) -> list[SessionRecord]:
        with self._transaction():
            return [
                session_copy(s) for s in sorted(self.tables.sessions.values(), key=lambda s: s.created_at)
            ]

    def update_session(self, session: SessionRecord) -> None:
        metadata, info = stored_json(session.metadata), stored_json(session.reward_info)
        with self._transaction():
            stored = self.tables.sessions.get(session.id)
            if stored is not None:
                stored.metadata, stored.status, stored.reward = metadata, session.status, session.reward
                stored.reward_info, stored.closed_at = info, session.closed_at
        self._publish_session(ev.SessionUpdated, session)

    def query_sessions(self, query: SessionQuery) -> tuple[list[SessionRecord], int]:
        with self._transaction():
            return self.tables.query(query)

    def children(self, session_id: str) -> list[str]:
        with self._transaction():
            forks = [s for s in self.tables.sessions.values() if s.parent_session == session_id]
        return [s.id for s in sorted(forks, key=lambda s: (s.created_at, s.id))]

    # --- turns --------------------------------------------------------------------------------------

    def begin_turn(
        self,
        turn: TurnRecord,
        first_event: Callable[[TurnRecord], ev.Payload] | None = None,
        new_session: SessionRecord | None = None,
        parent: TurnRecord | None = None,
    ) -> TurnRecord:
        stored = started(turn)
        with self._transaction() as published:
            if new_session is None and turn.session_id not in self.tables.sessions:
                raise NotFound(f"session '{turn.session_id}' was deleted", "session_id", "session_not_found")
            turn.id = self.tables.last_turn_id + 1
            turn.index, turn.branch = self.tables.next_index_and_branch(turn)
            if first_event is not None:
                self._insert_event(published, EventRecord.of(turn.session_id, turn.id, first_event(turn)))
            self._insert_sessions([new_session] if new_session is not None else [])
            self.tables.last_turn_id = turn.id
            self.tables.turns[turn.id] = replace(stored, id=turn.id, index=turn.index, branch=turn.branch)
        return turn

    def finish_turn(self, turn: TurnRecord) -> None:
        with self._transaction():
            stored = self.tables.turns.get(turn.id)
            if stored is not None:
                self.tables.turns[turn.id] = stored_end(stored, turn)

    def append_outputs(self, parts: list[OutputPart]) -> int:
        written = 0
        with self._transaction():
            for part in parts:
                stored = self.tables.turns.get(part.turn_id)
                if stored is None or stored.status != TURN_RUNNING or len(stored.output_ids) < part.start:
                    continue
                stored.output_ids = stored.output_ids[: part.start] + stored_ids(part.ids)
                stored.output_logprobs = stored.output_logprobs[: part.start] + stored_floats(part.logprobs)
                if part.weight_segments is not None:
                    stored.weight_segments = stored_segments(part.weight_segments)
                written += 1
        return written

    def get_turn(self, turn_id: int) -> TurnRecord | None:
        with self._transaction():
            stored = self.tables.turns.get(turn_id)
            return copy.deepcopy(stored)

    def get_turns(self, session_id: str) -> list[TurnRecord]:
        with self._transaction():
            return copy.deepcopy(self.tables.turns_of(session_id))

    def turn_counts(self, session_id: str | list[str] | None = None) -> dict[str, tuple[int, int]]:
        with self._transaction():
            return self.tables.turn_counts([session_id] if isinstance(session_id, str) else session_id)

    def session_and_parent(
        self, session_id: str, keys: list[str]
    ) -> tuple[SessionRecord | None, TurnRecord | None]:
        with self._transaction():
            session = self.get_session(session_id)
            return session, (self.find_turn_by_ext_keys(session_id, keys) if session is not None else None)

    def find_turn_by_ext_keys(self, session_id: str, keys: list[str]) -> TurnRecord | None:
        rank = {k: i for i, k in enumerate(keys)}
        with self._transaction():
            found = [
                t for t in self.tables.turns_of(session_id) if t.status == TURN_COMPLETE and t.ext_key in rank
            ]
            best = max(found, key=lambda t: (rank[t.ext_key or ""], t.id), default=None)
            return copy.deepcopy(best)

    # --- recomputations -----------------------------------------------------------------------------

    def schedule_recomputation(self, turn: TurnRecord, spans: list[tuple[int, int]]) -> None:
        marked = [(int(a), int(b)) for a, b in spans]
        with self._transaction():
            self.tables.recomputations[turn.id] = (turn.session_id, marked, time.time())

    def pending_recomputations(self) -> list[tuple[int, list[tuple[int, int]]]]:
        with self._transaction():
            marks = sorted(self.tables.recomputations.items(), key=lambda m: (m[1][2], m[0]))
            return [(turn_id, list(spans)) for turn_id, (_, spans, _) in marks]

    def end_recomputation(self, turn_id: int, event: EventRecord | None) -> None:
        with self._transaction() as published:
            if event is not None:
                self._insert_event(published, event)
            self.tables.recomputations.pop(turn_id, None)

    # --- events and the finished feed ---------------------------------------------------------------

    def add_event(self, event: EventRecord) -> None:
        with self._transaction() as published:
            self._insert_event(published, event)

    def get_events(self, session_id: str) -> list[EventRecord]:
        with self._transaction():
            events = [e for e in self.tables.events.values() if e.session_id == session_id]
            return copy.deepcopy(events)

    def mark_closed(self, session: SessionRecord) -> bool:
        closed = ev.SessionClosed(session.reward, session.closed_at)
        with self._transaction() as published:
            stored = self.tables.sessions.get(session.id)
            changed = stored is not None and stored.status == "open"
            if stored is not None and changed:
                stored.status, stored.closed_at = session.status, session.closed_at
                self._insert_event(published, EventRecord.of(session.id, None, closed))
        if changed:
            self._publish_session(ev.SessionUpdated, session)
        return changed

    def closed_after(self, after_id: int, limit: int) -> list[tuple[int, str]]:
        with self._transaction():
            closed = [(i, e.session_id) for i, e in self.tables.events.items() if e.kind == "session_closed"]
        return [(i, sid) for i, sid in closed if i > after_id][:limit]

    def last_event_id(self) -> int:
        with self._transaction():
            return self.tables.last_event_id

    # --- discarding, forks, deleting, pruning -------------------------------------------------------

    def discard_turns_after(self, session_id: str, turn_index: int, reason: str) -> list[int]:
        return self._discard(session_id, lambda t: t.index > turn_index, reason, turn_index)

    def discard_turns(self, session_id: str, turn_ids: list[int], reason: str) -> list[int]:
        wanted = set(turn_ids)
        return self._discard(session_id, lambda t: t.id in wanted, reason, None) if wanted else []

    def _discard(
        self, session_id: str, which: Callable[[TurnRecord], bool], reason: str, after: int | None
    ) -> list[int]:
        with self._transaction() as published:
            indices = self.tables.discard(session_id, which)
            if indices:
                discarded = ev.TurnsDiscarded(after, indices, reason)
                self._insert_event(published, EventRecord.of(session_id, None, discarded))
        return indices

    def fork(self, parent_id: str, at_turn: int, children: list[SessionRecord]) -> list[SessionRecord]:
        with self._transaction() as published:
            known = parent_id in self.tables.sessions
            at = fork_point(parent_id, at_turn, self.tables.turns_of(parent_id) if known else None)
            forked = ev.SessionForked(parent_id, at_turn, at.id)
            self._insert_sessions([replace(c, parent_session=parent_id, fork_turn=at_turn) for c in children])
            for child in children:
                child.parent_session, child.fork_turn = parent_id, at_turn
                self._insert_event(published, EventRecord.of(child.id, None, forked))
        for child in children:
            self._publish_session(ev.SessionCreated, child)
        return children

    def delete_session(self, session_id: str) -> tuple[int, int] | None:
        with self._transaction():
            forks = [s.id for s in self.tables.sessions.values() if s.parent_session == session_id]
            if forks:
                raise has_forks(session_id, forks)
            if any(t.status == TURN_RUNNING for t in self.tables.own_turns(session_id)):
                return None
            counts = self.tables.delete({session_id})
        if self.telemetry is not None:
            self.telemetry.publish(ev.SessionDeleted(turns=counts[0], events=counts[1]), session_id)
        return counts

    def prune(self, closed_before: float, exported_only: bool = False) -> list[str]:
        with self._transaction():
            pruned = self.tables.prunable(closed_before, exported_only)
            self.tables.delete(set(pruned))
        return pruned

    def mark_exported(self, session_ids: list[str]) -> None:
        now = time.time()
        with self._transaction():
            for sid in session_ids:
                stored = self.tables.sessions.get(sid)
                if stored is not None and stored.status != "open":
                    self.tables.exported[sid] = now

    # --- the store itself ---------------------------------------------------------------------------

    def store_id(self) -> str:
        with self._transaction():
            return self.tables.store_id

    def size_bytes(self) -> int:
        return 0  # nothing on disk, as a SQLite ":memory:" store

    def vacuum(self) -> None:
        with self._transaction():
            pass  # nothing to give back; a closed store refuses, as a database does

    def sweep_orphans(self) -> int:
        return 0  # one gateway's store: a new instance marks what the last one left running

    def close(self) -> None:
        self.front.close()
        self._closed = True
