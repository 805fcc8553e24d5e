"""SQLite (WAL) trajectory store: one file, durable across process crashes.

Token ids are stored as packed uint32 arrays and logprobs as packed float64 arrays, so a 64k-token
prompt costs 256 KiB and a logprob round-trips bit for bit. A turn stores only what it adds to an
earlier turn (`store.layout`), so an episode costs O(tokens), not O(turns²); the tables, their
version and the migration of older stores are in `store.schema`, and the queries, shared with
the PostgreSQL store, in `store.sql`.

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
import sqlite3
import threading
import time
import uuid
from array import array
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from core.errors import StoreError
from core.telemetry import Telemetry
from store import schema
from store.base import TURN_RUNNING, OutputPart, TurnRecord
from store.sql import Dialect, SqlStore, Tx, dump_segments


class SqliteStore(SqlStore):
    """The default store. Safe to share between threads; writes are serialised by a lock."""

    dialect = Dialect(marker="?", arrays=False, booleans=False)

    def __init__(
        self,
        path: str | Path,
        synchronous: str = "NORMAL",
        telemetry: Telemetry | None = None,
        recover: bool = True,
    ) -> None:
        """``recover=False`` leaves running turns as they are: for a tool that opens the store of a
        gateway that may be running (``belayer store prune``); the gateway passes True."""
        super().__init__(telemetry)
        self.path = str(path)
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
        if recover:
            self._mark_interrupted()

    def _mark_interrupted(self) -> None:
        """Turns left running by a crashed gateway keep their prompt, and the output written while
        they streamed (`append_outputs`), and are marked interrupted, with a ``turns_interrupted``
        event per session (as the PostgreSQL store does for a gone replica's)."""
        with self._writes.transaction() as tx:
            self._interrupt(tx)

    # --- the one connection, under the lock ---------------------------------------------------------

    def _location(self) -> str:
        return self.path

    @contextlib.contextmanager
    def _statement(self) -> Iterator[Tx]:
        try:
            with self._lock:
                yield Tx(self._db, self.dialect)
        except sqlite3.Error as e:
            raise self._failed(e) from e

    @contextlib.contextmanager
    def _begin(self) -> Iterator[Tx]:
        """Under the store's lock. SQLite may have rolled back already (a full disk does): then there
        is nothing to roll back, and the error that ended the transaction is the one reported."""
        try:
            with self._lock:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    yield Tx(self._db, self.dialect)
                    self._db.execute("COMMIT")
                except BaseException:
                    if self._db.in_transaction:
                        with contextlib.suppress(sqlite3.Error):
                            self._db.execute("ROLLBACK")
                    raise
        except sqlite3.Error as e:
            raise self._failed(e) from e

    def _disconnect(self) -> None:
        with self._lock:
            self._db.close()

    # --- the hooks of the shared queries ------------------------------------------------------------

    def _insert_id(self, tx: Tx, sql: str, args: tuple[Any, ...]) -> int:
        cur = tx.execute(sql, args)
        assert isinstance(cur, sqlite3.Cursor)
        return int(cur.lastrowid or 0)

    def _next_numbers(self, tx: Tx, session_id: str) -> tuple[int, int]:
        row = tx.execute(
            "SELECT COALESCE(MAX(idx) + 1, 0), COALESCE(MAX(branch) + 1, 0) FROM turns WHERE session_id = ?",
            (session_id,),
        ).fetchone()
        return int(row[0]), int(row[1])

    def _append_part(self, tx: Tx, part: OutputPart) -> int:
        row = tx.execute(
            "SELECT output_ids, output_logprobs FROM turns WHERE id = ? AND status = ?",
            (part.turn_id, TURN_RUNNING),
        ).fetchone()
        if row is None or len(row[0]) < 4 * part.start:
            return 0
        ids = row[0][: 4 * part.start] + array("I", part.ids).tobytes()
        lps = row[1][: 8 * part.start] + array("d", part.logprobs).tobytes()
        tx.execute(
            "UPDATE turns SET output_ids = ?, output_logprobs = ? WHERE id = ?", (ids, lps, part.turn_id)
        )
        if part.weight_segments is not None:
            tx.execute(
                "UPDATE turns SET weight_segments = ? WHERE id = ?",
                (dump_segments(part.weight_segments), part.turn_id),
            )
        return 1

    def _running_keeps(self, tx: Tx, session_id: str) -> bool:
        running = tx.execute(
            "SELECT id FROM turns WHERE session_id = ? AND status = ?", (session_id, TURN_RUNNING)
        ).fetchall()
        return any(r[0] not in self._unwritten for r in running)

    def _metadata_text(self, key: str) -> tuple[str, list[Any]]:
        return "CAST(json_extract(metadata, ?) AS TEXT)", ['$."' + key.replace('"', '""') + '"']

    # --- what SQLite spells its own way -------------------------------------------------------------

    def schedule_recomputation(self, turn: TurnRecord, spans: list[tuple[int, int]]) -> None:
        self._reads.rows(
            "INSERT OR REPLACE INTO recomputations (turn_id, session_id, spans, scheduled_at) VALUES (?, ?, ?, ?)",
            (turn.id, turn.session_id, schema.dump_json([list(s) for s in spans]), time.time()),
        )

    def pending_recomputations(self) -> list[tuple[int, list[tuple[int, int]]]]:
        rows = self._reads.rows("SELECT turn_id, spans FROM recomputations ORDER BY scheduled_at, turn_id")
        return [(int(r[0]), [(int(a), int(b)) for a, b in schema.load_json(r[1])]) for r in rows]

    def mark_exported(self, session_ids: list[str]) -> None:
        now = time.time()
        with self._writes.transaction():
            self._db.executemany(
                "INSERT OR REPLACE INTO exported SELECT id, ? FROM sessions WHERE id = ? AND status != 'open'",
                [(now, sid) for sid in session_ids],
            )

    def store_id(self) -> str:
        # made by the first caller (INSERT OR IGNORE: a concurrent one keeps the first), kept in `meta`
        self._reads.rows(
            "INSERT OR IGNORE INTO meta (key, value) VALUES ('store_id', ?)", (uuid.uuid4().hex,)
        )
        row = self._reads.one("SELECT value FROM meta WHERE key = 'store_id'")
        return str(row[0]) if row else ""

    def last_event_id(self) -> int:
        # AUTOINCREMENT's counter: ids of deleted events are never given again, so this never shrinks
        row = self._reads.one("SELECT seq FROM sqlite_sequence WHERE name = 'events'")
        return int(row[0]) if row else 0

    def size_bytes(self) -> int:
        if self.path == ":memory:":
            return 0
        return sum(
            Path(self.path + suffix).stat().st_size
            for suffix in ("", "-wal")
            if Path(self.path + suffix).exists()
        )

    def vacuum(self) -> None:
        with self._lock:
            if not schema.vacuum(self._db):
                raise StoreError(f"trajectory store {self.path}: VACUUM failed (see the log)")
