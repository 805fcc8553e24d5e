"""The SQLite store's tables, their version, and the migration of older stores.

Versions (the ``meta`` table's ``schema_version``; a store without ``meta`` is version 1):

1. every turn stores its whole prompt ids and its whole request (an episode costs O(turns²));
2. a turn stores what it adds to a base turn (`store.layout`): four columns more in ``turns``
   (``base_id``, ``prompt_base``, ``spans_base``, ``request_delta``); ``meta``; ``exported`` (which
   sessions an export has written, for ``belayer store prune --exported-only``);
3. tree rollouts: ``sessions`` gains ``parent_session`` and ``fork_turn`` (a fork child reads its
   parent's turns through ``fork_turn`` as its own first turns, shared, not copied;
   `store.sqlite`), and an index on ``parent_session``;
4. weight versions: ``turns`` gains ``weight_segments`` (JSON ``[[start, end, version], ...]``: which
   weight version generated each run of the turn's output, `TurnRecord.weight_segments`; NULL in turns
   stored before).

Any version-3 store gains the ``recomputations`` table when it is opened (the logprob recomputations
scheduled and not yet done, redone at start-up); it is not a new version, since code that does not
know the table reads the store as before.

Opening a version 1 store migrates it in place, in one transaction (all or nothing), then compacts the
file; a version 2 store gains the version 3 columns, and a version 3 store the version 4 column, in
one transaction each; a store newer than this code, or one that is not a Belayer store, is refused with a `StoreError`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Iterable, Iterator
from typing import Any

from core import events as ev
from core.errors import StoreError
from store import layout
from store.base import EventRecord

log = logging.getLogger("belayer.store")

SCHEMA_VERSION = 4

_TABLES = (
    """CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY, created_at REAL NOT NULL, metadata TEXT NOT NULL, status TEXT NOT NULL,
    reward REAL, reward_info TEXT, closed_at REAL, ephemeral INTEGER NOT NULL DEFAULT 0,
    parent_session TEXT, fork_turn INTEGER
)""",
    """CREATE TABLE IF NOT EXISTS turns (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL REFERENCES sessions(id),
    idx INTEGER NOT NULL, branch INTEGER NOT NULL, parent_id INTEGER, ext_key TEXT,
    status TEXT NOT NULL, prompt_ids BLOB NOT NULL, prompt_gen_spans TEXT NOT NULL,
    output_ids BLOB NOT NULL, output_logprobs BLOB NOT NULL, request TEXT NOT NULL, response TEXT,
    finish_reason TEXT, worker TEXT, timings TEXT NOT NULL, error TEXT, received_at REAL NOT NULL,
    base_id INTEGER, prompt_base INTEGER NOT NULL DEFAULT 0, spans_base INTEGER NOT NULL DEFAULT 0,
    request_delta INTEGER NOT NULL DEFAULT 0, weight_segments TEXT,
    UNIQUE (session_id, idx)
)""",
    "CREATE INDEX IF NOT EXISTS turns_ext ON turns (session_id, ext_key)",
    """CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, session_id TEXT NOT NULL, turn_id INTEGER, ts REAL NOT NULL,
    kind TEXT NOT NULL, data TEXT NOT NULL
)""",
    "CREATE INDEX IF NOT EXISTS events_session ON events (session_id)",
    "CREATE INDEX IF NOT EXISTS sessions_created ON sessions (created_at)",
)
_V2_TABLES = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS exported (session_id TEXT PRIMARY KEY, exported_at REAL NOT NULL)",
)
_RECOMPUTATIONS = """CREATE TABLE IF NOT EXISTS recomputations (
    turn_id INTEGER PRIMARY KEY, session_id TEXT NOT NULL, spans TEXT NOT NULL, scheduled_at REAL NOT NULL
)"""
_V3_SESSION_COLUMNS = ("parent_session TEXT", "fork_turn INTEGER")
_V4_TURN_COLUMN = "weight_segments TEXT"
_V3_INDEX = "CREATE INDEX IF NOT EXISTS sessions_parent ON sessions (parent_session)"
_V2_TURN_COLUMNS = (
    "base_id INTEGER",
    "prompt_base INTEGER NOT NULL DEFAULT 0",
    "spans_base INTEGER NOT NULL DEFAULT 0",
    "request_delta INTEGER NOT NULL DEFAULT 0",
)
_V1_TURN_COLUMNS = {
    "id", "session_id", "idx", "branch", "parent_id", "ext_key", "status", "prompt_ids", "prompt_gen_spans",
    "output_ids", "output_logprobs", "request", "response", "finish_reason", "worker", "timings", "error",
    "received_at",
}  # fmt: skip


def prepare(db: sqlite3.Connection, path: str) -> None:
    """Create the tables of a new store, migrate an older one, or refuse one this code cannot read."""
    tables = _tables(db)
    if "meta" in tables:
        _check_version(db, path)
        if not {"sessions", "turns", "events", "meta", "exported"} <= tables:
            _create(db)
        for to in sorted(_COLUMN_MIGRATIONS):
            if version(db) < to:
                migrate_columns(db, path, to)
        db.execute(_RECOMPUTATIONS)  # not a new version: code that does not know it ignores it
    elif "turns" not in tables:
        db.execute("PRAGMA auto_vacuum = INCREMENTAL")  # in WAL mode, takes with a VACUUM (of nothing)
        db.execute("VACUUM")
        _create(db)
    else:
        migrate(db, path)


def version(db: sqlite3.Connection) -> int:
    """The store's schema version (1: written before versions were recorded)."""
    if "meta" not in _tables(db):
        return 1
    row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return int(row[0]) if row else 1


