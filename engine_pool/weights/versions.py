"""The pool's weight version (`WeightVersions`): the version it serves and where its weights are, the
launch weights' version, and the state of an update (held while `updating`; `switching` once its drain
time is over, when `preemption` cuts the requests still running). `Preemption` is that cut.

Only workers on the current version are routed to or promoted (`current`). ``engine_pool.weights.update``
moves the pool to a new version; ``engine_pool.weights.keeper`` keeps the weight owner on it.

Example::

    versions = WeightVersions()
    versions.current(member)        # member.weight_version == "base"
    await versions.observe(member)  # a worker back from a failure: which version it holds
"""

from __future__ import annotations

import asyncio

from engine_pool.member import PoolMember


class Preemption:
    """The signal that cuts the requests still running when a weight update's drain time is over.
    A stream's reader `watch` es it with the event it waits on, so it wakes at once; `triggered` is
    checked between chunks (no cost per token)."""

    def __init__(self) -> None:
        self.triggered = False
        self._watchers: set[asyncio.Event] = set()

    def watch(self, wake: asyncio.Event) -> None:
        self._watchers.add(wake)

    def unwatch(self, wake: asyncio.Event) -> None:
        self._watchers.discard(wake)

    def trigger(self) -> None:
        self.triggered = True
        for wake in self._watchers:
            wake.set()


class WeightVersions:
    """The version the pool serves, and whether an update to a new one is under way."""

    def __init__(self) -> None:
        self.version = "base"
        """The version the pool serves: routed workers hold it."""
        self.path: str | None = None
        """Where the current version's weights are; None: the launch weights (`base`)."""
        self.base = "base"
        """The version of the weights launched workers start from (the model directory's)."""
        self.updating = False
        """An update holds new requests back (those on the old version may run during its drain)."""
        self.switching = False
        """The update's drain time is over: every request waits for it."""
        self.lock = asyncio.Lock()
        """Held by an update and by whatever brings a worker to the version, one at a time."""
        self.preemption = Preemption()
        """Triggered when an update's drain time is over; a new one for each update."""

    def current(self, m: PoolMember) -> bool:
        return m.weight_version == self.version

    async def observe(self, m: PoolMember) -> None:
        """A worker back from a failure says which version it holds, where it can: a restarted vLLM
        says ``default`` (its launch weights) and must be brought up to the version again."""
        seen = await m.client.weight_version()
        if seen is not None and seen != m.weight_version:
            m.weight_version = self.base if seen == "default" else seen
