"""Checkpoint retention and deletion without Docker: a deletion that fails is logged and counted; a
checkpoint over a disk quota that the storage driver does not enforce is refused."""

from __future__ import annotations

import logging

import pytest

from core.errors import CheckpointError
from core.logs import session_tag
from sandbox.fake import FakeSandboxBackend, Fault
from tests.sandbox.sessions.conftest import EnvFactory


async def test_retention_deletes_the_oldest(make_env: EnvFactory) -> None:
    env = await make_env(keep_checkpoints=2)
    sid = await env.session()
    c1, c2, c3 = [await env.manager.checkpoint(sid) for _ in range(3)]
    assert [c.checkpoint.id for c in env.manager.checkpoints(sid)] == [c2.checkpoint.id, c3.checkpoint.id]
    assert env.backend.checkpoint_ids == [c2.checkpoint.id, c3.checkpoint.id]
    assert env.backend.ops("delete_checkpoint") == [c1.checkpoint.id]
    assert env.manager.stats()["checkpoint_delete_failures"] == 0


async def test_a_failed_deletion_is_logged_and_counted(
    make_env: EnvFactory, caplog: pytest.LogCaptureFixture
) -> None:
    env = await make_env(keep_checkpoints=1)
    sid = await env.session()
    c1 = await env.manager.checkpoint(sid)
    env.backend.inject(Fault("delete_checkpoint"))

    with caplog.at_level(logging.WARNING, logger="belayer.sandbox"):
        c2 = await env.manager.checkpoint(sid)  # evicts c1, whose deletion fails

    assert [c.checkpoint.id for c in env.manager.checkpoints(sid)] == [c2.checkpoint.id]
    assert env.backend.checkpoint_ids == [c1.checkpoint.id, c2.checkpoint.id]  # c1's storage leaked
    assert env.manager.stats()["checkpoint_delete_failures"] == 1
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert record.getMessage() == (
        f"session {session_tag(sid)}: could not delete checkpoint {c1.checkpoint.id} (its storage leaks): "
        "delete_checkpoint failed (injected fault)"
    )


async def test_destroy_deletes_every_checkpoint_and_counts_the_failures(make_env: EnvFactory) -> None:
    env = await make_env()
    sid = await env.session()
    c1, c2 = await env.manager.checkpoint(sid), await env.manager.checkpoint(sid)
    env.backend.inject(Fault("delete_checkpoint"))

    await env.manager.destroy(sid)

    assert env.backend.ops("delete_checkpoint") == [c1.checkpoint.id, c2.checkpoint.id]
    assert env.backend.checkpoint_ids == [c1.checkpoint.id]
    assert env.manager.stats() == {
        "sandboxes": 0, "checkpoints_taken": 2, "checkpoint_delete_failures": 1, "restores": 0,
        "replays": 0, "standbys_made": 0, "standbys_used": 0, "background_failures": 0,
    }  # fmt: skip
    assert env.kinds()[-1] == "sandbox_destroyed"


async def test_released_checkpoints_are_not_deleted(make_env: EnvFactory) -> None:
    env = await make_env()
    sid = await env.session()
    c1 = await env.manager.checkpoint(sid)
    assert env.manager.release_checkpoints(sid) == [c1]
    await env.manager.destroy(sid)
    assert env.backend.checkpoint_ids == [c1.checkpoint.id]


async def test_a_checkpoint_over_the_unenforced_disk_quota_is_refused(
    make_env: EnvFactory, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="belayer.sandbox"):
        env = await make_env(FakeSandboxBackend(disk_quota_bytes=1000))  # the fake's driver enforces none
    [line] = [r.getMessage() for r in caplog.records if "disk limits" in r.getMessage()]
    assert "disk quota 1000 bytes per sandbox NOT enforced" in line
    sid = await env.session()
    await env.manager.write_file(sid, "small", b"x" * 600)
    kept = await env.manager.checkpoint(sid)
    await env.manager.write_file(sid, "more", b"x" * 600)
    with pytest.raises(CheckpointError, match="over its disk quota of 1000"):
        await env.manager.checkpoint(sid)
    assert [c.checkpoint.id for c in env.manager.checkpoints(sid)] == [kept.checkpoint.id]
    assert len(env.backend.ops("checkpoint")) == 1  # nothing was committed
    [(_, data)] = env.events(sid, "sandbox_checkpoint_refused")
    assert data == {"reason": "disk_quota", "writable_bytes": 1200, "disk_quota_bytes": 1000,
                    "sandbox_id": env.manager.sandbox_id(sid)}  # fmt: skip
    assert (await env.manager.exec(sid, "echo still here")).stdout == "still here\n"
