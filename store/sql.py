"""What the SQLite and PostgreSQL trajectory stores share: every query, and every record built from a row.

`SqlStore` implements `TrajectoryStore` once, in SQL that both databases run, and leaves to each backend
(`store.sqlite`, `store.postgres`) only what truly differs between them:

- **Spelling**, in a `Dialect` value: the queries are written with ``?`` markers, which `Tx` turns into
  psycopg's ``%s``; a list binds as ``IN (?, ?, …)`` (SQLite) or as one array, ``= ANY(?)``
  (PostgreSQL); a flag is an ``INTEGER`` 0/1 or a ``BOOLEAN``; PostgreSQL locks rows (``FOR UPDATE``,
  ``… SKIP LOCKED``) where SQLite's ``BEGIN IMMEDIATE`` already holds the one write lock, and orders
  ids by byte (``COLLATE "C"``) as SQLite does.
- **Connections and transactions**, in two context managers that yield a `Tx`: `SqlStore._statement`
  (one statement, committed on its own) and `SqlStore._begin` (a transaction: committed when the block
  ends, rolled back when it raises). SQLite runs both on its one connection under a lock; PostgreSQL on a
  connection of its pool. Either turns the database's own error into a `StoreError` that carries it
  (`SqlStore._failed`, which also counts and logs it). `SqlStore._transaction` wraps `_begin` and
  publishes the events the transaction recorded (``tx.events``) once it has committed, outside SQLite's
  lock (listeners may read the store).
- **Hooks** for what one backend does and the other does not: how a new turn's id comes back
  (``lastrowid`` or ``RETURNING id``), the next index and branch of a session (PostgreSQL also sweeps
  the running turns of dead replicas there), how a streamed output part is written, whether running
  turns keep a session from being deleted (PostgreSQL ignores a dead owner's), the metadata filter
  (``json_extract`` or ``json_typeof``), the owner column of a turn, and what closing a session adds
  (PostgreSQL's feed lock and ``NOTIFY``). Statements that differ whole (upserts, the recomputation
  queue, ``store_id``, ``last_event_id``, size, vacuum) stay in the backends.

Example: a backend is a `Dialect` and the hooks::

    class MemoryStore(SqlStore):
        dialect = Dialect(marker="?", arrays=False, booleans=False)
        ...  # _statement, _begin, _location, _insert_id, _next_numbers, ...
"""

from __future__ import annotations

import abc
import contextlib
import logging
import math
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from core.errors import Conflict, NotFound, StoreError
from core.telemetry import Telemetry
from store import layout, schema
from store.base import (
    TURN_COMPLETE,
    TURN_DISCARDED,
    TURN_INTERRUPTED,
    TURN_RUNNING,
    EventRecord,
    OutputPart,
    SessionQuery,
    SessionRecord,
    TrajectoryStore,
    TurnRecord,
)

log = logging.getLogger("belayer.store")

TURN_COLS = (
    "id, session_id, idx, branch, parent_id, ext_key, status, prompt_ids, prompt_gen_spans, output_ids, "
    "output_logprobs, request, response, finish_reason, worker, timings, error, received_at, base_id, "
    "prompt_base, spans_base, request_delta, weight_segments"
)
SESSION_COLS = (
    "id, created_at, metadata, status, reward, reward_info, closed_at, ephemeral, parent_session, fork_turn"
)

