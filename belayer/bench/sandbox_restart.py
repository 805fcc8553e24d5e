"""``belayer bench sandbox-restart``: a restarted gateway re-adopting its sandboxes, versus restoring them.

``--sandboxes`` N sessions each get a ``belayer-sandbox-python`` container with a background HTTP server
whose hit counter lives only in its memory, a checkpoint, and a tool call after it (journaled). Then the
gateway's sandbox manager goes away as a ``kill -9`` leaves it (the containers and checkpoints stay), and:

1. a new manager on the same store adopts the running containers: ``adopt_per_sandbox_s`` (median per
   sandbox) and ``adopt_startup_s`` (all of them), each counter checked to have lived through;
2. it goes away again, every container is killed, and a third manager restores each from its checkpoint
   and replays its journal: ``restore_per_sandbox_s`` and ``restore_startup_s``, each counter checked
   to be the checkpoint's plus the replayed hits, and the file written after the checkpoint back.

``adopt_speedup`` is ``restore_per_sandbox_s / adopt_per_sandbox_s``. Figures go to stdout as
``name: value`` lines, progress to stderr. Needs a Docker engine with CRIU.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from belayer.bench import emit as _emit
from belayer.testing.services import progress
from core.errors import BenchError
from sandbox.backend import SandboxSpec
from sandbox.backends import backend_for
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.images import ensure_python_image
from sandbox.sessions.manager import SandboxManager
from sandbox.workloads import PYTHON_COUNTER_QUERY as QUERY
from sandbox.workloads import PYTHON_COUNTER_SERVER as SERVER
from store import SessionRecord, SqliteStore


def emit(name: str, value: float | int | str) -> None:
    _emit(name, value, digits=4)


async def counter(manager: SandboxManager, sid: str) -> str:
    """One hit of the session's counter server (polled until it listens); the count it answers."""
    deadline = time.monotonic() + 30
    while True:
        result = await manager.exec(sid, QUERY)
        if result.exit_code == 0:
            return result.stdout.strip()
        if time.monotonic() > deadline:
            raise BenchError(f"{sid}: the counter server never answered: {result.stderr}")
        await asyncio.sleep(0.05)  # the server is starting: poll it


async def prepare(manager: SandboxManager, store: SqliteStore, sid: str, image: str) -> None:
    store.create_session(SessionRecord(sid, time.time(), {}))
    await manager.create(sid, SandboxSpec(image=image))
    await manager.write_file(sid, "server.py", SERVER.encode())
    await manager.exec(sid, "python3 server.py >/dev/null 2>&1 &")
    assert await counter(manager, sid) == "1"
    await manager.checkpoint(sid)
    await manager.exec(sid, "echo after-checkpoint > journaled.txt")


async def run(opts: argparse.Namespace, tmp: Path) -> None:
    backend = backend_for(checkpoint_dir=tmp / "checkpoints")
    image = ensure_python_image(backend)
    store = SqliteStore(tmp / "traj.db")
    settings = SandboxConfig(enabled=True, policy=PolicySettings(mode="never"), watch_interval_s=3600.0)
    sids = [f"ses_bench{i}" for i in range(opts.sandboxes)]
    manager = SandboxManager(backend, store, settings)
    try:
        progress(f"{len(sids)} sandboxes: a counter server, a checkpoint, a tool call each")
        await asyncio.gather(*(prepare(manager, store, sid, image) for sid in sids))
        await manager.detach()  # the gateway is gone; its sandboxes are not

        manager = SandboxManager(backend, store, settings)
        adopted = await manager.adopt()
        assert sorted(adopted.adopted) == sorted(sids), adopted
        assert [await counter(manager, sid) for sid in sids] == ["2"] * len(sids)  # lived through
        boxes = [manager.sandbox_id(sid) for sid in sids]
        await manager.detach()
        for box in boxes:
            backend.kill(box)

        manager = SandboxManager(backend, store, settings)
        restored = await manager.adopt()
        assert sorted(restored.restored) == sorted(sids), restored
        # the checkpoint's 1, + the hit after the adoption (journaled, so replayed), + this one
        assert [await counter(manager, sid) for sid in sids] == ["3"] * len(sids)
        for sid in sids:
            assert (await manager.read_file(sid, "journaled.txt")) == b"after-checkpoint\n"  # replayed
    finally:
        await manager.close()
        store.close()
        backend.close()
    adopt_s = statistics.median(adopted.timings.values())
    restore_s = statistics.median(restored.timings.values())
    emit("sandboxes", len(sids))
    emit("adopt_per_sandbox_s", adopt_s)
    emit("adopt_startup_s", adopted.seconds)
    emit("restore_per_sandbox_s", restore_s)
    emit("restore_startup_s", restored.seconds)
    emit("adopt_speedup", restore_s / adopt_s)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="belayer bench sandbox-restart", description=__doc__.split("\n")[0])
    p.add_argument("--sandboxes", type=int, default=4, help="sessions with a sandbox when the gateway dies")
    opts = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="belayer-bench-") as tmp:
        asyncio.run(run(opts, Path(tmp)))
    return 0
