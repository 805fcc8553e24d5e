"""The shared SQL store (`SqlStore`): the hooks a backend gives, statements, transactions, errors and
events on top of them, and the parts it holds, which run the queries (`store.sql`)."""

from __future__ import annotations

import abc
import contextlib
import logging
from collections.abc import Callable
from typing import Any, ClassVar

from core import events
from core.errors import StoreError
from core.telemetry import Telemetry
from store import schema
from store.base import (
    TURN_INTERRUPTED,
    TURN_RUNNING,
    EventRecord,
    OutputPart,
    SessionQuery,
    SessionRecord,
    TurnRecord,
)
from store.front import WriteFront
from store.roles import TrajectoryStore
from store.schema import dump_json
from store.sql.dialect import Dialect, Tx
from store.sql.lifecycle import SqlLifecycle
from store.sql.reads import SqlReads
from store.sql.rows import Fork
from store.sql.writes import SqlWrites

log = logging.getLogger("belayer.store")


class SqlStore(TrajectoryStore):
    """A `TrajectoryStore` in SQL; a backend gives its `dialect`, its connections and the hooks below,
    and the parts this holds run the queries: `SqlReads`, `SqlWrites` and `SqlLifecycle`."""

    dialect: ClassVar[Dialect]

    remote = False

    def __init__(self, telemetry: Telemetry | None, lanes: int = 0) -> None:
        self.front = WriteFront(lanes)
        """Writes made on the event loop (`store.front`): a remote backend passes its `lanes`."""
        self.telemetry = telemetry
        """Where each committed event (and session change) is also published, for the live feed."""
        self._forks: dict[str, Fork] = {}
        """Fork children's shared turns as writing needs them (they never change once forked)."""
        self._plain: dict[str, None] = {}
        """Sessions known not to be fork children (a session is one from its creation or never), so
        that a turn's parent lookup does not ask again at every turn; emptied at `PLAIN_KEPT`."""
        self._unwritten: dict[int, TurnRecord] = {}
        """Finished turns whose final write failed (disk full, read-only, connection lost): kept here,
        shown to readers, and written by the next write that succeeds, so no turn stays ``running``."""
        self.failures = 0
        """Store operations that failed (each is logged with its cause)."""
        self._reads = SqlReads(self)
        self._writes = SqlWrites(self, self._reads)
        self._life = SqlLifecycle(self, self._reads, self._writes)

    # --- the interface, run by the parts ------------------------------------------------------------

    def get_session(self, session_id: str) -> SessionRecord | None:
        return self._reads.get_session(session_id)

    def list_sessions(self) -> list[SessionRecord]:
        return self._reads.list_sessions()

    def query_sessions(self, query: SessionQuery) -> tuple[list[SessionRecord], int]:
        return self._reads.query_sessions(query)

    def turn_counts(self, session_id: str | list[str] | None = None) -> dict[str, tuple[int, int]]:
        return self._reads.turn_counts(session_id)

    def children(self, session_id: str) -> list[str]:
        return self._reads.children(session_id)

    def get_turn(self, turn_id: int) -> TurnRecord | None:
        return self._reads.get_turn(turn_id)

    def get_turns(self, session_id: str) -> list[TurnRecord]:
        return self._reads.get_turns(session_id)

    def find_turn_by_ext_keys(self, session_id: str, keys: list[str]) -> TurnRecord | None:
        return self._reads.find_turn_by_ext_keys(session_id, keys)

    def session_and_parent(
        self, session_id: str, keys: list[str]
    ) -> tuple[SessionRecord | None, TurnRecord | None]:
        return self._reads.session_and_parent(session_id, keys)

    def get_events(self, session_id: str) -> list[EventRecord]:
        return self._reads.get_events(session_id)

    def create_session(self, session: SessionRecord) -> SessionRecord:
        return self._writes.create_session(session)

    def update_session(self, session: SessionRecord) -> None:
        self._writes.update_session(session)

    def begin_turn(
        self,
        turn: TurnRecord,
        first_event: Callable[[TurnRecord], events.Payload] | None = None,
        new_session: SessionRecord | None = None,
        parent: TurnRecord | None = None,
    ) -> TurnRecord:
        return self._writes.begin_turn(turn, first_event, new_session, parent)

    def finish_turn(self, turn: TurnRecord) -> None:
        self._writes.finish_turn(turn)

    def append_outputs(self, parts: list[OutputPart]) -> int:
        return self._writes.append_outputs(parts)

    def end_recomputation(self, turn_id: int, event: EventRecord | None) -> None:
        self._writes.end_recomputation(turn_id, event)

    def add_event(self, event: EventRecord) -> None:
        self._writes.add_event(event)

    def discard_turns_after(self, session_id: str, turn_index: int, reason: str) -> list[int]:
        return self._writes.discard_turns_after(session_id, turn_index, reason)

    def discard_turns(self, session_id: str, turn_ids: list[int], reason: str) -> list[int]:
        return self._writes.discard_turns(session_id, turn_ids, reason)

    def fork(self, parent_id: str, at_turn: int, children: list[SessionRecord]) -> list[SessionRecord]:
        return self._life.fork(parent_id, at_turn, children)

    def mark_closed(self, session: SessionRecord) -> bool:
        return self._life.mark_closed(session)

    def closed_after(self, after_id: int, limit: int) -> list[tuple[int, str]]:
        return self._life.closed_after(after_id, limit)

    def delete_session(self, session_id: str) -> tuple[int, int] | None:
        return self._life.delete_session(session_id)

    def prune(self, closed_before: float, exported_only: bool = False) -> list[str]:
        return self._life.prune(closed_before, exported_only)

    def close(self) -> None:
        self._life.close()

    # --- what a backend provides --------------------------------------------------------------------

    @abc.abstractmethod
    def _statement(self) -> contextlib.AbstractContextManager[Tx]:
        """One statement, committed on its own; a database error becomes `_failed`'s."""

    @abc.abstractmethod
    def _begin(self) -> contextlib.AbstractContextManager[Tx]:
        """A transaction: committed when the block ends, rolled back when it raises; a database error
        becomes `_failed`'s."""

    @abc.abstractmethod
    def _location(self) -> str:
        """The store as logs and errors name it (no password)."""

    @abc.abstractmethod
    def _insert_id(self, tx: Tx, sql: str, args: tuple[Any, ...]) -> int:
        """Run an ``INSERT`` of one turn; the id it was given."""

    @abc.abstractmethod
    def _next_numbers(self, tx: Tx, session_id: str) -> tuple[int, int]:
        """In `begin_turn`'s transaction: the session's next free (index, branch)."""

    @abc.abstractmethod
    def _append_part(self, tx: Tx, part: OutputPart) -> int:
        """In a transaction: write one streamed part (`append_outputs`); 1 if written, else 0."""

    @abc.abstractmethod
    def _running_keeps(self, tx: Tx, session_id: str) -> bool:
        """In `delete_session`'s transaction: whether a running turn keeps the session."""

    @abc.abstractmethod
    def _metadata_text(self, key: str) -> tuple[str, list[Any]]:
        """A top-level metadata value as text (as SQLite's ``json_extract`` gives it), and its arguments."""

    @abc.abstractmethod
    def _disconnect(self) -> None:
        """Close the connections (`close`, once the unwritten turns had their last try)."""

    def _turn_extras(self) -> tuple[tuple[str, Any], ...]:
        """Columns (name, value) a backend adds to each new turn."""
        return ()

    def sweep_orphans(self) -> int:
        """None here: a store of one gateway marks what a crash left running when it opens."""
        return 0

    def _record_close(self, tx: Tx, event: EventRecord) -> None:
        """In `mark_closed`'s transaction: record the ``session_closed`` event."""
        self._insert_event(tx, event)

    # --- errors, events (statements: `SqlReads.rows`; transactions: `SqlWrites.transaction`) ---------

    def _failed(self, error: Exception) -> StoreError:
        """The StoreError for `error`, with the database's own cause in it (disk full, read-only, gone)."""
        self.failures += 1
        where = self._location()
        log.error("trajectory store %s failed: %s", where, error)
        return StoreError(f"trajectory store error: {error} ({where})")

    def _publish_session(self, kind: type[events.SessionChanged], session: SessionRecord) -> None:
        if self.telemetry is not None and not session.ephemeral:
            self.telemetry.publish(kind(session.status, session.reward, session.metadata), session.id)

    def _interrupt(self, tx: Tx, where: str = "", args: tuple[Any, ...] = ()) -> int:
        """In a transaction: the running turns that match become interrupted, with the tokens they had,
        and each session gets a ``turns_interrupted`` event; how many."""
        rows = tx.execute(
            f"UPDATE turns SET status = ? WHERE status = ?{' AND ' + where if where else ''} "
            "RETURNING session_id, idx, length(output_ids) / 4",
            (TURN_INTERRUPTED, TURN_RUNNING, *args),
        ).fetchall()
        for event in schema.interrupted_events(rows):
            self._insert_event(tx, event)
        return len(rows)

    @staticmethod
    def _insert_event(tx: Tx, event: EventRecord) -> None:
        """In a transaction: the event is published once that commits."""
        tx.execute(
            "INSERT INTO events (session_id, turn_id, ts, kind, data) VALUES (?, ?, ?, ?, ?)",
            (event.session_id, event.turn_id, event.ts, event.kind, dump_json(event.data)),
        )
        tx.events.append(event)
