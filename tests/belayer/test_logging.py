"""``belayer serve --log-format json``: every line the gateway writes is one JSON object, requests
included (once each: uvicorn's access log is off)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx

from core.logs import session_tag
from tests.support import belayer_server


def test_serve_writes_json_lines(tmp_path: Path, tiny_model_dir: Path) -> None:
    with belayer_server(["fake-engine", "--tokens", "3"], tmp_path / "engine.log") as engine:
        args = ["serve", "--model", str(tiny_model_dir), "--engine-url", engine.url,
                "--store", str(tmp_path / "t.db"), "--log-format", "json"]  # fmt: skip
        with belayer_server(args, tmp_path / "gw.log") as gw:
            sid = httpx.post(f"{gw.url}/api/sessions", json={}).json()["id"]
            body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}]}
            assert httpx.post(f"{gw.url}/s/{sid}/v1/chat/completions", json=body).status_code == 200
    lines = [json.loads(line) for line in (tmp_path / "gw.log").read_text().splitlines()]
    assert all({"ts", "level", "logger", "message"} <= line.keys() for line in lines)
    assert any(
        line["logger"] == "belayer.gateway" and line["message"].startswith("gateway ready") for line in lines
    )
    chats = [line for line in lines if line["logger"] == "belayer.requests" and line["method"] == "POST"]
    tag = session_tag(sid)
    assert [(c["path"], c["session_tag"], c["status"], c["level"]) for c in chats] == [
        ("/api/sessions", None, 201, "info"),  # the session is not in its path yet
        (f"/s/{tag}/v1/chat/completions", tag, 200, "info"),
    ]
    assert sid not in (tmp_path / "gw.log").read_text(), "a session id (a capability) was logged"
    assert all(isinstance(c["duration_ms"], float) for c in chats)
