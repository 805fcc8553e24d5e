"""Replicas on one store share its identity; each gateway's containers also carry its own id
(``--gateway-id``), so that a restarted replica takes back only its own, on a real Docker engine
(`sandbox.sessions.adoption`). The logic is tested fast in tests/sandbox/sessions/test_adoption.py;
this checks Docker's label filter and the containers themselves.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sandbox.backend import SandboxSpec
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.sessions.manager import SandboxManager
from store import SessionRecord, SqliteStore

pytestmark = pytest.mark.docker


async def test_a_restarted_replica_adopts_its_own_containers_and_leaves_the_others(
    backend: DockerSandboxBackend, busybox_image: str, tmp_path: Path
) -> None:
    store = SqliteStore(tmp_path / "traj.db")  # one store (one identity) for both replicas
    settings = SandboxConfig(enabled=True, policy=PolicySettings(mode="never"), watch_interval_s=3600.0)
    a = SandboxManager(backend, store, settings, gateway_id="host:8001")
    b = SandboxManager(backend, store, settings, gateway_id="host:8002")
    managers = [a, b]
    try:
        boxes = {}
        for sid, manager in (("on-a", a), ("on-b", b), ("a-closed", a)):
            store.create_session(SessionRecord(sid, time.time(), {}))
            boxes[sid] = await manager.create(sid, SandboxSpec(image=busybox_image))
            await manager.exec(sid, f"echo {sid} > f")
        closed = store.get_session("a-closed")
        assert closed is not None
        closed.status, closed.closed_at = "closed", time.time()
        store.mark_closed(closed)
        await a.detach()  # A is killed (its containers stay); B lives on

        again = SandboxManager(backend, store, settings, gateway_id="host:8001")
        managers.append(again)
        report = await again.adopt()

        assert (report.adopted, report.removed, report.others) == (["on-a"], [boxes["a-closed"]], ["on-b"])
        assert (await again.exec("on-a", "cat f")).stdout == "on-a\n"  # the same container, adopted
        assert (await b.exec("on-b", "cat f")).stdout == "on-b\n"  # B's, untouched
        on_b = backend.list_sandboxes({"belayer.gateway": "host:8002"})
        assert [box.id for box in on_b] == [boxes["on-b"]]
        assert backend.status(boxes["on-b"]).running
    finally:
        for manager in managers:
            await manager.close()
        store.close()
