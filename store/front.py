"""The one road by which writes made on the event loop reach the store (`WriteFront`).

A commit to PostgreSQL takes milliseconds; made on the event loop, it holds up every stream of the
process for that long (a failover storm writes an event per cut stream). So every write a caller on
the loop makes to a remote store goes to a *lane*: a thread of its own that runs the writes handed to
it one after another. A session's writes always go to the same lane (by a hash of its id), so they
commit in the order they were made: a turn's events before its end, its end before the next turn's
start. A local store (SQLite: a commit costs less than the hand-off) runs each write inline, as it
always did.

- `call`: the write, awaited: it has committed when `call` returns (a turn's start and end: the
  client's response waits for it). Cancelling the caller does not stop a write already handed over.
- `post`: the write, not awaited (an event, a failed turn's end): it commits after the session's
  earlier writes and before its later ones. A failure is logged (the store logs its own errors).
- `close`: the writes handed over run to the end, then the lanes stop (`TrajectoryStore.close` calls
  it before it closes the connections): a clean shutdown loses none.

Example::

    front = WriteFront(lanes=8)  # a remote store's; WriteFront(lanes=0): inline
    turn = await front.call(turn.session_id, store.begin_turn, turn)
    front.post(turn.session_id, store.add_event, EventRecord.of(turn.session_id, turn.id, failover, now))
    front.close()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

from core.errors import StoreError

T = TypeVar("T")

log = logging.getLogger("belayer.store")


class WriteFront:
    """Writes in order per session; off the event loop when there are lanes (a remote store)."""

    def __init__(self, lanes: int = 0) -> None:
        self._lanes = [
            concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"belayer-store-{i}")
            for i in range(lanes)
        ]
        self._closed = threading.Event()

    @property
    def remote(self) -> bool:
        """Whether writes leave the calling thread (a remote store's front)."""
        return bool(self._lanes) and not self._closed.is_set()

    def submit(self, key: str, work: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """Hand `work(*args)` to `key`'s lane; its future on the running loop. Inline when there are no
        lanes (or after `close`): the future is then done already."""
        if self.remote:
            try:
                return asyncio.wrap_future(self._lane(key).submit(work, *args))
            except RuntimeError:  # closed meanwhile: run inline, as a closed store refuses
                pass
        done: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        try:
            done.set_result(work(*args))
        except Exception as e:
            done.set_exception(e)
        return done

    async def call(self, key: str, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)`, committed when this returns; in `key`'s lane after its earlier writes."""
        if not self.remote:
            return work(*args)
        return await asyncio.shield(self.submit(key, work, *args))

    def post(self, key: str, work: Callable[..., object], *args: Any) -> None:
        """`work(*args)` in `key`'s lane after its earlier writes, not awaited; inline without lanes
        (where its error reaches the caller, as a direct call's does)."""
        if not self.remote:
            work(*args)
            return
        try:
            self._lane(key).submit(work, *args).add_done_callback(_log_failure)
        except RuntimeError:  # closed meanwhile
            work(*args)

    def close(self) -> None:
        """Run what was handed over, then stop the lanes (idempotent)."""
        self._closed.set()
        for lane in self._lanes:
            lane.shutdown(wait=True)

    def _lane(self, key: str) -> concurrent.futures.ThreadPoolExecutor:
        return self._lanes[zlib.crc32(key.encode()) % len(self._lanes)]


def _log_failure(done: concurrent.futures.Future[Any]) -> None:
    error = done.exception()
    if error is not None and not isinstance(error, StoreError):  # a StoreError: the store logged it
        log.error("trajectory store: a posted write failed: %r", error, exc_info=error)
