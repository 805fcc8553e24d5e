"""What the demo finds and says: small checks over the gateway's JSON, the `Findings` it prints as
``name: value`` lines, its progress lines (`say`), and `DemoFailed`.

>>> serving_worker([{"name": "w0", "state": "ready", "outstanding": 0, "pid": 7},
...                 {"name": "w1", "state": "ready", "outstanding": 1, "pid": 8}])["name"]
'w1'
>>> token_mismatches([{"prompt_ids": [1], "output_ids": [2, 3]}], [{"prompt_ids": [1], "output_ids": [2, 4]}])
['turn 0: output ids differ from index 1']
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from core.errors import BelayerError

Json = dict[str, Any]


def say(message: str) -> None:
    print(f"[demo] {message}", flush=True)


class DemoFailed(BelayerError):
    """The demo could not show what it shows (the gateway did not start, the kill came too late)."""


def serving_worker(engines: list[Json]) -> Json | None:
    """The worker with requests in flight (the one serving the only open stream), or None."""
    busy = [e for e in engines if e["state"] == "ready" and e.get("pid") and e["outstanding"] > 0]
    return max(busy, key=lambda e: int(e["outstanding"]), default=None)


def token_mismatches(turns: list[Json], reference: list[Json]) -> list[str]:
    """Where two trajectories' token ids differ, turn by turn (prompt and output); [] when equal."""
    if len(turns) != len(reference):
        return [f"{len(turns)} turns, the undisturbed run has {len(reference)}"]
    found = []
    for i, (got, ref) in enumerate(zip(turns, reference, strict=True)):
        for key in ("prompt_ids", "output_ids"):
            a, b = got[key], ref[key]
            if a != b:
                at = next(
                    (j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
                )
                found.append(f"turn {i}: {key.removesuffix('_ids')} ids differ from index {at}")
    return found


def failover_event(trajectory: Json) -> Json | None:
    """The data of the trajectory's first ``failover`` event (token index, workers, timings)."""
    return next((e["data"] for e in trajectory["events"] if e["kind"] == "failover"), None)


def timeline_worker(timeline: list[Json], kind: str) -> str | None:
    """The worker named by the first live-feed event of `kind` (``shadow_promoted``, ...)."""
    return next((e["data"].get("worker") for e in timeline if e["kind"] == kind), None)


def cold_start_s(timeline: list[Json], worker: str) -> float | None:
    """How long `worker` took to start, from its ``worker_cold_start`` event."""
    return next(
        (float(e["data"]["seconds"]) for e in timeline
         if e["kind"] == "worker_cold_start" and e["data"].get("worker") == worker),
        None,
    )  # fmt: skip


@dataclass
class Findings:
    """What the demo prints at the end, as ``name: value`` lines."""

    lines: list[tuple[str, str]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, value: object) -> None:
        self.lines.append((name, str(value)))

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time a phase of the demo, for the ``phases_s`` line."""
        started = time.monotonic()
        try:
            yield
        finally:
            self.phases[name] = time.monotonic() - started

    def check(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.problems.append(problem)
        return ok
