"""A restarted gateway takes back its sandboxes (`sandbox.sessions.adoption`), over the in-memory backend.

A "crash" leaves what a ``kill -9`` of the gateway leaves: the containers and checkpoints in the backend,
the events in the store, and no manager. The next manager, on the same store and backend, adopts them.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.pool import EnginePool
from gateway.api.sandbox import open_sandboxes
from sandbox.backend import SandboxSpec
from sandbox.config import PolicySettings
from sandbox.fake import FakeSandboxBackend
from sandbox.sessions.manager import SandboxManager
from store import SessionRecord, SqliteStore, TurnRecord
from tests.sandbox.sessions.conftest import SPEC, settings


class Gateways:
    """One backend (the Docker engine), one store file, and the managers of successive gateways."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.backend = FakeSandboxBackend()
        self.store = SqliteStore(path)
        self.managers: list[SandboxManager] = []
        self.manager = self.start()

    def start(self, **overrides: Any) -> SandboxManager:
        manager = SandboxManager(self.backend, self.store, settings(**overrides))
        self.managers.append(manager)
        return manager

    async def crash_and_restart(self, **overrides: Any) -> SandboxManager:
        """What kill -9 leaves (no manager, the store reopened), then a new gateway's start-up."""
        await self.manager.detach()
        self.store.close()
        self.store = SqliteStore(self.path)
        self.manager = self.start(**overrides)
        await self.manager.adopt()
        return self.manager

    async def session(self, sid: str, spec: SandboxSpec = SPEC, **create: Any) -> str:
        self.store.create_session(SessionRecord(sid, time.time(), {}))
        await self.manager.create(sid, spec, **create)
        return sid

    def kinds(self, sid: str) -> list[str]:
        return [e.kind for e in self.store.get_events(sid) if e.kind != "sandbox_call"]

    def last(self, sid: str, kind: str) -> dict[str, Any]:
        return next(e.data for e in reversed(self.store.get_events(sid)) if e.kind == kind)


@pytest.fixture
async def gws(tmp_path: Path) -> AsyncIterator[Gateways]:
    gateways = Gateways(tmp_path / "traj.db")
    yield gateways
    for manager in gateways.managers:
        await manager.close()
    gateways.store.close()


async def test_a_running_sandbox_is_adopted_with_its_journal_and_checkpoints(gws: Gateways) -> None:
    sid = await gws.session("s1")
    box = gws.manager.sandbox_id(sid)
    await gws.manager.exec(sid, "cd /tmp && X=1")
    ckpt = await gws.manager.checkpoint(sid)
    await gws.manager.exec(sid, "echo two > b")
    await gws.manager.write_file(sid, "c", b"\x00\xffbytes")

    manager = await gws.crash_and_restart()

    assert manager.adoption is not None and manager.adoption.adopted == [sid]
    assert manager.sandbox_id(sid) == box and gws.backend.sandboxes == [box]  # the same container
    state = manager.describe(sid)
    assert [c["id"] for c in state["checkpoints"]] == [ckpt.checkpoint.id]
    assert (state["status"], state["journaled_calls"], state["recovery"]) == ("running", 2, "replay")
    adopted = gws.last(sid, "sandbox_adopted")
    assert (adopted["sandbox_id"], adopted["checkpoints"], adopted["journaled_calls"]) == (box, 1, 2)
    assert (await manager.exec(sid, 'echo "$X"; pwd; cat b')).stdout == "1\n/tmp\ntwo\n"

    gws.backend.kill(box)  # the rebuilt journal replays on the checkpoint, as before the restart
    assert (await manager.exec(sid, 'echo "$X"; pwd; cat b')).stdout == "1\n/tmp\ntwo\n"
    assert await manager.read_file(sid, "c") == b"\x00\xffbytes"
    restored = manager.describe(sid)["last_restore"]
    assert (restored["mode"], restored["checkpoint_id"], restored["replayed"], restored["diverged"]) == (
        "replay", ckpt.checkpoint.id, 3, 0,
    )  # fmt: skip


