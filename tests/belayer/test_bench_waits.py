"""How the benches wait (`belayer.bench.waits`): every wait has a deadline and, when it gives up, names
what it waited for and why it stopped early. The recovery benches' wait for the worker serving their
stream (`belayer.bench.pool.serving_worker`) against a pool that `GET /api/engines` shows (an
`httpx.MockTransport`): `bench recovery` crashed with a StopIteration inside a coroutine when no worker
had the stream outstanding (the stream had ended)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from belayer.bench.pool import busy_worker, serving_worker
from belayer.bench.waits import failure, found, until, within
from core.errors import BenchError

URL = "http://gw"


def _pool(*engines: tuple[str, str, int]) -> httpx.AsyncClient:
    data = [{"name": n, "state": s, "outstanding": o, "pid": 100 + i} for i, (n, s, o) in enumerate(engines)]

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/api/engines"
        return httpx.Response(200, json={"data": data})

    return httpx.AsyncClient(transport=httpx.MockTransport(answer))


async def _stream_that(tokens: int, error: Exception | None = None) -> tuple[asyncio.Task[None], list[float]]:
    """A stream task already over: `tokens` arrivals, ended or failed with `error`."""
    arrivals = [0.0] * tokens

    async def stream() -> None:
        if error is not None:
            raise error

    task = asyncio.create_task(stream(), name="the stream")
    await asyncio.gather(task, return_exceptions=True)
    return task, arrivals


async def test_until_gives_up_at_its_deadline_naming_what_it_waited_for() -> None:
    with pytest.raises(BenchError) as caught:
        await until(lambda: False, "the pool's 2 ready workers", 0.05)
    assert str(caught.value) == "gave up waiting for the pool's 2 ready workers after 0.05 s"


async def test_found_gives_up_at_once_when_the_thing_can_no_longer_come() -> None:
    async def never() -> None:
        return None

    with pytest.raises(BenchError) as caught:  # no deadline reached: the hour is never waited
        await found(never, "a busy worker", 3600, hopeless=lambda: "the stream ended after 7 tokens")
    assert str(caught.value) == "gave up waiting for a busy worker: the stream ended after 7 tokens"


async def test_found_returns_the_first_result_that_is_not_none() -> None:
    answers: list[dict[str, Any] | None] = [None, None, {"name": "w1"}]

    async def probe() -> dict[str, Any] | None:
        return answers.pop(0)

    assert await found(probe, "w1", 60, interval=0) == {"name": "w1"}
    assert answers == []


async def test_within_names_what_it_waited_for() -> None:
    with pytest.raises(BenchError) as caught:
        await within(asyncio.Event().wait(), "the checkpoints in the background", 0.05)
    assert str(caught.value) == "gave up waiting for the checkpoints in the background after 0.05 s"
    assert await within(asyncio.sleep(0, "done"), "a sleep", 60) == "done"


async def test_failure_names_the_first_task_that_failed() -> None:
    ok, _ = await _stream_that(3)
    failed, _ = await _stream_that(3, RuntimeError("HTTP 502"))
    assert failure([ok]) is None
    assert failure([ok, failed]) == "the stream failed: RuntimeError: HTTP 502"


async def test_a_busy_worker_is_a_live_one_with_a_request_outstanding() -> None:
    async with _pool(("w0", "dead", 1), ("w1", "ready", 0), ("s0", "shadow", 0)) as http:
        assert await busy_worker(http, URL) is None
    async with _pool(("w0", "dead", 1), ("w1", "ready", 1)) as http:
        assert (await busy_worker(http, URL) or {})["name"] == "w1"


async def test_the_serving_worker_of_a_stream_that_ended_first_is_a_bench_error_not_a_stop_iteration() -> (
    None
):
    stream, arrivals = await _stream_that(420)  # the engine finished the reply: nobody has it outstanding
    async with _pool(("w0", "ready", 0), ("w1", "ready", 0), ("s0", "shadow", 0)) as http:
        with pytest.raises(BenchError) as caught:
            await serving_worker(http, URL, stream, arrivals, 20)
    assert str(caught.value) == (
        "gave up waiting for a worker with the stream outstanding: the stream ended after 420 tokens"
    )


async def test_a_stream_that_ends_before_the_kill_says_so() -> None:
    stream, arrivals = await _stream_that(3)
    async with _pool(("w0", "ready", 0)) as http:
        with pytest.raises(BenchError) as caught:
            await serving_worker(http, URL, stream, arrivals, 20)
    assert (
        str(caught.value)
        == "gave up waiting for the stream's first 20 tokens: the stream ended after 3 tokens"
    )
    failed, arrivals = await _stream_that(0, httpx.ReadError("connection reset"))
    async with _pool(("w0", "ready", 0)) as http:
        with pytest.raises(BenchError) as caught:
            await serving_worker(http, URL, failed, arrivals, 20)
    assert str(caught.value) == (
        "gave up waiting for the stream's first 20 tokens: the stream failed: ReadError: connection reset"
    )


async def test_the_serving_worker_of_a_running_stream_is_found() -> None:
    running = asyncio.create_task(asyncio.Event().wait(), name="the stream")
    try:
        async with _pool(("w0", "dead", 0), ("w1", "ready", 1), ("s0", "shadow", 0)) as http:
            victim = await serving_worker(http, URL, running, [0.0] * 20, 20)
        assert (victim["name"], victim["pid"]) == ("w1", 101)
    finally:
        running.cancel()
