"""The background-task owner: named tasks, failures logged and counted, periodic work that outlives a bad
step, and close() cancelling and joining all of it."""

from __future__ import annotations

import asyncio
import inspect
import logging

import pytest

from core.tasks import TaskOwner


async def test_periodic_work_runs_each_interval_and_outlives_a_failing_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    owner = TaskOwner("test")
    rounds: list[int] = []
    third = asyncio.Event()

    async def step() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 2:
            raise RuntimeError("a bad round")
        if len(rounds) == 3:
            third.set()

    with caplog.at_level(logging.ERROR, "belayer.tasks"):
        task = owner.every(0.001, step, "sweep")
        assert task.get_name() == "test/sweep"
        await asyncio.wait_for(third.wait(), 30)  # only turns a hang into a failure
    assert rounds[:3] == [0, 1, 2] and owner.failures == 1 and owner.running == 1
    assert "periodic task test/sweep failed" in caplog.text and "a bad round" in caplog.text
    await owner.close()
    assert task.cancelled() and owner.running == 0


async def test_the_first_step_waits_one_interval_and_close_ends_the_wait() -> None:
    owner = TaskOwner("test")
    calls: list[None] = []

    async def step() -> None:
        calls.append(None)

    task = owner.every(3600, step, "hourly")
    for _ in range(10):
        await asyncio.sleep(0)
    await owner.close()
    assert calls == [] and task.cancelled()


async def test_a_failed_task_is_logged_and_counted_and_a_closed_owner_spawns_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    owner = TaskOwner("test")

    async def fail() -> None:
        raise ValueError("broken")

    with caplog.at_level(logging.ERROR, "belayer.tasks"):
        owner.spawn(fail(), "once")
        await owner.join()
    assert owner.failures == 1 and "background task test/once failed: broken" in caplog.text
    await owner.close()
    late = fail()
    with pytest.raises(RuntimeError, match="test is closed"):
        owner.spawn(late, "late")
    assert inspect.getcoroutinestate(late) == inspect.CORO_CLOSED  # closed unrun: no "never awaited" warning


async def test_a_callable_interval_is_read_before_each_sleep() -> None:
    owner = TaskOwner("test")
    order: list[str] = []
    third = asyncio.Event()

    def interval() -> float:  # a setting that may change while the work runs
        order.append("read")
        return 0.001

    async def step() -> None:
        order.append("step")
        if order.count("step") == 3:
            third.set()

    owner.every(interval, step, "probe")
    await asyncio.wait_for(third.wait(), 30)  # only turns a hang into a failure
    await owner.close()
    assert order[:6] == ["read", "step"] * 3
