"""The trajectory store: sessions, turns (exact token ids and logprobs) and events, behind one interface.

- `store.base`: its records; `store.roles`: its faces, one `typing.Protocol` per kind of caller (turn log,
  event log, sessions, truncation, retention, feed, recomputations, lifecycle), and `TrajectoryStore`,
  all of them; `store.front`: `WriteFront`, the road of writes made on the event loop (off it for a
  remote store, in order per session);
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
    TurnRecord,
)
from store.roles import TrajectoryStore
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
