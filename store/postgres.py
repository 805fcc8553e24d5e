"""PostgreSQL trajectory store: several gateways (replicas) share one database.

``belayer serve --store postgresql://user@host/db`` selects it; SQLite stays the embedded default. The
turns are laid out as in the SQLite store (`store.layout`: a turn stores what it adds to its
base; token ids as packed uint32 ``bytea``, logprobs as packed float64), fork children share their
parent's rows, and every method commits before it returns, so any replica reads what another wrote:
prefix reuse (`gateway.turns.sessions`) finds a session's turns in the store, whichever gateway served them.
The queries are those of the SQLite store (`store.sql`), spelled for PostgreSQL; this module
holds the connections and what only replicas need (row and advisory locks, owners); the tables are in
`store.postgres_schema`, the finished feed's lock and listener in `store.postgres_feed`.

**Driver.** psycopg 3 with a *synchronous* connection pool (``psycopg_pool.ConnectionPool``): the
store interface is synchronous and the gateway calls it from worker threads: its reads through
``Gateway.offload``, its writes through the store's `front` (`store.front`: ``lanes`` threads, a
session's writes in order on one of them), so each call takes a pooled connection on its own thread and
the event loop never waits on the database for a write (``off_loop_only`` makes a write on the loop's
thread fail, for tests). An async driver would need every caller to become a coroutine, or a
private event loop per call, for no gain. Connections are in autocommit mode; multi-statement writes
run in explicit transactions.

**Schema.** Created or brought up to date when a store opens, under an advisory lock, so two gateways
starting at once do not race (`store.postgres_schema`).

**Concurrency between replicas.** A turn's index and branch are chosen under the session's row lock
(``SELECT … FOR UPDATE``), so two replicas starting turns in one session at once get consecutive
indices; deleting a session takes the same lock. ``append_outputs`` is one conditional ``UPDATE`` per
part (``status = 'running'``), so a streamed batch that loses the race with the turn's final write is
skipped, never written over it.

**The finished feed.** `mark_closed` takes the feed lock to its commit, so closes take their event ids
in commit order and a cursor never skips one, and sends a ``NOTIFY`` that every other replica's
`FeedListener` turns into ``feed_advanced`` (`store.postgres_feed`).

**Running turns of a dead gateway.** Each store instance is an *owner*: it holds a session-level
advisory lock on its owner number, on a connection of its own, for as long as it is open, and marks
the turns it starts with that number. PostgreSQL drops the lock when the owner's connection dies (its
process crashed or was killed). Opening a store, starting a turn in a session (the retry that
lands on another replica), ``prune``, and every live replica's periodic sweep (`sweep_orphans`, run by
`gateway.turns.orphan_sweep`) mark as ``interrupted`` the running turns whose owner's lock can be taken, with
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

import asyncio
import contextlib
import secrets
import time
import uuid
from array import array
from collections.abc import Iterator
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool

from core.errors import StoreError
from core.telemetry import Telemetry
from store import schema
from store.base import TURN_RUNNING, EventRecord, OutputPart, TurnRecord
from store.postgres_feed import FEED_CHANNEL, FEED_LOCK, FeedListener
from store.postgres_schema import TABLE_NAMES, prepare
from store.sql import Connection, Cursor, Dialect, SqlStore, Tx, dump_segments

_OWNER_CLASS = 0x626C  # advisory locks (class, owner): an owner is alive while it holds its lock

# The metadata filter reads a top-level value as SQLite's json_extract gives it, as text: a string
# without its quotes, true/false as 1/0, a number as written, an object or array as its JSON.
_META_TEXT = (
    "(CASE json_typeof(metadata::json -> ?) WHEN 'string' THEN metadata::json ->> ? "
    "WHEN 'boolean' THEN CASE WHEN (metadata::json ->> ?)::boolean THEN '1' ELSE '0' END "
    "WHEN 'null' THEN NULL ELSE metadata::jsonb ->> ? END)"
)


class PostgresStore(SqlStore):
    """The store of replicated gateways. Safe to share between threads (a connection pool)."""

    remote = True

    dialect = Dialect(
        marker="%s",
        arrays=True,
        booleans=True,
        row_lock=" FOR UPDATE",
        skip_locked=" FOR UPDATE SKIP LOCKED",
        text_id='id COLLATE "C"',
        sessions_order="created_at, id",
        forks_order=" ORDER BY id",
        id_param="?::bigint",
    )

    def __init__(
        self,
        url: str,
        telemetry: Telemetry | None = None,
        recover: bool = True,
        pool_size: int = 16,
        connect_timeout: float = 10.0,
        lanes: int = 8,
    ) -> None:
        """``recover=False`` leaves other gateways' running turns as they are (a maintenance tool);
        `lanes`: the threads of the `front` (each runs its sessions' writes in order)."""
        super().__init__(telemetry, lanes)
        self.url = url
        self.off_loop_only = False
        """Refuse (`AssertionError`) a write made on a thread that runs an event loop: tests set it."""
        try:
            self._owner_conn = psycopg.connect(url, autocommit=True, connect_timeout=int(connect_timeout))
        except psycopg.Error as e:
            raise StoreError(f"cannot open trajectory store {_redact(url)}: {e}") from e
        try:
            prepare(self._owner_conn, _redact(url))
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
        self._feed: FeedListener | None = None
        if telemetry is not None:
            self._feed = FeedListener(url, self.owner, telemetry, _redact(url))
            self._feed.start(connect_timeout)  # from now on, no other replica's close goes unheard

    # --- connections, transactions, errors ----------------------------------------------------------

    def _take_owner(self) -> int:
        """A free owner number, its lock held by this store's own connection until `close`."""
        while True:
            owner = secrets.randbelow(2**31 - 2) + 1
            row = self._owner_conn.execute(
                "SELECT pg_try_advisory_lock(%s, %s)", (_OWNER_CLASS, owner)
            ).fetchone()
            if row is not None and row[0]:
                return owner

    def _location(self) -> str:
        return _redact(self.url)

    @contextlib.contextmanager
    def _statement(self) -> Iterator[Tx]:
        try:
            with self._pool.connection() as conn:
                yield Tx(self._guarded(conn), self.dialect)
        except psycopg.Error as e:
            raise self._failed(e) from e

    @contextlib.contextmanager
    def _begin(self) -> Iterator[Tx]:
        try:
            with self._pool.connection() as conn, conn.transaction():
                yield Tx(self._guarded(conn), self.dialect)
        except psycopg.Error as e:
            raise self._failed(e) from e

    def _guarded(self, conn: psycopg.Connection[Any]) -> Connection:
        return _OffLoop(conn, self._location()) if self.off_loop_only else conn

    def _disconnect(self) -> None:
        if self._feed is not None:
            self._feed.stop()
        self._pool.close()
        self._owner_conn.close()  # releases the owner lock: this store's running turns are orphans

    # --- dead gateways' running turns ---------------------------------------------------------------

    def _recover(self) -> int:
        """Mark interrupted the running turns of every owner that is gone; how many."""
        rows = self._reads.rows(
            "SELECT DISTINCT owner FROM turns WHERE status = %s AND owner <> %s", (TURN_RUNNING, self.owner)
        )
        marked = 0
        for (owner,) in rows:
            with self._writes.transaction() as tx:
                if _owner_gone(tx, owner):
                    marked += self._interrupt(tx, "owner = ?", (owner,))
        return marked

    def sweep_orphans(self) -> int:
        return self._recover()

    def _sweep_session(self, tx: Tx, session_id: str, owners: list[int]) -> None:
        """In a transaction: the running turns of this session whose owner is gone become interrupted."""
        gone = [o for o in owners if _owner_gone(tx, o)]
        if gone:
            self._interrupt(tx, "session_id = ? AND owner = ANY(?)", (session_id, gone))

    # --- the hooks of the shared queries ------------------------------------------------------------

    def _insert_id(self, tx: Tx, sql: str, args: tuple[Any, ...]) -> int:
        row = tx.execute(f"{sql} RETURNING id", args).fetchone()
        assert row is not None
        return int(row[0])

    def _turn_extras(self) -> tuple[tuple[str, Any], ...]:
        return (("owner", self.owner),)

    def _next_numbers(self, tx: Tx, session_id: str) -> tuple[int, int]:
        """Under the session's row lock. Also interrupts the session's running turns of dead owners."""
        row = tx.execute(
            "SELECT COALESCE(MAX(idx) + 1, 0), COALESCE(MAX(branch) + 1, 0), "
            "array_agg(DISTINCT owner) FILTER (WHERE status = %s AND owner <> %s) "
            "FROM turns WHERE session_id = %s",
            (TURN_RUNNING, self.owner, session_id),
        ).fetchone()
        assert row is not None
        if row[2]:
            self._sweep_session(tx, session_id, list(row[2]))
        return int(row[0]), int(row[1])

    def _append_part(self, tx: Tx, part: OutputPart) -> int:
        # one conditional update: a turn whose final write came first is no longer running
        return tx.execute(
            "UPDATE turns SET output_ids = substring(output_ids FROM 1 FOR %s) || %s, "
            "output_logprobs = substring(output_logprobs FROM 1 FOR %s) || %s, "
            "weight_segments = COALESCE(%s, weight_segments) "
            "WHERE id = %s AND status = %s AND length(output_ids) >= %s",
            (
                4 * part.start,
                array("I", part.ids).tobytes(),
                8 * part.start,
                array("d", part.logprobs).tobytes(),
                dump_segments(part.weight_segments),
                part.turn_id,
                TURN_RUNNING,
                4 * part.start,
            ),
        ).rowcount

    def _running_keeps(self, tx: Tx, session_id: str) -> bool:
        running = tx.execute(
            "SELECT id, owner FROM turns WHERE session_id = %s AND status = %s", (session_id, TURN_RUNNING)
        ).fetchall()
        # a running turn of a live gateway keeps the session; a dead gateway's does not
        gone = {o for o in {r[1] for r in running} if o != self.owner and _owner_gone(tx, o)}
        return any(r[0] not in self._unwritten and r[1] not in gone for r in running)

    def _metadata_text(self, key: str) -> tuple[str, list[Any]]:
        return _META_TEXT, [key, key, key, key]

    def _record_close(self, tx: Tx, event: EventRecord) -> None:
        # the feed lock, held to the commit: closes take their event ids in commit order
        tx.execute("SELECT pg_advisory_xact_lock(%s)", (FEED_LOCK,))
        self._insert_event(tx, event)
        # delivered at the commit, to every replica's feed listener (`FeedListener`)
        tx.execute("SELECT pg_notify(%s, %s)", (FEED_CHANNEL, str(self.owner)))

    def prune(self, closed_before: float, exported_only: bool = False) -> list[str]:
        self._recover()  # a dead gateway's running turns do not keep their sessions
        return super().prune(closed_before, exported_only)

    # --- what PostgreSQL spells its own way ---------------------------------------------------------

    def schedule_recomputation(self, turn: TurnRecord, spans: list[tuple[int, int]]) -> None:
        self._reads.rows(
            "INSERT INTO recomputations (turn_id, session_id, spans, scheduled_at, owner) "
            "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (turn_id) DO UPDATE SET spans = EXCLUDED.spans, "
            "scheduled_at = EXCLUDED.scheduled_at, owner = EXCLUDED.owner",
            (turn.id, turn.session_id, schema.dump_json([list(s) for s in spans]), time.time(), self.owner),
        )

    def pending_recomputations(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """This store's own, and those of gone owners, which it claims (a live replica keeps its own)."""
        owners = self._reads.rows(
            "SELECT DISTINCT owner FROM recomputations WHERE owner <> %s", (self.owner,)
        )
        for (owner,) in owners:
            with self._writes.transaction() as tx:
                if _owner_gone(tx, owner):
                    tx.execute("UPDATE recomputations SET owner = %s WHERE owner = %s", (self.owner, owner))
        rows = self._reads.rows(
            "SELECT turn_id, spans FROM recomputations WHERE owner = %s ORDER BY scheduled_at, turn_id",
            (self.owner,),
        )
        return [(int(r[0]), [(int(a), int(b)) for a, b in schema.load_json(r[1])]) for r in rows]

    def mark_exported(self, session_ids: list[str]) -> None:
        now = time.time()
        with self._writes.transaction() as tx:
            tx.execute(
                "INSERT INTO exported SELECT id, %s FROM sessions WHERE id = ANY(%s) AND status <> 'open' "
                "ON CONFLICT (session_id) DO UPDATE SET exported_at = EXCLUDED.exported_at",
                (now, session_ids),
            )

    def store_id(self) -> str:
        # made by the first caller (a concurrent one keeps the first), kept in `meta`: every replica on
        # this database gives the same id
        self._reads.rows(
            "INSERT INTO meta (key, value) VALUES ('store_id', %s) ON CONFLICT (key) DO NOTHING",
            (uuid.uuid4().hex,),
        )
        row = self._reads.one("SELECT value FROM meta WHERE key = 'store_id'")
        return str(row[0]) if row else ""

    def last_event_id(self) -> int:
        # the sequence's last value: ids of deleted (or rolled back) events are never given again
        row = self._reads.one("SELECT last_value, is_called FROM events_id_seq")
        return int(row[0]) if row is not None and row[1] else 0

    def size_bytes(self) -> int:
        row = self._reads.one(
            "SELECT SUM(pg_total_relation_size(c.oid)) FROM pg_class c "
            "WHERE c.relname = ANY(%s) AND c.relkind = 'r' AND pg_table_is_visible(c.oid)",
            (list(TABLE_NAMES),),
        )
        return int(row[0]) if row and row[0] is not None else 0

    def vacuum(self) -> None:
        """A plain VACUUM (space reused, files shrink only at their end): VACUUM FULL would lock out
        every gateway on the database."""
        self._reads.rows(f"VACUUM {', '.join(TABLE_NAMES)}")


class _OffLoop:
    """A connection that refuses a write made on a thread that runs an event loop (`off_loop_only`)."""

    WRITES = frozenset({"INSERT", "UPDATE", "DELETE", "VACUUM"})

    def __init__(self, conn: psycopg.Connection[Any], location: str) -> None:
        self.conn, self.location = conn, location

    def execute(self, sql: str, args: Any, /) -> Cursor:
        if sql.lstrip().split(None, 1)[0].upper() in self.WRITES and _on_loop():
            raise AssertionError(f"a write to trajectory store {self.location} on the event loop: {sql[:60]}")
        return self.conn.execute(sql, args)


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop runs on this thread: a worker's
        return False
    return True


def _owner_gone(tx: Tx, owner: int) -> bool:
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
