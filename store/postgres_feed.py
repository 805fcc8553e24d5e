"""The PostgreSQL store's finished feed across replicas: the lock that orders closes, and the listener
that hears other replicas' closes.

Event ids come from one sequence, and a sequence value is taken when a transaction asks for it, not
when it commits: close X may take id 10, close Y id 11, and Y commit first; a reader at cursor 11 would
then never see X. So `PostgresStore.mark_closed` takes a transaction-level advisory lock (`FEED_LOCK`)
just before it inserts its ``session_closed`` event and holds it until its commit: closes allocate
their ids one at a time, in commit order (PostgreSQL makes a commit visible before it releases the
transaction's locks), and whoever reads id N can read every close below N. Only closes serialise on
this lock; other events take ids freely (the feed reads only ``session_closed`` events). A close also
sends a ``NOTIFY`` on `FEED_CHANNEL` (delivered at its commit): each store with a telemetry hub runs a
`FeedListener` on a connection of its own, which publishes ``feed_advanced`` for another replica's
close and so wakes ``GET /api/finished?follow=true`` followers on every gateway.

Example::

    listener = FeedListener(url, owner=7, telemetry=hub, location="postgresql://…")
    listener.start(timeout=10.0)  # from now on, no other replica's close goes unheard
    ...
    listener.stop()
"""

from __future__ import annotations

import logging
import threading

import psycopg

from core.events import FeedAdvanced
from core.telemetry import Telemetry

FEED_LOCK = 0x62656C61796566  # the finished feed's allocation lock (`PostgresStore.mark_closed`)
FEED_CHANNEL = "belayer_feed"  # NOTIFY channel: a session closed (payload: the closing owner)

log = logging.getLogger("belayer.store")


class FeedListener:
    """Publishes ``feed_advanced`` when another replica closes a session (its NOTIFY at commit), so a
    finished-feed follower on this gateway reads the store at once, not at its next heartbeat."""

    def __init__(self, url: str, owner: int, telemetry: Telemetry, location: str) -> None:
        self.url, self.owner, self.telemetry, self.location = url, owner, telemetry, location
        self._stopping = threading.Event()
        self._listening = threading.Event()
        self._thread = threading.Thread(target=self._listen, name="belayer-store-feed", daemon=True)

    def start(self, timeout: float) -> None:
        """Start listening; return once it listens (or after `timeout`)."""
        self._thread.start()
        self._listening.wait(timeout)

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _listen(self) -> None:
        try:
            with psycopg.connect(self.url, autocommit=True) as conn:
                conn.execute(f"LISTEN {FEED_CHANNEL}")
                self._listening.set()
                while not self._stopping.is_set():
                    for note in conn.notifies(timeout=0.5):
                        if note.payload != str(self.owner):  # this store's own closes publish themselves
                            self.telemetry.publish(FeedAdvanced(by="replica"))
        except psycopg.Error as e:  # followers fall back to their heartbeat's read of the store
            self._listening.set()
            if not self._stopping.is_set():
                log.warning("trajectory store %s: feed listener stopped: %s", self.location, e)
