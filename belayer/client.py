"""The trainer's client for a Belayer gateway: sessions, rewards, trajectories, the finished feed, export.

It needs only httpx and the standard library, so a trainer imports it cheaply (nothing of the gateway,
no model code). `Belayer` is synchronous, `AsyncBelayer` the same API for asyncio.

Example::

    from belayer.client import Belayer

    with Belayer("http://127.0.0.1:8000", token="...") as gw:
        with gw.session(metadata={"task": "t1"}) as s:  # closed on exit, also on an exception
            agent.run(openai_base_url=s.openai_base_url)  # or s.anthropic_base_url for Anthropic's SDK
            s.reward(1.0)
        for item in gw.finished(after=saved_cursor, follow=True):  # never polls; resumes by cursor
            train_on(item.session, item.rows)
            saved_cursor = item.cursor  # persist it: a restarted trainer continues from there

Errors: every failure is a `ClientError` carrying the gateway's error (``status``, ``message``,
``type``, ``param``, ``code``); `GatewayUnreachable` (also a ``ConnectionError``) when no answer came.
The finished feed reconnects by itself (with backoff) when its connection drops or the gateway
restarts, from the last cursor it yielded, so the items it yields have no gap and no duplicate.

>>> feed_params("17", follow=True, rows=False, limit=None)
{'follow': 'true', 'rows': 'false', 'after': '17'}
>>> query_params(status="closed", has_reward=True, metadata={"task": "t1"})
{'status': 'closed', 'has_reward': 'true', 'meta.task': 't1'}
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from core.errors import BelayerError

DEFAULT_TIMEOUT = 30.0
FEED_READ_TIMEOUT = 60.0
"""The feed sends a comment every 15 s: a connection silent for this long is dead, and is reopened."""
PAGE_SIZE = 100
EXPORT_PAGE_SIZE = 1000
RETRY_STATUSES = frozenset({502, 503, 504})
"""Answers of a proxy (or a gateway starting) in front of the feed: reconnect, as for a dropped one."""


class ClientError(BelayerError):
    """An error answer from the gateway: its HTTP ``status`` and its error JSON's fields."""

    def __init__(
        self,
        message: str,
        status: int | None = None,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        body: Any = None,
    ) -> None:
        super().__init__(message if status is None else f"{status}: {message}")
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.body = body


class GatewayUnreachable(ClientError, ConnectionError):
    """No answer: the gateway could not be reached, or the connection broke (the feed retries these)."""


@dataclass(frozen=True, slots=True)
class Finished:
    """One finished session from the feed: its ``cursor`` (persist it to resume there), its summary
    (as ``GET /api/sessions/{id}``) and, with ``rows=True``, its export rows (one per branch)."""

    cursor: str
    session: dict[str, Any]
    rows: list[dict[str, Any]] | None = None


@dataclass(slots=True)
class Backoff:
    """Reconnect delays: exponential with jitter, from `first` up to `most`; `attempts` in a row at most
    (None: forever). A connection that delivers anything resets the count."""

    first: float = 0.25
    most: float = 10.0
    attempts: int | None = 12
    failures: int = field(default=0, init=False)

    def next_delay(self, error: ClientError) -> float:
        """The wait before the next try, or `error` raised when the attempts are spent."""
        self.failures += 1
        if self.attempts is not None and self.failures > self.attempts:
            raise error
        delay: float = min(self.most, self.first * 2 ** (self.failures - 1))
        return delay * random.uniform(0.5, 1.0)


# --- what both clients share: the wire format ---------------------------------------------------------


