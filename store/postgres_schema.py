"""The PostgreSQL store's tables (`store.postgres`), and their creation when a store opens.

Created or brought up to date in one transaction under a transaction-level advisory lock, so two
gateways starting at once do not race: the second waits, then finds the tables there. A column a later
version adds is an ``ADD COLUMN IF NOT EXISTS`` in that same transaction (`COLUMNS`);
``meta.schema_version`` refuses a database newer than this code.
"""

from __future__ import annotations

from typing import Any

import psycopg

from core.errors import StoreError

SCHEMA_VERSION = 1
SCHEMA_LOCK = 0x62656C61796572  # "belayer": the advisory lock key of schema creation

TABLES = (
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
COLUMNS: tuple[tuple[str, str], ...] = ()
"""(table, column definition) that a later version added: ``ADD COLUMN IF NOT EXISTS`` at every open."""

TABLE_NAMES = ("sessions", "turns", "events", "exported", "recomputations", "meta")


def prepare(conn: psycopg.Connection[Any], location: str) -> None:
    """Create or bring up to date the tables, under the schema lock (two gateways may start at once)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
        for sql in TABLES:
            conn.execute(sql)
        for table, column in COLUMNS:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column}")
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        found = int(row[0]) if row else 0
        if found > SCHEMA_VERSION:
            raise StoreError(
                f"trajectory store {location} has schema version {found}, newer than this "
                f"Belayer reads ({SCHEMA_VERSION}); use the Belayer version that wrote it"
            )
        conn.execute(
            "INSERT INTO meta VALUES ('schema_version', %s) ON CONFLICT (key) DO UPDATE "
            "SET value = EXCLUDED.value",
            (str(SCHEMA_VERSION),),
        )
