"""`Belayer`, the synchronous trainer client: it sends the requests `belayer.client.wire` builds and
reads the answers, blocking. `belayer.client.aio` is the same for asyncio."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
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


class Session(SessionView):
    """One episode on the gateway. Point the agent at `openai_base_url` (or `anthropic_base_url`): the
    URL is the session (no token needed there). As a context manager it closes the session on exit."""

    def __init__(self, client: Belayer, summary: dict[str, Any]) -> None:
        super().__init__(summary)
        self._client = client

    def reward(self, value: float, info: Mapping[str, Any] | None = None) -> dict[str, Any]:
        self.summary = self._client._call(wire.reward_request(self.id, value, info))
        return self.summary

    def exec(self, command: str, timeout_s: float | None = None) -> dict[str, Any]:
        """Run `command` in the session's sandbox (``POST …/sandbox/exec``): ``stdout``, ``stderr``,
        ``exit_code``. A sandbox that failed meanwhile is restored first and the command runs there."""
        result: dict[str, Any] = self._client._call(wire.exec_request(self.id, command, timeout_s))
        return result

    def trajectory(self, token_text: bool = False) -> dict[str, Any]:
        """Every turn with its exact token ids, logprobs and loss mask (``GET …/trajectory``)."""
        traj: dict[str, Any] = self._client._call(wire.trajectory_request(self.id, token_text))
        return traj

    def refresh(self) -> dict[str, Any]:
        self.summary = self._client._call(wire.session_request(self.id))
        return self.summary

    def close(self) -> dict[str, Any]:
        """Close the session (again: a no-op); its sandbox, if any, is destroyed."""
        self.summary = self._client._call(wire.close_request(self.id))
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
    """The synchronous client (see `belayer.client`). ``backoff`` paces the feed's reconnects."""

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
            base_url=self.url, headers=wire.headers(token), timeout=timeout, transport=transport
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Belayer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, r: Request) -> httpx.Response:
        try:
            return self._http.request(r.method, r.path, params=r.params, json=r.json)
        except httpx.TransportError as e:
            raise wire.unreachable(e, r, self.url) from e

    def _call(self, r: Request) -> Any:
        return wire.json_of(self._request(r))

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = self._request(wire.HEALTH).json()
        return body

    def weights(self) -> dict[str, Any]:
        """``GET /api/weights``: the version served, each worker's, and the recent updates."""
        body: dict[str, Any] = self._call(wire.WEIGHTS)
        return body

    def update_weights(self, version: str, path: str, drain_s: float | None = None) -> dict[str, Any]:
        """``POST /api/weights`` (admin): every worker onto the weights at `path`, served as `version`."""
        body: dict[str, Any] = self._call(wire.update_weights_request(version, path, drain_s))
        return body

    def session(
        self,
        metadata: Mapping[str, Any] | None = None,
        sandbox: Mapping[str, Any] | None = None,
        group: str | None = None,
        seed: int | None = None,
    ) -> Session:
        """Create a session (with a sandbox, given its spec; in a routing `group`, given one; with the
        `seed` its keyed sampling derives from, given one); use it as ``with gw.session() as s:``."""
        return Session(self, self._call(wire.create_session_request(metadata, sandbox, group, seed)))

    def get_session(self, session_id: str) -> Session:
        return Session(self, self._call(wire.session_request(session_id)))

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
        """Every session that matches, page by page, oldest first (``order="desc"``: newest first; the
        HTTP route's own default is newest first). Other filters as keywords: ``reward_min``,
        ``created_after``/``created_before`` (Unix seconds or a `datetime`)…"""
        params = wire.query_params(
            status=status, metadata=metadata, has_reward=has_reward, order=order, **filters
        )
        pages = Pages(params, page_size)
        while pages.query is not None:
            page = self._call(pages.request())
            pages.advance(page)
            yield from page["data"]

    def finished(
        self, after: str | None = None, *, follow: bool = True, rows: bool = True, limit: int | None = None
    ) -> Iterator[Finished]:
        """The finished sessions after cursor `after` (None: from the first), in the order they closed.
        Unlike ``GET /api/finished``, it defaults to ``follow=True`` (after the backlog it waits for more,
        forever: ``follow=False`` ends after the backlog) and ``rows=True`` (each item's export rows).
        Reconnects by itself (see `Backoff`)."""
        feed = Feed(after, limit, follow=follow, rows=rows, backoff=self.backoff)
        while feed.wanted():
            r = feed.request()
            try:
                with self._http.stream(
                    r.method, r.path, params=r.params, timeout=feed.timeout(self._http)
                ) as answer:
                    if answer.status_code >= 400:
                        answer.read()
                    error = feed.opened(answer)
                    if error is None:
                        for line in answer.iter_lines():
                            item = feed.line(line)
                            if item is not None:
                                yield item
                            if feed.paused:
                                break
            except httpx.TransportError as e:
                error = wire.unreachable(e, r, self.url)
            delay = feed.retry_delay(error)
            if delay is not None:
                time.sleep(delay)

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
        the number of rows. ``format="atif"``: Harbor's ATIF trajectories (one per branch) instead,
        each written to ``path/<session>-branch-<n>/agent/trajectory.json`` (`path` is a directory);
        returns the number of trajectories."""
        export = ExportPages.of(format, status, metadata, has_reward, page_size, mark, filters)
        while (r := export.next_request()) is not None:
            export.add(self._request(r))
        export.write(path)
        return export.rows
