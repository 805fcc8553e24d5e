"""SQLite (WAL) trajectory store: one file, durable across process crashes.

Token ids are stored as packed uint32 arrays and logprobs as packed float64 arrays, so a 64k-token
prompt costs 256 KiB and a logprob round-trips bit for bit. A turn stores only what it adds to an
earlier turn (`gateway.store.layout`), so an episode costs O(tokens), not O(turns²); the tables, their
version and the migration of older stores are in `gateway.store.schema`.

A fork child (``parent_session``, ``fork_turn`` k) stores only its own turns. Reading its turns reads
its parent's turns with index <= k (the parent's own view, so a fork of a fork reads through the chain)
and then its own; its own turns are numbered from k + 1, stored as segments of the shared turn they
extend (or of turn k), and prefix reuse finds the shared turns too (`find_turn_by_ext_keys`). A
session that has fork children cannot be deleted (`Conflict`), nor pruned, while they exist. ``synchronous=NORMAL`` in
WAL mode makes every commit survive a crash of the gateway process (not a power loss); pass
``synchronous="FULL"`` for that, at the cost of an fsync per commit.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sqlite3
import threading
import time
import uuid
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.errors import Conflict, NotFound, StoreError
from core.telemetry import Telemetry
from gateway.store import layout, schema
from gateway.store.base import (
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


_loads = schema.load_json
_dumps = schema.dump_json


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


_TURN_COLS = (
    "id, session_id, idx, branch, parent_id, ext_key, status, prompt_ids, prompt_gen_spans, output_ids, "
    "output_logprobs, request, response, finish_reason, worker, timings, error, received_at, base_id, "
    "prompt_base, spans_base, request_delta, weight_segments"
)


def _segments(text: str | None) -> list[tuple[int, int, str]]:
    """Weight segments as stored (NULL: a turn stored before versions were recorded)."""
    return [(int(a), int(b), str(v)) for a, b, v in _loads(text)] if text else []


def _dump_segments(segments: list[tuple[int, int, str]]) -> str:
    return _dumps([list(s) for s in segments])


def _floats(blob: bytes) -> list[float]:
    a = array("d")
    a.frombytes(blob)
    return a.tolist()


def _shape(turn: TurnRecord) -> layout.Turn:
    return layout.Turn(turn.prompt_ids, turn.output_ids, turn.prompt_gen_spans, turn.request)


def _turn(row: tuple[Any, ...], base: TurnRecord | None) -> TurnRecord:
    """A turn from its row and, when it is stored as a segment (``base_id``), its base turn."""
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


@dataclass(frozen=True, slots=True)
class _Fork:
    """What writing a fork child's turns needs to know of the turns it shares (fixed at the fork)."""

    at_turn: int
    turn_id: int
    """The shared turn at index `at_turn`."""
    ids: frozenset[int]
    newest: dict[int, int]
    """Branch -> the newest shared turn's id on it."""
    max_branch: int


def _session(row: tuple[Any, ...]) -> SessionRecord:
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


