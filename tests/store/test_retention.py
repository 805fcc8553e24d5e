"""Retention: ``DELETE /api/sessions/{id}``, ``belayer store prune`` and the export marks it reads."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import httpx
import pytest

from belayer.cli import main
from engine_pool.fake import FakeEngine
from gateway.config import GatewayConfig
from sandbox.config import SandboxConfig
from sandbox.fake import FakeSandboxBackend
from store import SessionRecord, SqliteStore, TurnRecord
from store.export import export
from tests.support import GatewayHarness, asgi_gateway

DAY = 86400.0


async def _chat(gateway: GatewayHarness, sid: str, messages: list[dict[str, str]]) -> dict[str, str]:
    r = await gateway.client.post(
        f"/s/{sid}/v1/chat/completions", json={"model": "policy", "messages": messages}
    )
    assert r.status_code == 200, r.text
    message: dict[str, str] = r.json()["choices"][0]["message"]
    return message


async def test_delete_removes_the_trajectory(gateway: GatewayHarness, tmp_path: Path) -> None:
    sid, _ = await gateway.new_session(task="t")
    keep, _ = await gateway.new_session(task="keep")
    gateway.queue_replies("one", "two")
    messages = [{"role": "user", "content": "hi"}]
    messages += [await _chat(gateway, sid, messages), {"role": "user", "content": "more"}]
    await _chat(gateway, sid, messages)
    db = sqlite3.connect(tmp_path / "traj.db")
    # the second turn extends the first: stored as a segment beyond it (the plan's parent, not re-read)
    [(base, prompt_base)] = db.execute("SELECT base_id, prompt_base FROM turns WHERE idx = 1").fetchall()
    first = gateway.gw.store.get_turns(sid)[0]
    assert base == first.id and prompt_base == len(first.prompt_ids) + len(first.output_ids)

    r = await gateway.client.delete(f"/api/sessions/{sid}")
    assert r.status_code == 200, r.text
    assert r.json() == {
        "id": sid,
        "deleted": True,
        "turns": 2,
        "events": r.json()["events"],
        "sandbox": False,
    }
    assert r.json()["events"] >= 2
    assert (await gateway.client.get(f"/api/sessions/{sid}")).status_code == 404
    assert (await gateway.client.get(f"/api/sessions/{sid}/trajectory")).status_code == 404
    assert (await gateway.client.delete(f"/api/sessions/{sid}")).status_code == 404
    for table, column in (("turns", "session_id"), ("events", "session_id"), ("sessions", "id")):
        assert db.execute(f"SELECT COUNT(*) FROM {table} WHERE {column} = ?", (sid,)).fetchone()[0] == 0
    assert (await gateway.client.get(f"/api/sessions/{keep}")).status_code == 200
    r = await gateway.client.post(
        f"/s/{sid}/v1/chat/completions", json={"model": "policy", "messages": messages}
    )
    assert r.status_code == 404
    db.close()


async def test_delete_refuses_a_session_with_a_running_turn(gateway: GatewayHarness) -> None:
    sid, _ = await gateway.new_session()
    turn = gateway.gw.store.begin_turn(TurnRecord(sid, [1, 2], [], None, None, {}, time.time()))
    r = await gateway.client.delete(f"/api/sessions/{sid}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy"
    assert f"POST /api/sessions/{sid}/close" in r.json()["error"]["message"]
    turn.status = "complete"
    gateway.gw.store.finish_turn(turn)
    assert (await gateway.client.delete(f"/api/sessions/{sid}")).status_code == 200


async def test_delete_destroys_the_sandbox_and_needs_the_api_token(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        api_token="t0ken",
        sandbox=SandboxConfig(enabled=True, sandbox_port=None),
    )
    backend = FakeSandboxBackend()
    auth = {"authorization": "Bearer t0ken"}
    async with asgi_gateway(config, httpx.ASGITransport(FakeEngine().app()), sandbox_backend=backend) as (
        app,
        client,
    ):
        r = await client.post(
            "/api/sessions", json={"sandbox": {"image": "belayer-sandbox-busybox"}}, headers=auth
        )
        assert r.status_code == 201, r.text
        sid = r.json()["id"]
        assert app.state.gateway.sandboxes.has_sandbox(sid)
        assert (await client.delete(f"/api/sessions/{sid}")).status_code == 401
        r = await client.delete(f"/api/sessions/{sid}", headers=auth)
        assert r.status_code == 200 and r.json()["sandbox"] is True
        assert not app.state.gateway.sandboxes.has_sandbox(sid)


def _store(path: Path, now: float) -> SqliteStore:
    """Sessions of every kind, each with a 2000-token turn: old closed ones (one exported), an old open
    one, an old one-off /v1 request, a recent closed one."""
    store = SqliteStore(path)
    sessions = [
        SessionRecord("old_exported", now - 30 * DAY, {}, status="closed", closed_at=now - 10 * DAY),
        SessionRecord("old", now - 30 * DAY, {}, status="closed", closed_at=now - 9 * DAY),
        SessionRecord("old_open", now - 30 * DAY, {}),
        SessionRecord("req_old", now - 20 * DAY, {}, status="closed", ephemeral=True),
        SessionRecord("recent", now - 30 * DAY, {}, status="closed", closed_at=now - DAY),
    ]
    for k, s in enumerate(sessions):
        store.create_session(s)
        turn = store.begin_turn(TurnRecord(s.id, list(range(k, 2000 + k)), [], None, None, {"k": k}, now))
        turn.status, turn.output_ids = "complete", [1] * 500
        store.finish_turn(turn)
    return store


def test_prune(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.db"
    store = _store(path, time.time())
    assert export(store, tmp_path / "out.jsonl", "jsonl", ["old_exported", "old_open"]) >= 1
    store.close()

    assert main(["store", "prune", "--store", str(path), "--older-than", "7d", "--exported-only"]) == 0
    out = capsys.readouterr().out
    assert "pruned 1 exported sessions closed before" in out and ": old_exported\n" in out
    assert "-> " in out and " bytes" in out

    before = path.stat().st_size
    assert main(["store", "prune", "--store", str(path), "--older-than", "168h"]) == 0
    out = capsys.readouterr().out
    assert "pruned 2 sessions" in out and "old" in out and "req_old" in out
    assert path.stat().st_size < before  # the file shrank
    left = SqliteStore(path)
    assert sorted(s.id for s in left.list_sessions()) == ["old_open", "recent"]  # open ones stay
    assert [len(t.prompt_ids) for t in left.get_turns("recent")] == [2000]
    left.close()


@pytest.mark.parametrize("bad", ["7", "d", "-1d", "7y", "1e400d"])
def test_prune_refuses_what_is_not_a_duration(
    tmp_path: Path, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    SqliteStore(tmp_path / "t.db").close()
    assert main(["store", "prune", "--store", str(tmp_path / "t.db"), f"--older-than={bad}"]) == 2
    assert "not a duration" in capsys.readouterr().err
    assert main(["store", "prune", "--store", str(tmp_path / "none.db"), "--older-than", "1d"]) == 2
    assert not (tmp_path / "none.db").exists()
