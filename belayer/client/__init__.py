"""The trainer's client for a Belayer gateway: sessions, rewards, trajectories, the finished feed, export.

It needs only httpx and the standard library, so a trainer imports it cheaply (nothing of the gateway,
no model code; import-linter holds it to ``core``). `Belayer` is synchronous, `AsyncBelayer` the same
API for asyncio; both send the requests that `wire` builds and parse the answers with it.

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

from belayer.client.aio import AsyncBelayer, AsyncSession
from belayer.client.sync import Belayer, Session
from belayer.client.wire import (
    DEFAULT_TIMEOUT,
    EXPORT_PAGE_SIZE,
    FEED_READ_TIMEOUT,
    PAGE_SIZE,
    RETRY_STATUSES,
    Backoff,
    ClientError,
    FeedState,
    Finished,
    GatewayUnreachable,
    SSEParser,
    error_of,
    feed_params,
    query_params,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "EXPORT_PAGE_SIZE",
    "FEED_READ_TIMEOUT",
    "PAGE_SIZE",
    "RETRY_STATUSES",
    "AsyncBelayer",
    "AsyncSession",
    "Backoff",
    "Belayer",
    "ClientError",
    "FeedState",
    "Finished",
    "GatewayUnreachable",
    "SSEParser",
    "Session",
    "error_of",
    "feed_params",
    "query_params",
]
