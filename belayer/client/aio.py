"""`AsyncBelayer`, the trainer client for asyncio: `belayer.client.sync`'s API, awaited (``finished``
and ``sessions`` are async iterators), over the same requests and answers (`belayer.client.wire`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Generator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from belayer.client import wire
from belayer.client.wire import (
    DEFAULT_TIMEOUT,
    EXPORT_PAGE_SIZE,
    PAGE_SIZE,
    Backoff,
    ClientError,
    ExportPages,
    Feed,
    Finished,
    Pages,
    Request,
    SessionView,
)


class AsyncSession(SessionView):
    """`Session` for `AsyncBelayer`: ``async with gw.session() as s`` (or ``s = await gw.session()``)."""

    def __init__(self, client: AsyncBelayer, summary: dict[str, Any]) -> None:
        super().__init__(summary)
        self._client = client

    async def reward(self, value: float, info: Mapping[str, Any] | None = None) -> dict[str, Any]:
        self.summary = await self._client._call(wire.reward_request(self.id, value, info))
        return self.summary

    async def exec(self, command: str, timeout_s: float | None = None) -> dict[str, Any]:
        """Run `command` in the session's sandbox (``POST …/sandbox/exec``): ``stdout``, ``stderr``,
        ``exit_code``. A sandbox that failed meanwhile is restored first and the command runs there."""
        result: dict[str, Any] = await self._client._call(wire.exec_request(self.id, command, timeout_s))
        return result

    async def trajectory(self, token_text: bool = False) -> dict[str, Any]:
        traj: dict[str, Any] = await self._client._call(wire.trajectory_request(self.id, token_text))
        return traj

    async def refresh(self) -> dict[str, Any]:
        self.summary = await self._client._call(wire.session_request(self.id))
        return self.summary

    async def close(self) -> dict[str, Any]:
        self.summary = await self._client._call(wire.close_request(self.id))
        return self.summary


class _SessionStart:
    """What `AsyncBelayer.session` returns: awaitable (the session) and an async context manager (the
    session, closed on exit)."""

    def __init__(self, client: AsyncBelayer, request: Request) -> None:
        self._client, self._request = client, request
        self._session: AsyncSession | None = None

    async def _create(self) -> AsyncSession:
        return AsyncSession(self._client, await self._client._call(self._request))

    def __await__(self) -> Generator[Any, None, AsyncSession]:
        return self._create().__await__()

    async def __aenter__(self) -> AsyncSession:
        self._session = await self._create()
        return self._session

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        assert self._session is not None
        if error is None:
            await self._session.close()
            return
        try:
            await asyncio.shield(self._session.close())  # a cancelled episode is still closed
        except (ClientError, asyncio.CancelledError) as close_error:
            error.add_note(f"and closing session {self._session.id} failed: {close_error!r}")


class AsyncBelayer:
    """`Belayer` for asyncio: the same methods, awaited (``finished`` and ``sessions`` are async
    iterators)."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        *,
        backoff: Backoff | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.backoff = backoff or Backoff()
        self._http = httpx.AsyncClient(
            base_url=self.url, headers=wire.headers(token), timeout=timeout, transport=transport
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncBelayer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _request(self, r: Request) -> httpx.Response:
        try:
            return await self._http.request(r.method, r.path, params=r.params, json=r.json)
        except httpx.TransportError as e:
            raise wire.unreachable(e, r, self.url) from e

    async def _call(self, r: Request) -> Any:
        return wire.json_of(await self._request(r))

    async def health(self) -> dict[str, Any]:
        body: dict[str, Any] = (await self._request(wire.HEALTH)).json()
        return body

    async def weights(self) -> dict[str, Any]:
        """``GET /api/weights``: the version served, each worker's, and the recent updates."""
        body: dict[str, Any] = await self._call(wire.WEIGHTS)
        return body

    async def update_weights(self, version: str, path: str, drain_s: float | None = None) -> dict[str, Any]:
        """``POST /api/weights`` (admin): every worker onto the weights at `path`, served as `version`."""
        body: dict[str, Any] = await self._call(wire.update_weights_request(version, path, drain_s))
        return body

    def session(
        self,
        metadata: Mapping[str, Any] | None = None,
        sandbox: Mapping[str, Any] | None = None,
        group: str | None = None,
        seed: int | None = None,
    ) -> _SessionStart:
        return _SessionStart(self, wire.create_session_request(metadata, sandbox, group, seed))

    async def get_session(self, session_id: str) -> AsyncSession:
        return AsyncSession(self, await self._call(wire.session_request(session_id)))

    async def sessions(
        self,
        *,
        status: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        has_reward: bool | None = None,
        order: str = "asc",
        page_size: int = PAGE_SIZE,
        **filters: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        """As `Belayer.sessions`: oldest first unless ``order="desc"``; times as Unix seconds or datetimes."""
        params = wire.query_params(
            status=status, metadata=metadata, has_reward=has_reward, order=order, **filters
        )
        pages = Pages(params, page_size)
        while pages.query is not None:
            page = await self._call(pages.request())
            pages.advance(page)
            for item in page["data"]:
                yield item

    async def finished(
        self, after: str | None = None, *, follow: bool = True, rows: bool = True, limit: int | None = None
    ) -> AsyncIterator[Finished]:
        """As `Belayer.finished`: ``follow=True`` (waits for more, forever) and ``rows=True`` by default."""
        feed = Feed(after, limit, follow=follow, rows=rows, backoff=self.backoff)
        while feed.wanted():
            r = feed.request()
            try:
                async with self._http.stream(
                    r.method, r.path, params=r.params, timeout=feed.timeout(self._http)
                ) as answer:
                    if answer.status_code >= 400:
                        await answer.aread()
                    error = feed.opened(answer)
                    if error is None:
                        async for line in answer.aiter_lines():
                            item = feed.line(line)
                            if item is not None:
                                yield item
                            if feed.paused:
                                break
            except httpx.TransportError as e:
                error = wire.unreachable(e, r, self.url)
            delay = feed.retry_delay(error)
            if delay is not None:
                await asyncio.sleep(delay)

    async def export(
        self,
        path: str | Path,
        format: str = "jsonl",
        *,
        status: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        has_reward: bool | None = None,
        page_size: int = EXPORT_PAGE_SIZE,
        mark: bool = True,
        **filters: Any,
    ) -> int:
        export = ExportPages.of(format, status, metadata, has_reward, page_size, mark, filters)
        while (r := export.next_request()) is not None:
            export.add(await self._request(r))
        await asyncio.to_thread(export.write, path)
        return export.rows
