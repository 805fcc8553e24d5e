"""The tests' PostgreSQL server (`belayer.testing.postgres_local`): one per test session, the ``postgres``
fixture (`tests.store_backends`)."""

from belayer.testing.postgres_local import PostgresServer, postgres_server

__all__ = ["PostgresServer", "postgres_server"]
