"""The dashboard's memory of the live feed: totals since start, the recovery timeline, and a series.

A `Recorder` listens to the feed (`core.telemetry`). Prometheus keeps the same counts with labels; the
recorder keeps what a page needs at once when it opens: the last 300 recovery events (failovers,
worker state changes, promotions, cold starts, checkpoints, restores) and ten minutes of per-second
samples (tokens/s as they stream, mean time to first token, checkpoint time), which it also publishes as ``sample``
events so that open pages extend their charts live.

>>> hub = Telemetry()
>>> rec = Recorder(hub)
>>> hub.tokens_streamed += 8  # what the turn runner does as tokens arrive
>>> _ = hub.publish(events.TurnFinished(0, "complete", 5, 0, 8, "worker-0", 40.0, 90.0, "stop", 0))
>>> _ = hub.publish(events.ShadowPromoted("worker-1"))
>>> rec.sample(2.0)["tokens_per_s"], rec.totals.failovers, [e.kind for e in rec.timeline]
(4.0, 0, ['shadow_promoted'])
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

from core import events
from core.tasks import TaskOwner
from core.telemetry import Event, Telemetry

RECOVERY_KINDS = frozenset(
    {
        "failover", "worker_state", "shadow_promoted", "worker_cold_start", "replacement_started",
        "sandbox_checkpoint", "sandbox_restored", "sandbox_failure", "sandbox_checkpoint_failed",
        "sandbox_restore_failed", "turns_discarded",
    }
)  # fmt: skip
SERIES_SECONDS = 600


@dataclass(slots=True)
class Totals:
    """Counts since the gateway started, for the dashboard (Prometheus has the same, with labels)."""

    turns: int = 0
    tokens_generated: int = 0
    failovers: int = 0
    promotions: int = 0
    cold_starts: int = 0
    replacements: int = 0
    checkpoints: int = 0
    checkpoints_in_bubble: int = 0
    restores: int = 0
    replays: int = 0
    turns_discarded: int = 0


@dataclass(slots=True)
class Recorder:
    """Listens to the feed: keeps the totals, the recovery timeline, and a per-second series (tokens/s,
    mean time to first token, checkpoint time) that a sampler task publishes as ``sample`` events."""

    telemetry: Telemetry
    totals: Totals = field(default_factory=Totals)
    timeline: collections.deque[Event] = field(default_factory=lambda: collections.deque(maxlen=300))
    series: collections.deque[dict[str, Any]] = field(
        default_factory=lambda: collections.deque(maxlen=SERIES_SECONDS)
    )
    _streamed: int = 0
    """`Telemetry.tokens_streamed` at the last sample."""
    _turns: int = 0
    _ttft_ms: list[float] = field(default_factory=list)
    _checkpoint_s: float = 0.0
    _tasks: TaskOwner = field(default_factory=lambda: TaskOwner("dashboard-sampler"))

    def __post_init__(self) -> None:
        self.telemetry.listen(self.on_event)

    def on_event(self, e: Event) -> None:
        t = self.totals
        if e.kind in RECOVERY_KINDS:
            self.timeline.append(e)
        match e.typed:
            case events.TurnFinished(output_tokens=generated, ttft_ms=ttft_ms):
                t.turns += 1
                t.tokens_generated += generated
                self._turns += 1
                if ttft_ms is not None:
                    self._ttft_ms.append(ttft_ms)
            case events.Failover():
                t.failovers += 1
            case events.ShadowPromoted():
                t.promotions += 1
            case events.WorkerColdStart():
                t.cold_starts += 1
            case events.ReplacementStarted():
                t.replacements += 1
            case events.SandboxCheckpoint(in_bubble=in_bubble, seconds=seconds):
                t.checkpoints += 1
                t.checkpoints_in_bubble += bool(in_bubble)
                self._checkpoint_s += seconds
            case events.SandboxRestored(mode="replay"):
                t.replays += 1
            case events.SandboxRestored():
                t.restores += 1
            case events.TurnsDiscarded(turn_indices=indices):
                t.turns_discarded += len(indices)

    def sample(self, seconds: float) -> dict[str, Any]:
        """Close the current interval: its figures, published as a ``sample`` event."""
        ttft = sum(self._ttft_ms) / len(self._ttft_ms) if self._ttft_ms else None
        streamed, self._streamed = (
            self.telemetry.tokens_streamed - self._streamed,
            self.telemetry.tokens_streamed,
        )
        sample = events.Sample(
            tokens_per_s=round(streamed / seconds, 3),
            turns_per_s=round(self._turns / seconds, 3),
            ttft_ms=round(ttft, 3) if ttft is not None else None,
            checkpoint_ms=round(self._checkpoint_s * 1000, 3),
        )
        self._turns, self._ttft_ms, self._checkpoint_s = 0, [], 0.0
        event = self.telemetry.publish(sample)
        data = event.data
        self.series.append({"ts": event.ts, **data})
        return data

    def start(self, interval: float = 1.0) -> None:
        last = time.monotonic()

        async def tick() -> None:
            nonlocal last
            now = time.monotonic()
            self.sample(now - last)
            last = now

        self._tasks.every(interval, tick, "dashboard-sampler")

    async def close(self) -> None:
        await self._tasks.close()