async def test_a_sandbox_that_died_meanwhile_is_restored_and_its_journal_replayed(gws: Gateways) -> None:
    sid = await gws.session("s1")
    box = gws.manager.sandbox_id(sid)
    await gws.manager.exec(sid, "echo one > a")
    ckpt = await gws.manager.checkpoint(sid)
    await gws.manager.exec(sid, "echo two >> a")
    await gws.manager.write_file(sid, "b", b"written\n")
    gws.backend.kill(box)

    manager = await gws.crash_and_restart()

    assert manager.adoption is not None and manager.adoption.restored == [sid]
    new = manager.sandbox_id(sid)
    assert new != box and gws.backend.sandboxes == [new]  # the dead one is removed
    assert gws.backend.ops("restore") == [ckpt.checkpoint.id]
    assert await manager.read_file(sid, "a") == b"one\ntwo\n"
    assert await manager.read_file(sid, "b") == b"written\n"
    assert gws.kinds(sid)[-2:] == ["sandbox_failure", "sandbox_restored"]
    failure = gws.last(sid, "sandbox_failure")
    assert failure == {
        "kind": "exited", "sandbox_id": box,
        "detail": "the sandbox stopped while the gateway was down: container exited, exit code 137",
    }  # fmt: skip
    restored = gws.last(sid, "sandbox_restored")
    assert (restored["mode"], restored["replayed"], restored["sandbox_id"]) == ("replay", 2, new)

    third = await gws.crash_and_restart()  # the restored sandbox is adopted in turn
    assert third.adoption is not None and third.adoption.adopted == [sid]
    assert third.sandbox_id(sid) == new


async def test_without_anything_to_restore_the_sandbox_is_failed_for_good(gws: Gateways) -> None:
    sid = await gws.session("s1", recovery="truncate")
    gws.backend.kill(gws.manager.sandbox_id(sid))

    manager = await gws.crash_and_restart()

    assert manager.adoption is not None and manager.adoption.failed == [sid]
    state = manager.describe(sid)
    assert state["status"] == "failed" and state["sandbox_id"] is None
    reason = gws.last(sid, "sandbox_failed")["reason"]
    assert (
        reason.startswith("exited: the sandbox stopped while the gateway was down")
        and "no checkpoint" in reason
    )
    assert gws.backend.sandboxes == []

    again = await gws.crash_and_restart()
    assert again.adoption is not None and again.adoption.failed == [sid]
    assert gws.kinds(sid).count("sandbox_failed") == 1  # nothing new happened to it


async def test_leaked_containers_go_and_foreign_ones_stay(gws: Gateways) -> None:
    closed = await gws.session("closed")
    leaked = gws.manager.sandbox_id(closed)
    ckpt = await gws.manager.checkpoint(closed)
    session = gws.store.get_session(closed)
    assert session is not None
    session.status, session.closed_at = "closed", time.time()
    gws.store.mark_closed(session)  # then the gateway died before removing the sandbox
    other_store = gws.backend.create(SPEC.model_copy(update={"labels": {"belayer.store": "another"}}))
    unlabelled = gws.backend.create(SPEC)

    manager = await gws.crash_and_restart()

    assert manager.adoption is not None and manager.adoption.removed == [leaked]
    assert sorted(gws.backend.sandboxes) == sorted([other_store.id, unlabelled.id])
    assert ckpt.checkpoint.id not in gws.backend.checkpoint_ids
    assert gws.last(closed, "sandbox_destroyed") == {
        "sandbox_id": leaked, "stage": "start-up", "reason": "leaked by a gateway that stopped",
    }  # fmt: skip
    assert not manager.has_sandbox(closed)


async def test_a_fork_child_is_adopted_with_its_lineage(gws: Gateways) -> None:
    parent = await gws.session("parent")
    await gws.manager.exec(parent, "echo base > f")
    gws.store.create_session(SessionRecord("child", time.time(), {}))
    await gws.manager.fork(parent, ["child"], 0)
    child_box = gws.manager.sandbox_id("child")

    manager = await gws.crash_and_restart()

    assert manager.adoption is not None and sorted(manager.adoption.adopted) == ["child", "parent"]
    assert manager.lineage_of("child") == ("parent",) and manager.sandbox_id("child") == child_box
    [fork_ckpt] = manager.checkpoints("child")
    assert fork_ckpt.trigger == "fork"
    gws.backend.kill(child_box)  # its own fork checkpoint brings it back
    assert (await manager.exec("child", "cat f")).stdout == "base\n"


async def test_the_listener_port_and_addresses_come_back(gws: Gateways) -> None:
    gws.manager.gateway_url = "http://10.99.0.1:9123"
    sid = await gws.session("s1", spec=SandboxSpec(image="img", network="gateway"))
    address = gws.backend.network.address(gws.manager.sandbox_id(sid))

    manager = await gws.crash_and_restart()

    assert manager.listener_port() == 9123
    assert address is not None and await manager.owner_of(address) == sid


