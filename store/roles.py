"""The store's faces, one per kind of caller (`typing.Protocol`s), and `TrajectoryStore`, all of them.

A caller is typed with the role(s) it uses, not with the whole store:

- `TurnLog`: a turn's start, streamed outputs and end, and reading turns back (`TurnReads`; the turn
  ledger, the prefix reuse, the in-flight writer);
- `EventLog`: a session's events (`EventReads`; the turn ledger's, the sandbox manager's);
- `Sessions`: creating, reading (`SessionReads`), listing, closing and forking sessions (the API, the
  session manager);
- `Truncation`: marking turns discarded (the sandbox manager's restores);
- `Retention`: deleting, pruning, export marks and space (``belayer store``, ``DELETE /api/sessions``);
- `Feed`: the finished feed's cursor (``GET /api/finished``);
- `Recomputations`: logprob recomputations that outlive a gateway (`gateway.turns.recompute`);
- `Lifecycle`: the store itself: its identity, its writes' front (`Fronted`, `store.front`), orphans,
  closing.

Callers that need several have theirs here too: `LedgerStore`, `SandboxEvents`, `TrajectoryReader`
(reads only: exports, trainers' readers, adoption) and `Exporter`. `TrajectoryStore` is all of them: what `store.factory` opens and the gateway's lifespan closes.
`store.sql.SqlStore` (SQLite, PostgreSQL) and `store.memory.MemoryStore` (the fake) implement it, and
``tests/store/test_contract.py`` holds each of them to it. Every method commits before it returns; a
caller on the event loop writes through `Lifecycle.front`, which keeps a remote store's commits off
the loop.

Example: a reader of trajectories needs two roles, and a test can hand it the fake::

    class Reader(SessionReads, TurnReads, Protocol): ...

    def turns_of_closed(store: Reader) -> list[TurnRecord]:
        return [t for s in store.list_sessions() if s.status != "open" for t in store.get_turns(s.id)]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from core.events import Payload
from store.base import EventRecord, OutputPart, SessionQuery, SessionRecord, TurnRecord
from store.front import WriteFront


class TurnReads(Protocol):
    """A session's turns as they read."""

    def get_turn(self, turn_id: int) -> TurnRecord | None: ...

    def get_turns(self, session_id: str) -> list[TurnRecord]: ...

    def find_turn_by_ext_keys(self, session_id: str, keys: list[str]) -> TurnRecord | None:
        """The newest complete turn whose ext key is in ``keys``, preferring keys later in the list."""
        ...

    def session_and_parent(
        self, session_id: str, keys: list[str]
    ) -> tuple[SessionRecord | None, TurnRecord | None]:
        """The session, and the turn a request extends (`find_turn_by_ext_keys` with the chain keys of
        its assistant messages), read together where a request's prompt is planned; (None, None) for
        an unknown session."""
        ...


class TurnLog(TurnReads, Protocol):
    """A session's turns: written as they start, stream and end; read back."""

    remote: bool
    """Reached over the network (PostgreSQL): a commit takes milliseconds, so a caller on the event
    loop writes through `Lifecycle.front`, and prepares requests off the loop too. A local SQLite commit
    (WAL, ~0.2 ms) costs less on the event loop than the hand-off (measured: streamed tokens/s 8-19%
    lower off the loop)."""

    def begin_turn(
        self,
        turn: TurnRecord,
        first_event: Callable[[TurnRecord], Payload] | None = None,
        new_session: SessionRecord | None = None,
        parent: TurnRecord | None = None,
    ) -> TurnRecord:
        """Persist a new running turn; assigns ``id``, ``index`` and ``branch``. In the same
        transaction: ``new_session`` is created first, and ``first_event(turn)`` (which may look at the
        assigned index and branch) is recorded. `parent`: the caller's copy of turn ``parent_id``, when
        it has one as the store returned it (the store need not read it again). Raises `NotFound`
        when the session was deleted."""
        ...

    def finish_turn(self, turn: TurnRecord) -> None:
        """Persist the turn's outputs, response, status and timings."""
        ...

    def append_outputs(self, parts: list[OutputPart]) -> int:
        """While turns stream: each part's tokens become its turn's output from position ``start`` on
        (what was stored beyond ``start`` is replaced), in one transaction, so a crash of the gateway
        keeps what was generated so far. A part is skipped when its turn is no longer running (its
        final write came first) or holds fewer than ``start`` tokens (a gap). Returns the parts
        written. The caller sends a turn's parts in order: what is stored stays a prefix of its
        final output."""
        ...


