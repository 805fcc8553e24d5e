"""Tree rollouts: ``POST /api/sessions/{id}/fork`` on a scripted engine and the in-memory sandbox backend.

A scripted episode runs to turn k; its fork's children each continue with their own scripted replies.
They share the parent's turns (prompt ids start with exactly the parent's), their own sandboxes start
from the parent's environment at turn k, and the parent goes on unaffected.
"""

from __future__ import annotations

import asyncio
import sqlite3
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.errors import RestoreError
from engine_pool.fake import FakeEngine, Fault, FaultInjector
from gateway.api.sandbox_listener import SandboxFacing
from gateway.config import FailoverConfig, GatewayConfig
from gateway.gateway import Gateway
from sandbox.backend import Checkpoint, Sandbox
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.fake import FakeSandboxBackend
from store import SessionRecord, SqliteStore, TurnRecord, schema
from store.export import session_rows
from store.schema import SCHEMA_VERSION, version
from tests.support import asgi_gateway, post_body

Messages = list[dict[str, Any]]


class Rig:
    """A gateway over two scripted engine hosts (behind a `FaultInjector`) and a fake sandbox backend."""

    def __init__(
        self,
        app: Any,
        client: httpx.AsyncClient,
        engine: FakeEngine,
        faults: FaultInjector,
        backend: FakeSandboxBackend,
    ) -> None:
        self.app, self.client, self.engine, self.faults, self.backend = app, client, engine, faults, backend

    @property
    def gw(self) -> Gateway:
        gw: Gateway = self.app.state.gateway
        return gw

    def reply(self, text: str) -> None:
        tok = self.gw.tokenizer
        self.engine.outputs.append([*tok.encode(text), tok.encode(tok.eos_token)[0]])

    async def session(self, sandbox: bool = False) -> str:
        body: dict[str, Any] = {"metadata": {"task": "t1"}}
        if sandbox:
            body["sandbox"] = {"image": "img"}
        r = await self.client.post("/api/sessions", json=body)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    async def turn(self, sid: str, messages: Messages, reply: str) -> Messages:
        """One LLM call answered with `reply`; the conversation after it (with a next user message)."""
        self.reply(reply)
        body = {"model": "policy", "messages": messages, "max_tokens": 32, "logprobs": True}
        r = await self.client.post(f"/s/{sid}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]
        return [
            *messages,
            {"role": "assistant", "content": answer["content"]},
            {"role": "user", "content": "next"},
        ]

    async def episode(self, sid: str, turns: int, tag: str = "p", tools: bool = False) -> list[Messages]:
        """`turns` turns; the conversation before each (and after the last). With `tools`, each turn
        is followed by a tool call writing the turn's number to a file."""
        convo: list[Messages] = [[{"role": "user", "content": "solve the task"}]]
        for i in range(turns):
            convo.append(await self.turn(sid, convo[-1], f"{tag} step {i}"))
            if tools:
                await self.exec(sid, f"echo {i} > /workspace/turn-{i}")
        return convo

    async def exec(self, sid: str, command: str) -> str:
        r = await self.client.post(f"/api/sessions/{sid}/sandbox/exec", json={"command": command})
        assert r.status_code == 200, r.text
        return str(r.json()["stdout"])

    async def turn_files(self, sid: str) -> list[int]:
        """Which turns' tool calls (``/workspace/turn-N``) the sandbox holds."""
        found = []
        for i in range(5):
            body = {"command": f"cat /workspace/turn-{i}"}
            r = await self.client.post(f"/api/sessions/{sid}/sandbox/exec", json=body)
            if r.json()["exit_code"] == 0:
                found.append(i)
        return found

    async def fork(self, sid: str, at_turn: int, n: int, **extra: Any) -> list[dict[str, Any]]:
        r = await self.client.post(f"/api/sessions/{sid}/fork", json={"at_turn": at_turn, "n": n, **extra})
        assert r.status_code == 201, r.text
        data: list[dict[str, Any]] = r.json()["data"]
        return data

    async def trajectory(self, sid: str) -> dict[str, Any]:
        r = await self.client.get(f"/api/sessions/{sid}/trajectory")
        assert r.status_code == 200, r.text
        out: dict[str, Any] = r.json()
        return out


@pytest.fixture
async def rig(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Rig]:
    engine = FakeEngine(max_model_len=4096)
    faults = FaultInjector(httpx.ASGITransport(engine.app()))
    backend = FakeSandboxBackend()
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        failover=FailoverConfig(stall_timeout=0.3, no_worker_wait=1.0, max_failovers=3),
        sandbox=SandboxConfig(enabled=True, sandbox_port=None, policy=PolicySettings(mode="never")),
        max_fork_siblings=4,
    )
    probes = {"probe_interval": 0.05, "probe_timeout": 0.2}
    hosts = ["http://e0", "http://e1"]
    async with asgi_gateway(config, faults, hosts=hosts, pool_options=probes, sandbox_backend=backend) as (
        app,
        client,
    ):
        yield Rig(app, client, engine, faults, backend)