def error_of(response: httpx.Response) -> ClientError:
    """The `ClientError` for an error answer (OpenAI-shaped error JSON, or whatever text came)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return ClientError(
            str(err.get("message") or response.reason_phrase),
            response.status_code,
            err.get("type"),
            err.get("param"),
            err.get("code"),
            body,
        )
    return ClientError(response.text[:500] or response.reason_phrase, response.status_code, body=body)


def _json(response: httpx.Response) -> Any:
    if response.status_code >= 400:
        raise error_of(response)
    return response.json()


def _unreachable(e: httpx.TransportError, what: str) -> GatewayUnreachable:
    return GatewayUnreachable(f"{what}: {type(e).__name__}: {e}")


def query_params(
    *,
    status: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    has_reward: bool | None = None,
    **other: Any,
) -> dict[str, str]:
    """``GET /api/sessions``'s (and the export's) filters as query parameters: ``metadata`` becomes
    ``meta.KEY=value``, booleans ``true``/``false``; other keywords go as they are (None: left out)."""
    params: dict[str, str] = {}
    pairs: list[tuple[str, Any]] = [("status", status), ("has_reward", has_reward), *other.items()]
    pairs += [(f"meta.{k}", v) for k, v in (metadata or {}).items()]
    for key, value in pairs:
        if value is not None:
            params[key] = _text(value)
    return params


def _text(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def feed_params(after: str | None, *, follow: bool, rows: bool, limit: int | None) -> dict[str, str]:
    params = {"follow": _text(follow), "rows": _text(rows)}
    if after:
        params["after"] = after
    if limit is not None:
        params["limit"] = str(limit)
    return params


@dataclass(slots=True)
class SSEParser:
    """Server-sent events from lines: `feed` returns ``(event, data)`` at each block's end."""

    event: str = "message"
    data: list[str] = field(default_factory=list)

    def feed(self, line: str) -> tuple[str, str] | None:
        if line == "":
            if not self.data:
                self.event = "message"
                return None
            out = (self.event, "\n".join(self.data))
            self.event, self.data = "message", []
            return out
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self.event = value
        elif name == "data":
            self.data.append(value)
        return None


@dataclass(slots=True)
class FeedState:
    """Where a finished feed is: the cursor to resume from, and how many items are still wanted."""

    cursor: str | None
    left: int | None
    done: bool = False

    def on_event(self, event: str, data: str) -> Finished | None:
        """The item to yield for one event (None for the others); ``end`` marks the feed done."""
        body = json.loads(data)
        if event == "finished":
            item = Finished(str(body["cursor"]), body["session"], body.get("rows"))
            self.cursor = item.cursor
            self.left = None if self.left is None else self.left - 1
            return item
        if event in ("end", "shutdown") and body.get("cursor"):
            self.cursor = str(body["cursor"])  # past sessions deleted since they closed, if any
        self.done = self.done or event == "end"
        return None

    def params(self, follow: bool, rows: bool) -> dict[str, str]:
        return feed_params(self.cursor, follow=follow, rows=rows, limit=self.left)


def _headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def _export_page(response: httpx.Response) -> tuple[bytes, int, int]:
    if response.status_code >= 400:
        raise error_of(response)
    rows = int(response.headers.get("x-row-count", "0"))
    return response.content, rows, int(response.headers.get("x-total-count", "0"))


def _write_export(path: str | Path, fmt: str, pages: list[bytes]) -> None:
    out = Path(path)
    if fmt != "parquet" or len(pages) == 1:
        out.write_bytes(b"".join(pages))
        return
    import io  # several Parquet pages: one table (pyarrow only here, where it is needed)

    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = [pq.read_table(io.BytesIO(p)) for p in pages if p]
    pq.write_table(pa.concat_tables(tables, promote_options="default"), out)


def _anthropic_url(summary: Mapping[str, Any]) -> str:
    url = summary.get("anthropic_base_url")
    return str(url) if url else str(summary["base_url"]).removesuffix("/v1")


# --- the synchronous client ---------------------------------------------------------------------------