_loads = schema.load_json
_dumps = schema.dump_json


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one database spells what the shared queries need."""

    marker: str
    """The driver's parameter marker (the shared queries are written with ``?``)."""
    arrays: bool
    """A list binds as one array (``= ANY(?)``), else as a marker per value (``IN (?, ?)``)."""
    booleans: bool
    """Flags are ``BOOLEAN`` columns, else ``INTEGER`` 0/1."""
    row_lock: str = ""
    """Appended to a ``SELECT`` of the session row that numbers a turn or deletes the session."""
    skip_locked: str = ""
    """Appended to the ``SELECT`` of a batch of sessions to prune."""
    text_id: str = "id"
    """The session id as it orders (by byte, as SQLite compares text)."""
    sessions_order: str = "created_at"
    """`list_sessions`' order."""
    forks_order: str = ""
    """The order of the fork children that keep a session from being deleted (named in the error)."""
    id_param: str = "?"
    """A turn id parameter where the database cannot infer its type (a recursive query's seed)."""

    def among(self, column: str, values: Sequence[Any]) -> tuple[str, tuple[Any, ...]]:
        """``column`` is one of `values`: the condition and its arguments."""
        if self.arrays:
            return f"{column} = ANY(?)", (list(values),)
        return f"{column} IN ({','.join('?' * len(values))})", tuple(values)

    def flag(self, value: bool) -> bool | int:
        return value if self.booleans else int(value)

    @property
    def listed(self) -> str:
        """The condition of a session that lists (not ephemeral)."""
        return "NOT ephemeral" if self.booleans else "ephemeral = 0"


class Cursor(Protocol):
    """What the shared queries read of a DB-API cursor (``sqlite3`` and ``psycopg`` alike)."""

    @property
    def rowcount(self) -> int: ...

    @property
    def description(self) -> object: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Connection(Protocol):
    def execute(self, sql: str, args: Any, /) -> Cursor: ...


@dataclass(slots=True)
class Tx:
    """One connection, in a transaction or for one statement; the events it recorded (published once
    it commits). Every ``?`` of a statement becomes the dialect's marker: a backend's own statements
    may use either, and none may use ``?`` as anything but a marker."""

    conn: Connection
    dialect: Dialect
    events: list[EventRecord] = field(default_factory=list)

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        if self.dialect.marker != "?":
            sql = sql.replace("?", self.dialect.marker)
        return self.conn.execute(sql, args)


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def _segments(text: str | None) -> list[tuple[int, int, str]]:
    """Weight segments as stored (NULL: a turn stored before versions were recorded)."""
    return [(int(a), int(b), str(v)) for a, b, v in _loads(text)] if text else []


def dump_segments(segments: list[tuple[int, int, str]] | None) -> str | None:
    return _dumps([list(s) for s in segments]) if segments is not None else None


def _floats(blob: bytes) -> list[float]:
    a = array("d")
    a.frombytes(blob)
    return a.tolist()


def _shape(turn: TurnRecord) -> layout.Turn:
    return layout.Turn(turn.prompt_ids, turn.output_ids, turn.prompt_gen_spans, turn.request)


def turn_record(row: tuple[Any, ...], base: TurnRecord | None) -> TurnRecord:
    """A turn from its row (`TURN_COLS`) and, when it is stored as a segment (``base_id``), its base."""
    if row[18] is not None and base is None:
        raise StoreError(f"turn {row[0]} is stored beyond turn {row[18]}, which is missing")
    stored = layout.Encoded(
        row[18] is not None,
        row[19],
        layout.unpack_ids(row[7]),
        row[20],
        schema.load_spans(row[8]),
        _loads(row[11]),
        bool(row[21]),
    )
    prompt_ids, spans, request = layout.decode(stored, _shape(base) if base is not None else None)
    return TurnRecord(
        id=row[0],
        session_id=row[1],
        index=row[2],
        branch=row[3],
        parent_id=row[4],
        ext_key=row[5],
        status=row[6],
        prompt_ids=prompt_ids,
        prompt_gen_spans=spans,
        output_ids=layout.unpack_ids(row[9]),
        output_logprobs=_floats(row[10]),
        request=request,
        response=_loads(row[12]) if row[12] else None,
        finish_reason=row[13],
        worker=row[14],
        timings=_loads(row[15]),
        error=row[16],
        received_at=row[17],
        weight_segments=_segments(row[22]),
    )


def session_record(row: tuple[Any, ...]) -> SessionRecord:
    """A session from its row (`SESSION_COLS`)."""
    return SessionRecord(
        id=row[0],
        created_at=row[1],
        metadata=_loads(row[2]),
        status=row[3],
        reward=_finite(row[4]),  # an older version stored inf / NaN rewards
        reward_info=_loads(row[5]) if row[5] else None,
        closed_at=row[6],
        ephemeral=bool(row[7]),
        parent_session=row[8],
        fork_turn=row[9],
    )


