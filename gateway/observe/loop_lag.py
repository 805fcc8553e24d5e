"""The event loop's lag: how late it wakes a task that sleeps a fixed interval.

Every stream, request and write of a gateway process runs on one event loop; when a callback holds it
(a long synchronous store write, a big JSON body, thousands of chunks at once), everything else waits.
`LoopLagSampler` sleeps ``interval_s`` over and over and records each overshoot in a histogram
(``belayer_event_loop_lag_seconds`` on ``/metrics``): one timer per interval, nothing per request.

Example::

    sampler = LoopLagSampler(metrics.loop_lag, interval_s=0.1)
    sampler.start()
    ...
    await sampler.close()
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

from core.tasks import TaskOwner


class LoopLagSampler:
    """Observes into `histogram` how late each ``interval_s`` sleep ends (see the module docstring)."""

    def __init__(self, histogram: Histogram, interval_s: float = 0.1) -> None:
        self.histogram = histogram
        self.interval_s = interval_s
        self._tasks = TaskOwner("loop-lag")

    def start(self) -> None:
        self._tasks.spawn(self._run(), "sample")

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t0 = loop.time()
            await asyncio.sleep(self.interval_s)
            self.histogram.observe(max(0.0, loop.time() - t0 - self.interval_s))

    async def close(self) -> None:
        await self._tasks.close()
