"""The finished feed on the server: the store's record of closes, ``GET /api/finished``'s backlog, its
cursors and errors (following it, and the client, are in ``tests/belayer/test_client.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine_pool.fake import FakeEngine
from gateway.config import GatewayConfig
from tests.support import asgi_gateway

HI = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture
def config(tmp_path: Path, tiny_model_dir: Path) -> GatewayConfig:
    return GatewayConfig(model=str(tiny_model_dir), store_path=str(tmp_path / "t.db"), api_token="secret")


def blocks(text: str) -> list[tuple[str | None, str, dict[str, object]]]:
    """``(id, event, data)`` of each SSE block (comments left out)."""
    out = []
    for block in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":"))
        if fields:
            out.append((fields.get("id"), fields["event"], json.loads(fields["data"])))
    return out


async def test_the_backlog_comes_in_close_order_with_cursors_and_rows(config: GatewayConfig) -> None:
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app())) as (_, client):
        client.headers["Authorization"] = "Bearer secret"
        ids = [
            (await client.post("/api/sessions", json={"metadata": {"i": i}})).json()["id"] for i in range(4)
        ]
        assert (await client.post(f"/s/{ids[2]}/v1/chat/completions", json=HI)).status_code == 200
        for sid in (ids[2], ids[0], ids[3]):  # ids[1] stays open: not finished
            assert (await client.post(f"/api/sessions/{sid}/close")).status_code == 200
        assert (await client.post(f"/api/sessions/{ids[2]}/close")).status_code == 200  # again: no change

        r = await client.get("/api/finished?rows=true")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        feed = blocks(r.text)
        assert [e for _, e, _ in feed] == ["finished"] * 3 + ["end"]
        assert [d["session"]["id"] for _, _, d in feed[:3]] == [ids[2], ids[0], ids[3]]  # type: ignore[index]
        cursors = [d["cursor"] for _, _, d in feed[:3]]
        assert [i for i, _, _ in feed[:3]] == cursors and feed[3][2] == {"cursor": cursors[-1]}
        first = feed[0][2]
        summary = (await client.get(f"/api/sessions/{ids[2]}")).json()
        assert (
            first["session"] == summary
            and summary["anthropic_base_url"] == summary["base_url"][: -len("/v1")]
        )
        [row] = first["rows"]  # type: ignore[misc]
        assert row["session_id"] == ids[2] and row["num_turns"] == 1
        assert "rows" not in blocks((await client.get("/api/finished")).text)[0][2]

        after_first = blocks((await client.get(f"/api/finished?after={cursors[0]}")).text)
        assert [d.get("cursor") for _, _, d in after_first] == [*cursors[1:], cursors[-1]]
        limited = blocks((await client.get(f"/api/finished?after={cursors[0]}&limit=1")).text)
        assert [(e, d["cursor"]) for _, e, d in limited] == [("finished", cursors[1]), ("end", cursors[1])]
        resumed = await client.get("/api/finished", headers={"Last-Event-ID": str(cursors[1])})
        assert [d["cursor"] for _, _, d in blocks(resumed.text)] == [cursors[2], cursors[2]]
        nothing = blocks((await client.get(f"/api/finished?after={cursors[-1]}")).text)
        assert nothing == [(None, "end", {"cursor": cursors[-1]})]


async def test_bad_queries_name_their_parameter_and_the_feed_needs_the_token(config: GatewayConfig) -> None:
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app())) as (_, client):
        assert (await client.get("/api/finished")).status_code == 401
        client.headers["Authorization"] = "Bearer secret"
        for query, param in [
            ("after=x", "after"), ("after=-1", "after"), ("after=1.5", "after"), ("after=%EF%BC%91", "after"),
            ("after=9223372036854775808", "after"), ("follow=yes", "follow"), ("rows=1", "rows"),
            ("limit=-1", "limit"), ("limit=x", "limit"), ("limit=99999999999999999999", "limit"),
        ]:  # fmt: skip
            r = await client.get(f"/api/finished?{query}")
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (query, r.text)
        r = await client.get("/api/finished", headers={"Last-Event-ID": "nope"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "Last-Event-ID"
        # a cursor beyond this store's events (another store's): waiting for it would skip sessions
        r = await client.get("/api/finished?after=5&follow=true")
        assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_cursor", r.text