def _tables(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


@contextlib.contextmanager
def _immediate(db: sqlite3.Connection) -> Iterator[None]:
    """One ``BEGIN IMMEDIATE`` transaction: committed, or rolled back on any error (SQLite may have
    rolled it back already, as a full disk does)."""
    db.execute("BEGIN IMMEDIATE")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _create(db: sqlite3.Connection) -> None:
    with _immediate(db):
        for sql in (*_TABLES, *_V2_TABLES, _V3_INDEX, _RECOMPUTATIONS):
            db.execute(sql)
        db.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))


def _check_version(db: sqlite3.Connection, path: str) -> None:
    found = version(db)
    if found > SCHEMA_VERSION:
        raise StoreError(
            f"trajectory store {path} has schema version {found}, newer than this Belayer reads "
            f"({SCHEMA_VERSION}); open it with the Belayer version that wrote it, or give a new --store"
        )


def migrate(db: sqlite3.Connection, path: str) -> None:
    """Version 1 -> 2, in place: add the columns and tables, and store each turn as what it adds to
    its base. One transaction: a failure leaves the store as it was, and says so."""
    t0, before = time.monotonic(), _file_bytes(db)
    try:
        with _immediate(db):
            migrated_meanwhile = "meta" in _tables(db)  # by another process, while this one waited
            if not migrated_meanwhile:
                _check_v1(db, path)
                for column in _V2_TURN_COLUMNS:
                    db.execute(f"ALTER TABLE turns ADD COLUMN {column}")
                for sql in (*_TABLES, *_V2_TABLES, _RECOMPUTATIONS):  # and any index an older version lacked
                    db.execute(sql)
                sessions, turns, compacted = _compact(db)
                _add_v3(db)
                _add_v4(db)
                db.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),))
    except (sqlite3.Error, ValueError) as e:  # ValueError: a row that does not parse
        raise StoreError(
            f"cannot migrate trajectory store {path} from schema version 1 to {SCHEMA_VERSION}: {e}; the "
            "store is unchanged (it needs write access and free space about its size)"
        ) from e
    if migrated_meanwhile:
        _check_version(db, path)
        return
    shrunk = vacuum(db)
    log.info(
        "trajectory store %s migrated from schema version 1 to %d: %d sessions, %d turns (%d stored as "
        "segments of an earlier turn), %d -> %d bytes%s, in %.2f s",
        path, SCHEMA_VERSION, sessions, turns, compacted, before, _file_bytes(db),
        "" if shrunk else " (not compacted: VACUUM failed)", time.monotonic() - t0,
    )  # fmt: skip


def _add_v3(db: sqlite3.Connection) -> None:
    """In a transaction: the version 3 session columns (when missing) and index."""
    columns = {r[1] for r in db.execute("PRAGMA table_info(sessions)")}
    for column in _V3_SESSION_COLUMNS:
        if column.split()[0] not in columns:
            db.execute(f"ALTER TABLE sessions ADD COLUMN {column}")
    db.execute(_V3_INDEX)


def _add_v4(db: sqlite3.Connection) -> None:
    """In a transaction: the version 4 turn column (when missing)."""
    columns = {r[1] for r in db.execute("PRAGMA table_info(turns)")}
    if _V4_TURN_COLUMN.split()[0] not in columns:
        db.execute(f"ALTER TABLE turns ADD COLUMN {_V4_TURN_COLUMN}")


_COLUMN_MIGRATIONS = {3: _add_v3, 4: _add_v4}
"""Each version that only adds columns (and indices): what brings a store at the version before to it."""


def migrate_columns(db: sqlite3.Connection, path: str, to: int) -> None:
    """Version ``to - 1`` -> ``to``, in place and in one transaction (`_COLUMN_MIGRATIONS`): 3 adds the
    fork columns of ``sessions``, 4 the ``weight_segments`` column of ``turns``."""
    try:
        with _immediate(db):
            if version(db) < to:  # else another process migrated it while this one waited
                _COLUMN_MIGRATIONS[to](db)
                db.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (str(to),))
    except sqlite3.Error as e:
        raise StoreError(
            f"cannot migrate trajectory store {path} from schema version {to - 1} to {to}: {e}; the "
            "store is unchanged (it needs write access)"
        ) from e
    log.info("trajectory store %s migrated from schema version %d to %d", path, to - 1, to)


