"""Standby sandboxes on a real Docker engine with CRIU (`sandbox.sessions.standby`): the checkpoint taken
in a bubble is restored into a paused container; when the sandbox dies, the manager unpauses that one
and replays the calls since the checkpoint, and a process's in-memory state and the files come back
exactly as they were before the failure."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from core.errors import SandboxError
from sandbox.backend import SandboxSpec
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.sessions.manager import SandboxManager
from sandbox.workloads import SHELL_COUNTER_SERVER as COUNTER_SERVER
from store import SessionRecord, SqliteStore, TurnRecord

pytestmark = pytest.mark.docker

BUMP = 'kill -USR1 "$(cat /workspace/server.pid)"; sleep 0.4; cat /workspace/count'


def paused(backend: DockerSandboxBackend, box: str) -> bool:
    return bool(backend._api.inspect_container(box)["State"]["Paused"])


async def test_a_standby_recovery_brings_back_memory_and_files(
    backend: DockerSandboxBackend, busybox_image: str, tmp_path: Path, no_leaked_snapshots: None
) -> None:
    store = SqliteStore(tmp_path / "traj.db")
    store.create_session(SessionRecord("s1", time.time(), {}))
    settings = SandboxConfig(
        enabled=True, policy=PolicySettings(mode="always"), standby=True, watch_interval_s=3600.0
    )
    manager = SandboxManager(backend, store, settings)
    try:
        await manager.create("s1", SandboxSpec(image=busybox_image))
        primary = manager.sandbox_id("s1")
        await manager.exec("s1", COUNTER_SERVER)
        assert (await manager.exec("s1", BUMP)).stdout == "1\n"
        await manager.write_file("s1", "kept.txt", b"before\n")
        await manager.exec("s1", "mkdir -p sub && cd sub && FOO=bar")

        turn = TurnRecord("s1", [1, 2, 3], [], None, None, {}, time.time())
        store.begin_turn(turn)
        manager.turn_started(turn)  # its bubble: the checkpoint, then the standby of it
        await manager.idle()
        turn.status = "complete"
        manager.turn_finished(turn)
        [ckpt] = manager.checkpoints("s1")
        [made] = [e.data for e in store.get_events("s1") if e.kind == "sandbox_standby"]
        standby = made["sandbox_id"]
        assert (made["action"], made["checkpoint_id"]) == ("made", ckpt.checkpoint.id)
        assert paused(backend, standby) and not paused(backend, primary)
        with pytest.raises(SandboxError):  # frozen: nothing runs in it
            backend.exec(standby, "true", timeout_s=5)

        # after the checkpoint: calls k+1..n, which the recovery replays on the standby
        assert (await manager.exec("s1", BUMP)).stdout == "2\n"
        await manager.write_file("s1", "/workspace/sub/after.txt", b"after\n")
        await manager.exec("s1", "rm /workspace/kept.txt && echo changed > /workspace/kept2.txt")
        backend.kill(primary)

        again = await manager.exec("s1", 'echo "$FOO $(pwd)"; cat after.txt ../kept2.txt; ls ..')

        assert manager.sandbox_id("s1") == standby and not paused(backend, standby)
        assert again.stdout == "bar /workspace/sub\nafter\nchanged\ncount\nkept2.txt\nserver.pid\nsub\n"
        assert (await manager.exec("s1", BUMP)).stdout == "3\n"  # the server's memory: 1, then 2 replayed
        restored = manager.describe("s1")["last_restore"]
        assert (restored["standby"], restored["checkpoint_id"], restored["replayed"], restored["diverged"]) == (
            True, ckpt.checkpoint.id, 3, 0,
        )  # fmt: skip
        assert primary not in {b.id for b in backend.list_sandboxes({"belayer.session": "s1"})}
    finally:
        await manager.close()
        store.close()
    assert backend.list_sandboxes({"belayer.session": "s1"}) == []
