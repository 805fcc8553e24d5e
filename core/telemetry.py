"""The live feed: one in-process stream of everything that happens in a gateway, in order.

Every layer publishes what it does (the trajectory store its session events, the engine pool its
worker state changes, the turn runner its turns) to one `Telemetry` hub. Three kinds of readers use it:

- listeners (`listen`), called synchronously in the publisher's thread: the Prometheus metrics and the
  event log, which must see every event and only count or log;
- subscribers (`subscribe`), each an asyncio queue: ``GET /api/events`` streams one per client (the
  dashboard, scripts). A subscriber that falls behind loses its oldest events and is told how many;
- `recent`: the last `keep` events, so that a page opened now can show what happened before it.

Publishing is cheap (a lock, a deque append, one call per listener), thread-safe (the store also
writes from worker threads), and never raises: a listener's error is logged and the event goes on.

What is published is one of the typed events of `core.events` (its kind and data are what the feed
carries); a kind that `core.events.REGISTRY` does not hold is refused (`core.errors.UnknownEvent`).

Example::

    hub = Telemetry()
    hub.listen(lambda e: print(e.kind, e.data))
    hub.publish(events.ShadowPromoted(worker="worker-1"))

>>> hub = Telemetry(keep=2)
>>> seen = []
>>> hub.listen(lambda e: seen.append(e.kind))
>>> for worker in ("a", "b", "c"):
...     _ = hub.publish(events.ShadowPromoted(worker))
>>> seen, [e.data["worker"] for e in hub.recent()], hub.seq
(['shadow_promoted', 'shadow_promoted', 'shadow_promoted'], ['b', 'c'], 3)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from core import events
from core.errors import UnknownEvent
from core.events import Payload

log = logging.getLogger("belayer.telemetry")


@dataclass(frozen=True, slots=True)
class Event:
    """One thing that happened: its place in the feed (`seq`), wall time, kind, session and data."""

    seq: int
    ts: float
    kind: str
    session_id: str | None
    turn_id: int | None
    data: dict[str, Any]
    payload: Payload | None = field(default=None, compare=False, repr=False)
    """The typed event (`core.events`) its kind and data were written from (None: an event built by hand,
    as tests do; `typed` decodes it then)."""

    @property
    def typed(self) -> Payload:
        """The typed event: `payload`, or decoded from the kind and data."""
        return self.payload if self.payload is not None else events.decode(self.kind, self.data)

    def as_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "ts": self.ts,
            "kind": self.kind,
            "session_id": self.session_id,
            "turn_id": self.turn_id,
            "data": self.data,
        }


@dataclass(slots=True)
class Subscription:
    """One reader's queue; `lost` counts events dropped because it fell behind."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Event | None]
    """The events; None once the feed is closed (the gateway is shutting down)."""
    session_id: str | None = None
    kinds: frozenset[str] | None = None
    lost: int = 0

    def wants(self, event: Event) -> bool:
        if self.session_id is not None and event.session_id != self.session_id:
            return False
        return self.kinds is None or event.kind in self.kinds

    def offer(self, event: Event | None) -> None:
        """On the subscriber's loop: queue the event (None: the end), dropping the oldest when full."""
        if self.queue.full():
            self.queue.get_nowait()
            self.lost += 1
        self.queue.put_nowait(event)


@dataclass(slots=True)
class Telemetry:
    """The hub (see above)."""

    keep: int = 5000
    queue_size: int = 10000
    started_at: float = field(default_factory=time.time)
    seq: int = 0
    closed: bool = False
    tokens_streamed: int = 0
    """Generated tokens as they arrive (the turn runner adds them; the dashboard's tokens/s reads it)."""
    _recent: collections.deque[Event] = field(init=False)
    _listeners: list[Callable[[Event], None]] = field(default_factory=list)
    _subs: list[Subscription] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._recent = collections.deque(maxlen=self.keep)

    def listen(self, fn: Callable[[Event], None]) -> None:
        """Call `fn` with every event from now on, in the publisher's thread (it must not block)."""
        self._listeners.append(fn)

    def publish(
        self,
        payload: Payload,
        session_id: str | None = None,
        turn_id: int | None = None,
        ts: float | None = None,
    ) -> Event:
        """Publish one typed event (`core.events`); refused (`core.errors.UnknownEvent`) if its kind is
        not registered."""
        if events.REGISTRY.get(payload.kind) is not type(payload):
            raise UnknownEvent(f"{type(payload).__name__} is not in core.events.REGISTRY")
        return self._emit(payload, payload.data(), session_id, turn_id, ts)

    def publish_record(
        self, kind: str, data: dict[str, Any], session_id: str | None, turn_id: int | None, ts: float
    ) -> Event:
        """Publish a stored event (the store's rows, after their commit) with its data as stored, checked
        against its kind's fields (`core.errors.UnknownEvent` for data that fits no kind)."""
        return self._emit(events.decode(kind, data), data, session_id, turn_id, ts)

    def _emit(
        self,
        payload: Payload,
        data: dict[str, Any],
        session_id: str | None,
        turn_id: int | None,
        ts: float | None,
    ) -> Event:
        kind = payload.kind
        with self._lock:
            self.seq += 1
            stamp = ts if ts is not None else time.time()
            event = Event(self.seq, stamp, kind, session_id, turn_id, data, payload)
            self._recent.append(event)
            subs = [s for s in self._subs if s.wants(event)]
        for fn in self._listeners:
            try:
                fn(event)
            except Exception:  # a listener's bug must not break what published
                log.exception("telemetry listener %r failed on a %s event", fn, kind)
        for sub in subs:
            with contextlib.suppress(RuntimeError):  # its loop is closed: it is going away
                sub.loop.call_soon_threadsafe(sub.offer, event)
        return event

    def close(self) -> None:
        """End every subscription (each reader gets None, then the end of its queue): a server that
        shuts down must not wait for streams that never end by themselves."""
        with self._lock:
            self.closed = True
            subs = list(self._subs)
        for sub in subs:
            with contextlib.suppress(RuntimeError):
                sub.loop.call_soon_threadsafe(sub.offer, None)

    def recent(
        self, after: int = 0, session_id: str | None = None, kinds: Collection[str] | None = None
    ) -> list[Event]:
        """Retained events with ``seq > after`` (oldest first), optionally of one session or kinds."""
        with self._lock:
            events = list(self._recent)
        return [
            e
            for e in events
            if e.seq > after
            and (session_id is None or e.session_id == session_id)
            and (kinds is None or e.kind in kinds)
        ]

    @contextlib.asynccontextmanager
    async def subscribe(
        self, after: int | None = None, session_id: str | None = None, kinds: Collection[str] | None = None
    ) -> AsyncIterator[Subscription]:
        """A queue of the events from now on (first the retained ones after `after`, if given), with no
        gap and no duplicate between the two."""
        sub = Subscription(
            asyncio.get_running_loop(),
            asyncio.Queue(self.queue_size),
            session_id,
            frozenset(kinds) if kinds is not None else None,
        )
        with self._lock:
            backlog = [e for e in self._recent if after is not None and e.seq > after and sub.wants(e)]
            self._subs.append(sub)
        for event in backlog[-self.queue_size :]:
            sub.queue.put_nowait(event)
        if self.closed:
            sub.offer(None)
        try:
            yield sub
        finally:
            with self._lock:
                self._subs.remove(sub)
