"""Which store a ``--store`` value names: a ``postgresql://`` (or ``postgres://``) URL opens the
PostgreSQL store that replicated gateways share (`store.postgres`); anything else is the path
of a SQLite file, the embedded default.

>>> is_url("postgresql://belayer@db/trajectories"), is_url("belayer-trajectories.db")
(True, False)
"""

from __future__ import annotations

from core.telemetry import Telemetry
from store.roles import TrajectoryStore
from store.sqlite import SqliteStore

URL_SCHEMES = ("postgresql://", "postgres://")


def is_url(location: str) -> bool:
    """Whether ``--store`` names a PostgreSQL database (else a SQLite file)."""
    return location.startswith(URL_SCHEMES)


def open_store(
    location: str, synchronous: str = "NORMAL", telemetry: Telemetry | None = None, recover: bool = True
) -> TrajectoryStore:
    """The store at `location`; `synchronous` is SQLite's (PostgreSQL commits durably). psycopg is
    imported only for a URL."""
    if is_url(location):
        from store.postgres import PostgresStore

        return PostgresStore(location, telemetry, recover=recover)
    return SqliteStore(location, synchronous, telemetry, recover=recover)
