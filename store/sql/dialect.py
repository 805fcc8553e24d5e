"""How one database spells the shared queries (`Dialect`), and the connection they run on (`Tx`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from store.base import EventRecord


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one database spells what the shared queries need."""

    marker: str
    """The driver's parameter marker (the shared queries are written with ``?``)."""
    arrays: bool
    """A list binds as one array (``= ANY(?)``), else as a marker per value (``IN (?, ?)``)."""
    booleans: bool
    """Flags are ``BOOLEAN`` columns, else ``INTEGER`` 0/1."""
    row_lock: str = ""
    """Appended to a ``SELECT`` of the session row that numbers a turn or deletes the session."""
    skip_locked: str = ""
    """Appended to the ``SELECT`` of a batch of sessions to prune."""
    text_id: str = "id"
    """The session id as it orders (by byte, as SQLite compares text)."""
    sessions_order: str = "created_at"
    """`list_sessions`' order."""
    forks_order: str = ""
    """The order of the fork children that keep a session from being deleted (named in the error)."""
    id_param: str = "?"
    """A turn id parameter where the database cannot infer its type (a recursive query's seed)."""

    def among(self, column: str, values: Sequence[Any]) -> tuple[str, tuple[Any, ...]]:
        """``column`` is one of `values`: the condition and its arguments."""
        if self.arrays:
            return f"{column} = ANY(?)", (list(values),)
        return f"{column} IN ({','.join('?' * len(values))})", tuple(values)

    def flag(self, value: bool) -> bool | int:
        return value if self.booleans else int(value)

    @property
    def listed(self) -> str:
        """The condition of a session that lists (not ephemeral)."""
        return "NOT ephemeral" if self.booleans else "ephemeral = 0"


class Cursor(Protocol):
    """What the shared queries read of a DB-API cursor (``sqlite3`` and ``psycopg`` alike)."""

    @property
    def rowcount(self) -> int: ...

    @property
    def description(self) -> object: ...

    def fetchone(self) -> Any: ...

    def fetchall(self) -> list[Any]: ...


class Connection(Protocol):
    def execute(self, sql: str, args: Any, /) -> Cursor: ...


@dataclass(slots=True)
class Tx:
    """One connection, in a transaction or for one statement; the events it recorded (published once
    it commits). Every ``?`` of a statement becomes the dialect's marker: a backend's own statements
    may use either, and none may use ``?`` as anything but a marker."""

    conn: Connection
    dialect: Dialect
    events: list[EventRecord] = field(default_factory=list)

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        if self.dialect.marker != "?":
            sql = sql.replace("?", self.dialect.marker)
        return self.conn.execute(sql, args)
