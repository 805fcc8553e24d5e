"""Durable trajectory storage: an interface and its SQLite implementation."""

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
