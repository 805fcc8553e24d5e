"""PostgreSQL trajectory store: several gateways (replicas) share one database.

``belayer serve --store postgresql://user@host/db`` selects it; SQLite stays the embedded default. The
turns are laid out as in the SQLite store (`gateway.store.layout`: a turn stores what it adds to its
base; token ids as packed uint32 ``bytea``, logprobs as packed float64), fork children share their
parent's rows, and every method commits before it returns, so any replica reads what another wrote:
prefix reuse (`gateway.sessions`) finds a session's turns in the store, whichever gateway served them.

**Driver.** psycopg 3 with a *synchronous* connection pool (``psycopg_pool.ConnectionPool``): the
store interface is synchronous and the gateway calls it from worker threads (``Gateway.offload``,
``asyncio.to_thread``), so each call takes a pooled connection on its own thread and the event loop
never waits on the database. An async driver would need every caller to become a coroutine, or a
private event loop per call, for no gain. Connections are in autocommit mode; multi-statement writes
run in explicit transactions.

**Schema.** Created or brought up to date when a store opens, in one transaction under a
transaction-level advisory lock, so two gateways starting at once do not race: the second waits, then
finds the tables there. A column a later version adds is an ``ADD COLUMN IF NOT EXISTS`` in that same
transaction (`_COLUMNS`); ``meta.schema_version`` refuses a database newer than this code.

**Concurrency between replicas.** A turn's index and branch are chosen under the session's row lock
(``SELECT … FOR UPDATE``), so two replicas starting turns in one session at once get consecutive
indices; deleting a session takes the same lock. ``append_outputs`` is one conditional ``UPDATE`` per
part (``status = 'running'``), so a streamed batch that loses the race with the turn's final write is
skipped, never written over it.

**The finished feed.** Event ids come from one sequence, and a sequence value is taken when a
transaction asks for it, not when it commits: close X may take id 10, close Y id 11, and Y commit
first; a reader at cursor 11 would then never see X. So `mark_closed` takes a transaction-level
advisory lock (the feed lock) just before it inserts its ``session_closed`` event and holds it until
its commit: closes allocate their ids one at a time, in commit order (PostgreSQL makes a commit
visible before it releases the transaction's locks), and whoever reads id N can read every close
below N. Only closes serialise on this lock; other events take ids freely (the feed reads only
``session_closed`` events). A close also sends a ``NOTIFY`` (delivered at its commit): each store
with a telemetry hub listens on a connection of its own and publishes ``feed_advanced`` for another
replica's close, which wakes ``GET /api/finished?follow=true`` followers on every gateway.

**Running turns of a dead gateway.** Each store instance is an *owner*: it holds a session-level
advisory lock on its owner number, on a connection of its own, for as long as it is open, and marks
the turns it starts with that number. PostgreSQL drops the lock when the owner's connection dies (its
process crashed or was killed). Opening a store, starting a turn in a session (the retry that
lands on another replica), ``prune``, and every live replica's periodic sweep (`sweep_orphans`, run by
`gateway.orphan_sweep`) mark as ``interrupted`` the running turns whose owner's lock can be taken, with
a ``turns_interrupted`` event per session: their gateway is gone; ``delete_session`` does not wait for
them. A live replica's running turns are left alone. Two replicas sweeping at once do not both mark a
turn: the owner's lock is held to the commit by whichever took it. Until then (at most one sweep
period), a dead gateway's turn reads as ``running``. Pending logprob recomputations carry their owner
too, and `pending_recomputations` claims only those of dead owners. (If the owner's connection itself breaks
while its process lives, its turns may be marked interrupted by another replica.)

``vacuum`` runs a plain ``VACUUM`` (deleted rows' space is reused; the files shrink only at their end):
``VACUUM FULL`` would lock out every replica.

Example (each gateway replica opens its own instance on the same database)::

    store = PostgresStore("postgresql://belayer@db.internal/trajectories")
    store.get_turns(session_id)  # what any replica wrote
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import threading
import time
import uuid
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

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

SCHEMA_VERSION = 1
_SCHEMA_LOCK = 0x62656C61796572  # "belayer": the advisory lock key of schema creation
_FEED_LOCK = 0x62656C61796566  # the finished feed's allocation lock (`mark_closed`)
_OWNER_CLASS = 0x626C  # advisory locks (class, owner): an owner is alive while it holds its lock
_FEED_CHANNEL = "belayer_feed"  # NOTIFY channel: a session closed (payload: the closing owner)

_TABLES = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    """CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, created_at DOUBLE PRECISION NOT NULL, metadata TEXT NOT NULL,
    status TEXT NOT NULL, reward DOUBLE PRECISION, reward_info TEXT, closed_at DOUBLE PRECISION,
    ephemeral BOOLEAN NOT NULL DEFAULT FALSE, parent_session TEXT, fork_turn INTEGER
)""",
    """CREATE TABLE IF NOT EXISTS turns (
    id BIGSERIAL PRIMARY KEY, session_id TEXT NOT NULL REFERENCES sessions(id),
    idx INTEGER NOT NULL, branch INTEGER NOT NULL, parent_id BIGINT, ext_key TEXT,
    status TEXT NOT NULL, prompt_ids BYTEA NOT NULL, prompt_gen_spans TEXT NOT NULL,
    output_ids BYTEA NOT NULL, output_logprobs BYTEA NOT NULL, request TEXT NOT NULL, response TEXT,
    finish_reason TEXT, worker TEXT, timings TEXT NOT NULL, error TEXT,
    received_at DOUBLE PRECISION NOT NULL, base_id BIGINT, prompt_base INTEGER NOT NULL DEFAULT 0,
    spans_base INTEGER NOT NULL DEFAULT 0, request_delta BOOLEAN NOT NULL DEFAULT FALSE,
    weight_segments TEXT, owner INTEGER NOT NULL DEFAULT 0,
    UNIQUE (session_id, idx)
)""",
    """CREATE TABLE IF NOT EXISTS events (
    id BIGSERIAL PRIMARY KEY, session_id TEXT NOT NULL, turn_id BIGINT,
    ts DOUBLE PRECISION NOT NULL, kind TEXT NOT NULL, data TEXT NOT NULL
)""",
    "CREATE TABLE IF NOT EXISTS exported (session_id TEXT PRIMARY KEY, exported_at DOUBLE PRECISION NOT NULL)",
    """CREATE TABLE IF NOT EXISTS recomputations (
    turn_id BIGINT PRIMARY KEY, session_id TEXT NOT NULL, spans TEXT NOT NULL,
    scheduled_at DOUBLE PRECISION NOT NULL, owner INTEGER NOT NULL DEFAULT 0
)""",
    "CREATE INDEX IF NOT EXISTS turns_ext ON turns (session_id, ext_key)",
    "CREATE INDEX IF NOT EXISTS turns_running ON turns (owner) WHERE status = 'running'",
    "CREATE INDEX IF NOT EXISTS events_session ON events (session_id)",
    "CREATE INDEX IF NOT EXISTS events_closed ON events (id) WHERE kind = 'session_closed'",
    "CREATE INDEX IF NOT EXISTS sessions_created ON sessions (created_at)",
    "CREATE INDEX IF NOT EXISTS sessions_parent ON sessions (parent_session)",
)
_COLUMNS: tuple[tuple[str, str], ...] = ()
"""(table, column definition) that a later version added: ``ADD COLUMN IF NOT EXISTS`` at every open."""

_TURN_COLS = (
    "id, session_id, idx, branch, parent_id, ext_key, status, prompt_ids, prompt_gen_spans, output_ids, "
    "output_logprobs, request, response, finish_reason, worker, timings, error, received_at, base_id, "
    "prompt_base, spans_base, request_delta, weight_segments"
)
_SESSION_COLS = (
    "id, created_at, metadata, status, reward, reward_info, closed_at, ephemeral, parent_session, fork_turn"
)
_TABLE_NAMES = ("sessions", "turns", "events", "exported", "recomputations", "meta")

_loads = schema.load_json
_dumps = schema.dump_json


def _finite(value: float | None) -> float | None:
    return value if value is None or math.isfinite(value) else None


def _segments(text: str | None) -> list[tuple[int, int, str]]:
    """Weight segments as stored (NULL: none recorded)."""
    return [(int(a), int(b), str(v)) for a, b, v in _loads(text)] if text else []


def _dump_segments(segments: list[tuple[int, int, str]] | None) -> str | None:
    return _dumps([list(s) for s in segments]) if segments is not None else None


def _floats(blob: bytes) -> list[float]:
    a = array("d")
    a.frombytes(blob)
    return a.tolist()


def _shape(turn: TurnRecord) -> layout.Turn:
    return layout.Turn(turn.prompt_ids, turn.output_ids, turn.prompt_gen_spans, turn.request)


def _turn(row: tuple[Any, ...], base: TurnRecord | None) -> TurnRecord:
    """A turn from its row (`_TURN_COLS`) and, when it is stored as a segment, its base turn."""
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


def _session(row: tuple[Any, ...]) -> SessionRecord:
    return SessionRecord(
        id=row[0],
        created_at=row[1],
        metadata=_loads(row[2]),
        status=row[3],
        reward=_finite(row[4]),
        reward_info=_loads(row[5]) if row[5] else None,
        closed_at=row[6],
        ephemeral=bool(row[7]),
        parent_session=row[8],
        fork_turn=row[9],
    )


@dataclass(frozen=True, slots=True)
class _Fork:
    """What writing a fork child's turns needs to know of the turns it shares (fixed at the fork)."""

    at_turn: int
    turn_id: int
    ids: frozenset[int]
    newest: dict[int, int]
    max_branch: int