class EventReads(Protocol):
    """A session's events, in the order they were written."""

    def get_events(self, session_id: str) -> list[EventRecord]: ...


class EventLog(EventReads, Protocol):
    """A session's events: written one at a time (most come in a transaction of their own change)."""

    def add_event(self, event: EventRecord) -> None: ...


class SessionReads(Protocol):
    """Sessions as they read: one, all, a page of those that match, their numbers of turns, forks."""

    def get_session(self, session_id: str) -> SessionRecord | None: ...

    def list_sessions(self) -> list[SessionRecord]: ...

    def query_sessions(self, query: SessionQuery) -> tuple[list[SessionRecord], int]:
        """One page of the (non-ephemeral) sessions that match, and how many match in all."""
        ...

    def turn_counts(self, session_id: str | list[str] | None = None) -> dict[str, tuple[int, int]]:
        """Each session's (or the given sessions') number of turns and of branches, without reading turns."""
        ...

    def children(self, session_id: str) -> list[str]:
        """The ids of the sessions forked from this one (directly)."""
        ...


class Sessions(SessionReads, Protocol):
    """Sessions: created, read, listed, updated, closed and forked."""

    def create_session(self, session: SessionRecord) -> SessionRecord: ...

    def update_session(self, session: SessionRecord) -> None: ...

    def mark_closed(self, session: SessionRecord) -> bool:
        """Close an open session: its status and ``closed_at`` (set by the caller) and one
        ``session_closed`` event, the finished feed's entry, in one transaction. False, and nothing
        written, when the stored session is not open (it was closed already)."""
        ...

    def fork(self, parent_id: str, at_turn: int, children: list[SessionRecord]) -> list[SessionRecord]:
        """Create `children` as forks of session `parent_id` at its turn `at_turn`, in one transaction:
        each child's turns read as the parent's turns with index <= `at_turn` (shared rows, not copies)
        followed by its own, numbered from ``at_turn + 1``. Raises `NotFound` (unknown session or turn)
        or `Conflict` (the turn is not complete)."""
        ...


class Truncation(Protocol):
    """Turns rolled back by an environment restore: marked discarded, kept readable."""

    def discard_turns_after(self, session_id: str, turn_index: int, reason: str) -> list[int]:
        """Mark the session's turns with index > ``turn_index`` (not yet discarded) as discarded, and
        record one ``turns_discarded`` event with ``reason``; return the indices marked. Indices are
        never reused: the next turn gets the next index, so numbering has no gap."""
        ...

    def discard_turns(self, session_id: str, turn_ids: list[int], reason: str) -> list[int]:
        """Mark exactly these turns (by id) as discarded, with a ``turns_discarded`` event; return the
        indices marked. For a turn that finishes after the restore that discarded it."""
        ...


class Retention(Protocol):
    """What is kept: deleting and pruning sessions, export marks, the space on disk."""

    def delete_session(self, session_id: str) -> tuple[int, int] | None:
        """Delete the session with its turns, events and export mark, in one transaction; the numbers
        of turns and events deleted. None, and nothing deleted, while one of its turns is running.
        Raises `Conflict` when sessions were forked from it: they share its turns."""
        ...

    def prune(self, closed_before: float, exported_only: bool = False) -> list[str]:
        """Delete the sessions that were closed before `closed_before` (an epoch time; a plain ``/v1``
        request's session counts from its creation), only those exported with `exported_only`, as
        `delete_session` does; their ids. Open sessions, those with a running turn, and those that fork
        children share turns with, are kept."""
        ...

    def mark_exported(self, session_ids: list[str]) -> None:
        """Record that an export has written these sessions (for ``prune --exported-only``); an open
        one is not marked, since it may still grow."""
        ...

    def size_bytes(self) -> int:
        """The store's size on disk."""
        ...

    def vacuum(self) -> None:
        """Give the space of deleted rows back to the file system (the file shrinks)."""
        ...