def ids(turn: dict[str, Any]) -> list[int]:
    return list(turn["prompt_ids"]) + list(turn["output_ids"])


async def test_children_share_the_parent_turns_and_diverge(rig: Rig) -> None:
    parent = await rig.session()
    convo = await rig.episode(parent, 4)
    k = 2
    children = await rig.fork(parent, k, 3, metadata={"group": "g1"})
    assert [c["parent_session"] for c in children] == [parent] * 3
    assert {c["fork_turn"] for c in children} == {k}
    assert all(c["num_turns"] == k + 1 and c["metadata"] == {"task": "t1", "group": "g1"} for c in children)
    before = (await rig.trajectory(parent))["turns"]

    for i, child in enumerate(children):  # each continues turn k's conversation its own way
        after = await rig.turn(child["id"], convo[k + 1], f"child {i} a")
        await rig.turn(child["id"], after, f"child {i} b")
    await rig.turn(parent, convo[4], "parent goes on")

    parent_traj = await rig.trajectory(parent)
    assert parent_traj["turns"][:4] == before and len(parent_traj["turns"]) == 5
    assert parent_traj["session"]["parent_session"] is None
    outputs = set()
    for child in children:
        traj = await rig.trajectory(child["id"])
        turns = traj["turns"]
        assert [t["index"] for t in turns] == [0, 1, 2, 3, 4]
        assert turns[: k + 1] == before[: k + 1]  # shared, exactly as the parent has them
        assert turns[k + 1]["prompt_ids"][: len(ids(before[k]))] == ids(before[k])
        assert turns[k + 1]["parent_index"] == k and turns[4]["parent_index"] == k + 1
        assert len({t["branch"] for t in turns}) == 1  # one branch through the fork
        assert (traj["session"]["parent_session"], traj["session"]["fork_turn"]) == (parent, k)
        outputs.add(tuple(turns[4]["output_ids"]))
        [row] = session_rows(rig.gw.store, child["id"])  # its own branch, through the shared turns
        assert (row["parent_session"], row["fork_turn"], row["num_turns"]) == (parent, k, 5)
        assert row["prompt_ids"] + row["response_ids"] == ids(turns[4])
    assert len(outputs) == 3
    assert [r["parent_session"] for r in session_rows(rig.gw.store, parent)] == [None]