@dataclass(frozen=True, slots=True)
class Fork:
    """What writing a fork child's turns needs to know of the turns it shares (fixed at the fork)."""

    at_turn: int
    turn_id: int
    """The shared turn at index `at_turn`."""
    ids: frozenset[int]
    newest: dict[int, int]
    """Branch -> the newest shared turn's id on it."""
    max_branch: int


class SqlStore(TrajectoryStore):
    """A `TrajectoryStore` in SQL; a backend gives its `dialect`, its connections and the hooks below."""

    dialect: ClassVar[Dialect]

    def __init__(self, telemetry: Telemetry | None) -> None:
        self.telemetry = telemetry
        """Where each committed event (and session change) is also published, for the live feed."""
        self._forks: dict[str, Fork] = {}
        """Fork children's shared turns as writing needs them (they never change once forked)."""
        self._unwritten: dict[int, TurnRecord] = {}
        """Finished turns whose final write failed (disk full, read-only, connection lost): kept here,
        shown to readers, and written by the next write that succeeds, so no turn stays ``running``."""
        self.failures = 0
        """Store operations that failed (each is logged with its cause)."""

    # --- what a backend provides --------------------------------------------------------------------

    @abc.abstractmethod
    def _statement(self) -> contextlib.AbstractContextManager[Tx]:
        """One statement, committed on its own; a database error becomes `_failed`'s."""

    @abc.abstractmethod
    def _begin(self) -> contextlib.AbstractContextManager[Tx]:
        """A transaction: committed when the block ends, rolled back when it raises; a database error
        becomes `_failed`'s."""

    @abc.abstractmethod
    def _location(self) -> str:
        """The store as logs and errors name it (no password)."""

    @abc.abstractmethod
    def _insert_id(self, tx: Tx, sql: str, args: tuple[Any, ...]) -> int:
        """Run an ``INSERT`` of one turn; the id it was given."""

    @abc.abstractmethod
    def _next_numbers(self, tx: Tx, session_id: str) -> tuple[int, int]:
        """In `begin_turn`'s transaction: the session's next free (index, branch)."""

    @abc.abstractmethod
    def _append_part(self, tx: Tx, part: OutputPart) -> int:
        """In a transaction: write one streamed part (`append_outputs`); 1 if written, else 0."""

    @abc.abstractmethod
    def _running_keeps(self, tx: Tx, session_id: str) -> bool:
        """In `delete_session`'s transaction: whether a running turn keeps the session."""

    @abc.abstractmethod
    def _metadata_text(self, key: str) -> tuple[str, list[Any]]:
        """A top-level metadata value as text (as SQLite's ``json_extract`` gives it), and its arguments."""

    @abc.abstractmethod
    def _disconnect(self) -> None:
        """Close the connections (`close`, once the unwritten turns had their last try)."""

    def _turn_extras(self) -> tuple[tuple[str, Any], ...]:
        """Columns (name, value) a backend adds to each new turn."""
        return ()

    def _record_close(self, tx: Tx, event: EventRecord) -> None:
        """In `mark_closed`'s transaction: record the ``session_closed`` event."""
        self._insert_event(tx, event)

    # --- statements, transactions, errors -----------------------------------------------------------

    def _failed(self, error: Exception) -> StoreError:
        """The StoreError for `error`, with the database's own cause in it (disk full, read-only, gone)."""
        self.failures += 1
        where = self._location()
        log.error("trajectory store %s failed: %s", where, error)
        return StoreError(f"trajectory store error: {error} ({where})")

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """One statement (committed on its own), its rows."""
        with self._statement() as tx:
            cur = tx.execute(sql, args)
            return cur.fetchall() if cur.description is not None else []

    def _one(self, sql: str, args: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        rows = self._rows(sql, args)
        return rows[0] if rows else None

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[Tx]:
        """Several statements committed together (or not at all); their events published after."""
        with self._begin() as tx:
            yield tx
        if self.telemetry is not None:  # after the commit, outside SQLite's lock: listeners may read
            for ev in tx.events:
                self.telemetry.publish(ev.kind, ev.data, ev.session_id, ev.turn_id, ev.ts)

    def _publish_session(self, kind: str, session: SessionRecord) -> None:
        if self.telemetry is not None and not session.ephemeral:
            data = {"status": session.status, "reward": session.reward, "metadata": session.metadata}
            self.telemetry.publish(kind, data, session.id)

    def _interrupt(self, tx: Tx, where: str = "", args: tuple[Any, ...] = ()) -> int:
        """In a transaction: the running turns that match become interrupted, with the tokens they had,
        and each session gets a ``turns_interrupted`` event; how many."""
        rows = tx.execute(
            f"UPDATE turns SET status = ? WHERE status = ?{' AND ' + where if where else ''} "
            "RETURNING session_id, idx, length(output_ids) / 4",
            (TURN_INTERRUPTED, TURN_RUNNING, *args),
        ).fetchall()
        for event in schema.interrupted_events(rows):
            self._insert_event(tx, event)
        return len(rows)

    # --- sessions -----------------------------------------------------------------------------------

    def create_session(self, session: SessionRecord) -> SessionRecord:
        with self._statement() as tx:
            self._insert_session(tx, session)
        self._publish_session("session_created", session)
        return session

    def _insert_session(self, tx: Tx, session: SessionRecord) -> None:
        tx.execute(
            f"INSERT INTO sessions ({SESSION_COLS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                session.id,
                session.created_at,
                _dumps(session.metadata),
                session.status,
                session.reward,
                _dumps(session.reward_info) if session.reward_info is not None else None,
                session.closed_at,
                self.dialect.flag(session.ephemeral),
                session.parent_session,
                session.fork_turn,
            ),
        )

    def get_session(self, session_id: str) -> SessionRecord | None:
        row = self._one(f"SELECT {SESSION_COLS} FROM sessions WHERE id = ?", (session_id,))
        return session_record(row) if row else None

    def list_sessions(self) -> list[SessionRecord]:
        rows = self._rows(f"SELECT {SESSION_COLS} FROM sessions ORDER BY {self.dialect.sessions_order}")
        return [session_record(r) for r in rows]

    def update_session(self, session: SessionRecord) -> None:
        self._rows(
            "UPDATE sessions SET metadata = ?, status = ?, reward = ?, reward_info = ?, closed_at = ? "
            "WHERE id = ?",
            (
                _dumps(session.metadata),
                session.status,
                session.reward,
                _dumps(session.reward_info) if session.reward_info is not None else None,
                session.closed_at,
                session.id,
            ),
        )
        self._publish_session("session_updated", session)

    def query_sessions(self, query: SessionQuery) -> tuple[list[SessionRecord], int]:
        where, args = [self.dialect.listed], list[Any]()
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
            value, value_args = self._metadata_text(key)
            where.append(f"{value} = ?")
            args += [*value_args, text]
        clause = " AND ".join(where)
        total = self._one(f"SELECT COUNT(*) FROM sessions WHERE {clause}", args)
        order, text_id = "DESC" if query.newest_first else "ASC", self.dialect.text_id
        if query.after is not None:  # keyset paging: cheap at any depth, unlike OFFSET
            op = "<" if query.newest_first else ">"
            clause += f" AND (created_at {op} ? OR (created_at = ? AND {text_id} {op} ?))"
            args += [query.after[0], query.after[0], query.after[1]]
        rows = self._rows(
            f"SELECT {SESSION_COLS} FROM sessions WHERE {clause} "
            f"ORDER BY created_at {order}, {text_id} {order} LIMIT ? OFFSET ?",
            [*args, query.limit, query.offset],
        )
        return [session_record(r) for r in rows], int(total[0]) if total else 0

    # --- turns --------------------------------------------------------------------------------------

    def begin_turn(
        self,
        turn: TurnRecord,
        first_event: Callable[[TurnRecord], tuple[str, dict[str, Any]]] | None = None,
        new_session: SessionRecord | None = None,
        parent: TurnRecord | None = None,
    ) -> TurnRecord:
        fork = self._fork_of(turn.session_id) if new_session is None else None
        base_id, base = self._base(turn, parent, fork) if new_session is None else (None, None)
        enc = layout.encode(_shape(turn), base)
        with self._transaction() as tx:
            if new_session is not None:
                self._insert_session(tx, new_session)
            elif self._lock_session(tx, turn.session_id) is None:
                raise NotFound(f"session '{turn.session_id}' was deleted", "session_id", "session_not_found")
            turn.index, turn.branch = self._next_index_and_branch(tx, turn, fork)
            extras = self._turn_extras()
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
                _dumps(turn.timings),
                turn.received_at,
                *(value for _, value in extras),
                base_id if enc.has_base else None,
                *self._encoded(enc),
            )
            sql = f"INSERT INTO turns ({columns}) VALUES ({', '.join('?' * len(values))})"
            turn.id = self._insert_id(tx, sql, values)
            if first_event is not None:
                kind, data = first_event(turn)
                self._insert_event(tx, EventRecord(turn.session_id, turn.id, time.time(), kind, data))
        return turn

    def _lock_session(self, tx: Tx, session_id: str) -> tuple[Any, ...] | None:
        """In a transaction: the session's row, locked where the database locks rows (PostgreSQL: turns
        of one session are numbered one at a time); None when it is gone."""
        row: tuple[Any, ...] | None = tx.execute(
            f"SELECT 1 FROM sessions WHERE id = ?{self.dialect.row_lock}", (session_id,)
        ).fetchone()
        return row

    def _encoded(self, enc: layout.Encoded) -> tuple[Any, ...]:
        """(prompt_base, prompt_ids, spans_base, prompt_gen_spans, request, request_delta) as stored."""
        cols = schema.encoded_columns(enc)
        return (*cols[:5], self.dialect.flag(bool(cols[5])))

    def _base(
        self, turn: TurnRecord, parent: TurnRecord | None, fork: Fork | None
    ) -> tuple[int | None, layout.Turn | None]:
        """The turn to store `turn` beyond: its parent, else the session's newest turn (a fork child
        with none yet: the turn it was forked at). The caller's copy of the parent (read by the prefix
        reuse) saves reading it again when it is the stored one."""
        if turn.parent_id is None:
            row = self._one("SELECT MAX(id) FROM turns WHERE session_id = ?", (turn.session_id,))
            newest = row[0] if row is not None else None
            base_id = newest if newest is not None or fork is None else fork.turn_id
        elif parent is not None and parent.id == turn.parent_id and self._is_stored(parent):
            return parent.id, _shape(parent)
        else:
            base_id = turn.parent_id
        base = self._read(base_id) if base_id is not None else None
        shared = fork is not None and base is not None and base.id in fork.ids
        if base is None or (base.session_id != turn.session_id and not shared):
            return None, None
        return base.id, _shape(base)

    def _fork_of(self, session_id: str) -> Fork | None:
        """The shared turns of a fork child (None for any other session)."""
        fork = self._forks.get(session_id)
        if fork is not None:
            return fork
        row = self._one("SELECT parent_session, fork_turn FROM sessions WHERE id = ?", (session_id,))
        if row is None or row[0] is None:
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
        self._forks[session_id] = fork
        return fork

    def _shared(self, parent_id: str, at_turn: int) -> list[TurnRecord]:
        """The turns a child of `parent_id` forked at `at_turn` shares: the parent's, through it."""
        return [t for t in self.get_turns(parent_id) if t.index <= at_turn]

    def _is_stored(self, turn: TurnRecord) -> bool:
        """Whether the store holds `turn`'s prompt and output as they are (compared by length)."""
        row = self._one(
            "SELECT session_id, prompt_base + length(prompt_ids) / 4, length(output_ids) / 4 FROM turns "
            "WHERE id = ?",
            (turn.id,),
        )
        return row is not None and tuple(row) == (turn.session_id, len(turn.prompt_ids), len(turn.output_ids))

    def _read(self, turn_id: int) -> TurnRecord | None:
        """A turn as stored (not `_latest`), with the chain of bases it is stored beyond, in one query."""
        rows = self._rows(
            f"WITH RECURSIVE chain(id) AS (SELECT {self.dialect.id_param} UNION ALL SELECT t.base_id "
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
                base = self._read(base_id)
            turn = turn_record(row, base)
            known[turn.id] = turn
            turns.append(turn)
        return turns

    def _next_index_and_branch(self, tx: Tx, turn: TurnRecord, fork: Fork | None) -> tuple[int, int]:
        """Index = next in the session (a fork child's: after its fork turn). Branch = the parent's
        branch when the parent is that branch's newest turn (shared turns included), else a new branch."""
        index, new_branch = self._next_numbers(tx, turn.session_id)
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
            self._unwritten[turn.id] = turn
            raise
        self._unwritten.pop(turn.id, None)
        self._write_unwritten()

    def _write_unwritten(self) -> None:
        """Retry the final writes that failed earlier (stop at the first that fails again)."""
        for turn in list(self._unwritten.values()):
            try:
                self._write_finish(turn)
            except StoreError:
                return
            self._unwritten.pop(turn.id, None)
            log.warning("trajectory store: turn %d written after an earlier failure", turn.id)

    def _write_finish(self, turn: TurnRecord) -> None:
        self._rows(
            "UPDATE turns SET status = CASE status WHEN 'discarded' THEN status ELSE ? END, ext_key = ?, "
            "output_ids = ?, output_logprobs = ?, response = ?, finish_reason = ?, worker = ?, "
            "timings = ?, error = ?, weight_segments = ? WHERE id = ?",
            (
                turn.status,
                turn.ext_key,
                array("I", turn.output_ids).tobytes(),
                array("d", turn.output_logprobs).tobytes(),
                _dumps(turn.response) if turn.response is not None else None,
                turn.finish_reason,
                turn.worker,
                _dumps(turn.timings),
                turn.error,
                dump_segments(turn.weight_segments),
                turn.id,
            ),
        )

    def append_outputs(self, parts: list[OutputPart]) -> int:
        written = 0
        with self._transaction() as tx:
            for part in parts:
                written += self._append_part(tx, part)
        return written

    def end_recomputation(self, turn_id: int, event: EventRecord | None) -> None:
        with self._transaction() as tx:
            if event is not None:
                self._insert_event(tx, event)
            tx.execute("DELETE FROM recomputations WHERE turn_id = ?", (turn_id,))

    def get_turn(self, turn_id: int) -> TurnRecord | None:
        turn = self._read(turn_id)
        return self._latest(turn) if turn else None

    def get_turns(self, session_id: str) -> list[TurnRecord]:
        row = self._one("SELECT parent_session, fork_turn FROM sessions WHERE id = ?", (session_id,))
        shared = self._shared(str(row[0]), int(row[1])) if row is not None and row[0] is not None else []
        rows = self._rows(f"SELECT {TURN_COLS} FROM turns WHERE session_id = ? ORDER BY idx", (session_id,))
        own = self._decode(rows, {t.id: t for t in shared})
        return shared + [self._latest(t) for t in own]

    def _latest(self, stored: TurnRecord) -> TurnRecord:
        """A turn as it is: its finished state when that could not be written yet."""
        return self._unwritten.get(stored.id, stored)

    def turn_counts(self, session_id: str | list[str] | None = None) -> dict[str, tuple[int, int]]:
        sql = "SELECT session_id, COUNT(*), COUNT(DISTINCT branch) FROM turns"
        ids = [session_id] if isinstance(session_id, str) else session_id
        if ids is None:
            rows = self._rows(f"{sql} GROUP BY session_id")
            forks = self._rows("SELECT id FROM sessions WHERE parent_session IS NOT NULL")
        else:
            among, args = self.dialect.among("session_id", ids)
            rows = self._rows(f"{sql} WHERE {among} GROUP BY session_id", args)
            among, args = self.dialect.among("id", ids)
            forks = self._rows(f"SELECT id FROM sessions WHERE parent_session IS NOT NULL AND {among}", args)
        counts = {str(sid): (int(turns), int(branches)) for sid, turns, branches in rows}
        for (sid,) in forks:  # a fork child counts the turns it shares
            turns_of = self.get_turns(sid)
            counts[sid] = (len(turns_of), len({t.branch for t in turns_of}))
        return counts

    def find_turn_by_ext_keys(self, session_id: str, keys: list[str]) -> TurnRecord | None:
        if not keys:
            return None
        fork = self._fork_of(session_id)
        shared_ids, shared_args = self.dialect.among("id", sorted(fork.ids) if fork is not None else [])
        ext_keys, key_args = self.dialect.among("ext_key", keys)
        rows = self._rows(
            f"SELECT id, ext_key FROM turns WHERE (session_id = ? OR {shared_ids}) AND status = ? "
            f"AND {ext_keys}",
            (session_id, *shared_args, TURN_COMPLETE, *key_args),
        )
        if not rows:
            return None
        rank = {k: i for i, k in enumerate(keys)}
        return self._read(max(rows, key=lambda r: (rank[r[1]], r[0]))[0])

    # --- events -------------------------------------------------------------------------------------

    def add_event(self, event: EventRecord) -> None:
        with self._transaction() as tx:
            self._insert_event(tx, event)

    @staticmethod
    def _insert_event(tx: Tx, event: EventRecord) -> None:
        """In a transaction: the event is published once that commits."""
        tx.execute(
            "INSERT INTO events (session_id, turn_id, ts, kind, data) VALUES (?, ?, ?, ?, ?)",
            (event.session_id, event.turn_id, event.ts, event.kind, _dumps(event.data)),
        )
        tx.events.append(event)

    def get_events(self, session_id: str) -> list[EventRecord]:
        rows = self._rows(
            "SELECT session_id, turn_id, ts, kind, data FROM events WHERE session_id = ? ORDER BY id",
            (session_id,),
        )
        return [EventRecord(r[0], r[1], r[2], r[3], _loads(r[4])) for r in rows]

    # --- discarding, deleting, pruning --------------------------------------------------------------

    def discard_turns_after(self, session_id: str, turn_index: int, reason: str) -> list[int]:
        where = "session_id = ? AND idx > ? AND status <> ?"
        return self._discard(session_id, where, (session_id, turn_index, TURN_DISCARDED), reason, turn_index)

    def discard_turns(self, session_id: str, turn_ids: list[int], reason: str) -> list[int]:
        if not turn_ids:
            return []
        among, args = self.dialect.among("id", turn_ids)
        where = f"session_id = ? AND status <> ? AND {among}"
        return self._discard(session_id, where, (session_id, TURN_DISCARDED, *args), reason, None)

    def _discard(
        self, session_id: str, where: str, args: tuple[Any, ...], reason: str, after: int | None
    ) -> list[int]:
        """One transaction: mark the matching turns discarded and record the event."""
        with self._transaction() as tx:
            rows = tx.execute(
                f"UPDATE turns SET status = ? WHERE {where} RETURNING idx", (TURN_DISCARDED, *args)
            ).fetchall()
            indices = sorted(int(r[0]) for r in rows)
            if indices:
                data = {"after_turn": after, "turn_indices": indices, "reason": reason}
                self._insert_event(tx, EventRecord(session_id, None, time.time(), "turns_discarded", data))
        return indices

    def delete_session(self, session_id: str) -> tuple[int, int] | None:
        with self._transaction() as tx:
            if self.dialect.row_lock:
                self._lock_session(tx, session_id)
            forks = [
                r[0]
                for r in tx.execute(
                    f"SELECT id FROM sessions WHERE parent_session = ?{self.dialect.forks_order}",
                    (session_id,),
                ).fetchall()
            ]
            if forks:
                raise Conflict(
                    f"session '{session_id}' has fork children ({', '.join(forks)}) that share its turns; "
                    "delete them first",
                    "session_id",
                    "session_has_forks",
                )
            if self._running_keeps(tx, session_id):
                return None
            counts = self._delete(tx, [session_id])
        self._forget_unwritten({session_id})
        if self.telemetry is not None:
            self.telemetry.publish("session_deleted", {"turns": counts[0], "events": counts[1]}, session_id)
        return counts

    def prune(self, closed_before: float, exported_only: bool = False) -> list[str]:
        where = (
            "status <> 'open' AND COALESCE(closed_at, created_at) < ? AND id NOT IN "
            "(SELECT session_id FROM turns WHERE status = 'running') AND id NOT IN "
            "(SELECT parent_session FROM sessions WHERE parent_session IS NOT NULL)"
        ) + (" AND id IN (SELECT session_id FROM exported)" if exported_only else "")
        pruned: list[str] = []
        while True:  # in batches: a gateway writing to this store waits for one batch at most
            with self._transaction() as tx:
                rows = tx.execute(
                    f"SELECT id FROM sessions WHERE {where} ORDER BY created_at LIMIT 100"
                    f"{self.dialect.skip_locked}",
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
        among, args = self.dialect.among("session_id", ids)
        turns = tx.execute(f"DELETE FROM turns WHERE {among}", args).rowcount
        events = tx.execute(f"DELETE FROM events WHERE {among}", args).rowcount
        tx.execute(f"DELETE FROM exported WHERE {among}", args)
        tx.execute(f"DELETE FROM recomputations WHERE {among}", args)
        among, args = self.dialect.among("id", ids)
        tx.execute(f"DELETE FROM sessions WHERE {among}", args)
        for sid in ids:
            self._forks.pop(sid, None)
        return turns, events

    def _forget_unwritten(self, session_ids: set[str]) -> None:
        for turn_id, turn in list(self._unwritten.items()):
            if turn.session_id in session_ids:
                self._unwritten.pop(turn_id, None)

    # --- forks, the finished feed, closing ----------------------------------------------------------

    def fork(self, parent_id: str, at_turn: int, children: list[SessionRecord]) -> list[SessionRecord]:
        if self.get_session(parent_id) is None:
            raise NotFound(f"unknown session '{parent_id}'", "session_id", "session_not_found")
        at = next((t for t in self.get_turns(parent_id) if t.index == at_turn), None)
        if at is None:
            raise NotFound(f"session '{parent_id}' has no turn {at_turn}", "at_turn", "turn_not_found")
        if at.status != TURN_COMPLETE:
            raise Conflict(
                f"turn {at_turn} of session '{parent_id}' is {at.status}; fork at a complete turn",
                "at_turn",
                "turn_not_complete",
            )
        data = {"parent_session": parent_id, "fork_turn": at_turn, "fork_turn_id": at.id}
        with self._transaction() as tx:
            for child in children:
                child.parent_session, child.fork_turn = parent_id, at_turn
                self._insert_session(tx, child)
                self._insert_event(tx, EventRecord(child.id, None, time.time(), "session_forked", data))
        for child in children:
            self._publish_session("session_created", child)
        return children

    def children(self, session_id: str) -> list[str]:
        rows = self._rows(
            "SELECT id FROM sessions WHERE parent_session = ? ORDER BY created_at, id", (session_id,)
        )
        return [str(r[0]) for r in rows]

    def mark_closed(self, session: SessionRecord) -> bool:
        data = {"reward": session.reward, "closed_at": session.closed_at}
        with self._transaction() as tx:
            changed = tx.execute(
                "UPDATE sessions SET status = ?, closed_at = ? WHERE id = ? AND status = 'open'",
                (session.status, session.closed_at, session.id),
            ).rowcount
            if changed:
                self._record_close(tx, EventRecord(session.id, None, time.time(), "session_closed", data))
        if changed:
            self._publish_session("session_updated", session)
        return bool(changed)

    def closed_after(self, after_id: int, limit: int) -> list[tuple[int, str]]:
        rows = self._rows(
            "SELECT id, session_id FROM events WHERE kind = 'session_closed' AND id > ? ORDER BY id LIMIT ?",
            (after_id, limit),
        )
        return [(int(r[0]), str(r[1])) for r in rows]

    def close(self) -> None:
        self._write_unwritten()
        if self._unwritten:
            log.error(
                "trajectory store %s closes with turns %s unwritten; they will read as interrupted",
                self._location(),
                sorted(self._unwritten),
            )
        self._disconnect()