class SqliteStore(TrajectoryStore):
    """The default store. Safe to share between threads; writes are serialised by a lock."""

    def __init__(
        self,
        path: str | Path,
        synchronous: str = "NORMAL",
        telemetry: Telemetry | None = None,
        recover: bool = True,
    ) -> None:
        """``recover=False`` leaves running turns as they are: for a tool that opens the store of a
        gateway that may be running (``belayer store prune``); the gateway passes True."""
        self.path = str(path)
        self.telemetry = telemetry
        """Where each committed event (and session change) is also published, for the live feed."""
        self._committed: list[EventRecord] = []
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        try:
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute(f"PRAGMA synchronous={synchronous}")
            schema.prepare(self._db, self.path)
        except sqlite3.Error as e:
            raise StoreError(f"cannot open trajectory store {self.path}: {e}") from e
        self._lock = threading.Lock()
        self._forks: dict[str, _Fork] = {}
        """Fork children's shared turns as writing needs them (they never change once forked)."""
        self._unwritten: dict[int, TurnRecord] = {}
        """Finished turns whose final write failed (disk full, read-only): kept here, shown to readers,
        and written by the next write that succeeds, so no turn stays ``running``."""
        self.failures = 0
        """Store operations that failed (each is logged with its cause)."""
        if recover:
            self._mark_interrupted()

    def _mark_interrupted(self) -> None:
        """Turns left running by a crashed gateway keep their prompt, and the output written while
        they streamed (`append_outputs`), and are marked interrupted, with a ``turns_interrupted``
        event per session (as the PostgreSQL store does for a gone replica's)."""
        with self._transaction():
            rows = self._db.execute(
                "UPDATE turns SET status = ? WHERE status = ? RETURNING session_id, idx, length(output_ids) / 4",
                (TURN_INTERRUPTED, TURN_RUNNING),
            ).fetchall()
            for event in schema.interrupted_events(rows):
                self._insert_event(event)

    def _exec(self, sql: str, args: tuple[Any, ...] = ()) -> sqlite3.Cursor:
        try:
            with self._lock:
                return self._db.execute(sql, args)
        except sqlite3.Error as e:
            raise self._failed(e) from e

    def _failed(self, error: sqlite3.Error) -> StoreError:
        """The StoreError for `error`, with SQLite's own cause in it (disk full, read-only, corrupt)."""
        self.failures += 1
        log.error("trajectory store %s failed: %s", self.path, error)
        return StoreError(f"trajectory store error: {error} ({self.path})")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        """Several writes committed together (or not at all), under the store's lock. SQLite may have
        rolled back already (a full disk does): then there is nothing to roll back, and the error
        that ended the transaction is the one reported. The events it wrote are published once it
        has committed."""
        try:
            with self._lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield self._db
                    self._db.execute("COMMIT")
                except BaseException:
                    self._committed.clear()
                    if self._db.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            self._db.execute("ROLLBACK")
                    raise
                committed, self._committed = self._committed, []
        except sqlite3.Error as e:
            raise self._failed(e) from e
        if self.telemetry is not None:  # outside the lock: listeners may read the store
            for ev in committed:
                self.telemetry.publish(ev.kind, ev.data, ev.session_id, ev.turn_id, ev.ts)

    def _publish_session(self, kind: str, session: SessionRecord) -> None:
        if self.telemetry is not None and not session.ephemeral:
            data = {"status": session.status, "reward": session.reward, "metadata": session.metadata}
            self.telemetry.publish(kind, data, session.id)

    def create_session(self, session: SessionRecord) -> SessionRecord:
        with self._lock:
            self._insert_session(session)
        self._publish_session("session_created", session)
        return session

    def _insert_session(self, session: SessionRecord) -> None:
        try:
            self._db.execute(
                "INSERT INTO sessions (id, created_at, metadata, status, reward, reward_info, closed_at, "
                "ephemeral, parent_session, fork_turn) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    session.id,
                    session.created_at,
                    _dumps(session.metadata),
                    session.status,
                    session.reward,
                    _dumps(session.reward_info) if session.reward_info is not None else None,
                    session.closed_at,
                    int(session.ephemeral),
                    session.parent_session,
                    session.fork_turn,
                ),
            )
        except sqlite3.Error as e:
            raise self._failed(e) from e

    def get_session(self, session_id: str) -> SessionRecord | None:
        row = self._exec("SELECT * FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return _session(row) if row else None

    def list_sessions(self) -> list[SessionRecord]:
        return [_session(r) for r in self._exec("SELECT * FROM sessions ORDER BY created_at").fetchall()]

    def update_session(self, session: SessionRecord) -> None:
        self._exec(
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
        with self._transaction() as db:
            if new_session is not None:
                self._insert_session(new_session)
            elif db.execute("SELECT 1 FROM sessions WHERE id = ?", (turn.session_id,)).fetchone() is None:
                raise NotFound(f"session '{turn.session_id}' was deleted", "session_id", "session_not_found")
            turn.index, turn.branch = self._next_index_and_branch(turn, fork)
            cur = db.execute(
                "INSERT INTO turns (session_id, idx, branch, parent_id, ext_key, status, output_ids, "
                "output_logprobs, timings, received_at, base_id, prompt_base, prompt_ids, spans_base, "
                "prompt_gen_spans, request, request_delta) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
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
                    base_id if enc.has_base else None,
                    *schema.encoded_columns(enc),
                ),
            )
            turn.id = int(cur.lastrowid or 0)
            if first_event is not None:
                kind, data = first_event(turn)
                self._insert_event(EventRecord(turn.session_id, turn.id, time.time(), kind, data))
        return turn

    def _base(
        self, turn: TurnRecord, parent: TurnRecord | None, fork: _Fork | None
    ) -> tuple[int | None, layout.Turn | None]:
        """The turn to store `turn` beyond: its parent, else the session's newest turn (a fork child
        with none yet: the turn it was forked at). The caller's copy of the parent (read by the prefix
        reuse) saves reading it again when it is the stored one."""
        if turn.parent_id is None:
            row = self._exec("SELECT MAX(id) FROM turns WHERE session_id = ?", (turn.session_id,)).fetchone()
            base_id = row[0] if row[0] is not None or fork is None else fork.turn_id
        elif parent is not None and parent.id == turn.parent_id and self._is_stored(parent):
            return parent.id, _shape(parent)
        else:
            base_id = turn.parent_id
        base = self._read(base_id) if base_id is not None else None
        shared = fork is not None and base is not None and base.id in fork.ids
        if base is None or (base.session_id != turn.session_id and not shared):
            return None, None
        return base.id, _shape(base)

    def _fork_of(self, session_id: str) -> _Fork | None:
        """The shared turns of a fork child (None for any other session)."""
        fork = self._forks.get(session_id)
        if fork is not None:
            return fork
        row = self._exec(
            "SELECT parent_session, fork_turn FROM sessions WHERE id = ?", (session_id,)
        ).fetchone()
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
        fork = _Fork(int(row[1]), at.id, frozenset(t.id for t in shared), newest, max(newest))
        self._forks[session_id] = fork
        return fork

    def _shared(self, parent_id: str, at_turn: int) -> list[TurnRecord]:
        """The turns a child of `parent_id` forked at `at_turn` shares: the parent's, through it."""
        return [t for t in self.get_turns(parent_id) if t.index <= at_turn]

    def _is_stored(self, turn: TurnRecord) -> bool:
        """Whether the store holds `turn`'s prompt and output as they are (compared by length)."""
        row = self._exec(
            "SELECT session_id, prompt_base + length(prompt_ids) / 4, length(output_ids) / 4 FROM turns "
            "WHERE id = ?",
            (turn.id,),
        ).fetchone()
        return row is not None and tuple(row) == (turn.session_id, len(turn.prompt_ids), len(turn.output_ids))

    def _read(self, turn_id: int) -> TurnRecord | None:
        """A turn as stored (not `_latest`), with the chain of bases it is stored beyond, in one query."""
        rows = self._exec(
            "WITH RECURSIVE chain(id) AS (SELECT ? UNION ALL SELECT t.base_id FROM turns t "
            "JOIN chain c ON t.id = c.id WHERE t.base_id < t.id) "
            f"SELECT {_TURN_COLS} FROM turns WHERE id IN (SELECT id FROM chain) ORDER BY id",
            (turn_id,),
        ).fetchall()
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
            turn = _turn(row, base)
            known[turn.id] = turn
            turns.append(turn)
        return turns

    def _next_index_and_branch(self, turn: TurnRecord, fork: _Fork | None) -> tuple[int, int]:
        """Index = next in the session (a fork child's: after its fork turn). Branch = the parent's
        branch when the parent is that branch's newest turn (shared turns included), else a new branch."""
        db = self._db
        index, new_branch = (int(v) for v in db.execute(
            "SELECT COALESCE(MAX(idx) + 1, 0), COALESCE(MAX(branch) + 1, 0) FROM turns WHERE session_id = ?",
            (turn.session_id,),
        ).fetchone())  # fmt: skip
        if fork is not None:
            index, new_branch = max(index, fork.at_turn + 1), max(new_branch, fork.max_branch + 1)
        if turn.parent_id is None:
            return index, new_branch
        parent = db.execute("SELECT branch FROM turns WHERE id = ?", (turn.parent_id,)).fetchone()
        if parent is None:
            return index, new_branch
        newest = db.execute(
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
        self._exec(
            "UPDATE turns SET status = CASE status WHEN 'discarded' THEN status ELSE ? END, ext_key = ?, output_ids = ?, output_logprobs = ?, response = ?, "
            "finish_reason = ?, worker = ?, timings = ?, error = ?, weight_segments = ? WHERE id = ?",
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
                _dump_segments(turn.weight_segments),
                turn.id,
            ),
        )

    def append_outputs(self, parts: list[OutputPart]) -> int:
        written = 0
        with self._transaction() as db:
            for part in parts:
                row = db.execute(
                    "SELECT output_ids, output_logprobs FROM turns WHERE id = ? AND status = ?",
                    (part.turn_id, TURN_RUNNING),
                ).fetchone()
                if row is None or len(row[0]) < 4 * part.start:
                    continue
                ids = row[0][: 4 * part.start] + array("I", part.ids).tobytes()
                lps = row[1][: 8 * part.start] + array("d", part.logprobs).tobytes()
                db.execute(
                    "UPDATE turns SET output_ids = ?, output_logprobs = ? WHERE id = ?",
                    (ids, lps, part.turn_id),
                )
                if part.weight_segments is not None:
                    db.execute(
                        "UPDATE turns SET weight_segments = ? WHERE id = ?",
                        (_dump_segments(part.weight_segments), part.turn_id),
                    )
                written += 1
        return written

    def schedule_recomputation(self, turn: TurnRecord, spans: list[tuple[int, int]]) -> None:
        self._exec(
            "INSERT OR REPLACE INTO recomputations (turn_id, session_id, spans, scheduled_at) VALUES (?, ?, ?, ?)",
            (turn.id, turn.session_id, _dumps([list(s) for s in spans]), time.time()),
        )

    def pending_recomputations(self) -> list[tuple[int, list[tuple[int, int]]]]:
        rows = self._exec("SELECT turn_id, spans FROM recomputations ORDER BY scheduled_at, turn_id")
        return [(int(r[0]), [(int(a), int(b)) for a, b in _loads(r[1])]) for r in rows.fetchall()]

    def end_recomputation(self, turn_id: int, event: EventRecord | None) -> None:
        with self._transaction() as db:
            if event is not None:
                self._insert_event(event)
            db.execute("DELETE FROM recomputations WHERE turn_id = ?", (turn_id,))

    def get_turn(self, turn_id: int) -> TurnRecord | None:
        turn = self._read(turn_id)
        return self._latest(turn) if turn else None

    def get_turns(self, session_id: str) -> list[TurnRecord]:
        row = self._exec(
            "SELECT parent_session, fork_turn FROM sessions WHERE id = ?", (session_id,)
        ).fetchone()
        shared = self._shared(str(row[0]), int(row[1])) if row is not None and row[0] is not None else []
        rows = self._exec(f"SELECT {_TURN_COLS} FROM turns WHERE session_id = ? ORDER BY idx", (session_id,))
        own = self._decode(rows.fetchall(), {t.id: t for t in shared})
        return shared + [self._latest(t) for t in own]

    def _latest(self, stored: TurnRecord) -> TurnRecord:
        """A turn as it is: its finished state when that could not be written yet."""
        return self._unwritten.get(stored.id, stored)

    def turn_counts(self, session_id: str | list[str] | None = None) -> dict[str, tuple[int, int]]:
        sql = "SELECT session_id, COUNT(*), COUNT(DISTINCT branch) FROM turns"
        ids = [session_id] if isinstance(session_id, str) else session_id
        if ids is None:
            rows = self._exec(f"{sql} GROUP BY session_id")
        else:
            marks = ",".join("?" * len(ids))
            rows = self._exec(f"{sql} WHERE session_id IN ({marks}) GROUP BY session_id", tuple(ids))
        counts = {sid: (turns, branches) for sid, turns, branches in rows.fetchall()}
        if ids is None:
            forks = self._exec("SELECT id FROM sessions WHERE parent_session IS NOT NULL").fetchall()
        else:
            marks = ",".join("?" * len(ids))
            sql = f"SELECT id FROM sessions WHERE parent_session IS NOT NULL AND id IN ({marks})"
            forks = self._exec(sql, tuple(ids)).fetchall()
        for (sid,) in forks:  # a fork child counts the turns it shares
            turns = self.get_turns(sid)
            counts[sid] = (len(turns), len({t.branch for t in turns}))
        return counts

    def query_sessions(self, query: SessionQuery) -> tuple[list[SessionRecord], int]:
        where, args = ["ephemeral = 0"], list[Any]()
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
            where.append("CAST(json_extract(metadata, ?) AS TEXT) = ?")
            args += ['$."' + key.replace('"', '""') + '"', text]
        clause = " AND ".join(where)
        total = int(self._exec(f"SELECT COUNT(*) FROM sessions WHERE {clause}", tuple(args)).fetchone()[0])
        order = "DESC" if query.newest_first else "ASC"
        if query.after is not None:  # keyset paging: cheap at any depth, unlike OFFSET
            op = "<" if query.newest_first else ">"
            clause += f" AND (created_at {op} ? OR (created_at = ? AND id {op} ?))"
            args += [query.after[0], query.after[0], query.after[1]]
        rows = self._exec(
            f"SELECT * FROM sessions WHERE {clause} ORDER BY created_at {order}, id {order} LIMIT ? OFFSET ?",
            (*args, query.limit, query.offset),
        ).fetchall()
        return [_session(r) for r in rows], total

    def find_turn_by_ext_keys(self, session_id: str, keys: list[str]) -> TurnRecord | None:
        if not keys:
            return None
        marks = ",".join("?" * len(keys))
        fork = self._fork_of(session_id)
        shared = sorted(fork.ids) if fork is not None else []
        rows = self._exec(
            f"SELECT id, ext_key FROM turns WHERE (session_id = ? OR id IN ({','.join('?' * len(shared))})) "
            f"AND status = ? AND ext_key IN ({marks})",
            (session_id, *shared, TURN_COMPLETE, *keys),
        ).fetchall()
        if not rows:
            return None
        rank = {k: i for i, k in enumerate(keys)}
        return self._read(max(rows, key=lambda r: (rank[r[1]], r[0]))[0])

    def add_event(self, event: EventRecord) -> None:
        with self._transaction():
            self._insert_event(event)

    def size_bytes(self) -> int:
        if self.path == ":memory:":
            return 0
        return sum(
            Path(self.path + suffix).stat().st_size
            for suffix in ("", "-wal")
            if Path(self.path + suffix).exists()
        )

    def _insert_event(self, event: EventRecord) -> None:
        """In a transaction: the event is published once that commits."""
        self._db.execute(
            "INSERT INTO events (session_id, turn_id, ts, kind, data) VALUES (?, ?, ?, ?, ?)",
            (event.session_id, event.turn_id, event.ts, event.kind, _dumps(event.data)),
        )
        self._committed.append(event)

    def get_events(self, session_id: str) -> list[EventRecord]:
        rows = self._exec(
            "SELECT session_id, turn_id, ts, kind, data FROM events WHERE session_id = ? ORDER BY id",
            (session_id,),
        ).fetchall()
        return [EventRecord(r[0], r[1], r[2], r[3], _loads(r[4])) for r in rows]

    def discard_turns_after(self, session_id: str, turn_index: int, reason: str) -> list[int]:
        where = "session_id = ? AND idx > ? AND status != ?"
        return self._discard(session_id, where, (session_id, turn_index, TURN_DISCARDED), reason, turn_index)

    def discard_turns(self, session_id: str, turn_ids: list[int], reason: str) -> list[int]:
        if not turn_ids:
            return []
        where = f"session_id = ? AND status != ? AND id IN ({','.join('?' * len(turn_ids))})"
        return self._discard(session_id, where, (session_id, TURN_DISCARDED, *turn_ids), reason, None)

    def _discard(
        self, session_id: str, where: str, args: tuple[Any, ...], reason: str, after: int | None
    ) -> list[int]:
        """One transaction: mark the matching turns discarded and record the event."""
        with self._transaction() as db:
            rows = db.execute(f"SELECT idx FROM turns WHERE {where} ORDER BY idx", args).fetchall()
            indices = [int(r[0]) for r in rows]
            if indices:
                db.execute(f"UPDATE turns SET status = ? WHERE {where}", (TURN_DISCARDED, *args))
                data = {"after_turn": after, "turn_indices": indices, "reason": reason}
                self._insert_event(EventRecord(session_id, None, time.time(), "turns_discarded", data))
        return indices

    def delete_session(self, session_id: str) -> tuple[int, int] | None:
        with self._transaction() as db:
            forks = [
                r[0] for r in db.execute("SELECT id FROM sessions WHERE parent_session = ?", (session_id,))
            ]
            if forks:
                raise Conflict(
                    f"session '{session_id}' has fork children ({', '.join(forks)}) that share its turns; "
                    "delete them first",
                    "session_id",
                    "session_has_forks",
                )
            running = db.execute(
                "SELECT id FROM turns WHERE session_id = ? AND status = ?", (session_id, TURN_RUNNING)
            ).fetchall()
            if any(r[0] not in self._unwritten for r in running):
                return None
            counts = self._delete(db, [session_id])
        self._forget_unwritten({session_id})
        if self.telemetry is not None:
            self.telemetry.publish("session_deleted", {"turns": counts[0], "events": counts[1]}, session_id)
        return counts

    def prune(self, closed_before: float, exported_only: bool = False) -> list[str]:
        where = (
            "status != 'open' AND COALESCE(closed_at, created_at) < ? AND id NOT IN "
            "(SELECT session_id FROM turns WHERE status = 'running') AND id NOT IN "
            "(SELECT parent_session FROM sessions WHERE parent_session IS NOT NULL)"
        ) + (" AND id IN (SELECT session_id FROM exported)" if exported_only else "")
        pruned: list[str] = []
        while True:  # in batches: a gateway writing to this store waits for one batch at most
            with self._transaction() as db:
                rows = db.execute(
                    f"SELECT id FROM sessions WHERE {where} ORDER BY created_at LIMIT 100", (closed_before,)
                ).fetchall()
                ids = [str(r[0]) for r in rows]
                if ids:
                    self._delete(db, ids)
            pruned += ids
            if len(ids) < 100:
                break
        self._forget_unwritten(set(pruned))
        return pruned

    def _delete(self, db: sqlite3.Connection, ids: list[str]) -> tuple[int, int]:
        """In a transaction: the sessions, their turns, events and export marks; (turns, events)."""
        marks = ",".join("?" * len(ids))
        turns = db.execute(f"DELETE FROM turns WHERE session_id IN ({marks})", ids).rowcount
        events = db.execute(f"DELETE FROM events WHERE session_id IN ({marks})", ids).rowcount
        db.execute(f"DELETE FROM exported WHERE session_id IN ({marks})", ids)
        db.execute(f"DELETE FROM recomputations WHERE session_id IN ({marks})", ids)
        db.execute(f"DELETE FROM sessions WHERE id IN ({marks})", ids)
        for sid in ids:
            self._forks.pop(sid, None)
        return turns, events

    def _forget_unwritten(self, session_ids: set[str]) -> None:
        for turn_id, turn in list(self._unwritten.items()):
            if turn.session_id in session_ids:
                self._unwritten.pop(turn_id, None)

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
        with self._transaction():
            for child in children:
                child.parent_session, child.fork_turn = parent_id, at_turn
                self._insert_session(child)
                self._insert_event(EventRecord(child.id, None, time.time(), "session_forked", data))
        for child in children:
            self._publish_session("session_created", child)
        return children

    def children(self, session_id: str) -> list[str]:
        rows = self._exec(
            "SELECT id FROM sessions WHERE parent_session = ? ORDER BY created_at, id", (session_id,)
        )
        return [str(r[0]) for r in rows.fetchall()]

    def mark_exported(self, session_ids: list[str]) -> None:
        now = time.time()
        with self._transaction() as db:
            db.executemany(
                "INSERT OR REPLACE INTO exported SELECT id, ? FROM sessions WHERE id = ? AND status != 'open'",
                [(now, sid) for sid in session_ids],
            )

    def vacuum(self) -> None:
        with self._lock:
            if not schema.vacuum(self._db):
                raise StoreError(f"trajectory store {self.path}: VACUUM failed (see the log)")

    def close(self) -> None:
        self._write_unwritten()
        if self._unwritten:
            log.error(
                "trajectory store %s closes with turns %s unwritten; they will read as interrupted",
                self.path,
                sorted(self._unwritten),
            )
        with self._lock:
            self._db.close()

    def mark_closed(self, session: SessionRecord) -> bool:
        data = {"reward": session.reward, "closed_at": session.closed_at}
        with self._transaction() as db:
            changed = db.execute(
                "UPDATE sessions SET status = ?, closed_at = ? WHERE id = ? AND status = 'open'",
                (session.status, session.closed_at, session.id),
            ).rowcount
            if changed:
                self._insert_event(EventRecord(session.id, None, time.time(), "session_closed", data))
        if changed:
            self._publish_session("session_updated", session)
        return bool(changed)

    def closed_after(self, after_id: int, limit: int) -> list[tuple[int, str]]:
        rows = self._exec(
            "SELECT id, session_id FROM events WHERE kind = 'session_closed' AND id > ? ORDER BY id LIMIT ?",
            (after_id, limit),
        ).fetchall()
        return [(int(r[0]), str(r[1])) for r in rows]

    def store_id(self) -> str:
        # made by the first caller (INSERT OR IGNORE: a concurrent one keeps the first), kept in `meta`
        self._exec("INSERT OR IGNORE INTO meta (key, value) VALUES ('store_id', ?)", (uuid.uuid4().hex,))
        return str(self._exec("SELECT value FROM meta WHERE key = 'store_id'").fetchone()[0])

    def last_event_id(self) -> int:
        # AUTOINCREMENT's counter: ids of deleted events are never given again, so this never shrinks
        row = self._exec("SELECT seq FROM sqlite_sequence WHERE name = 'events'").fetchone()
        return int(row[0]) if row else 0