async def test_rewards_and_a_fork_of_a_fork(rig: Rig) -> None:
    root = await rig.session()
    convo = await rig.episode(root, 3)
    [child] = await rig.fork(root, 1, 1)
    after = await rig.turn(child["id"], convo[2], "child 2")
    after = await rig.turn(child["id"], after, "child 3")
    grandchildren = await rig.fork(child["id"], 2, 2)  # at the child's own turn 2
    for i, g in enumerate(grandchildren):
        conv = convo[2] + [{"role": "assistant", "content": "child 2"}, {"role": "user", "content": "next"}]
        await rig.turn(g["id"], conv, f"grandchild {i}")
        traj = await rig.trajectory(g["id"])
        assert [t["index"] for t in traj["turns"]] == [0, 1, 2, 3]
        shared = (await rig.trajectory(child["id"]))["turns"][:3]
        assert traj["turns"][:3] == shared
        assert traj["turns"][3]["prompt_ids"][: len(ids(shared[2]))] == ids(shared[2])
    [a, b] = grandchildren
    for sid, reward in ((root, 0.1), (child["id"], 0.5), (a["id"], 1.0), (b["id"], 0.0)):
        r = await rig.client.post(f"/api/sessions/{sid}/reward", json={"reward": reward})
        assert r.status_code == 200, r.text
    got = {
        sid: (await rig.client.get(f"/api/sessions/{sid}")).json()["reward"]
        for sid in (root, a["id"], b["id"])
    }
    assert got == {root: 0.1, a["id"]: 1.0, b["id"]: 0.0}
    # a parent whose turns are shared cannot be deleted before its children
    r = await rig.client.delete(f"/api/sessions/{child['id']}")
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_has_forks"
    for sid in (a["id"], b["id"], child["id"], root):
        assert (await rig.client.post(f"/api/sessions/{sid}/close")).status_code == 200
        assert (await rig.client.delete(f"/api/sessions/{sid}")).status_code == 200, sid


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"at_turn": 9, "n": 2}, 404, "turn_not_found"),
        ({"at_turn": 0, "n": 0}, 400, None),
        ({"at_turn": 0, "n": 5}, 400, "too_many_siblings"),
        ({"at_turn": -1, "n": 1}, 400, None),
        ({"n": 1}, 400, None),
        ({"at_turn": 0, "n": 1, "other": 1}, 400, None),
        (b"{not json", 400, None),
        ([1, 2], 400, None),
    ],
)
async def test_bad_fork_requests_are_refused(rig: Rig, body: Any, status: int, code: str | None) -> None:
    parent = await rig.session(sandbox=True)
    await rig.episode(parent, 1)
    before = len(rig.gw.store.list_sessions())
    r = await post_body(rig.client, f"/api/sessions/{parent}/fork", body)
    assert r.status_code == status, r.text
    assert "message" in r.json()["error"]
    if code is not None:
        assert r.json()["error"]["code"] == code
    assert len(rig.gw.store.list_sessions()) == before and len(rig.backend.sandboxes) == 1


async def test_unknown_closed_and_incomplete_turns_are_refused(rig: Rig) -> None:
    r = await rig.client.post("/api/sessions/ses_nope/fork", json={"at_turn": 0, "n": 1})
    assert r.status_code == 404
    parent = await rig.session()
    await rig.episode(parent, 2)
    rig.gw.store.discard_turns_after(parent, 0, "test")
    r = await rig.client.post(f"/api/sessions/{parent}/fork", json={"at_turn": 1, "n": 1})
    assert r.status_code == 409 and r.json()["error"]["code"] == "turn_not_complete"
    await rig.client.post(f"/api/sessions/{parent}/close")
    r = await rig.client.post(f"/api/sessions/{parent}/fork", json={"at_turn": 0, "n": 1})
    assert r.status_code == 409 and r.json()["error"]["code"] == "session_closed"
    assert len(rig.gw.store.list_sessions()) == 1


async def test_children_get_the_sandbox_of_turn_k(rig: Rig) -> None:
    """No checkpoint exactly at k: the one before it, then the tool calls up to k replayed."""
    parent = await rig.session(sandbox=True)
    manager = rig.gw.sandboxes
    assert manager is not None
    convo = await rig.episode(parent, 1, tools=True)  # turn 0, its tool call
    await manager.checkpoint(parent)  # keep_through 0
    for i in (1, 2, 3):
        convo.append(await rig.turn(parent, convo[-1], f"p step {i}"))
        await rig.exec(parent, f"echo {i} > /workspace/turn-{i}")
    k = 2
    children = await rig.fork(parent, k, 3)
    for child in children:
        assert child["sandbox"]["forked_from"] == parent
        # the tool calls of turns 0 and 1 are there; turn 2's are the child's to run
        assert await rig.turn_files(child["id"]) == [0, 1]
    assert await rig.turn_files(parent) == [0, 1, 2, 3]
    for i, child in enumerate(children):
        await rig.exec(child["id"], f"echo {i} > /workspace/mine")
    assert [await rig.exec(c["id"], "cat /workspace/mine") for c in children] == ["0\n", "1\n", "2\n"]
    [event] = [
        e for e in (await rig.trajectory(children[0]["id"]))["events"] if e["kind"] == "sandbox_forked"
    ]
    assert event["data"]["replayed"] == 1 and event["data"]["fork_turn"] == k
    assert len(rig.backend.sandboxes) == 4
    for child in children:
        assert (await rig.client.post(f"/api/sessions/{child['id']}/close")).status_code == 200
    assert len(rig.backend.sandboxes) == 1


