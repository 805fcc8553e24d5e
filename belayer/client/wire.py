"""What both trainer clients share, with no I/O of its own: each call as a `Request` to send, the
parsing of the answers, and the state of the operations that take several requests (a listing's
pages, an export's pages, the finished feed and its reconnects). `Belayer` and `AsyncBelayer` only
send the requests and read the answers, the one blocking, the other awaiting.

>>> reward_request("s1", 1.0, None)
Request(method='POST', path='/api/sessions/s1/reward', params=None, json={'reward': 1.0})
>>> pages = Pages({"status": "closed"}, page_size=2)
>>> pages.query
{'status': 'closed', 'limit': '2', 'offset': '0'}
>>> pages.advance({"data": [{}, {}], "total": 3}); pages.query
{'status': 'closed', 'limit': '2', 'offset': '2'}
>>> pages.advance({"data": [{}], "total": 3}); pages.query is None
True
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from core.atif import write_trajectories
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


# --- requests and answers ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    """One request to the gateway, as either client sends it."""

    method: str
    path: str
    params: Mapping[str, str] | None = None
    json: Any = None


def create_session_request(
    metadata: Mapping[str, Any] | None,
    sandbox: Mapping[str, Any] | None,
    group: str | None = None,
    seed: int | None = None,
) -> Request:
    """``POST /api/sessions``; `group`: the session's routing group (sessions that share a prompt);
    `seed`: the seed its turns' keyed sampling derives from (0 to 2^63 - 1: ``core.keyed``).

    >>> create_session_request(None, None, group="task-7", seed=11).json
    {'metadata': {}, 'group': 'task-7', 'seed': 11}
    """
    body: dict[str, Any] = {"metadata": dict(metadata or {})}
    if sandbox is not None:
        body["sandbox"] = dict(sandbox)
    if group is not None:
        body["group"] = group
    if seed is not None:
        body["seed"] = seed
    return Request("POST", "/api/sessions", json=body)


def session_request(session_id: str) -> Request:
    return Request("GET", f"/api/sessions/{session_id}")


def reward_request(session_id: str, value: float, info: Mapping[str, Any] | None) -> Request:
    body = {"reward": value, **({"info": dict(info)} if info is not None else {})}
    return Request("POST", f"/api/sessions/{session_id}/reward", json=body)


def trajectory_request(session_id: str, token_text: bool) -> Request:
    params = {"token_text": "true"} if token_text else None
    return Request("GET", f"/api/sessions/{session_id}/trajectory", params=params)


def exec_request(session_id: str, command: str, timeout_s: float | None) -> Request:
    body: dict[str, Any] = {"command": command, **({"timeout_s": timeout_s} if timeout_s is not None else {})}
    return Request("POST", f"/api/sessions/{session_id}/sandbox/exec", json=body)


def close_request(session_id: str) -> Request:
    return Request("POST", f"/api/sessions/{session_id}/close")


HEALTH = Request("GET", "/health")
WEIGHTS = Request("GET", "/api/weights")


def update_weights_request(version: str, path: str, drain_s: float | None) -> Request:
    """``POST /api/weights``: load the weights at `path` (a directory the gateway can read) on every
    worker and serve them as `version`; in-flight turns finish for up to `drain_s` seconds (None: the
    gateway's default), then are cut and resumed on the new weights.

    >>> update_weights_request("step-2", "/ckpt/step-2", 0.0).json
    {'version': 'step-2', 'path': '/ckpt/step-2', 'drain_s': 0.0}
    """
    body: dict[str, Any] = {"version": version, "path": path}
    if drain_s is not None:
        body["drain_s"] = drain_s
    return Request("POST", "/api/weights", json=body)


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


def json_of(response: httpx.Response) -> Any:
    """An answer's JSON, or its `ClientError` raised."""
    if response.status_code >= 400:
        raise error_of(response)
    return response.json()


def unreachable(e: httpx.TransportError, request: Request, url: str) -> GatewayUnreachable:
    return GatewayUnreachable(f"{request.method} {url}{request.path}: {type(e).__name__}: {e}")


def headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def anthropic_url(summary: Mapping[str, Any]) -> str:
    url = summary.get("anthropic_base_url")
    return str(url) if url else str(summary["base_url"]).removesuffix("/v1")


class SessionView:
    """What both clients' sessions show of the summary the gateway last answered."""

    def __init__(self, summary: dict[str, Any]) -> None:
        self.summary = summary
        """The session as the gateway last answered it (``GET /api/sessions/{id}``)."""

    @property
    def id(self) -> str:
        return str(self.summary["id"])

    @property
    def openai_base_url(self) -> str:
        return str(self.summary["base_url"])

    @property
    def group(self) -> str | None:
        """The session's routing group (None: it named none)."""
        group = self.summary.get("group")
        return str(group) if group is not None else None

    @property
    def anthropic_base_url(self) -> str:
        return anthropic_url(self.summary)


# --- listings and exports: several pages ---------------------------------------------------------------


def query_params(
    *,
    status: str | None = None,
    metadata: Mapping[str, Any] | None = None,
    has_reward: bool | None = None,
    **other: Any,
) -> dict[str, str]:
    """``GET /api/sessions``'s (and the export's) filters as query parameters: ``metadata`` becomes
    ``meta.KEY=value``, booleans ``true``/``false``, a `datetime` (``created_after``, ``created_before``)
    Unix seconds (a naive one is local time, as `datetime.timestamp` reads it); other keywords go as
    they are (None: left out).

    >>> from datetime import datetime, timezone
    >>> query_params(created_after=datetime(2026, 1, 31, tzinfo=timezone.utc), created_before=1769904000)
    {'created_after': '1769817600.0', 'created_before': '1769904000'}
    """
    params: dict[str, str] = {}
    pairs: list[tuple[str, Any]] = [("status", status), ("has_reward", has_reward), *other.items()]
    pairs += [(f"meta.{k}", v) for k, v in (metadata or {}).items()]
    for key, value in pairs:
        if value is not None:
            params[key] = _text(value)
    return params


def _text(value: Any) -> str:
    if isinstance(value, datetime):
        return str(value.timestamp())  # the gateway takes times as Unix seconds
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


@dataclass(slots=True)
class Pages:
    """A listing's pages (``GET /api/sessions``): `query` is the next page's (None: no more), given the
    answer to the previous one; offsets, or the gateway's ``next_cursor`` where it answers one (keyset
    paging, stable while sessions are added)."""

    params: dict[str, str]
    page_size: int
    query: dict[str, str] | None = field(init=False)
    offset: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.query = {**self.params, "limit": str(self.page_size), "offset": "0"}

    def request(self) -> Request:
        return Request("GET", "/api/sessions", params=self.query)

    def advance(self, page: dict[str, Any]) -> None:
        self.query = None
        if not page["data"]:
            return
        if "next_cursor" in page:
            if page["next_cursor"]:
                self.query = {**self.params, "limit": str(self.page_size), "cursor": str(page["next_cursor"])}
            return
        self.offset += len(page["data"])
        if self.offset < page["total"]:
            self.query = {**self.params, "limit": str(self.page_size), "offset": str(self.offset)}


@dataclass(slots=True)
class ExportPages:
    """An export, page by page: ``POST /api/export`` marks the rows exported, ``GET`` (``mark=False``)
    only reads. `next_request` is None once every row came; `write` joins the pages into one file (ATIF:
    writes each trajectory to its ``trajectory.json`` under the directory, `core.atif`)."""

    params: dict[str, str]
    page_size: int
    method: str
    pages: list[bytes] = field(default_factory=list)
    rows: int = 0
    offset: int = 0
    total: int = 1

    @classmethod
    def of(
        cls,
        format: str,
        status: str | None,
        metadata: Mapping[str, Any] | None,
        has_reward: bool | None,
        page_size: int,
        mark: bool,
        filters: Mapping[str, Any],
    ) -> ExportPages:
        params = query_params(
            status=status,
            metadata=metadata,
            has_reward=has_reward,
            format=format,
            **{"order": "asc", **filters},
        )
        return cls(params, page_size, "POST" if mark else "GET")

    def next_request(self) -> Request | None:
        if self.offset >= self.total:
            return None
        query = {**self.params, "limit": str(self.page_size), "offset": str(self.offset)}
        return Request(self.method, "/api/export", params=query)

    def add(self, response: httpx.Response) -> None:
        if response.status_code >= 400:
            raise error_of(response)
        self.pages.append(response.content)
        self.rows += int(response.headers.get("x-row-count", "0"))
        self.total = int(response.headers.get("x-total-count", "0"))
        self.offset += self.page_size

    def write(self, path: str | Path) -> None:
        out = Path(path)
        if self.params["format"] == "atif":  # a directory, as `belayer export --format atif` writes
            lines = (line for page in self.pages for line in page.splitlines() if line.strip())
            write_trajectories((json.loads(line) for line in lines), out)
            return
        if self.params["format"] != "parquet" or len(self.pages) == 1:
            out.write_bytes(b"".join(self.pages))
            return
        import io  # several Parquet pages: one table (pyarrow only here, where it is needed)

        import pyarrow as pa
        import pyarrow.parquet as pq

        tables = [pq.read_table(io.BytesIO(p)) for p in self.pages if p]
        pq.write_table(pa.concat_tables(tables, promote_options="default"), out)


# --- the finished feed ---------------------------------------------------------------------------------


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


class Feed:
    """One reading of the finished feed across its connections. For each connection: `request`, then
    `opened` with the answer (its body read if an error), then `line` for each line until `paused`;
    then `retry_delay` with what cut it short (None: the feed is done). See `Backoff`."""

    def __init__(
        self, after: str | None, limit: int | None, *, follow: bool, rows: bool, backoff: Backoff
    ) -> None:
        self.state = FeedState(after, limit)
        self.follow, self.rows = follow, rows
        self.backoff = Backoff(backoff.first, backoff.most, backoff.attempts)  # a fresh count
        self.paused = False
        self._parser = SSEParser()

    def wanted(self) -> bool:
        return not self.state.done and self.state.left != 0

    def request(self) -> Request:
        self.paused, self._parser = False, SSEParser()
        return Request("GET", "/api/finished", params=self.state.params(self.follow, self.rows))

    @staticmethod
    def timeout(http: httpx.Client | httpx.AsyncClient) -> httpx.Timeout:
        t = http.timeout
        return httpx.Timeout(t.connect, read=FEED_READ_TIMEOUT, write=t.write, pool=t.pool)

    @staticmethod
    def opened(response: httpx.Response) -> ClientError | None:
        """None to read the stream; the error to reconnect after (a proxy's answer); other errors raised."""
        if response.status_code >= 400 and response.status_code not in RETRY_STATUSES:
            raise error_of(response)
        return error_of(response) if response.status_code >= 400 else None

    def line(self, line: str) -> Finished | None:
        """The item one line completes, if any; `paused` once this connection has given what it will."""
        event = self._parser.feed(line)
        if event is None:
            return None
        item = self.state.on_event(*event)
        self.backoff.failures = 0  # the gateway answers: a later drop starts the delays afresh
        self.paused = self.state.done or self.state.left == 0 or event[0] == "shutdown"
        return item

    def retry_delay(self, error: ClientError | None) -> float | None:
        """The wait before reconnecting (None: done); `error`, what cut the connection short (None: the
        stream ended), is raised when the attempts are spent."""
        if self.state.done:
            return None
        if error is None:
            error = GatewayUnreachable("the finished feed ended without its end")
        return self.backoff.next_delay(error)
