"""The manager's own thread pools: long tool calls never stall other sessions' work."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from sandbox.fake import Shell
from tests.sandbox.sessions.conftest import Env, EnvFactory, eventually


def blocking(env: Env, go: threading.Event) -> list[str]:
    """Register `wait-go`: a command that blocks until `go` is set; returns who entered it."""
    entered: list[str] = []
    lock = threading.Lock()

    def wait_go(shell: Shell, argv: list[str]) -> int:
        with lock:
            entered.append(argv[1])
        shell.wait(go)
        shell.print(f"{argv[1]} done\n")
        return 0

    env.backend.commands["wait-go"] = wait_go
    return entered


async def test_twenty_long_tool_calls_do_not_stall_another_sessions_exec_or_checkpoint(env: Env) -> None:
    # asyncio's default pool has min(32, cpus + 4) threads: 6 on 2 cores. Pin it small, so that a
    # manager using it (as it once did) would stall here on any machine.
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(4))
    go = threading.Event()
    entered = blocking(env, go)
    sessions = [await env.session(f"s{i}") for i in range(21)]
    long_calls = [
        asyncio.create_task(env.manager.exec(sid, f"wait-go {sid}", timeout_s=60)) for sid in sessions[:20]
    ]
    try:
        await eventually(lambda: len(entered) == 20, "all 20 long calls running at once")
        other = sessions[20]
        # The 20 are held until `go` is set, after these: a manager that queued these behind them would
        # never answer, so the order proves it and the (generous) timeouts only turn a hang into a failure.
        result = await asyncio.wait_for(env.manager.exec(other, "echo prompt > f; cat f"), 30)
        ckpt = await asyncio.wait_for(env.manager.checkpoint(other), 30)
        await asyncio.wait_for(env.manager.write_file(other, "g", b"x"), 30)
        assert await asyncio.wait_for(env.manager.read_file(other, "g"), 30) == b"x"
        assert (result.stdout, ckpt.session_id) == ("prompt\n", other)
        assert not any(task.done() for task in long_calls)  # the 20 are still blocked
    finally:
        go.set()
    results = await asyncio.gather(*long_calls)
    assert [r.stdout for r in results] == [f"{sid} done\n" for sid in sessions[:20]]


async def test_an_exec_queued_for_a_thread_has_not_hung(make_env: EnvFactory) -> None:
    env = await make_env(exec_threads=1, exec_grace_s=0.2)
    go = threading.Event()
    entered = blocking(env, go)
    first, second = await env.session("s1"), await env.session("s2")
    holder = asyncio.create_task(env.manager.exec(first, "wait-go s1", timeout_s=10))
    await eventually(lambda: entered == ["s1"])
    queued = asyncio.create_task(env.manager.exec(second, "echo late", timeout_s=0.1))  # deadline 0.3 s
    await asyncio.sleep(0.5)  # longer than its deadline, all of it waiting for the one thread
    assert not queued.done()
    go.set()

    assert (await holder).stdout == "s1 done\n"
    assert (await queued).stdout == "late\n"
    assert "sandbox_failure" not in env.kinds("s2")


async def test_close_stops_the_pools(make_env: EnvFactory) -> None:
    env = await make_env()
    sid = await env.session()
    await env.manager.exec(sid, "true")
    await env.manager.checkpoint(sid)
    await env.manager.close()

    def pool_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith(("sandbox-exec", "sandbox-op"))]

    await eventually(lambda: pool_threads() == [])
    assert env.backend.sandboxes == [] and env.backend.checkpoint_ids == []
