"""The disk limits on a real Docker engine: the verify stage's copy of /workspace streams through the
gateway and stops at ``max_workspace_bytes`` (`sandbox.sessions.verify`); the sandboxes' disk quota is
enforced by the storage driver, or else checked before each checkpoint. The logic is tested fast in
tests/sandbox/sessions/ (test_verify_stage.py, test_checkpoints.py)."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from core.errors import CheckpointError
from sandbox.backend import SandboxSpec
from sandbox.config import DockerBackendConfig, PolicySettings, SandboxConfig
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.sessions.manager import SandboxManager
from sandbox.sessions.verify import VerifyPlan
from store import SessionRecord, SqliteStore

pytestmark = pytest.mark.docker

MiB = 1 << 20
ManagerFactory = Callable[..., SandboxManager]


@pytest.fixture(scope="module")
def verify_image(backend: DockerSandboxBackend, busybox_image: str) -> str:
    """The busybox image with ``/usr/bin/env`` (how the verifier is started), as busybox itself."""
    name = "belayer-test-verify:busybox"
    if not backend.has_image(name):
        backend.derive_image(name, busybox_image, {"/usr/bin/env": Path("/bin/busybox")})
    return name


@pytest.fixture
async def make_manager(tmp_path: Path) -> AsyncIterator[ManagerFactory]:
    made: list[tuple[SandboxManager, SqliteStore]] = []

    def make(backend: DockerSandboxBackend, **settings: object) -> SandboxManager:
        store = SqliteStore(tmp_path / f"traj-{len(made)}.db")
        config = SandboxConfig(enabled=True, policy=PolicySettings(mode="never"), watch_interval_s=3600.0)
        manager = SandboxManager(backend, store, config.model_copy(update=settings))
        made.append((manager, store))
        return manager

    yield make
    for manager, store in made:
        await manager.close()
        store.close()


async def session(manager: SandboxManager, sid: str, image: str) -> str:
    manager.store.create_session(SessionRecord(sid, time.time(), {}))
    await manager.create(sid, SandboxSpec(image=image))
    return sid


async def test_an_oversized_workspace_is_not_verified_and_the_other_session_goes_on(
    backend: DockerSandboxBackend, verify_image: str, make_manager: ManagerFactory
) -> None:
    manager = make_manager(backend, max_workspace_bytes=MiB)
    sid, other = await session(manager, "big", verify_image), await session(manager, "other", verify_image)
    await manager.exec(sid, "head -c 8388608 /dev/zero > /workspace/big.bin")
    plan = VerifyPlan(files={"verify.sh": (b"exit 0\n", 0o644)}, keep_agent_sandbox=True)
    outcome = await manager.verify(sid, plan)
    summary = outcome.summary()
    assert (outcome.verified, outcome.reason, summary["max_workspace_bytes"]) == (
        False, "workspace_too_large", MiB,
    )  # fmt: skip
    assert MiB < summary["workspace_bytes"] < 8 * MiB  # the copy stopped early
    assert (await manager.exec(other, "echo fine")).stdout == "fine\n"
    assert (await manager.exec(sid, "echo unpaused")).stdout == "unpaused\n"  # kept, and not frozen


async def test_the_copy_streams_through_the_gateway(
    backend: DockerSandboxBackend, verify_image: str, make_manager: ManagerFactory
) -> None:
    """32 MiB copied into the verifier's sandbox; the gateway holds a few MiB of it at a time (it held
    the whole archive about four times over before)."""
    size = 32 * MiB
    manager = make_manager(backend)
    sid = await session(manager, "s1", verify_image)
    await manager.exec(sid, f"head -c {size} /dev/urandom > big.bin && echo ok > a && echo cheat > test_a.py")
    check = f'test "$(wc -c < big.bin)" -eq {size} && test "$(cat a)" = ok && test "$(cat test_a.py)" = orig'
    plan = VerifyPlan(
        files={"verify.sh": (check.encode(), 0o644)}, originals={"test_a.py": (b"orig\n", 0o644)},
        protected=("test_*.py",),
    )  # fmt: skip
    tracemalloc.start()
    try:
        outcome = await manager.verify(sid, plan)  # the protected file is reset on the way
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert outcome.verified and [c.path for c in outcome.changes] == ["test_a.py"], outcome.output
    assert peak < size // 4, f"peak {peak / MiB:.1f} MiB for a {size // MiB} MiB working directory"


async def test_the_disk_quota_is_enforced_or_checked_before_each_checkpoint(
    docker_config: DockerBackendConfig, busybox_image: str, make_manager: ManagerFactory
) -> None:
    config = docker_config.model_copy(update={"disk_quota_bytes": 4 * MiB})
    with DockerSandboxBackend(config) as backend:
        enforced, why = backend.disk_quota()
        assert why.startswith("storage driver ")
        manager = make_manager(backend)
        sid = await session(manager, "s1", busybox_image)
        write = await manager.exec(sid, "head -c 8388608 /dev/zero > /workspace/big.bin; echo $?")
        if enforced:  # the driver stops the writes
            assert write.stdout.strip() != "0", write
            return
        assert write.stdout == "0\n"  # not stopped: the checkpoint, which would commit it all, is refused
        with pytest.raises(CheckpointError, match="over its disk quota"):
            await manager.checkpoint(sid)
        assert manager.checkpoints(sid) == []
        events = [e for e in manager.store.get_events(sid) if e.kind == "sandbox_checkpoint_refused"]
        assert [e.data["reason"] for e in events] == ["disk_quota"]
        assert events[0].data["writable_bytes"] > 8 * MiB
