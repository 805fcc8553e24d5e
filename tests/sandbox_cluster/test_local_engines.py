"""Docker engines of their own, one per node of the local cluster (``belayer.testing.docker_local``):

- the engines are independent: a container made on b is not on c, and they share no process;
- `kill` is a lost machine: the containers' processes die with the engine (gone from /proc, found by
  their cgroup rather than by the engine's own bookkeeping), and the other engine is untouched;
- `restart` brings the engine back with its container there but not running;
- CRIU works on an engine other than the machine's main one: a shell's state survives checkpoint,
  destroy and restore.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from belayer.testing.docker_local import LocalDockerEngine
from core.errors import SandboxError
from sandbox.backend import Sandbox, SandboxSpec
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.images import BUSYBOX_IMAGE
from tests.support import poll

pytestmark = [pytest.mark.sandbox_cluster, pytest.mark.docker]


@contextlib.contextmanager
def sandbox_on(engine: LocalDockerEngine) -> Iterator[tuple[DockerSandboxBackend, Sandbox]]:
    """A busybox sandbox on `engine`, and the backend that made it; destroyed afterwards (through a new
    backend: the engine may have been restarted meanwhile)."""
    with DockerSandboxBackend(engine.backend_config()) as backend:
        box = backend.create(SandboxSpec(image=BUSYBOX_IMAGE))
        try:
            yield backend, box
        finally:
            with DockerSandboxBackend(engine.backend_config()) as fresh, contextlib.suppress(SandboxError):
                fresh.destroy(box.id)


def in_cgroup_of(container_id: str) -> list[int]:
    """The processes now in the container's cgroup (any state, zombies too), read from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if container_id in Path(f"/proc/{entry}/cgroup").read_text():
                    found.append(int(entry))
    return found


def test_the_engines_are_independent(node_engines: dict[str, LocalDockerEngine]) -> None:
    b, c = node_engines["b"], node_engines["c"]
    assert b.url != c.url and b.data_root != c.data_root
    before = set(b.container_states())  # what other tests of the session left there, if anything
    with sandbox_on(b) as (backend, box):
        assert {k: v for k, v in b.container_states().items() if k not in before} == {box.id: "running"}
        assert box.id not in c.container_states()
        assert backend.exec(box.id, "echo on b").stdout == "on b\n"
        assert not set(b.pids()) & set(c.pids())
        assert len(b.pids()) > len(c.pids())  # b's shim and its container's processes are b's


def test_kill_takes_the_containers_down_and_restart_brings_them_back_stopped(
    whole_engines: dict[str, LocalDockerEngine],
) -> None:
    b, c = whole_engines["b"], whole_engines["c"]
    before = set(b.container_states())
    docker0 = Path("/sys/class/net/docker0").exists()  # the main engine's bridge, which b must not touch
    with sandbox_on(b) as (backend, box), sandbox_on(c) as (_, bystander):
        backend.exec(box.id, "sleep 1000 >/dev/null 2>&1 &")
        container_id = backend._api.inspect_container(box.id)["Id"]
        inside = in_cgroup_of(container_id)
        assert len(inside) >= 3  # the supervisor, its session's shell, the sleep

        killed = b.kill()

        assert set(inside) <= set(killed)
        assert not b.running() and not b.answers() and b.pids() == []
        poll(lambda: in_cgroup_of(container_id) == [] or None, "the container's processes gone from /proc")
        assert c.container_states()[bystander.id] == "running"  # the other node is untouched

        b.restart()

        assert {k: v for k, v in b.container_states().items() if k not in before} == {box.id: "exited"}
        assert Path("/sys/class/net/docker0").exists() == docker0  # a dockerd restarted over its old
        # networks deletes docker0 (not its own bridge): `start` makes it forget them
        with DockerSandboxBackend(b.backend_config()) as after:
            assert not after.status(box.id).running
        assert in_cgroup_of(container_id) == []


def test_criu_checkpoint_and_restore_on_a_node_engine(node_engines: dict[str, LocalDockerEngine]) -> None:
    c = node_engines["c"]
    with sandbox_on(c) as (backend, box):
        backend.exec(box.id, "cd /tmp && X=5")
        ckpt = backend.checkpoint(box.id)
        try:
            backend.destroy(box.id)
            restored = backend.restore(ckpt)
            try:
                assert backend.exec(restored.id, "echo $X $(pwd)").stdout == "5 /tmp\n"
                assert restored.id in c.container_states()
            finally:
                backend.destroy(restored.id)
        finally:
            backend.delete_checkpoint(ckpt)