async def test_a_child_sandbox_that_dies_is_restored_from_its_fork_checkpoint(rig: Rig) -> None:
    """A child's journal starts at its fork; its fork checkpoint is the base it replays on, even after
    the parent's checkpoints are gone."""
    parent = await rig.session(sandbox=True)
    manager = rig.gw.sandboxes
    assert manager is not None
    convo = await rig.episode(parent, 1, tools=True)
    await manager.checkpoint(parent)  # keep_through 0
    for i in (1, 2):
        convo.append(await rig.turn(parent, convo[-1], f"p step {i}"))
        await rig.exec(parent, f"echo {i} > /workspace/turn-{i}")
    [a, b] = await rig.fork(parent, 2, 2)  # the checkpoint at turn 0, then turn 1's call replayed
    for child in (a, b):
        [base] = manager.checkpoints(child["id"])
        assert (base.trigger, base.keep_through, base.session_id) == ("fork", 2, child["id"])
    assert (await rig.client.post(f"/api/sessions/{parent}/close")).status_code == 200
    await rig.turn(a["id"], convo[3], "a step 3")
    await rig.exec(a["id"], "echo 2 > /workspace/turn-2")  # journaled on top of the fork checkpoint
    rig.backend.kill(manager.describe(a["id"])["sandbox_id"])
    assert await rig.exec(a["id"], "echo back") == "back\n"  # restored and replayed, transparently
    assert await rig.turn_files(a["id"]) == [0, 1, 2]
    assert await rig.turn_files(b["id"]) == [0, 1]
    [restore] = [e for e in (await rig.trajectory(a["id"]))["events"] if e["kind"] == "sandbox_restored"]
    assert restore["data"]["mode"] == "replay" and restore["data"]["replayed"] == 1
    assert [t["index"] for t in (await rig.trajectory(a["id"]))["turns"]] == [0, 1, 2, 3]


async def test_a_fork_the_journal_cannot_reach_is_refused(rig: Rig) -> None:
    parent = await rig.session(sandbox=True)
    manager = rig.gw.sandboxes
    assert manager is not None
    await rig.episode(parent, 3, tools=True)
    await manager.checkpoint(parent)  # at turn 2: the journal starts after it
    r = await rig.client.post(f"/api/sessions/{parent}/fork", json={"at_turn": 1, "n": 2})
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_checkpoint", r.text
    assert len(rig.gw.store.list_sessions()) == 1 and len(rig.backend.sandboxes) == 1
    assert len(await rig.fork(parent, 2, 1)) == 1  # exactly at its checkpoint: fine


async def test_a_fork_that_fails_half_way_leaves_nothing(rig: Rig) -> None:
    parent = await rig.session(sandbox=True)
    manager = rig.gw.sandboxes
    assert manager is not None
    await rig.episode(parent, 2, tools=True)
    await manager.checkpoint(parent)
    restore, calls = rig.backend.restore, []

    def second_fails(checkpoint: Checkpoint) -> Sandbox:  # the first child's restore works
        calls.append(checkpoint.id)
        if len(calls) == 2:
            raise RestoreError("injected: the second restore fails")
        return restore(checkpoint)

    rig.backend.restore = second_fails  # type: ignore[method-assign]
    r = await rig.client.post(f"/api/sessions/{parent}/fork", json={"at_turn": 1, "n": 3})
    assert r.status_code == 500 and r.json()["error"]["code"] == "checkpoint_failed", r.text
    assert len(calls) == 3  # every child was tried; the two made were removed
    assert len(rig.backend.sandboxes) == 1 and len(rig.gw.store.list_sessions()) == 1
    assert rig.gw.store.children(parent) == []
    assert rig.backend.checkpoint_ids == [c.checkpoint.id for c in manager.checkpoints(parent)]


