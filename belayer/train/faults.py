"""The RL run's faults: a ``kill -9`` of a worker while it serves (`kill_serving_worker`), and of running
episodes' sandbox containers (`kill_sandboxes`), each counted in the run's `Report`."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
from typing import Any

import httpx

from belayer.testing.services import progress
from belayer.train.report import Report

Json = dict[str, Any]


def streaming(engine: Json) -> bool:
    """Whether a worker (an ``/api/engines`` entry) has a request that has had tokens from it."""
    return any(n > 0 for n in engine.get("in_flight_tokens", []))


async def kill_serving_worker(
    http: httpx.AsyncClient, report: Report, timeout: float = 120.0, mid_stream: bool = False
) -> None:
    """``kill -9`` the process group of a ready worker with requests in flight, once one has (with
    `mid_stream`: a request that has had tokens from it, so that its turn fails over mid-stream)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        engines = (await http.get("/api/engines")).json()["data"]
        busy = [e for e in engines if e["state"] == "ready" and e.get("pid") and e["outstanding"] > 0
                and (streaming(e) or not mid_stream)]  # fmt: skip
        if busy:
            victim = max(busy, key=lambda e: int(e["outstanding"]))
            os.killpg(os.getpgid(int(victim["pid"])), signal.SIGKILL)
            report.kills.append(victim["name"])
            progress(
                f"killed worker {victim['name']} (pid {victim['pid']}) with {victim['outstanding']} in flight"
            )
            return
        await asyncio.sleep(0.02)
    report.client_errors.append("no worker was busy to kill")


async def kill_sandboxes(live: set[str], count: int, report: Report, rng: random.Random) -> None:
    """``kill -9`` the sandbox containers of `count` running episodes (`live`: set up, not finished), one
    at a time, each at a random moment (up to 2 s after the last)."""
    import docker

    engine = await asyncio.to_thread(docker.from_env)
    try:
        for _ in range(count):
            await asyncio.sleep(rng.uniform(0.1, 2.0))  # the moment, drawn
            while True:
                session = rng.choice(sorted(live)) if live else None
                boxes = await asyncio.to_thread(
                    engine.containers.list, filters={"label": f"belayer.session={session}"}
                ) if session else []  # fmt: skip
                if boxes:
                    await asyncio.to_thread(boxes[0].kill)  # SIGKILL
                    report.sandbox_kills.append(str(session))
                    progress(f"killed the sandbox container of session {session} ({boxes[0].name})")
                    break
                await asyncio.sleep(0.05)
    finally:
        engine.close()
