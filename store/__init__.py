"""The trajectory store: sessions, turns (exact token ids and logprobs) and events, behind one interface.

- `store.base`: the interface, `TrajectoryStore`, and its records;
- `store.sqlite`: `SqliteStore`, the embedded default (one file); `store.postgres`: `PostgresStore`,
  the store that replicated gateways share (its tables in `store.postgres_schema`, its finished feed
  across replicas in `store.postgres_feed`); both run the queries of `store.sql`;
- `store.memory`: `MemoryStore`, the fake, for fast tests of the logic above the store;
- `store.layout`: how a turn is stored as what it adds to an earlier turn; `store.schema`: the SQLite
  tables and their migrations, and the JSON and span encodings both databases use;
- `store.factory`: the store a ``--store`` value names; `store.export`: trajectories to files.
"""

from store.base import (
    EventRecord,
    OutputPart,
    SessionQuery,
    SessionRecord,
    TrajectoryStore,
    TurnRecord,
)
from store.sqlite import SqliteStore

__all__ = [
    "EventRecord",
    "OutputPart",
    "SessionQuery",
    "SessionRecord",
    "SqliteStore",
    "TrajectoryStore",
    "TurnRecord",
]