@dataclass(slots=True)
class _Tx:
    """One transaction on one pooled connection; its events are published once it commits."""

    conn: psycopg.Connection[Any]
    events: list[EventRecord] = field(default_factory=list)

    def execute(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> psycopg.Cursor[Any]:
        return self.conn.execute(sql, args)


# The metadata filter reads a top-level value as SQLite's json_extract gives it, as text: a string
# without its quotes, true/false as 1/0, a number as written, an object or array as its JSON.
_META_TEXT = (
    "(CASE json_typeof(metadata::json -> %s) WHEN 'string' THEN metadata::json ->> %s "
    "WHEN 'boolean' THEN CASE WHEN (metadata::json ->> %s)::boolean THEN '1' ELSE '0' END "
    "WHEN 'null' THEN NULL ELSE metadata::jsonb ->> %s END)"
)


class PostgresStore(TrajectoryStore):
    """The store of replicated gateways. Safe to share between threads (a connection pool)."""

    def __init__(
        self,
        url: str,
        telemetry: Telemetry | None = None,
        recover: bool = True,
        pool_size: int = 16,
        connect_timeout: float = 10.0,
    ) -> None:
        """``recover=False`` leaves other gateways' running turns as they are (a maintenance tool)."""
        self.url = url
        self.telemetry = telemetry
        self._forks: dict[str, _Fork] = {}
        self._unwritten: dict[int, TurnRecord] = {}
        """Finished turns whose final write failed: shown to readers, written by the next success."""
        self.failures = 0
        try:
            self._owner_conn = psycopg.connect(url, autocommit=True, connect_timeout=int(connect_timeout))
        except psycopg.Error as e:
            raise StoreError(f"cannot open trajectory store {_redact(url)}: {e}") from e
        try:
            self._prepare()
            self.owner = self._take_owner()
        except psycopg.Error as e:
            self._owner_conn.close()
            raise StoreError(f"cannot open trajectory store {_redact(url)}: {e}") from e
        except StoreError:
            self._owner_conn.close()
            raise
        # the pool: one connection per thread the gateway calls the store from (`Gateway.offload`)
        self._pool = ConnectionPool(
            url,
            min_size=1,
            max_size=pool_size,
            kwargs={"autocommit": True},
            timeout=connect_timeout,
            name="belayer-store",
            open=True,
        )
        try:
            self._pool.wait(connect_timeout)
        except psycopg.Error as e:  # PoolTimeout is one
            self._pool.close()
            self._owner_conn.close()
            raise StoreError(f"cannot open trajectory store {_redact(url)}: {e}") from e
        if recover:
            self._recover()
        self._stopping = threading.Event()
        self._listener: threading.Thread | None = None
        if telemetry is not None:
            listening = threading.Event()
            self._listener = threading.Thread(
                target=self._listen, args=(telemetry, listening), name="belayer-store-feed", daemon=True
            )
            self._listener.start()
            listening.wait(connect_timeout)  # from now on, no other replica's close goes unheard

    def _listen(self, telemetry: Telemetry, listening: threading.Event) -> None:
        """Publish ``feed_advanced`` when another replica closes a session (its NOTIFY at commit), so a
        finished-feed follower on this gateway reads the store at once, not at its next heartbeat."""
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                conn.execute(f"LISTEN {_FEED_CHANNEL}")
                listening.set()
                while not self._stopping.is_set():
                    for note in conn.notifies(timeout=0.5):
                        if note.payload != str(self.owner):  # this store's own closes publish themselves
                            telemetry.publish("feed_advanced", {"by": "replica"})
        except psycopg.Error as e:  # followers fall back to their heartbeat's read of the store
            listening.set()
            if not self._stopping.is_set():
                log.warning("trajectory store %s: feed listener stopped: %s", _redact(self.url), e)

    # --- connections, transactions, errors ----------------------------------------------------------

    def _prepare(self) -> None:
        """Create or bring up to date the tables, under the schema lock (two gateways may start at once)."""
        conn = self._owner_conn
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            for sql in _TABLES:
                conn.execute(sql)
            for table, column in _COLUMNS:
                conn.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column}")
            row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            found = int(row[0]) if row else 0
            if found > SCHEMA_VERSION:
                raise StoreError(
                    f"trajectory store {_redact(self.url)} has schema version {found}, newer than this "
                    f"Belayer reads ({SCHEMA_VERSION}); use the Belayer version that wrote it"
                )
            conn.execute(
                "INSERT INTO meta VALUES ('schema_version', %s) ON CONFLICT (key) DO UPDATE "
                "SET value = EXCLUDED.value",
                (str(SCHEMA_VERSION),),
            )

    def _take_owner(self) -> int:
        """A free owner number, its lock held by this store's own connection until `close`."""
        while True:
            owner = secrets.randbelow(2**31 - 2) + 1
            row = self._owner_conn.execute(
                "SELECT pg_try_advisory_lock(%s, %s)", (_OWNER_CLASS, owner)
            ).fetchone()
            if row is not None and row[0]:
                return owner

    def _failed(self, error: Exception) -> StoreError:
        self.failures += 1
        log.error("trajectory store %s failed: %s", _redact(self.url), error)
        return StoreError(f"trajectory store error: {error} ({_redact(self.url)})")

    def _rows(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> list[tuple[Any, ...]]:
        """One statement (committed on its own), its rows."""
        try:
            with self._pool.connection() as conn:
                cur = conn.execute(sql, args)
                return cur.fetchall() if cur.description is not None else []
        except psycopg.Error as e:
            raise self._failed(e) from e

    def _one(self, sql: str, args: tuple[Any, ...] | list[Any] = ()) -> tuple[Any, ...] | None:
        rows = self._rows(sql, args)
        return rows[0] if rows else None

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[_Tx]:
        """Several statements committed together (or not at all); their events published after."""
        try:
            with self._pool.connection() as conn, conn.transaction():
                tx = _Tx(conn)
                yield tx
        except psycopg.Error as e:
            raise self._failed(e) from e
        if self.telemetry is not None:
            for ev in tx.events:
                self.telemetry.publish(ev.kind, ev.data, ev.session_id, ev.turn_id, ev.ts)

    def _publish_session(self, kind: str, session: SessionRecord) -> None:
        if self.telemetry is not None and not session.ephemeral:
            data = {"status": session.status, "reward": session.reward, "metadata": session.metadata}
            self.telemetry.publish(kind, data, session.id)

    # --- dead gateways' running turns ---------------------------------------------------------------

    def _recover(self) -> int:
        """Mark interrupted the running turns of every owner that is gone; how many."""
        rows = self._rows(
            "SELECT DISTINCT owner FROM turns WHERE status = %s AND owner <> %s", (TURN_RUNNING, self.owner)
        )
        marked = 0
        for (owner,) in rows:
            with self._transaction() as tx:
                if _owner_gone(tx, owner):
                    marked += self._interrupt(tx, "owner = %s", (owner,))
        return marked

    def sweep_orphans(self) -> int:
        return self._recover()

    def _sweep_session(self, tx: _Tx, session_id: str, owners: list[int]) -> None:
        """In a transaction: the running turns of this session whose owner is gone become interrupted."""
        gone = [o for o in owners if _owner_gone(tx, o)]
        if gone:
            self._interrupt(tx, "session_id = %s AND owner = ANY(%s)", (session_id, gone))

    def _interrupt(self, tx: _Tx, where: str, args: tuple[Any, ...]) -> int:
        """In a transaction: the running turns that match become interrupted, with the tokens they had,
        and each session gets a ``turns_interrupted`` event; how many."""
        rows = tx.execute(
            f"UPDATE turns SET status = %s WHERE status = %s AND {where} "
            "RETURNING session_id, idx, length(output_ids) / 4",
            (TURN_INTERRUPTED, TURN_RUNNING, *args),
        ).fetchall()
        for event in schema.interrupted_events(rows):
            self._insert_event(tx, event)
        return len(rows)

    # --- sessions -----------------------------------------------------------------------------------

    def create_session(self, session: SessionRecord) -> SessionRecord:
        with self._transaction() as tx:
            self._insert_session(tx, session)
        self._publish_session("session_created", session)
        return session

    @staticmethod
    def _insert_session(tx: _Tx, session: SessionRecord) -> None:
        tx.execute(
            f"INSERT INTO sessions ({_SESSION_COLS}) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s)",
            (
                session.id,
                session.created_at,
                _dumps(session.metadata),
                session.status,
                session.reward,
                _dumps(session.reward_info) if session.reward_info is not None else None,
                session.closed_at,
                session.ephemeral,
                session.parent_session,
                session.fork_turn,
            ),
        )

    def get_session(self, session_id: str) -> SessionRecord | None:
        row = self._one(f"SELECT {_SESSION_COLS} FROM sessions WHERE id = %s", (session_id,))
        return _session(row) if row else None

    def list_sessions(self) -> list[SessionRecord]:
        rows = self._rows(f"SELECT {_SESSION_COLS} FROM sessions ORDER BY created_at, id")
        return [_session(r) for r in rows]

    def update_session(self, session: SessionRecord) -> None:
        self._rows(
            "UPDATE sessions SET metadata = %s, status = %s, reward = %s, reward_info = %s, closed_at = %s "
            "WHERE id = %s",
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
            else:  # the session's row lock: turns of one session are numbered one at a time
                locked = tx.execute(
                    "SELECT 1 FROM sessions WHERE id = %s FOR UPDATE", (turn.session_id,)
                ).fetchone()
                if locked is None:
                    raise NotFound(
                        f"session '{turn.session_id}' was deleted", "session_id", "session_not_found"
                    )
            turn.index, turn.branch = self._next_index_and_branch(tx, turn, fork)
            row = tx.execute(
                "INSERT INTO turns (session_id, idx, branch, parent_id, ext_key, status, output_ids, "
                "output_logprobs, timings, received_at, owner, base_id, prompt_base, prompt_ids, "
                "spans_base, prompt_gen_spans, request, request_delta) "
                "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
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
                    self.owner,
                    base_id if enc.has_base else None,
                    *_encoded(enc),
                ),
            ).fetchone()
            assert row is not None
            turn.id = int(row[0])
            if first_event is not None:
                kind, data = first_event(turn)
                self._insert_event(tx, EventRecord(turn.session_id, turn.id, time.time(), kind, data))
        return turn

    def _base(
        self, turn: TurnRecord, parent: TurnRecord | None, fork: _Fork | None
    ) -> tuple[int | None, layout.Turn | None]:
        """The turn to store `turn` beyond: its parent, else the session's newest turn (a fork child
        with none yet: the turn it was forked at)."""
        if turn.parent_id is None:
            row = self._one("SELECT MAX(id) FROM turns WHERE session_id = %s", (turn.session_id,))
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

    def _fork_of(self, session_id: str) -> _Fork | None:
        fork = self._forks.get(session_id)
        if fork is not None:
            return fork
        row = self._one("SELECT parent_session, fork_turn FROM sessions WHERE id = %s", (session_id,))
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
        return [t for t in self.get_turns(parent_id) if t.index <= at_turn]

    def _is_stored(self, turn: TurnRecord) -> bool:
        row = self._one(
            "SELECT session_id, prompt_base + length(prompt_ids) / 4, length(output_ids) / 4 FROM turns "
            "WHERE id = %s",
            (turn.id,),
        )
        return row is not None and tuple(row) == (turn.session_id, len(turn.prompt_ids), len(turn.output_ids))

    def _read(self, turn_id: int) -> TurnRecord | None:
        """A turn as stored, with the chain of bases it is stored beyond, in one query."""
        rows = self._rows(
            "WITH RECURSIVE chain(id) AS (SELECT %s::bigint UNION ALL SELECT t.base_id FROM turns t "
            "JOIN chain c ON t.id = c.id WHERE t.base_id < t.id) "
            f"SELECT {_TURN_COLS} FROM turns WHERE id IN (SELECT id FROM chain) ORDER BY id",
            (turn_id,),
        )
        turns = self._decode(rows, {})
        return turns[-1] if turns and turns[-1].id == turn_id else None

    def _decode(self, rows: list[tuple[Any, ...]], known: dict[int, TurnRecord]) -> list[TurnRecord]:
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

    def _next_index_and_branch(self, tx: _Tx, turn: TurnRecord, fork: _Fork | None) -> tuple[int, int]:
        """Under the session's row lock. Also interrupts the session's running turns of dead owners."""
        row = tx.execute(
            "SELECT COALESCE(MAX(idx) + 1, 0), COALESCE(MAX(branch) + 1, 0), "
            "array_agg(DISTINCT owner) FILTER (WHERE status = %s AND owner <> %s) "
            "FROM turns WHERE session_id = %s",
            (TURN_RUNNING, self.owner, turn.session_id),
        ).fetchone()
        assert row is not None
        index, new_branch, owners = int(row[0]), int(row[1]), row[2]
        if owners:
            self._sweep_session(tx, turn.session_id, list(owners))
        if fork is not None:
            index, new_branch = max(index, fork.at_turn + 1), max(new_branch, fork.max_branch + 1)
        if turn.parent_id is None:
            return index, new_branch
        parent = tx.execute("SELECT branch FROM turns WHERE id = %s", (turn.parent_id,)).fetchone()
        if parent is None:
            return index, new_branch
        newest = tx.execute(
            "SELECT MAX(id) FROM turns WHERE session_id = %s AND branch = %s", (turn.session_id, parent[0])
        ).fetchone()[0]  # type: ignore[index]
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
        for turn in list(self._unwritten.values()):
            try:
                self._write_finish(turn)
            except StoreError:
                return
            self._unwritten.pop(turn.id, None)
            log.warning("trajectory store: turn %d written after an earlier failure", turn.id)

    def _write_finish(self, turn: TurnRecord) -> None:
        self._rows(
            "UPDATE turns SET status = CASE status WHEN 'discarded' THEN status ELSE %s END, ext_key = %s, "
            "output_ids = %s, output_logprobs = %s, response = %s, finish_reason = %s, worker = %s, "
            "timings = %s, error = %s, weight_segments = %s WHERE id = %s",
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
        with self._transaction() as tx:
            for part in parts:
                # one conditional update: a turn whose final write came first is no longer running
                cur = tx.execute(
                    "UPDATE turns SET output_ids = substring(output_ids FROM 1 FOR %s) || %s, "
                    "output_logprobs = substring(output_logprobs FROM 1 FOR %s) || %s, "
                    "weight_segments = COALESCE(%s, weight_segments) "
                    "WHERE id = %s AND status = %s AND length(output_ids) >= %s",
                    (
                        4 * part.start,
                        array("I", part.ids).tobytes(),
                        8 * part.start,
                        array("d", part.logprobs).tobytes(),
                        _dump_segments(part.weight_segments),
                        part.turn_id,
                        TURN_RUNNING,
                        4 * part.start,
                    ),
                )
                written += cur.rowcount
        return written

    def schedule_recomputation(self, turn: TurnRecord, spans: list[tuple[int, int]]) -> None:
        self._rows(
            "INSERT INTO recomputations (turn_id, session_id, spans, scheduled_at, owner) "
            "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (turn_id) DO UPDATE SET spans = EXCLUDED.spans, "
            "scheduled_at = EXCLUDED.scheduled_at, owner = EXCLUDED.owner",
            (turn.id, turn.session_id, _dumps([list(s) for s in spans]), time.time(), self.owner),
        )

    def pending_recomputations(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """This store's own, and those of gone owners, which it claims (a live replica keeps its own)."""
        owners = self._rows("SELECT DISTINCT owner FROM recomputations WHERE owner <> %s", (self.owner,))
        for (owner,) in owners:
            with self._transaction() as tx:
                if _owner_gone(tx, owner):
                    tx.execute("UPDATE recomputations SET owner = %s WHERE owner = %s", (self.owner, owner))
        rows = self._rows(
            "SELECT turn_id, spans FROM recomputations WHERE owner = %s ORDER BY scheduled_at, turn_id",
            (self.owner,),
        )
        return [(int(r[0]), [(int(a), int(b)) for a, b in _loads(r[1])]) for r in rows]

    def end_recomputation(self, turn_id: int, event: EventRecord | None) -> None:
        with self._transaction() as tx:
            if event is not None:
                self._insert_event(tx, event)
            tx.execute("DELETE FROM recomputations WHERE turn_id = %s", (turn_id,))

    def get_turn(self, turn_id: int) -> TurnRecord | None:
        turn = self._read(turn_id)
        return self._latest(turn) if turn else None

    def get_turns(self, session_id: str) -> list[TurnRecord]:
        row = self._one("SELECT parent_session, fork_turn FROM sessions WHERE id = %s", (session_id,))
        shared = self._shared(str(row[0]), int(row[1])) if row is not None and row[0] is not None else []
        rows = self._rows(f"SELECT {_TURN_COLS} FROM turns WHERE session_id = %s ORDER BY idx", (session_id,))
        own = self._decode(rows, {t.id: t for t in shared})
        return shared + [self._latest(t) for t in own]

    def _latest(self, stored: TurnRecord) -> TurnRecord:
        return self._unwritten.get(stored.id, stored)

    def turn_counts(self, session_id: str | list[str] | None = None) -> dict[str, tuple[int, int]]:
        sql = "SELECT session_id, COUNT(*), COUNT(DISTINCT branch) FROM turns"
        ids = [session_id] if isinstance(session_id, str) else session_id
        if ids is None:
            rows = self._rows(f"{sql} GROUP BY session_id")
            forks = self._rows("SELECT id FROM sessions WHERE parent_session IS NOT NULL")
        else:
            rows = self._rows(f"{sql} WHERE session_id = ANY(%s) GROUP BY session_id", (ids,))
            forks = self._rows(
                "SELECT id FROM sessions WHERE parent_session IS NOT NULL AND id = ANY(%s)", (ids,)
            )
        counts = {str(sid): (int(turns), int(branches)) for sid, turns, branches in rows}
        for (sid,) in forks:  # a fork child counts the turns it shares
            turns_of = self.get_turns(sid)
            counts[sid] = (len(turns_of), len({t.branch for t in turns_of}))
        return counts

    def query_sessions(self, query: SessionQuery) -> tuple[list[SessionRecord], int]:
        where, args = ["NOT ephemeral"], list[Any]()
        if query.status is not None:
            where.append("status = %s")
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
                where.append(f"{column} {op} %s")
                args.append(bound)
        for key, text in query.metadata.items():
            where.append(f"{_META_TEXT} = %s")
            args += [key, key, key, key, text]
        clause = " AND ".join(where)
        total = self._one(f"SELECT COUNT(*) FROM sessions WHERE {clause}", args)
        order = "DESC" if query.newest_first else "ASC"
        if query.after is not None:
            op = "<" if query.newest_first else ">"
            clause += f' AND (created_at {op} %s OR (created_at = %s AND id COLLATE "C" {op} %s))'
            args += [query.after[0], query.after[0], query.after[1]]
        rows = self._rows(
            f"SELECT {_SESSION_COLS} FROM sessions WHERE {clause} "
            f'ORDER BY created_at {order}, id COLLATE "C" {order} LIMIT %s OFFSET %s',
            [*args, query.limit, query.offset],
        )
        return [_session(r) for r in rows], int(total[0]) if total else 0

    def find_turn_by_ext_keys(self, session_id: str, keys: list[str]) -> TurnRecord | None:
        if not keys:
            return None
        fork = self._fork_of(session_id)
        shared = sorted(fork.ids) if fork is not None else []
        rows = self._rows(
            "SELECT id, ext_key FROM turns WHERE (session_id = %s OR id = ANY(%s)) AND status = %s "
            "AND ext_key = ANY(%s)",
            (session_id, shared, TURN_COMPLETE, keys),
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
    def _insert_event(tx: _Tx, event: EventRecord) -> None:
        tx.execute(
            "INSERT INTO events (session_id, turn_id, ts, kind, data) VALUES (%s, %s, %s, %s, %s)",
            (event.session_id, event.turn_id, event.ts, event.kind, _dumps(event.data)),
        )
        tx.events.append(event)

    def get_events(self, session_id: str) -> list[EventRecord]:
        rows = self._rows(
            "SELECT session_id, turn_id, ts, kind, data FROM events WHERE session_id = %s ORDER BY id",
            (session_id,),
        )
        return [EventRecord(r[0], r[1], r[2], r[3], _loads(r[4])) for r in rows]

    def size_bytes(self) -> int:
        row = self._one(
            "SELECT SUM(pg_total_relation_size(c.oid)) FROM pg_class c "
            "WHERE c.relname = ANY(%s) AND c.relkind = 'r' AND pg_table_is_visible(c.oid)",
            (list(_TABLE_NAMES),),
        )
        return int(row[0]) if row and row[0] is not None else 0

    # --- discarding, deleting, pruning --------------------------------------------------------------

    def discard_turns_after(self, session_id: str, turn_index: int, reason: str) -> list[int]:
        where = "session_id = %s AND idx > %s AND status <> %s"
        return self._discard(session_id, where, (session_id, turn_index, TURN_DISCARDED), reason, turn_index)

    def discard_turns(self, session_id: str, turn_ids: list[int], reason: str) -> list[int]:
        if not turn_ids:
            return []
        where = "session_id = %s AND status <> %s AND id = ANY(%s)"
        return self._discard(session_id, where, (session_id, TURN_DISCARDED, turn_ids), reason, None)

    def _discard(
        self, session_id: str, where: str, args: tuple[Any, ...], reason: str, after: int | None
    ) -> list[int]:
        with self._transaction() as tx:
            rows = tx.execute(
                f"UPDATE turns SET status = %s WHERE {where} RETURNING idx", (TURN_DISCARDED, *args)
            ).fetchall()
            indices = sorted(int(r[0]) for r in rows)
            if indices:
                data = {"after_turn": after, "turn_indices": indices, "reason": reason}
                self._insert_event(tx, EventRecord(session_id, None, time.time(), "turns_discarded", data))
        return indices

    def delete_session(self, session_id: str) -> tuple[int, int] | None:
        with self._transaction() as tx:
            tx.execute("SELECT 1 FROM sessions WHERE id = %s FOR UPDATE", (session_id,))
            forks = [
                r[0]
                for r in tx.execute(
                    "SELECT id FROM sessions WHERE parent_session = %s ORDER BY id", (session_id,)
                ).fetchall()
            ]
            if forks:
                raise Conflict(
                    f"session '{session_id}' has fork children ({', '.join(forks)}) that share its turns; "
                    "delete them first",
                    "session_id",
                    "session_has_forks",
                )
            running = tx.execute(
                "SELECT id, owner FROM turns WHERE session_id = %s AND status = %s",
                (session_id, TURN_RUNNING),
            ).fetchall()
            # a running turn of a live gateway keeps the session; a dead gateway's does not
            gone = {o for o in {r[1] for r in running} if o != self.owner and _owner_gone(tx, o)}
            if any(r[0] not in self._unwritten and r[1] not in gone for r in running):
                return None
            counts = self._delete(tx, [session_id])
        self._forget_unwritten({session_id})
        if self.telemetry is not None:
            self.telemetry.publish("session_deleted", {"turns": counts[0], "events": counts[1]}, session_id)
        return counts

    def prune(self, closed_before: float, exported_only: bool = False) -> list[str]:
        where = (
            "status <> 'open' AND COALESCE(closed_at, created_at) < %s AND id NOT IN "
            "(SELECT session_id FROM turns WHERE status = 'running') AND id NOT IN "
            "(SELECT parent_session FROM sessions WHERE parent_session IS NOT NULL)"
        ) + (" AND id IN (SELECT session_id FROM exported)" if exported_only else "")
        self._recover()  # a dead gateway's running turns do not keep their sessions
        pruned: list[str] = []
        while True:  # in batches: the gateways writing to this store wait for one batch at most
            with self._transaction() as tx:
                rows = tx.execute(
                    f"SELECT id FROM sessions WHERE {where} ORDER BY created_at LIMIT 100 FOR UPDATE "
                    "SKIP LOCKED",
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

    def _delete(self, tx: _Tx, ids: list[str]) -> tuple[int, int]:
        turns = tx.execute("DELETE FROM turns WHERE session_id = ANY(%s)", (ids,)).rowcount
        events = tx.execute("DELETE FROM events WHERE session_id = ANY(%s)", (ids,)).rowcount
        tx.execute("DELETE FROM exported WHERE session_id = ANY(%s)", (ids,))
        tx.execute("DELETE FROM recomputations WHERE session_id = ANY(%s)", (ids,))
        tx.execute("DELETE FROM sessions WHERE id = ANY(%s)", (ids,))
        for sid in ids:
            self._forks.pop(sid, None)
        return turns, events

    def _forget_unwritten(self, session_ids: set[str]) -> None:
        for turn_id, turn in list(self._unwritten.items()):
            if turn.session_id in session_ids:
                self._unwritten.pop(turn_id, None)

    # --- forks, exports, the finished feed ----------------------------------------------------------

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
            "SELECT id FROM sessions WHERE parent_session = %s ORDER BY created_at, id", (session_id,)
        )
        return [str(r[0]) for r in rows]

    def mark_exported(self, session_ids: list[str]) -> None:
        now = time.time()
        with self._transaction() as tx:
            tx.execute(
                "INSERT INTO exported SELECT id, %s FROM sessions WHERE id = ANY(%s) AND status <> 'open' "
                "ON CONFLICT (session_id) DO UPDATE SET exported_at = EXCLUDED.exported_at",
                (now, session_ids),
            )

    def mark_closed(self, session: SessionRecord) -> bool:
        data = {"reward": session.reward, "closed_at": session.closed_at}
        with self._transaction() as tx:
            changed = tx.execute(
                "UPDATE sessions SET status = %s, closed_at = %s WHERE id = %s AND status = 'open'",
                (session.status, session.closed_at, session.id),
            ).rowcount
            if changed:
                # the feed lock, held to the commit: closes take their event ids in commit order
                tx.execute("SELECT pg_advisory_xact_lock(%s)", (_FEED_LOCK,))
                self._insert_event(tx, EventRecord(session.id, None, time.time(), "session_closed", data))
                # delivered at the commit, to every replica's feed listener (`_listen`)
                tx.execute("SELECT pg_notify(%s, %s)", (_FEED_CHANNEL, str(self.owner)))
        if changed:
            self._publish_session("session_updated", session)
        return bool(changed)

    def closed_after(self, after_id: int, limit: int) -> list[tuple[int, str]]:
        rows = self._rows(
            "SELECT id, session_id FROM events WHERE kind = 'session_closed' AND id > %s ORDER BY id LIMIT %s",
            (after_id, limit),
        )
        return [(int(r[0]), str(r[1])) for r in rows]

    def store_id(self) -> str:
        # made by the first caller (a concurrent one keeps the first), kept in `meta`: every replica on
        # this database gives the same id
        self._rows(
            "INSERT INTO meta (key, value) VALUES ('store_id', %s) ON CONFLICT (key) DO NOTHING",
            (uuid.uuid4().hex,),
        )
        row = self._one("SELECT value FROM meta WHERE key = 'store_id'")
        return str(row[0]) if row else ""

    def last_event_id(self) -> int:
        # the sequence's last value: ids of deleted (or rolled back) events are never given again
        row = self._one("SELECT last_value, is_called FROM events_id_seq")
        return int(row[0]) if row is not None and row[1] else 0

    # --- maintenance --------------------------------------------------------------------------------

    def vacuum(self) -> None:
        """A plain VACUUM (space reused, files shrink only at their end): VACUUM FULL would lock out
        every gateway on the database."""
        self._rows(f"VACUUM {', '.join(_TABLE_NAMES)}")

    def close(self) -> None:
        self._write_unwritten()
        if self._unwritten:
            log.error(
                "trajectory store %s closes with turns %s unwritten; they will read as interrupted",
                _redact(self.url),
                sorted(self._unwritten),
            )
        self._stopping.set()
        if self._listener is not None:
            self._listener.join(5)
        self._pool.close()
        self._owner_conn.close()  # releases the owner lock: this store's running turns are orphans


def _owner_gone(tx: _Tx, owner: int) -> bool:
    """Whether `owner`'s store is closed or its process dead: its lock can be taken (until the commit)."""
    row = tx.execute("SELECT pg_try_advisory_xact_lock(%s, %s)", (_OWNER_CLASS, owner)).fetchone()
    return bool(row and row[0])


def _redact(url: str) -> str:
    """The URL without its password (it goes into logs and errors)."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.Error:
        return "postgresql://…"
    info.pop("password", None)
    return psycopg.conninfo.make_conninfo("", **info)


def _encoded(enc: layout.Encoded) -> tuple[Any, ...]:
    """(prompt_base, prompt_ids, spans_base, prompt_gen_spans, request, request_delta) as stored."""
    cols = schema.encoded_columns(enc)
    return (*cols[:5], bool(cols[5]))
