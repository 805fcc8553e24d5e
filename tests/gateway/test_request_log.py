"""One INFO line per HTTP request (``belayer.requests``), with method, path, session, status and
duration as structured fields."""

from __future__ import annotations

import json
import logging

import pytest

from core.logs import JsonFormatter, session_tag
from tests.support import GatewayHarness


def request_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "belayer.requests"]


async def test_each_request_is_one_line_with_its_session(
    gateway: GatewayHarness, caplog: pytest.LogCaptureFixture
) -> None:
    gateway.queue_replies("hello", "again")
    sid, _ = await gateway.new_session()
    assert (await gateway.client.get(f"/api/sessions/{sid}")).json()["log_tag"] == session_tag(sid)
    caplog.clear()
    caplog.set_level(logging.INFO, "belayer.requests")
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
    assert (await gateway.client.post(f"/s/{sid}/v1/chat/completions", json=body)).status_code == 200
    streamed = await gateway.client.post(f"/s/{sid}/v1/chat/completions", json={**body, "stream": True})
    assert streamed.status_code == 200 and "[DONE]" in streamed.text
    assert (await gateway.client.get(f"/api/sessions/{sid}/trajectory")).status_code == 200
    assert (await gateway.client.get("/no/such/route")).status_code == 404
    lines = request_lines(caplog)
    tag = session_tag(sid)
    assert [(r.levelno, r.method, r.path, r.session_tag, r.status) for r in lines] == [  # type: ignore[attr-defined]
        (logging.INFO, "POST", f"/s/{tag}/v1/chat/completions", tag, 200),
        (logging.INFO, "POST", f"/s/{tag}/v1/chat/completions", tag, 200),
        (logging.INFO, "GET", f"/api/sessions/{tag}/trajectory", tag, 200),
        (logging.INFO, "GET", "/no/such/route", None, 404),
    ]
    assert all(r.duration_ms > 0 for r in lines)  # type: ignore[attr-defined]
    assert lines[0].getMessage().startswith(f"POST /s/{tag}/v1/chat/completions 200 ")
    assert not any(sid in r.getMessage() for r in caplog.records), "a session id (a capability) was logged"
    parsed = json.loads(JsonFormatter().format(lines[0]))
    assert {k: parsed[k] for k in ("message", "method", "path", "session_tag", "status")} == {
        "message": lines[0].getMessage(),
        "method": "POST",
        "path": f"/s/{tag}/v1/chat/completions",
        "session_tag": tag,
        "status": 200,
    }
    assert isinstance(parsed["duration_ms"], float)


async def test_a_refused_request_is_logged_with_its_status(
    gateway: GatewayHarness, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "belayer.requests")
    r = await gateway.client.post("/api/sessions", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    [line] = request_lines(caplog)
    assert (line.method, line.path, line.status) == ("POST", "/api/sessions", 415)  # type: ignore[attr-defined]