async def test_keep_on_shutdown_leaves_the_sandboxes_to_the_next_gateway(tmp_path: Path) -> None:
    backend, store = FakeSandboxBackend(), SqliteStore(tmp_path / "traj.db")
    store.create_session(SessionRecord("s1", time.time(), {}))
    async with httpx.AsyncClient() as http:
        pool = EnginePool(http)
        async with open_sandboxes(settings(keep_on_shutdown=True), store, pool, backend) as manager:
            assert manager is not None
            box = await manager.create("s1", SPEC)
            await manager.exec("s1", "echo kept > f")
        assert backend.sandboxes == [box]  # a clean shutdown left it

        async with open_sandboxes(settings(), store, pool, backend) as manager:
            assert manager is not None and manager.adoption is not None
            assert manager.adoption.adopted == ["s1"] and manager.sandbox_id("s1") == box
            assert (await manager.exec("s1", "cat f")).stdout == "kept\n"
        assert backend.sandboxes == []  # keep_on_shutdown off: removed
    store.close()


async def test_replicas_on_one_store_adopt_only_their_own_sandboxes(gws: Gateways) -> None:
    """Two replicas share a store (and so its identity) and a Docker engine: at its restart, replica A
    takes back its own sessions' sandboxes, removes only its own leaked ones, and never touches B's, which
    B (restarted with its id) adopts in turn."""
    a = SandboxManager(gws.backend, gws.store, settings(), gateway_id="host:8001")
    b = SandboxManager(gws.backend, gws.store, settings(), gateway_id="host:8002")
    gws.managers += [a, b]
    for sid, manager in (("on-a", a), ("on-b", b), ("a-closed", a), ("b-closed", b)):
        gws.store.create_session(SessionRecord(sid, time.time(), {}))
        await manager.create(sid, SPEC)
        await manager.exec(sid, f"echo {sid} > f")
    boxes = {sid: (a if sid.startswith(("on-a", "a-")) else b).sandbox_id(sid) for sid in
             ("on-a", "on-b", "a-closed", "b-closed")}  # fmt: skip
    labelled = gws.backend.list_sandboxes({"belayer.gateway": "host:8002"})
    assert sorted(box.id for box in labelled) == sorted([boxes["on-b"], boxes["b-closed"]])
    for sid in ("a-closed", "b-closed"):  # closed; both gateways die before removing their sandboxes
        session = gws.store.get_session(sid)
        assert session is not None
        session.status, session.closed_at = "closed", time.time()
        gws.store.mark_closed(session)
    await a.detach()  # A is killed; B lives on

    again = SandboxManager(gws.backend, gws.store, settings(), gateway_id="host:8001")
    gws.managers.append(again)
    report = await again.adopt()

    assert (report.adopted, report.restored, report.failed) == (["on-a"], [], [])
    assert report.removed == [boxes["a-closed"]]  # its own leaked one; B's closed session's box stays
    assert report.others == ["on-b"]
    assert sorted(gws.backend.sandboxes) == sorted([boxes["on-a"], boxes["on-b"], boxes["b-closed"]])
    assert again.sandbox_id("on-a") == boxes["on-a"] and not again.has_sandbox("on-b")
    assert (await again.exec("on-a", "cat f")).stdout == "on-a\n"
    assert (await b.exec("on-b", "cat f")).stdout == "on-b\n"  # B's sandbox, untouched, still B's
    assert "sandbox_adopted" not in gws.kinds("on-b")

    await b.detach()  # now B dies too, and comes back with its id: it adopts its own
    b_again = SandboxManager(gws.backend, gws.store, settings(), gateway_id="host:8002")
    gws.managers.append(b_again)
    report = await b_again.adopt()
    assert (report.adopted, report.removed, report.others) == (["on-b"], [boxes["b-closed"]], ["on-a"])
    assert (await b_again.exec("on-b", "cat f")).stdout == "on-b\n"
    assert again.sandbox_id("on-a") == boxes["on-a"]  # A's, untouched by B's start-up


async def test_a_standby_left_behind_is_removed_and_the_sandbox_adopted(gws: Gateways) -> None:
    """A gateway killed with a standby (`sandbox.sessions.standby`) leaves it frozen: no slot holds it, so
    the next start-up removes it as leaked; the session's own sandbox is adopted."""
    gws.manager = gws.start(policy=PolicySettings(mode="always"), standby=True)
    sid = await gws.session("s1")
    box = gws.manager.sandbox_id(sid)
    turn = TurnRecord(sid, [1, 2, 3], [], None, None, {}, time.time())
    gws.store.begin_turn(turn)
    gws.manager.turn_started(turn)  # its bubble: a checkpoint, then the standby of it
    await gws.manager.idle()
    [standby] = [b for b in gws.backend.sandboxes if b != box]
    assert gws.backend.frozen(standby)

    manager = await gws.crash_and_restart()

    assert manager.adoption is not None
    assert (manager.adoption.adopted, manager.adoption.removed) == ([sid], [standby])
    assert gws.backend.sandboxes == [box] and manager.sandbox_id(sid) == box
