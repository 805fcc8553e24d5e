"""The writes of the shared SQL store (`SqlWrites`, a part of `store.sql.core.SqlStore`): sessions, a turn's start, streamed outputs and finish (a final
write that failed is kept and retried), recomputation outcomes, events, and discarding turns."""

from __future__ import annotations

import contextlib
import logging
from array import array
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from core import events as ev
from core.errors import NotFound, StoreError
from store import layout, schema
from store.base import TURN_DISCARDED, EventRecord, OutputPart, SessionRecord, TurnRecord, stored_metadata
from store.schema import dump_json
from store.sql.dialect import Tx
from store.sql.reads import SqlReads
from store.sql.rows import SESSION_COLS, Fork, dump_segments, shape

if TYPE_CHECKING:
    from store.sql.core import SqlStore

log = logging.getLogger("belayer.store")


class SqlWrites:
    """What the store writes, each method in one transaction (or one statement)."""

    def __init__(self, db: SqlStore, reads: SqlReads) -> None:
        self.db, self.reads = db, reads

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Tx]:
        """Several statements committed together (or not at all); their events published after."""
        with self.db._begin() as tx:
            yield tx
        telemetry = self.db.telemetry
        if telemetry is not None:  # after the commit, outside SQLite's lock: listeners may read
            for e in tx.events:
                telemetry.publish_record(e.kind, e.data, e.session_id, e.turn_id, e.ts)

    def create_session(self, session: SessionRecord) -> SessionRecord:
        with self.db._statement() as tx:
            self.insert_session(tx, session)
        self.db._publish_session(ev.SessionCreated, session)
        return session

    def insert_session(self, tx: Tx, session: SessionRecord) -> None:
        tx.execute(
            f"INSERT INTO sessions ({SESSION_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                session.id,
                session.created_at,
                dump_json(stored_metadata(session)),
                session.status,
                session.reward,
                dump_json(session.reward_info) if session.reward_info is not None else None,
                session.closed_at,
                self.db.dialect.flag(session.ephemeral),
                session.parent_session,
                session.fork_turn,
            ),
        )

    def update_session(self, session: SessionRecord) -> None:
        self.reads.rows(
            "UPDATE sessions SET metadata = ?, status = ?, reward = ?, reward_info = ?, closed_at = ? "
            "WHERE id = ?",
            (
                dump_json(stored_metadata(session)),
                session.status,
                session.reward,
                dump_json(session.reward_info) if session.reward_info is not None else None,
                session.closed_at,
                session.id,
            ),
        )
        self.db._publish_session(ev.SessionUpdated, session)

    def begin_turn(
        self,
        turn: TurnRecord,
        first_event: Callable[[TurnRecord], ev.Payload] | None = None,
        new_session: SessionRecord | None = None,
        parent: TurnRecord | None = None,
    ) -> TurnRecord:
        fork = self.reads.fork_of(turn.session_id) if new_session is None else None
        base_id, base = self._base(turn, parent, fork) if new_session is None else (None, None)
        enc = layout.encode(shape(turn), base)
        with self.transaction() as tx:
            if new_session is not None:
                self.insert_session(tx, new_session)
            elif self.lock_session(tx, turn.session_id) is None:
                raise NotFound(f"session '{turn.session_id}' was deleted", "session_id", "session_not_found")
            turn.index, turn.branch = self._next_index_and_branch(tx, turn, fork)
            extras = self.db._turn_extras()
            columns = (
                "session_id, idx, branch, parent_id, ext_key, status, output_ids, output_logprobs, timings, "
                f"received_at, {''.join(f'{name}, ' for name, _ in extras)}base_id, prompt_base, prompt_ids, "
                "spans_base, prompt_gen_spans, request, request_delta"
            )
            values = (
                turn.session_id,
                turn.index,
                turn.branch,
                turn.parent_id,
                turn.ext_key,
                turn.status,
                b"",
                b"",
                dump_json(turn.timings),
                turn.received_at,
                *(value for _, value in extras),
                base_id if enc.has_base else None,
                *self._encoded(enc),
            )
            sql = f"INSERT INTO turns ({columns}) VALUES ({', '.join('?' * len(values))})"
            turn.id = self.db._insert_id(tx, sql, values)
            if first_event is not None:
                self.db._insert_event(tx, EventRecord.of(turn.session_id, turn.id, first_event(turn)))
        return turn

    def lock_session(self, tx: Tx, session_id: str) -> tuple[Any, ...] | None:
        """In a transaction: the session's row, locked where the database locks rows (PostgreSQL: turns
        of one session are numbered one at a time); None when it is gone."""
        row: tuple[Any, ...] | None = tx.execute(
            f"SELECT 1 FROM sessions WHERE id = ?{self.db.dialect.row_lock}", (session_id,)
        ).fetchone()
        return row

    def _encoded(self, enc: layout.Encoded) -> tuple[Any, ...]:
        """(prompt_base, prompt_ids, spans_base, prompt_gen_spans, request, request_delta) as stored."""
        cols = schema.encoded_columns(enc)
        return (*cols[:5], self.db.dialect.flag(bool(cols[5])))

    def _base(
        self, turn: TurnRecord, parent: TurnRecord | None, fork: Fork | None
    ) -> tuple[int | None, layout.Turn | None]:
        """The turn to store `turn` beyond: its parent, else the session's newest turn (a fork child
        with none yet: the turn it was forked at). The caller's copy of the parent (read by the prefix
        reuse) saves reading it again when it is the stored one."""
        if turn.parent_id is None:
            row = self.reads.one("SELECT MAX(id) FROM turns WHERE session_id = ?", (turn.session_id,))
            newest = row[0] if row is not None else None
            base_id = newest if newest is not None or fork is None else fork.turn_id
        elif parent is not None and parent.id == turn.parent_id and self._is_stored(parent):
            return parent.id, shape(parent)
        else:
            base_id = turn.parent_id
        base = self.reads.read(base_id) if base_id is not None else None
        shared = fork is not None and base is not None and base.id in fork.ids
        if base is None or (base.session_id != turn.session_id and not shared):
            return None, None
        return base.id, shape(base)

    def _is_stored(self, turn: TurnRecord) -> bool:
        """Whether the store holds `turn`'s prompt and output as they are (compared by length)."""
        row = self.reads.one(
            "SELECT session_id, prompt_base + length(prompt_ids) / 4, length(output_ids) / 4 FROM turns "
            "WHERE id = ?",
            (turn.id,),
        )
        return row is not None and tuple(row) == (turn.session_id, len(turn.prompt_ids), len(turn.output_ids))

    def _next_index_and_branch(self, tx: Tx, turn: TurnRecord, fork: Fork | None) -> tuple[int, int]:
        """Index = next in the session (a fork child's: after its fork turn). Branch = the parent's
        branch when the parent is that branch's newest turn (shared turns included), else a new branch."""
        index, new_branch = self.db._next_numbers(tx, turn.session_id)
        if fork is not None:
            index, new_branch = max(index, fork.at_turn + 1), max(new_branch, fork.max_branch + 1)
        if turn.parent_id is None:
            return index, new_branch
        parent = tx.execute("SELECT branch FROM turns WHERE id = ?", (turn.parent_id,)).fetchone()
        if parent is None:
            return index, new_branch
        newest = tx.execute(
            "SELECT MAX(id) FROM turns WHERE session_id = ? AND branch = ?", (turn.session_id, parent[0])
        ).fetchone()[0]
        if newest is None and fork is not None and turn.parent_id in fork.ids:
            newest = fork.newest.get(int(parent[0]))
        return index, int(parent[0]) if newest == turn.parent_id else new_branch

    def finish_turn(self, turn: TurnRecord) -> None:
        try:
            self._write_finish(turn)
        except StoreError:
            self.db._unwritten[turn.id] = turn
            raise
        self.db._unwritten.pop(turn.id, None)
        self.write_unwritten()

    def write_unwritten(self) -> None:
        """Retry the final writes that failed earlier (stop at the first that fails again)."""
        for turn in list(self.db._unwritten.values()):
            try:
                self._write_finish(turn)
            except StoreError:
                return
            self.db._unwritten.pop(turn.id, None)
            log.warning("trajectory store: turn %d written after an earlier failure", turn.id)

    def _write_finish(self, turn: TurnRecord) -> None:
        self.reads.rows(
            "UPDATE turns SET status = CASE status WHEN 'discarded' THEN status ELSE ? END, ext_key = ?, "
            "output_ids = ?, output_logprobs = ?, response = ?, finish_reason = ?, worker = ?, "
            "timings = ?, error = ?, weight_segments = ? WHERE id = ?",
            (
                turn.status,
                turn.ext_key,
                array("I", turn.output_ids).tobytes(),
                array("d", turn.output_logprobs).tobytes(),
                dump_json(turn.response) if turn.response is not None else None,
                turn.finish_reason,
                turn.worker,
                dump_json(turn.timings),
                turn.error,
                dump_segments(turn.weight_segments),
                turn.id,
            ),
        )

    def append_outputs(self, parts: list[OutputPart]) -> int:
        written = 0
        with self.transaction() as tx:
            for part in parts:
                written += self.db._append_part(tx, part)
        return written

    def end_recomputation(self, turn_id: int, event: EventRecord | None) -> None:
        with self.transaction() as tx:
            if event is not None:
                self.db._insert_event(tx, event)
            tx.execute("DELETE FROM recomputations WHERE turn_id = ?", (turn_id,))

    def add_event(self, event: EventRecord) -> None:
        with self.transaction() as tx:
            self.db._insert_event(tx, event)

    def discard_turns_after(self, session_id: str, turn_index: int, reason: str) -> list[int]:
        where = "session_id = ? AND idx > ? AND status <> ?"
        return self._discard(session_id, where, (session_id, turn_index, TURN_DISCARDED), reason, turn_index)

    def discard_turns(self, session_id: str, turn_ids: list[int], reason: str) -> list[int]:
        if not turn_ids:
            return []
        among, args = self.db.dialect.among("id", turn_ids)
        where = f"session_id = ? AND status <> ? AND {among}"
        return self._discard(session_id, where, (session_id, TURN_DISCARDED, *args), reason, None)

    def _discard(
        self, session_id: str, where: str, args: tuple[Any, ...], reason: str, after: int | None
    ) -> list[int]:
        """One transaction: mark the matching turns discarded and record the event."""
        with self.transaction() as tx:
            rows = tx.execute(
                f"UPDATE turns SET status = ? WHERE {where} RETURNING idx", (TURN_DISCARDED, *args)
            ).fetchall()
            indices = sorted(int(r[0]) for r in rows)
            if indices:
                discarded = ev.TurnsDiscarded(after, indices, reason)
                self.db._insert_event(tx, EventRecord.of(session_id, None, discarded))
        return indices
