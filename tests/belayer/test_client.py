"""The trainer's client against a real gateway on a socket (the finished feed streams): sessions that
close on exit, rewards, trajectories, both SDKs through the session's URLs, and the finished feed
followed live, resumed by cursor, over a dropped connection and across a gateway restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pyarrow.parquet as pq
import pytest

from belayer.client import AsyncBelayer, Backoff, Belayer, ClientError, Finished
from core.net import free_port
from engine_pool.fake import FakeEngine
from engine_pool.pool import EnginePool
from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.serve.server import build_server
from sandbox.fake import FakeSandboxBackend

TOKEN = "secret"
QUICK = Backoff(first=0.05, most=0.5, attempts=60)


@pytest.fixture
def config(tmp_path: Path, tiny_model_dir: Path) -> GatewayConfig:
    config = GatewayConfig(
        model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), api_token=TOKEN, port=free_port()
    )
    config.server.shutdown_grace_s = 5.0
    return config


@contextlib.asynccontextmanager
async def served(config: GatewayConfig, sandboxes: FakeSandboxBackend | None = None) -> AsyncIterator[str]:
    """The gateway as it runs in production (its server ends open feeds at shutdown) on a socket; with
    `sandboxes`, sessions get sandboxes from that fake backend."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(FakeEngine().app())) as engine_http:
        pool = EnginePool(engine_http)
        pool.add_remote("http://fake-engine")
        server = build_server(build_app(config, pool=pool, sandbox_backend=sandboxes), config)
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                assert not serving.done(), "the gateway did not start"
                await asyncio.sleep(0.01)
            yield f"http://127.0.0.1:{config.port}"
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 10)


async def in_thread(fn: Callable[[], Any]) -> Any:
    """Sync client code, off the loop that serves the gateway."""
    return await asyncio.to_thread(fn)


