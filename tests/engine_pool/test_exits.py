"""A launched worker's death noticed by its pidfds (``engine_pool.workers.exits``): which processes of its group
are vital, a watch that fires once and not after it was closed, and the pool's side: a dead engine-core
stand-in fences its worker without a probe, and a planned stop (a removal, a stop) is no death."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from engine_pool.fake import ENGINE_CORE_ENV, ENGINE_CORE_TITLE
from engine_pool.pool import DEAD, READY, EnginePool
from engine_pool.workers.exits import ExitWatch, vital
from engine_pool.workers.worker import launch_group, stop_group
from gateway.app import build_pool
from gateway.config import GatewayConfig

# the server (bash, then sleep) starts a child titled as vLLM titles its engine core, and a helper that is not
GROUP = [
    "bash",
    "-c",
    f"(exec -a {ENGINE_CORE_TITLE} sleep 600) & (exec -a helper sleep 600) & exec sleep 600",
]


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def group_of_three(tmp_path: Path) -> tuple[subprocess.Popen[bytes], int, int, int]:
    """The reaper over `GROUP` once all its processes run: (reaper, server, engine core, helper)."""
    proc = launch_group(sys.executable, GROUP, {}, tmp_path / "group.log")
    async with asyncio.timeout(30):
        while True:  # processes starting in other processes: looked at until they are there
            server = children(proc.pid)
            kids = children(server[0]) if server else []
            titles = {k: Path(f"/proc/{k}/cmdline").read_bytes().split(b"\0")[0] for k in kids}
            if server and sorted(titles.values()) == [ENGINE_CORE_TITLE.encode(), b"helper"]:
                break
            await asyncio.sleep(0.01)
    core = next(k for k, t in titles.items() if t == ENGINE_CORE_TITLE.encode())
    helper = next(k for k, t in titles.items() if t == b"helper")
    return proc, server[0], core, helper


async def test_vital_processes_are_the_reaper_the_server_and_vllms_titled_ones(tmp_path: Path) -> None:
    proc, server, core, helper = await group_of_three(tmp_path)
    try:
        assert sorted(vital(proc.pid)) == sorted(
            [(proc.pid, "the reaper"), (server, "the server"), (core, ENGINE_CORE_TITLE)]
        )
        assert helper not in dict(vital(proc.pid))  # a process vLLM does not title: it may come and go
        assert vital(proc.pid, prefix="OTHER") == [(proc.pid, "the reaper"), (server, "the server")]
    finally:
        await stop_group(proc, grace=0.0)


async def test_the_watch_fires_once_at_the_first_exit_and_never_once_closed(tmp_path: Path) -> None:
    proc, server, core, helper = await group_of_three(tmp_path)
    loop = asyncio.get_running_loop()
    fired: asyncio.Future[tuple[str, float]] = loop.create_future()
    calls: list[str] = []

    def on_exit(why: str, at: float) -> None:
        calls.append(why)
        fired.set_result((why, at))

    watch = ExitWatch(on_exit)
    closed = ExitWatch(lambda why, at: calls.append(f"closed watch: {why}"))
    try:
        for pid, what in vital(proc.pid):
            assert watch.add(pid, what) and closed.add(pid, what)
        assert watch.watching == closed.watching == 3
        closed.close()
        os.kill(helper, signal.SIGKILL)  # not vital: nothing fires
        os.kill(core, signal.SIGKILL)
        async with asyncio.timeout(30):
            why, at = await fired
        assert why == f"{ENGINE_CORE_TITLE} (pid {core}) exited" and at <= time.monotonic()
        assert watch.watching == 0 and watch.fired == why
    finally:
        await stop_group(proc, grace=0.0)  # the other vital processes exit too: the watch fired once
    gone: asyncio.Future[str] = loop.create_future()
    late = ExitWatch(lambda why, at: gone.set_result(why))
    assert late.add(server, "the server")  # gone and reaped: fires in the next iteration
    async with asyncio.timeout(30):
        assert await gone == f"the server (pid {server}) exited"
    assert calls == [why]


# --- the pool ----------------------------------------------------------------------------------------


async def until(pool: EnginePool, done: object, timeout: float = 60.0) -> None:
    """Wait, on the pool's state changes, until ``done()`` holds."""
    assert callable(done)
    async with asyncio.timeout(timeout):
        while not done():
            await pool.roster.wait_change(1.0)


@pytest.fixture
async def pool(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[EnginePool]:
    """Two launched fake workers, each with an engine-core stand-in; no probe round ever runs."""
    monkeypatch.setenv(ENGINE_CORE_ENV, "1")
    config = GatewayConfig(
        model=str(tiny_model_dir), worker_kind="fake", workers=2, shadows=0, log_dir=str(tmp_path / "logs"),
        worker_start_timeout=60.0,
    )  # fmt: skip
    async with httpx.AsyncClient(timeout=10) as http:
        pool = build_pool(config, http)
        pool.settings.probe_interval = 3600.0  # only the watch can notice a death
        try:
            await pool.start()
            yield pool
        finally:
            await pool.stop()


async def test_a_dead_engine_core_fences_its_lingering_worker_at_once(pool: EnginePool) -> None:
    first, second = pool.roster.ready()
    assert first.process is not None and first.process.pid is not None
    assert first.process.watched == 3  # the reaper, the server, its engine core
    [core] = [pid for pid, what in vital(first.process.pid) if what == ENGINE_CORE_TITLE]
    cut: list[Exception] = []
    first.streams.add(cut.append)  # as a running stream's guard registers itself
    os.kill(core, signal.SIGKILL)
    await until(pool, lambda: first.state == DEAD)
    assert [type(e).__name__ for e in cut] == ["WorkerExited"]
    assert str(cut[0]).startswith(f"worker {first.name}: {ENGINE_CORE_TITLE} (pid {core}) exited")
    assert second.state == READY and second.process is not None and second.process.watched == 3


async def test_a_planned_stop_is_no_death(pool: EnginePool) -> None:
    first, second = pool.roster.ready()
    assert first.process is not None and second.process is not None
    launched = pool.factory.launched
    removed = await pool.remove(first.name, drain_timeout=0.0)  # a scale-down
    assert removed.state == DEAD and first.process.watched == 0
    assert second.process.pid is not None
    witness: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    seen = ExitWatch(lambda why, at: witness.set_result(why))
    seen.add(second.process.pid, "the reaper")  # readable with the pool's watch, had stop left it open
    await second.process.stop()  # stopped by hand while ready: no watch may take it for a death
    async with asyncio.timeout(30):
        await witness  # by now the pool's watch, had it been left open, would have fired
    assert second.process.watched == 0 and not second.process.alive()
    assert second.state == READY and second.last_transition is not None
    assert not str(second.last_transition["why"]).startswith("failed")
    assert pool.factory.launched == launched  # no replacement was launched
