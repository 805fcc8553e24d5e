"""What the gateway fuzzer (``test_fuzz.py``) found, one focused test each."""

from __future__ import annotations

import json
import logging
from collections.abc import MutableMapping
from typing import Any

import pytest

from tests.support import GatewayHarness

MSG = [{"role": "user", "content": "hi"}]


async def call_hanging_up(gw: GatewayHarness, path: str, body: bytes) -> list[dict[str, Any]]:
    """Call the app as a server does for a client that sends `body` (not all of it) and disconnects."""
    pending = [{"type": "http.request", "body": body, "more_body": True}]

    async def receive() -> dict[str, Any]:
        return pending.pop(0) if pending else {"type": "http.disconnect"}

    sent: list[dict[str, Any]] = []

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(dict(message))

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
        "headers": [(b"host", b"gw"), (b"content-type", b"application/json")],
        "client": ("127.0.0.1", 9), "server": ("gw", 80),
    }  # fmt: skip
    await gw.app(scope, receive, send)
    return sent


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/api/sessions"])
async def test_a_client_that_hangs_up_mid_body_is_no_unexpected_error(
    gateway: GatewayHarness, path: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Found: Starlette's ``ClientDisconnect`` while reading the body was logged as an unexpected error,
    with its traceback, and answered 500; it is the client's doing: a 4xx, and nothing logged."""
    with caplog.at_level(logging.ERROR, logger="belayer"):
        sent = await call_hanging_up(gateway, path, b'{"model": "policy", "messages": [')
    start = next(m for m in sent if m["type"] == "http.response.start")
    assert start["status"] == 400
    body = json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))
    message = body["error"]["message"]
    assert "closed the connection" in message and (body.get("type") == "error") == path.startswith(
        "/v1/messages"
    )
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    sessions = await gateway.client.get("/api/sessions")
    assert sessions.status_code == 200 and sessions.json()["data"] == []