def _check_v1(db: sqlite3.Connection, path: str) -> None:
    columns = {r[1] for r in db.execute("PRAGMA table_info(turns)")}
    missing = _V1_TURN_COLUMNS - columns
    if missing:
        raise StoreError(
            f"{path} is not a Belayer trajectory store this version can read: its turns table lacks "
            f"{', '.join(sorted(missing))}; give a new --store"
        )


def _compact(db: sqlite3.Connection) -> tuple[int, int, int]:
    """Rewrite every session's turns as segments; (sessions, turns, turns rewritten)."""
    sessions = [r[0] for r in db.execute("SELECT DISTINCT session_id FROM turns").fetchall()]
    turns = compacted = 0
    for sid in sessions:
        rows = db.execute(
            "SELECT id, parent_id, prompt_ids, output_ids, prompt_gen_spans, request FROM turns "
            "WHERE session_id = ? ORDER BY idx",
            (sid,),
        ).fetchall()
        known: dict[int, layout.Turn] = {}
        previous: int | None = None
        for turn_id, parent_id, prompt, output, spans, request in rows:
            turn = layout.Turn(
                layout.unpack_ids(prompt), layout.unpack_ids(output), load_spans(spans), load_json(request)
            )
            base_id = parent_id if parent_id in known else previous
            enc = layout.encode(turn, known[base_id] if base_id is not None else None)
            if enc.has_base:
                db.execute(
                    "UPDATE turns SET base_id = ?, prompt_base = ?, prompt_ids = ?, spans_base = ?, "
                    "prompt_gen_spans = ?, request = ?, request_delta = ? WHERE id = ?",
                    (base_id, *encoded_columns(enc), turn_id),
                )
                compacted += 1
            known[turn_id], previous = turn, turn_id
            turns += 1
    return len(sessions), turns, compacted


def encoded_columns(enc: layout.Encoded) -> tuple[Any, ...]:
    """(prompt_base, prompt_ids, spans_base, prompt_gen_spans, request, request_delta) as stored."""
    return (
        enc.prompt_base,
        layout.pack_ids(enc.prompt_tail),
        enc.spans_base,
        dump_json(enc.spans_tail),
        dump_json(enc.request),
        int(enc.request_delta),
    )


def load_json(text: str) -> Any:
    """JSON as stored; a non-finite number that an older version wrote (``NaN``, ``Infinity``) reads
    as null, so that one poisoned value cannot make every later read fail."""
    return json.loads(text, parse_constant=lambda _name: None)


def dump_json(value: object) -> str:
    """JSON that any reader can parse back: a non-finite number is an error here, never stored."""
    return json.dumps(value, allow_nan=False)


def interrupted_events(rows: Iterable[tuple[Any, ...]]) -> list[EventRecord]:
    """One ``turns_interrupted`` event per session, from the ``(session id, turn index, output tokens)``
    of the running turns a gateway that is gone left, just marked interrupted."""
    by_session: dict[str, list[tuple[int, int]]] = {}
    for sid, idx, kept in rows:
        by_session.setdefault(str(sid), []).append((int(idx), int(kept)))
    events = []
    for sid, turns in by_session.items():
        turns.sort()
        interrupted = ev.TurnsInterrupted([i for i, _ in turns], [k for _, k in turns], "gateway_gone")
        events.append(EventRecord.of(sid, None, interrupted))
    return events


def load_spans(text: str) -> list[layout.Span]:
    """Generated spans; one written before turn ids were kept has -1 for its turn."""
    return [(s[0], s[1], s[2] if len(s) > 2 else -1) for s in load_json(text)]


def vacuum(db: sqlite3.Connection) -> bool:
    """Give free pages back to the file system; False if it failed. A store in incremental mode (new
    and migrated ones) only moves pages into the holes (short locks: a gateway may be writing); an
    older one is rebuilt by a VACUUM, which also turns incremental mode on."""
    try:
        if db.execute("PRAGMA auto_vacuum").fetchone()[0] == 2:
            db.execute("PRAGMA incremental_vacuum").fetchall()
        else:
            db.execute("PRAGMA auto_vacuum = INCREMENTAL")
            db.execute("VACUUM")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    except sqlite3.Error as e:
        log.warning("trajectory store: VACUUM failed (%s); free pages stay in the file for reuse", e)
        return False
    return True


def _file_bytes(db: sqlite3.Connection) -> int:
    pages = db.execute("PRAGMA page_count").fetchone()[0]
    size: int = db.execute("PRAGMA page_size").fetchone()[0]
    return int(pages) * size