class Session:
    """One episode on the gateway. Point the agent at `openai_base_url` (or `anthropic_base_url`): the
    URL is the session (no token needed there). As a context manager it closes the session on exit."""

    def __init__(self, client: Belayer, summary: dict[str, Any]) -> None:
        self._client = client
        self.summary = summary
        """The session as the gateway last answered it (``GET /api/sessions/{id}``)."""

    @property
    def id(self) -> str:
        return str(self.summary["id"])

    @property
    def openai_base_url(self) -> str:
        return str(self.summary["base_url"])

    @property
    def anthropic_base_url(self) -> str:
        return _anthropic_url(self.summary)

    def reward(self, value: float, info: Mapping[str, Any] | None = None) -> dict[str, Any]:
        body = {"reward": value, **({"info": dict(info)} if info is not None else {})}
        self.summary = self._client._call("POST", f"/api/sessions/{self.id}/reward", json=body)
        return self.summary

    def trajectory(self, token_text: bool = False) -> dict[str, Any]:
        """Every turn with its exact token ids, logprobs and loss mask (``GET …/trajectory``)."""
        params = {"token_text": "true"} if token_text else None
        traj: dict[str, Any] = self._client._call("GET", f"/api/sessions/{self.id}/trajectory", params=params)
        return traj

    def refresh(self) -> dict[str, Any]:
        self.summary = self._client._call("GET", f"/api/sessions/{self.id}")
        return self.summary

    def close(self) -> dict[str, Any]:
        """Close the session (again: a no-op); its sandbox, if any, is destroyed."""
        self.summary = self._client._call("POST", f"/api/sessions/{self.id}/close")
        return self.summary

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        if error is None:
            self.close()
            return
        try:
            self.close()
        except ClientError as close_error:  # the episode's own error is the one to see
            error.add_note(f"and closing session {self.id} failed: {close_error}")