def one_episode_sync(url: str) -> tuple[str, dict[str, Any]]:
    with Belayer(url, token=TOKEN) as gw, gw.session(metadata={"task": "t1"}) as s:
        assert s.anthropic_base_url == s.openai_base_url.removesuffix("/v1")
        chat = openai.OpenAI(base_url=s.openai_base_url, api_key="unused", max_retries=0)
        answer = chat.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert answer.choices[0].message.content
        claude = anthropic.Anthropic(base_url=s.anthropic_base_url, api_key="unused", max_retries=0)
        message = claude.messages.create(
            model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert message.content
        assert s.reward(0.5, info={"passed": 1})["reward"] == 0.5
        traj = s.trajectory()
        assert [len(t["output_ids"]) for t in traj["turns"]] == [4, 4]
        return s.id, traj


async def test_a_sync_session_makes_real_sdk_requests_and_closes_on_exit(config: GatewayConfig) -> None:
    async with served(config) as url:
        sid, traj = await in_thread(lambda: one_episode_sync(url))
        assert traj["session"]["id"] == sid and traj["session"]["reward_info"] == {"passed": 1}

        def afterwards() -> None:
            with Belayer(url, token=TOKEN) as gw:
                assert gw.get_session(sid).summary["status"] == "closed"
                with pytest.raises(RuntimeError, match="the agent broke"), gw.session() as s:
                    broken = s.id
                    raise RuntimeError("the agent broke")
                assert gw.get_session(broken).summary["status"] == "closed"
                with pytest.raises(ClientError) as final:
                    gw.get_session(sid).reward(1.0)
                assert (final.value.status, final.value.code) == (409, "reward_final")
                with pytest.raises(ClientError) as missing:
                    gw.get_session("ses_nope")
                assert (missing.value.status, missing.value.code, missing.value.param) == (
                    404, "session_not_found", "session_id",
                )  # fmt: skip
                assert [s["id"] for s in gw.sessions(status="closed", page_size=1)] == [sid, broken]
                assert [s["id"] for s in gw.sessions(metadata={"task": "t1"})] == [sid]
                assert [s["id"] for s in gw.sessions(has_reward=False)] == [broken]
            with Belayer(url) as anonymous, pytest.raises(ClientError) as refused:
                anonymous.session()
            assert refused.value.status == 401 and "API token" in refused.value.message

        await in_thread(afterwards)


async def test_a_session_runs_commands_in_its_sandbox(config: GatewayConfig, tmp_path: Path) -> None:
    config.sandbox.enabled, config.sandbox.checkpoint_dir = True, tmp_path / "checkpoints"
    async with served(config, FakeSandboxBackend()) as url:
        async with AsyncBelayer(url, token=TOKEN) as gw, gw.session(sandbox={"image": "busybox"}) as s:
            await s.exec("echo seven > /workspace/red")
            assert (await s.exec("cat /workspace/red"))["stdout"] == "seven\n"
            failed = await s.exec("cat /workspace/blue", timeout_s=5)
            assert failed["exit_code"] != 0 and failed["stdout"] == ""
            sid = s.id

        def sync_side() -> None:
            with Belayer(url, token=TOKEN) as gw:
                with gw.session(sandbox={"image": "busybox"}) as other:
                    assert other.exec("cat /workspace/red")["exit_code"] != 0  # its own sandbox
                with pytest.raises(ClientError) as closed:
                    gw.get_session(sid).exec("true")
                assert (closed.value.status, closed.value.code) == (
                    404,
                    "sandbox_not_found",
                )  # closed with it

        await in_thread(sync_side)


async def test_both_clients_name_a_sessions_routing_group(config: GatewayConfig) -> None:
    async with served(config) as url, AsyncBelayer(url, token=TOKEN) as gw:
        async with gw.session(metadata={"task": "t3"}, group="task-3") as s:
            assert (s.group, s.summary["metadata"]) == ("task-3", {"task": "t3"})
            assert (await gw.get_session(s.id)).group == "task-3"
        assert (await gw.session()).group is None
        with pytest.raises(ClientError) as bad:
            await gw.session(group="")
        assert (bad.value.status, bad.value.param, bad.value.code) == (400, "group", "invalid_value")

        def sync_side() -> tuple[str | None, str | None, str | None]:
            with Belayer(url, token=TOKEN) as sync, sync.session(group="task-4") as t:
                return t.group, sync.get_session(t.id).group, sync.session().group

        assert await in_thread(sync_side) == ("task-4", "task-4", None)


async def test_both_clients_give_a_session_the_seed_its_keyed_sampling_derives_from(
    config: GatewayConfig,
) -> None:
    async with served(config) as url, AsyncBelayer(url, token=TOKEN) as gw:
        async with gw.session(seed=2**63 - 1) as s:
            assert s.summary["seed"] == 2**63 - 1 == (await gw.get_session(s.id)).summary["seed"]
        assert (await gw.session()).summary["seed"] is None
        with pytest.raises(ClientError) as bad:
            await gw.session(seed=2**63)
        assert (bad.value.status, bad.value.param) == (400, "seed")

        def sync_side() -> int | None:
            with Belayer(url, token=TOKEN) as sync, sync.session(seed=7) as t:
                return sync.get_session(t.id).summary["seed"]  # type: ignore[no-any-return]

        assert await in_thread(sync_side) == 7


async def test_listings_take_times_as_datetimes_or_unix_seconds_and_list_oldest_first(
    config: GatewayConfig,
) -> None:
    async with served(config) as url, AsyncBelayer(url, token=TOKEN) as gw:
        first, second = await gw.session(), await gw.session()
        made = [first.summary["created_at"], second.summary["created_at"]]
        between = datetime.fromtimestamp((made[0] + made[1]) / 2)  # naive: local time, as the client reads it

        async def ids(**filters: Any) -> list[str]:
            return [s["id"] async for s in gw.sessions(**filters)]

        assert await ids() == [first.id, second.id]  # the client's order: oldest first
        assert await ids(order="desc") == [second.id, first.id]  # the HTTP route's default
        assert await ids(created_after=between) == [second.id]
        assert await ids(created_before=between.astimezone(UTC)) == [first.id]
        assert await ids(created_after=made[1]) == [second.id]  # Unix seconds, as the gateway takes them
        with pytest.raises(ClientError) as bad:
            await ids(created_after="yesterday")
        assert (bad.value.status, bad.value.param) == (400, "created_after")

        def sync_side() -> list[str]:
            with Belayer(url, token=TOKEN) as sync:
                return [s["id"] for s in sync.sessions(created_after=between)]

        assert await in_thread(sync_side) == [second.id]


async def test_an_async_session_makes_real_sdk_requests_and_closes_on_exit(config: GatewayConfig) -> None:
    async with served(config) as url, AsyncBelayer(url, token=TOKEN) as gw:
        async with gw.session(metadata={"task": "t2"}) as s:
            chat = openai.AsyncOpenAI(base_url=s.openai_base_url, api_key="unused", max_retries=0)
            await chat.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            claude = anthropic.AsyncAnthropic(base_url=s.anthropic_base_url, api_key="unused", max_retries=0)
            await claude.messages.create(
                model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            await s.reward(1.0)
            assert len((await s.trajectory())["turns"]) == 2
        assert (await gw.get_session(s.id)).summary["status"] == "closed"
        with pytest.raises(KeyError):
            async with gw.session() as broken:
                raise KeyError("boom")
        assert (await gw.get_session(broken.id)).summary["status"] == "closed"
        plain = await gw.session()  # awaited, not entered: the caller closes it
        assert (await plain.close())["status"] == "closed"
        assert [x["id"] async for x in gw.sessions(status="closed", page_size=2)] == [
            s.id,
            broken.id,
            plain.id,
        ]
        out = Path(config.store_path).parent
        assert await gw.export(out / "out.jsonl", status="closed", page_size=1) == 2  # two branches
        assert [json.loads(line)["session_id"] for line in (out / "out.jsonl").read_text().splitlines()] == [
            s.id
        ] * 2
        assert await gw.export(out / "out.parquet", "parquet", status="closed", page_size=1) == 2  # 3 pages
        assert pq.read_table(out / "out.parquet").column("session_id").to_pylist() == [s.id] * 2
        assert await gw.export(out / "read.jsonl", status="closed", mark=False) == 2  # GET: reads only
        assert (out / "read.jsonl").read_text() == (out / "out.jsonl").read_text()
        with pytest.raises(ClientError) as bad:
            [x async for x in gw.finished(after="not-a-cursor")]
        assert (bad.value.status, bad.value.param) == (400, "after")


async def close_new(gw: AsyncBelayer, n: int) -> list[str]:
    """`n` sessions with one turn each, closed in order."""
    ids = []
    for i in range(n):
        async with gw.session(metadata={"n": i}) as s:
            chat = openai.AsyncOpenAI(base_url=s.openai_base_url, api_key="unused", max_retries=0)
            await chat.chat.completions.create(
                model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
            )
        ids.append(s.id)
    return ids


async def test_the_finished_feed_has_the_backlog_then_follows_and_resumes_exactly(
    config: GatewayConfig,
) -> None:
    async with served(config) as url, AsyncBelayer(url, token=TOKEN, backoff=QUICK) as gw:
        first = await close_new(gw, 3)
        backlog = [item async for item in gw.finished(follow=False)]
        assert [i.session["id"] for i in backlog] == first
        assert all(
            isinstance(i, Finished) and i.rows and i.rows[0]["session_id"] == i.session["id"] for i in backlog
        )

        # following: the backlog, then sessions as they close
        seen: asyncio.Queue[Finished] = asyncio.Queue()

        async def follow(after: str | None) -> None:
            async for item in gw.finished(after=after, rows=False):
                await seen.put(item)

        follower = asyncio.create_task(follow(backlog[0].cursor))
        got = [await asyncio.wait_for(seen.get(), 10) for _ in range(2)]
        assert [i.session["id"] for i in got] == first[1:] and got[0].rows is None
        later = await close_new(gw, 2)
        got = [await asyncio.wait_for(seen.get(), 10) for _ in range(2)]
        assert [i.session["id"] for i in got] == later
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower

        # a trainer that stopped after its cursor gets exactly the rest, closed while it was away or not
        everything = [*first, *later]
        stopped_at = backlog[1].cursor
        more = await close_new(gw, 2)
        rest = [i.session["id"] async for i in gw.finished(after=stopped_at, follow=False)]
        assert rest == [*everything[2:], *more]
        two = [i.session["id"] async for i in gw.finished(after=stopped_at, follow=True, limit=2)]
        assert two == everything[2:4]


class DropOnce(httpx.AsyncBaseTransport):
    """A network that cuts the first finished-feed connection right after its first finished event."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.feeds = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await self.inner.handle_async_request(request)
        if request.url.path != "/api/finished":
            return response
        self.feeds += 1
        if self.feeds > 1:
            return response
        stream = response.stream
        assert isinstance(stream, httpx.AsyncByteStream)

        async def cut() -> AsyncIterator[bytes]:
            buffer = b""
            async for chunk in stream:
                buffer += chunk
                while b"\n\n" in buffer:
                    block, buffer = buffer.split(b"\n\n", 1)
                    yield block + b"\n\n"
                    if b"event: finished" in block:
                        await stream.aclose()
                        raise httpx.RemoteProtocolError("peer closed connection (the test cut it)")

        return httpx.Response(response.status_code, headers=response.headers, stream=_Stream(cut()))

    async def aclose(self) -> None:
        await self.inner.aclose()


class _Stream(httpx.AsyncByteStream):
    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.chunks:
            yield chunk


async def test_a_dropped_feed_reconnects_from_the_last_cursor_it_yielded(config: GatewayConfig) -> None:
    network = DropOnce()
    async with (
        served(config) as url,
        AsyncBelayer(url, token=TOKEN) as setup,
        AsyncBelayer(url, token=TOKEN, backoff=QUICK, transport=network) as gw,
    ):
        ids = await close_new(setup, 3)
        assert [i.session["id"] async for i in gw.finished(follow=False)] == ids
        assert network.feeds == 2


async def test_a_sync_follower_continues_across_a_gateway_restart(config: GatewayConfig) -> None:
    """The follower (a trainer's thread) sees the gateway stop, reconnects to the new one on the same
    store, and gets each session once; a new reader from its saved cursor gets only what came after."""
    items: queue.Queue[Finished | BaseException] = queue.Queue()
    url = f"http://127.0.0.1:{config.port}"

    def follow() -> None:
        try:
            with Belayer(url, token=TOKEN, backoff=QUICK) as gw:
                for n, item in enumerate(gw.finished(follow=True), 1):
                    items.put(item)
                    if n == 4:  # the 2 sessions before the restart and the 2 after
                        return
        except BaseException as e:  # the test reads it
            items.put(e)

    def take(n: int) -> list[Finished]:
        out = []
        for _ in range(n):
            got = items.get(timeout=20)
            assert isinstance(got, Finished), got
            out.append(got)
        return out

    follower = threading.Thread(target=follow, name="trainer")
    async with served(config), AsyncBelayer(url, token=TOKEN) as gw:
        before = await close_new(gw, 2)
        follower.start()
        got = await in_thread(lambda: take(2))
        assert [i.session["id"] for i in got] == before
    # the gateway is down: the follower retries; the next one opens the same store
    await asyncio.sleep(0.3)
    async with served(config), AsyncBelayer(url, token=TOKEN) as gw:
        after = await close_new(gw, 2)
        got += await in_thread(lambda: take(2))
        assert [i.session["id"] for i in got] == [*before, *after]
        assert len({i.cursor for i in got}) == 4
        resumed = [i.session["id"] async for i in gw.finished(after=got[1].cursor, follow=False)]
        assert resumed == after
    await in_thread(lambda: follower.join(10))
    assert not follower.is_alive() and items.empty()
