"""What the SQLite and PostgreSQL trajectory stores share: every query, and every record built from a row.

`SqlStore` implements `TrajectoryStore` once, in SQL that both databases run, and leaves to each backend
(`store.sqlite`, `store.postgres`) only what truly differs between them:

- **Spelling**, in a `Dialect` value (`store.sql.dialect`): the queries are written with ``?`` markers,
  which `Tx` turns into psycopg's ``%s``; a list binds as ``IN (?, ?, …)`` (SQLite) or as one array,
  ``= ANY(?)`` (PostgreSQL); a flag is an ``INTEGER`` 0/1 or a ``BOOLEAN``; PostgreSQL locks rows
  (``FOR UPDATE``, ``… SKIP LOCKED``) where SQLite's ``BEGIN IMMEDIATE`` already holds the one write
  lock, and orders ids by byte (``COLLATE "C"``) as SQLite does.
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

The shared store is one object that holds its parts, one concern each; a backend subclasses it once and
gives its connections and hooks:

- `store.sql.core`: `SqlStore`, the hooks a backend gives, statements, transactions, errors, events, and
  the interface, each method run by the part that owns it;
- `store.sql.reads`: `SqlReads`, sessions, turns (decoded from their stored segments, `store.sql.rows`)
  and events as they are read;
- `store.sql.writes`: `SqlWrites`, creating and updating sessions, a turn's start, stream and finish
  (a final write that failed is kept and retried), recomputation outcomes, discarding;
- `store.sql.lifecycle`: `SqlLifecycle`, how a session branches and ends: forks, closing with the
  finished feed, deletion and pruning, and closing the store.

Each part holds the store (``db``: its statements, caches and hooks) and the parts it builds on; the
hooks a backend overrides (`_next_numbers`, `_append_part`, `_record_close`, ...) stay methods of the
store, so the parts call them through ``db``.

Example: a backend is a `Dialect` and the hooks::

    class SqliteStore(SqlStore):
        dialect = Dialect(marker="?", arrays=False, booleans=False)
        ...  # _statement, _begin, _location, _insert_id, _next_numbers, ...
"""

from store.sql.core import SqlStore
from store.sql.dialect import Connection, Cursor, Dialect, Tx
from store.sql.rows import dump_segments

__all__ = ["Connection", "Cursor", "Dialect", "SqlStore", "Tx", "dump_segments"]