class Feed(Protocol):
    """The finished feed: the ids of ``session_closed`` events are its cursor."""

    def closed_after(self, after_id: int, limit: int) -> list[tuple[int, str]]:
        """The finished feed: ``(event id, session id)`` of the ``session_closed`` events with an id
        above ``after_id``, oldest first, at most ``limit``. Ids only grow, so an id is a cursor."""
        ...

    def last_event_id(self) -> int:
        """The largest event id this store ever gave (0 for none): a feed cursor above it comes from
        another store."""
        ...


class Recomputations(Protocol):
    """Logprob recomputations scheduled for rewritten prompts, kept until their outcome."""

    def schedule_recomputation(self, turn: TurnRecord, spans: list[tuple[int, int]]) -> None:
        """Record that the logprobs of `turn`'s prompt tokens in `spans` are to be recomputed; the
        mark stays until `end_recomputation`, so a gateway that died first redoes it at start-up."""
        ...

    def pending_recomputations(self) -> list[tuple[int, list[tuple[int, int]]]]:
        """The recomputations scheduled and not ended: (turn id, spans), oldest first."""
        ...

    def end_recomputation(self, turn_id: int, event: EventRecord | None) -> None:
        """Record a recomputation's outcome (`event`; None: none, its turn is gone) and drop its mark,
        in one transaction."""
        ...


class Fronted(Protocol):
    """A store's writes made on the event loop go through its front."""

    front: WriteFront
    """The road of writes made from the event loop (`store.front`): in order per session, and off the
    loop for a remote store. `close` drains it first."""


class Lifecycle(Fronted, Protocol):
    """The store itself: its front, identity, failures, orphans and end."""

    failures: int
    """Operations that failed in the database (disk full, read-only, corrupt, connection lost); each
    is also logged with its cause. Exported as ``belayer_store_failures_total``."""

    def store_id(self) -> str:
        """This store's identity: a random id made once and kept in the store, the same for every
        gateway that opens it. Sandboxes carry it as a label, so a gateway restarted on this store finds
        its own containers, and no one else's (`sandbox.sessions.adoption`)."""
        ...

    def sweep_orphans(self) -> int:
        """Mark ``interrupted`` (with the tokens they had, and a ``turns_interrupted`` event per
        session) the running turns of gateways that are gone while this one runs; how many. Only a
        store that several gateways share has any (`gateway.turns.orphan_sweep` calls it periodically): a
        store of one gateway marks what a crash left running when it opens, so it finds none."""
        ...

    def close(self) -> None:
        """Drain `front`, then close the connections."""
        ...


class TrajectoryStore(
    TurnLog, EventLog, Sessions, Truncation, Retention, Feed, Recomputations, Lifecycle, Protocol
):
    """Where sessions, turns and events live: every role. Every method commits before it returns."""


class LedgerStore(TurnLog, EventLog, Fronted, Protocol):
    """What the turn ledger (`gateway.turns.ledger`) writes: turns and their events, through the front."""


class SandboxEvents(EventLog, Truncation, Fronted, Protocol):
    """What the sandbox manager's event log writes (`sandbox.sessions.records.EventLog`): events, and
    the turns a restore discards, through the front."""


class TrajectoryReader(SessionReads, TurnReads, EventReads, Protocol):
    """What readers of trajectories use: the export (`store.export`, `store.atif`), the sandbox manager's
    adoption, the session API's reads. Nothing here writes."""


class Exporter(TrajectoryReader, Retention, Protocol):
    """What an export uses: the trajectories, and the marks of what it wrote (`Retention.mark_exported`)."""