class Belayer:
    """The synchronous client (see the module docstring). ``backoff`` paces the feed's reconnects."""

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        *,
        backoff: Backoff | None = None,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.backoff = backoff or Backoff()
        self._http = httpx.Client(
            base_url=self.url, headers=_headers(token), timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Belayer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            return _json(self._http.request(method, path, **kw))
        except httpx.TransportError as e:
            raise _unreachable(e, f"{method} {self.url}{path}") from e

    def health(self) -> dict[str, Any]:
        try:
            body: dict[str, Any] = self._http.get("/health").json()
        except httpx.TransportError as e:
            raise _unreachable(e, f"GET {self.url}/health") from e
        return body

    def session(
        self, metadata: Mapping[str, Any] | None = None, sandbox: Mapping[str, Any] | None = None
    ) -> Session:
        """Create a session (with a sandbox, given its spec); use it as ``with gw.session() as s:``."""
        body: dict[str, Any] = {"metadata": dict(metadata or {})}
        if sandbox is not None:
            body["sandbox"] = dict(sandbox)
        return Session(self, self._call("POST", "/api/sessions", json=body))

    def get_session(self, session_id: str) -> Session:
        return Session(self, self._call("GET", f"/api/sessions/{session_id}"))

    def sessions(
        self,
        *,
        status: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        has_reward: bool | None = None,
        order: str = "asc",
        page_size: int = PAGE_SIZE,
        **filters: Any,
    ) -> Iterator[dict[str, Any]]:
        """Every session that matches, page by page (``reward_min``, ``created_after``… as keywords)."""
        params = query_params(status=status, metadata=metadata, has_reward=has_reward, order=order, **filters)
        pages = _pages(params, page_size)
        page = None
        while True:
            try:
                query = pages.send(page)
            except StopIteration:
                return
            page = self._call("GET", "/api/sessions", params=query)
            yield from page["data"]

    def finished(
        self, after: str | None = None, *, follow: bool = True, rows: bool = True, limit: int | None = None
    ) -> Iterator[Finished]:
        """The finished sessions after cursor `after` (None: from the first), in the order they closed;
        with ``follow`` it waits for more, forever. Reconnects by itself (see `Backoff`)."""
        state, backoff = FeedState(after, limit), _fresh(self.backoff)
        while not state.done and state.left != 0:
            try:
                with self._http.stream(
                    "GET",
                    "/api/finished",
                    params=state.params(follow, rows),
                    timeout=_feed_timeout(self._http),
                ) as r:
                    if r.status_code >= 400 and r.status_code not in RETRY_STATUSES:
                        r.read()
                        raise error_of(r)
                    if r.status_code < 400:
                        yield from _items(state, r.iter_lines(), backoff)
                        continue_error: ClientError = GatewayUnreachable(
                            "the finished feed ended without its end"
                        )
                    else:
                        r.read()
                        continue_error = error_of(r)
            except httpx.TransportError as e:
                continue_error = _unreachable(e, f"GET {self.url}/api/finished")
            if not state.done:
                time.sleep(backoff.next_delay(continue_error))

    def export(
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
        """Write the matching sessions' rows (one per branch) to `path` as JSONL or Parquet, page by page
        through ``POST /api/export``, which marks them exported (for ``belayer store prune
        --exported-only``); with ``mark=False``, through ``GET /api/export``, which only reads. Returns
        the number of rows."""
        params = query_params(
            status=status,
            metadata=metadata,
            has_reward=has_reward,
            format=format,
            **{"order": "asc", **filters},
        )
        method = "POST" if mark else "GET"
        pages: list[bytes] = []
        rows, offset, total = 0, 0, 1
        while offset < total:
            query = {**params, "limit": str(page_size), "offset": str(offset)}
            try:
                content, n, total = _export_page(self._http.request(method, "/api/export", params=query))
            except httpx.TransportError as e:
                raise _unreachable(e, f"{method} {self.url}/api/export") from e
            pages.append(content)
            rows, offset = rows + n, offset + page_size
        _write_export(path, format, pages)
        return rows


def _pages(params: dict[str, str], page_size: int) -> Generator[dict[str, str], dict[str, Any] | None, None]:
    """The query of each page of a listing, given the answer to the previous one: offsets, or the
    gateway's ``next_cursor`` where it answers one (keyset paging, stable while sessions are added)."""
    offset = 0
    page = yield {**params, "limit": str(page_size), "offset": "0"}
    while page is not None and page["data"]:
        if "next_cursor" in page:
            if not page["next_cursor"]:
                return
            page = yield {**params, "limit": str(page_size), "cursor": str(page["next_cursor"])}
            continue
        offset += len(page["data"])
        if offset >= page["total"]:
            return
        page = yield {**params, "limit": str(page_size), "offset": str(offset)}


def _fresh(backoff: Backoff) -> Backoff:
    return Backoff(backoff.first, backoff.most, backoff.attempts)


def _feed_timeout(http: httpx.Client | httpx.AsyncClient) -> httpx.Timeout:
    return httpx.Timeout(
        http.timeout.connect, read=FEED_READ_TIMEOUT, write=http.timeout.write, pool=http.timeout.pool
    )


def _items(state: FeedState, lines: Iterable[str], backoff: Backoff) -> Iterator[Finished]:
    parser = SSEParser()
    for line in lines:
        event = parser.feed(line)
        if event is None:
            continue
        item = state.on_event(*event)
        backoff.failures = 0  # the gateway answers: a later drop starts the delays afresh
        if item is not None:
            yield item
        if state.done or state.left == 0 or event[0] == "shutdown":
            return


# --- the asynchronous client --------------------------------------------------------------------------


class AsyncSession:
    """`Session` for `AsyncBelayer`: ``async with gw.session() as s`` (or ``s = await gw.session()``)."""

    def __init__(self, client: AsyncBelayer, summary: dict[str, Any]) -> None:
        self._client = client
        self.summary = summary

    @property
    def id(self) -> str:
        return str(self.summary["id"])

    @property
    def openai_base_url(self) -> str:
        return str(self.summary["base_url"])

    @property
    def anthropic_base_url(self) -> str:
        return _anthropic_url(self.summary)

    async def reward(self, value: float, info: Mapping[str, Any] | None = None) -> dict[str, Any]:
        body = {"reward": value, **({"info": dict(info)} if info is not None else {})}
        self.summary = await self._client._call("POST", f"/api/sessions/{self.id}/reward", json=body)
        return self.summary

    async def trajectory(self, token_text: bool = False) -> dict[str, Any]:
        params = {"token_text": "true"} if token_text else None
        traj: dict[str, Any] = await self._client._call(
            "GET", f"/api/sessions/{self.id}/trajectory", params=params
        )
        return traj

    async def refresh(self) -> dict[str, Any]:
        self.summary = await self._client._call("GET", f"/api/sessions/{self.id}")
        return self.summary

    async def close(self) -> dict[str, Any]:
        self.summary = await self._client._call("POST", f"/api/sessions/{self.id}/close")
        return self.summary


class _SessionStart:
    """What `AsyncBelayer.session` returns: awaitable (the session) and an async context manager (the
    session, closed on exit)."""

    def __init__(self, client: AsyncBelayer, body: dict[str, Any]) -> None:
        self._client, self._body = client, body
        self._session: AsyncSession | None = None

    async def _create(self) -> AsyncSession:
        return AsyncSession(self._client, await self._client._call("POST", "/api/sessions", json=self._body))

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
            base_url=self.url, headers=_headers(token), timeout=timeout, transport=transport
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncBelayer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            return _json(await self._http.request(method, path, **kw))
        except httpx.TransportError as e:
            raise _unreachable(e, f"{method} {self.url}{path}") from e

    async def health(self) -> dict[str, Any]:
        try:
            body: dict[str, Any] = (await self._http.get("/health")).json()
        except httpx.TransportError as e:
            raise _unreachable(e, f"GET {self.url}/health") from e
        return body

    def session(
        self, metadata: Mapping[str, Any] | None = None, sandbox: Mapping[str, Any] | None = None
    ) -> _SessionStart:
        body: dict[str, Any] = {"metadata": dict(metadata or {})}
        if sandbox is not None:
            body["sandbox"] = dict(sandbox)
        return _SessionStart(self, body)

    async def get_session(self, session_id: str) -> AsyncSession:
        return AsyncSession(self, await self._call("GET", f"/api/sessions/{session_id}"))

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
        params = query_params(status=status, metadata=metadata, has_reward=has_reward, order=order, **filters)
        pages = _pages(params, page_size)
        page = None
        while True:
            try:
                query = pages.send(page)
            except StopIteration:
                return
            page = await self._call("GET", "/api/sessions", params=query)
            for item in page["data"]:
                yield item

    async def finished(
        self, after: str | None = None, *, follow: bool = True, rows: bool = True, limit: int | None = None
    ) -> AsyncIterator[Finished]:
        state, backoff = FeedState(after, limit), _fresh(self.backoff)
        while not state.done and state.left != 0:
            try:
                async with self._http.stream(
                    "GET",
                    "/api/finished",
                    params=state.params(follow, rows),
                    timeout=_feed_timeout(self._http),
                ) as r:
                    if r.status_code >= 400 and r.status_code not in RETRY_STATUSES:
                        await r.aread()
                        raise error_of(r)
                    if r.status_code < 400:
                        async for item in _aitems(state, r.aiter_lines(), backoff):
                            yield item
                        continue_error: ClientError = GatewayUnreachable(
                            "the finished feed ended without its end"
                        )
                    else:
                        await r.aread()
                        continue_error = error_of(r)
            except httpx.TransportError as e:
                continue_error = _unreachable(e, f"GET {self.url}/api/finished")
            if not state.done:
                await asyncio.sleep(backoff.next_delay(continue_error))

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
        params = query_params(
            status=status,
            metadata=metadata,
            has_reward=has_reward,
            format=format,
            **{"order": "asc", **filters},
        )
        method = "POST" if mark else "GET"
        pages: list[bytes] = []
        rows, offset, total = 0, 0, 1
        while offset < total:
            query = {**params, "limit": str(page_size), "offset": str(offset)}
            try:
                content, n, total = _export_page(await self._http.request(method, "/api/export", params=query))
            except httpx.TransportError as e:
                raise _unreachable(e, f"{method} {self.url}/api/export") from e
            pages.append(content)
            rows, offset = rows + n, offset + page_size
        await asyncio.to_thread(_write_export, path, format, pages)
        return rows


async def _aitems(state: FeedState, lines: AsyncIterator[str], backoff: Backoff) -> AsyncIterator[Finished]:
    parser = SSEParser()
    async for line in lines:
        event = parser.feed(line)
        if event is None:
            continue
        item = state.on_event(*event)
        backoff.failures = 0
        if item is not None:
            yield item
        if state.done or state.left == 0 or event[0] == "shutdown":
            return
