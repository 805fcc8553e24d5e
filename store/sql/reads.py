"""The reads of the shared SQL store (`SqlReads`, a part of `store.sql.core.SqlStore`): sessions, turns
(with a fork child's shared ones) and events."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from core.errors import StoreError
from store.base import TURN_COMPLETE, EventRecord, SessionQuery, SessionRecord, TurnRecord
from store.schema import load_json
from store.sql.rows import SESSION_COLS, TURN_COLS, Fork, session_record, turn_record

if TYPE_CHECKING:
    from store.sql.core import SqlStore

PLAIN_KEPT = 65536
"""At most this many sessions are remembered as not forked (`SqlStore._plain`): about 6 MB."""


class SqlReads:
    """What the store reads; a finished turn whose final write failed reads as it finished (`_latest`)."""

    def __init__(self, db: SqlStore) -> None:
        self.db = db
        """The store: its statements, its caches and its backend's spelling."""

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """One statement (committed on its own), its rows: the store's reads, and its writes of one
        statement."""
        with self.db._statement() as tx:
            cur = tx.execute(sql, args)
            return cur.fetchall() if cur.description is not None else []

    def one(self, sql: str, args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        rows = self.rows(sql, args)
        return rows[0] if rows else None

    def get_session(self, session_id: str) -> SessionRecord | None:
        row = self._session_row(session_id)
        return session_record(row) if row else None

    def _session_row(self, session_id: str) -> tuple[Any, ...] | None:
        return self.one(f"SELECT {SESSION_COLS} FROM sessions WHERE id = ?", (session_id,))

    def list_sessions(self) -> list[SessionRecord]:
        rows = self.rows(f"SELECT {SESSION_COLS} FROM sessions ORDER BY {self.db.dialect.sessions_order}")
        return [session_record(r) for r in rows]

    def query_sessions(self, query: SessionQuery) -> tuple[list[SessionRecord], int]:
        where, args = [self.db.dialect.listed], list[Any]()
        if query.status is not None:
            where.append("status = ?")
            args.append(query.status)
        if query.has_reward is not None:
            where.append("reward IS NOT NULL" if query.has_reward else "reward IS NULL")
        bounds: tuple[tuple[str, str, float | None], ...] = (
            ("reward", ">=", query.reward_min),
            ("reward", "<=", query.reward_max),
            ("created_at", ">=", query.created_after),
            ("created_at", "<", query.created_before),
        )
        for column, op, bound in bounds:
            if bound is not None:
                where.append(f"{column} {op} ?")
                args.append(bound)
        for key, text in query.metadata.items():
            value, value_args = self.db._metadata_text(key)
            where.append(f"{value} = ?")
            args += [*value_args, text]
        clause = " AND ".join(where)
        total = self.one(f"SELECT COUNT(*) FROM sessions WHERE {clause}", args)
        order, text_id = "DESC" if query.newest_first else "ASC", self.db.dialect.text_id
        if query.after is not None:  # keyset paging: cheap at any depth, unlike OFFSET
            op = "<" if query.newest_first else ">"
            clause += f" AND (created_at {op} ? OR (created_at = ? AND {text_id} {op} ?))"
            args += [query.after[0], query.after[0], query.after[1]]
        rows = self.rows(
            f"SELECT {SESSION_COLS} FROM sessions WHERE {clause} "
            f"ORDER BY created_at {order}, {text_id} {order} LIMIT ? OFFSET ?",
            [*args, query.limit, query.offset],
        )
        return [session_record(r) for r in rows], int(total[0]) if total else 0

    def get_turn(self, turn_id: int) -> TurnRecord | None:
        turn = self.read(turn_id)
        return self._latest(turn) if turn else None

    def get_turns(self, session_id: str) -> list[TurnRecord]:
        row = self.one("SELECT parent_session, fork_turn FROM sessions WHERE id = ?", (session_id,))
        shared = self._shared(str(row[0]), int(row[1])) if row is not None and row[0] is not None else []
        rows = self.rows(f"SELECT {TURN_COLS} FROM turns WHERE session_id = ? ORDER BY idx", (session_id,))
        own = self._decode(rows, {t.id: t for t in shared})
        return shared + [self._latest(t) for t in own]

    def _latest(self, stored: TurnRecord) -> TurnRecord:
        """A turn as it is: its finished state when that could not be written yet."""
        return self.db._unwritten.get(stored.id, stored)

    def turn_counts(self, session_id: str | list[str] | None = None) -> dict[str, tuple[int, int]]:
        sql = "SELECT session_id, COUNT(*), COUNT(DISTINCT branch) FROM turns"
        ids = [session_id] if isinstance(session_id, str) else session_id
        if ids is None:
            rows = self.rows(f"{sql} GROUP BY session_id")
            forks = self.rows("SELECT id FROM sessions WHERE parent_session IS NOT NULL")
        else:
            among, args = self.db.dialect.among("session_id", ids)
            rows = self.rows(f"{sql} WHERE {among} GROUP BY session_id", args)
            among, args = self.db.dialect.among("id", ids)
            forks = self.rows(f"SELECT id FROM sessions WHERE parent_session IS NOT NULL AND {among}", args)
        counts = {str(sid): (int(turns), int(branches)) for sid, turns, branches in rows}
        for (sid,) in forks:  # a fork child counts the turns it shares
            turns_of = self.get_turns(sid)
            counts[sid] = (len(turns_of), len({t.branch for t in turns_of}))
        return counts

    def session_and_parent(
        self, session_id: str, keys: list[str]
    ) -> tuple[SessionRecord | None, TurnRecord | None]:
        row = self._session_row(session_id)  # decoded after the parent is read: one stay in this part
        if row is None:
            return None, None
        parent = self.find_turn_by_ext_keys(session_id, keys)
        return session_record(row), parent

    def find_turn_by_ext_keys(self, session_id: str, keys: list[str]) -> TurnRecord | None:
        if not keys:
            return None
        fork = self.fork_of(session_id)
        # A session's own turns alone unless it is a fork child: with an empty list in the OR, SQLite
        # scans the whole table (every turn of every session) in place of the (session_id, ext_key)
        # index, at every turn of every session: `belayer bench scale` found it.
        within, args = "session_id = ?", (session_id,)
        if fork is not None and fork.ids:
            shared_ids, shared_args = self.db.dialect.among("id", sorted(fork.ids))
            within, args = f"(session_id = ? OR {shared_ids})", (session_id, *shared_args)
        ext_keys, key_args = self.db.dialect.among("ext_key", keys)
        rows = self.rows(
            f"SELECT id, ext_key FROM turns WHERE {within} AND status = ? AND {ext_keys}",
            (*args, TURN_COMPLETE, *key_args),
        )
        if not rows:
            return None
        rank = {k: i for i, k in enumerate(keys)}
        return self.read(max(rows, key=lambda r: (rank[r[1]], r[0]))[0])

    def fork_of(self, session_id: str) -> Fork | None:
        """The shared turns of a fork child (None for any other session)."""
        fork = self.db._forks.get(session_id)
        if fork is not None:
            return fork
        if session_id in self.db._plain:
            return None
        row = self.one("SELECT parent_session, fork_turn FROM sessions WHERE id = ?", (session_id,))
        if row is None:
            return None
        if row[0] is None:
            if len(self.db._plain) >= PLAIN_KEPT:
                self.db._plain.clear()  # one dict operation: safe beside the other threads' reads
            self.db._plain[session_id] = None
            return None
        shared = self._shared(str(row[0]), int(row[1]))
        at = next((t for t in shared if t.index == row[1]), None)
        if at is None:
            raise StoreError(
                f"session {session_id} was forked at turn {row[1]} of {row[0]}, which is missing"
            )
        newest: dict[int, int] = {}
        for t in shared:
            newest[t.branch] = max(newest.get(t.branch, t.id), t.id)
        fork = Fork(int(row[1]), at.id, frozenset(t.id for t in shared), newest, max(newest))
        self.db._forks[session_id] = fork
        return fork

    def _shared(self, parent_id: str, at_turn: int) -> list[TurnRecord]:
        """The turns a child of `parent_id` forked at `at_turn` shares: the parent's, through it."""
        return [t for t in self.get_turns(parent_id) if t.index <= at_turn]

    def read(self, turn_id: int) -> TurnRecord | None:
        """A turn as stored (not `_latest`), with the chain of bases it is stored beyond, in one query."""
        rows = self.rows(
            f"WITH RECURSIVE chain(id) AS (SELECT {self.db.dialect.id_param} UNION ALL SELECT t.base_id "
            "FROM turns t JOIN chain c ON t.id = c.id WHERE t.base_id < t.id) "
            f"SELECT {TURN_COLS} FROM turns WHERE id IN (SELECT id FROM chain) ORDER BY id",
            (turn_id,),
        )
        turns = self._decode(rows, {})
        return turns[-1] if turns and turns[-1].id == turn_id else None

    def _decode(self, rows: list[tuple[Any, ...]], known: dict[int, TurnRecord]) -> list[TurnRecord]:
        """Turns from rows in id order; each base is found in `known` (filled as rows are read: a base
        is always an earlier turn), else read."""
        turns = []
        for row in rows:
            base_id = row[18]
            base = known.get(base_id) if base_id is not None else None
            if base_id is not None and base is None:
                base = self.read(base_id)
            turn = turn_record(row, base)
            known[turn.id] = turn
            turns.append(turn)
        return turns

    def get_events(self, session_id: str) -> list[EventRecord]:
        rows = self.rows(
            "SELECT session_id, turn_id, ts, kind, data FROM events WHERE session_id = ? ORDER BY id",
            (session_id,),
        )
        return [EventRecord(r[0], r[1], r[2], r[3], load_json(r[4])) for r in rows]

    def children(self, session_id: str) -> list[str]:
        rows = self.rows(
            "SELECT id FROM sessions WHERE parent_session = ? ORDER BY created_at, id", (session_id,)
        )
        return [str(r[0]) for r in rows]
