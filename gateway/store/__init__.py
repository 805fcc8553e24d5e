"""Durable trajectory storage: an interface and its SQLite implementation."""

from gateway.store.base import EventRecord, SessionQuery, SessionRecord, TrajectoryStore, TurnRecord
from gateway.store.sqlite import SqliteStore

__all__ = ["EventRecord", "SessionQuery", "SessionRecord", "SqliteStore", "TrajectoryStore", "TurnRecord"]