async def test_a_forked_sandbox_calling_its_parent_url_lands_in_its_own_session(rig: Rig) -> None:
    """The restored harness still holds ``/s/{parent}/…``: the listener rewrites it to the child's."""
    manager = rig.gw.sandboxes
    assert manager is not None
    manager.gateway_url = "http://10.99.0.1:9000"
    r = await rig.client.post("/api/sessions", json={"sandbox": {"image": "img", "network": "gateway"}})
    parent = r.json()["id"]
    convo = await rig.episode(parent, 2)
    await manager.checkpoint(parent)
    [a, b] = await rig.fork(parent, 1, 2)
    facing = SandboxFacing(rig.app, manager)

    async def from_box(sid: str, path: str, reply: str) -> httpx.Response:
        address = manager.describe(sid)["sandbox_id"]
        client_ip = rig.backend.network.address(address)
        assert client_ip is not None
        transport = httpx.ASGITransport(facing, client=(client_ip, 5555))
        rig.reply(reply)
        body = {"model": "policy", "messages": convo[2], "max_tokens": 32}
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            return await c.post(path, json=body)

    r = await from_box(a["id"], f"/s/{parent}/v1/chat/completions", "from a")
    assert r.status_code == 200, r.text
    r = await from_box(b["id"], f"/s/{b['id']}/v1/chat/completions", "from b")
    assert r.status_code == 200, r.text
    r = await from_box(a["id"], f"/s/{b['id']}/v1/chat/completions", "into a sibling")
    assert r.status_code == 403  # a sibling's session stays out of reach
    parent_turns = (await rig.trajectory(parent))["turns"]
    assert len(parent_turns) == 2
    for child, text in ((a, "from a"), (b, "from b")):
        turns = (await rig.trajectory(child["id"]))["turns"]
        assert len(turns) == 3 and turns[2]["response"]["message"]["content"] == text
        assert turns[2]["prompt_ids"][: len(ids(parent_turns[1]))] == ids(parent_turns[1])


async def test_a_fork_while_the_parent_fails_over(rig: Rig) -> None:
    parent = await rig.session()
    convo = await rig.episode(parent, 2)
    rig.faults.faults["e0"] = [Fault("drop_after", 2)]
    rig.faults.faults["e1"] = [Fault("drop_after", 2)]
    body = {"model": "policy", "messages": convo[2], "max_tokens": 16, "stream": True}
    parent_turn = asyncio.create_task(rig.client.post(f"/s/{parent}/v1/chat/completions", json=body))
    children = await rig.fork(parent, 1, 2)
    assert (await parent_turn).status_code == 200
    traj = await rig.trajectory(parent)
    assert [e["kind"] for e in traj["events"]].count("failover") >= 1
    assert traj["turns"][2]["status"] == "complete"
    for child in children:
        await rig.turn(child["id"], convo[2], "child")
        turns = (await rig.trajectory(child["id"]))["turns"]
        assert [t["index"] for t in turns] == [0, 1, 2]
        assert turns[2]["prompt_ids"] == traj["turns"][2]["prompt_ids"]


def test_store_sharing_and_migration_from_version_2(tmp_path: Path) -> None:
    """A child stores none of the shared turns; a version 2 store gains the fork columns."""
    store = SqliteStore(tmp_path / "s.db")
    store.create_session(SessionRecord("p", time.time(), {}))
    parent_id = None
    for i in range(4):
        turn = TurnRecord("p", list(range(100 * (i + 1))), [], parent_id, None, {}, time.time())
        store.begin_turn(turn)
        turn.status, turn.output_ids, turn.output_logprobs = "complete", [7] * 100, [-0.1] * 100
        turn.prompt_ids = list(range(100 * (i + 1)))
        store.finish_turn(turn)
        parent_id = turn.id
    store.fork("p", 2, [SessionRecord("c", time.time(), {})])
    rows = store._db.execute("SELECT COUNT(*) FROM turns WHERE session_id = 'c'").fetchone()[0]
    assert rows == 0 and [t.index for t in store.get_turns("c")] == [0, 1, 2]
    assert store.turn_counts("c") == {"c": (3, 1)}
    store.close()

    db = sqlite3.connect(tmp_path / "old.db", isolation_level=None)
    db.execute(
        "CREATE TABLE sessions (id TEXT PRIMARY KEY, created_at REAL NOT NULL, metadata TEXT NOT NULL, "
        "status TEXT NOT NULL, reward REAL, reward_info TEXT, closed_at REAL, ephemeral INTEGER NOT NULL DEFAULT 0)"
    )
    for sql in (*schema._TABLES[1:], *schema._V2_TABLES):
        db.execute(sql)
    db.execute("INSERT INTO meta VALUES ('schema_version', '2')")
    db.execute("INSERT INTO sessions VALUES ('old', 1.0, '{}', 'open', NULL, NULL, NULL, 0)")
    db.close()
    store = SqliteStore(tmp_path / "old.db")
    assert version(store._db) == SCHEMA_VERSION == 4  # version 2 -> 3 (forks) -> 4 (weight versions)
    old = store.get_session("old")
    assert old is not None and (old.parent_session, old.fork_turn) == (None, None)
    store.close()
