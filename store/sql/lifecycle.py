"""What the life of a session adds over the shared SQL store's reads and writes (`SqlLifecycle`, a part of
`store.sql.core.SqlStore`): forks, closing with the finished feed, deletion and pruning, and closing the
store."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from core import events as ev
from store.base import EventRecord, SessionRecord, fork_point, has_forks
from store.sql.dialect import Tx
from store.sql.reads import SqlReads
from store.sql.writes import SqlWrites

if TYPE_CHECKING:
    from store.sql.core import SqlStore

log = logging.getLogger("belayer.store")


class SqlLifecycle:
    """Forks, closes, deletion, pruning and the store's close."""

    def __init__(self, db: SqlStore, reads: SqlReads, writes: SqlWrites) -> None:
        self.db, self.reads, self.writes = db, reads, writes

    def fork(self, parent_id: str, at_turn: int, children: list[SessionRecord]) -> list[SessionRecord]:
        known = self.reads.get_session(parent_id) is not None
        at = fork_point(parent_id, at_turn, self.reads.get_turns(parent_id) if known else None)
        forked = ev.SessionForked(parent_id, at_turn, at.id)
        with self.writes.transaction() as tx:
            for child in children:
                child.parent_session, child.fork_turn = parent_id, at_turn
                self.writes.insert_session(tx, child)
                self.db._insert_event(tx, EventRecord.of(child.id, None, forked))
        for child in children:
            self.db._publish_session(ev.SessionCreated, child)
        return children

    def mark_closed(self, session: SessionRecord) -> bool:
        closed = ev.SessionClosed(session.reward, session.closed_at)
        with self.writes.transaction() as tx:
            changed = tx.execute(
                "UPDATE sessions SET status = ?, closed_at = ? WHERE id = ? AND status = 'open'",
                (session.status, session.closed_at, session.id),
            ).rowcount
            if changed:
                self.db._record_close(tx, EventRecord.of(session.id, None, closed))
        if changed:
            self.db._publish_session(ev.SessionUpdated, session)
        return bool(changed)

    def closed_after(self, after_id: int, limit: int) -> list[tuple[int, str]]:
        rows = self.reads.rows(
            "SELECT id, session_id FROM events WHERE kind = 'session_closed' AND id > ? ORDER BY id LIMIT ?",
            (after_id, limit),
        )
        return [(int(r[0]), str(r[1])) for r in rows]

    def delete_session(self, session_id: str) -> tuple[int, int] | None:
        with self.writes.transaction() as tx:
            if self.db.dialect.row_lock:
                self.writes.lock_session(tx, session_id)
            forks = [
                r[0]
                for r in tx.execute(
                    f"SELECT id FROM sessions WHERE parent_session = ?{self.db.dialect.forks_order}",
                    (session_id,),
                ).fetchall()
            ]
            if forks:
                raise has_forks(session_id, forks)
            if self.db._running_keeps(tx, session_id):
                return None
            counts = self._delete(tx, [session_id])
        self._forget_unwritten({session_id})
        if self.db.telemetry is not None:
            self.db.telemetry.publish(ev.SessionDeleted(turns=counts[0], events=counts[1]), session_id)
        return counts

    def prune(self, closed_before: float, exported_only: bool = False) -> list[str]:
        where = (
            "status <> 'open' AND COALESCE(closed_at, created_at) < ? AND id NOT IN "
            "(SELECT session_id FROM turns WHERE status = 'running') AND id NOT IN "
            "(SELECT parent_session FROM sessions WHERE parent_session IS NOT NULL)"
        ) + (" AND id IN (SELECT session_id FROM exported)" if exported_only else "")
        pruned: list[str] = []
        while True:  # in batches: a gateway writing to this store waits for one batch at most
            with self.writes.transaction() as tx:
                rows = tx.execute(
                    f"SELECT id FROM sessions WHERE {where} ORDER BY created_at LIMIT 100"
                    f"{self.db.dialect.skip_locked}",
                    (closed_before,),
                ).fetchall()
                ids = [str(r[0]) for r in rows]
                if ids:
                    self._delete(tx, ids)
            pruned += ids
            if len(ids) < 100:
                break
        self._forget_unwritten(set(pruned))
        return pruned

    def _delete(self, tx: Tx, ids: list[str]) -> tuple[int, int]:
        """In a transaction: the sessions, their turns, events and export marks; (turns, events)."""
        among, args = self.db.dialect.among("session_id", ids)
        turns = tx.execute(f"DELETE FROM turns WHERE {among}", args).rowcount
        events = tx.execute(f"DELETE FROM events WHERE {among}", args).rowcount
        tx.execute(f"DELETE FROM exported WHERE {among}", args)
        tx.execute(f"DELETE FROM recomputations WHERE {among}", args)
        among, args = self.db.dialect.among("id", ids)
        tx.execute(f"DELETE FROM sessions WHERE {among}", args)
        for sid in ids:
            self.db._forks.pop(sid, None)
            self.db._plain.pop(sid, None)
        return turns, events

    def _forget_unwritten(self, session_ids: set[str]) -> None:
        for turn_id, turn in list(self.db._unwritten.items()):
            if turn.session_id in session_ids:
                self.db._unwritten.pop(turn_id, None)

    def close(self) -> None:
        self.db.front.close()  # the writes handed over commit first
        self.writes.write_unwritten()
        if self.db._unwritten:
            log.error(
                "trajectory store %s closes with turns %s unwritten; they will read as interrupted",
                self.db._location(),
                sorted(self.db._unwritten),
            )
        self.db._disconnect()
