"""Fixtures that run a store test on every store: SQLite, PostgreSQL, and the in-memory fake.

- ``postgres`` (session): the one PostgreSQL server of the test run (`tests.postgres_server`);
- ``store_backend`` (parametrized ``sqlite`` | ``postgres`` | ``memory``): a `StoreBackend` over fresh
  storage, whose ``open()`` gives a new store instance over the same data (a restart, or a second
  gateway): the contract of `TrajectoryStore`, which the fake (`store.memory`) is held to as well;
- ``sql_store_backend`` (``sqlite`` | ``postgres``): the same for tests of the stored layout, whose
  ``rows(sql)`` reads the tables directly (the fake has none).

The ``postgres`` parameter carries the ``postgres`` marker. They are imported into ``tests/conftest.py``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from store import TrajectoryStore
from store.memory import MemoryStore
from store.memory_tables import MemoryTables
from store.postgres import PostgresStore
from store.sqlite import SqliteStore
from tests.postgres_server import PostgresServer, postgres_server


@dataclass
class StoreBackend:
    kind: str
    location: str
    """The SQLite file, or the PostgreSQL database's URL (what ``--store`` takes); "" for the fake."""
    opened: list[TrajectoryStore] = field(default_factory=list)
    tables: MemoryTables = field(default_factory=MemoryTables)
    """The fake's data, which each of its instances opens."""

    def open(self, **options: Any) -> TrajectoryStore:
        store: TrajectoryStore
        if self.kind == "sqlite":
            store = SqliteStore(self.location, **options)
        elif self.kind == "postgres":
            store = PostgresStore(self.location, **options)
        else:
            store = MemoryStore(self.tables, **options)
        self.opened.append(store)
        return store

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        """``sql`` on the tables themselves (booleans read as 0/1, as SQLite stores them)."""
        assert self.kind != "memory", "the fake has no tables: take the sql_store_backend fixture"
        if self.kind == "sqlite":
            db = sqlite3.connect(self.location)
            try:
                return db.execute(sql).fetchall()
            finally:
                db.close()
        with psycopg.connect(self.location) as conn:
            rows = conn.execute(sql).fetchall()  # type: ignore[arg-type]
        return [tuple(int(v) if isinstance(v, bool) else v for v in r) for r in rows]


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


_SQL = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=[*_SQL, "memory"])
def store_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreBackend]:
    yield from _backend(request, tmp_path)


@pytest.fixture(params=_SQL)
def sql_store_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreBackend]:
    yield from _backend(request, tmp_path)


def _backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StoreBackend]:
    if request.param == "sqlite":
        backend = StoreBackend("sqlite", str(tmp_path / "t.db"))
    elif request.param == "memory":
        backend = StoreBackend("memory", "")
    else:
        server: PostgresServer = request.getfixturevalue("postgres")
        backend = StoreBackend("postgres", server.new_database())
    yield backend
    for store in backend.opened:  # what a test left open (closing twice is harmless)
        _close_quietly(store.close)


def _close_quietly(close: Callable[[], None]) -> None:
    try:
        close()
    except Exception:  # already closed
        return
