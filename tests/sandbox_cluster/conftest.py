"""Fixtures for sandboxes across a local Ray cluster (marker ``sandbox_cluster``): one Docker engine of
its own per node (``belayer.testing.docker_local``), next to the shared Ray cluster (``tests/conftest.py``,
whose nodes b and c declare sandbox slots).

`node_engines` starts engines "b" and "c" once per test session, on first use, each with the busybox
sandbox image, and stops them at the end. A test that kills an engine takes `whole_engines`, which starts
every engine it lost again afterwards, so the next test finds them all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from belayer.testing.docker_local import LocalDockerEngine, ensure_busybox, local_docker_engines
from belayer.testing.ray_local import LocalRayCluster
from sandbox.cluster import ClusterConfig, ClusterSandboxBackend
from tests.sandbox.conftest import (  # the gateway host's engine
    backend,
    docker_config,
    docker_engine,
    python_image,
)

__all__ = [
    "backend",
    "cluster",
    "docker_config",
    "docker_engine",
    "node_engines",
    "python_image",
    "whole_engines",
]

ENGINES = ("b", "c")  # the Ray nodes that declare sandbox slots


@pytest.fixture(scope="session")
def node_engines() -> Iterator[dict[str, LocalDockerEngine]]:
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        if os.environ.get("CI"):
            pytest.fail(
                "CI must run the sandbox_cluster tests: run deploy/host/setup_sandbox_host.sh install first"
            )
        pytest.skip(
            "a Docker engine of its own per node needs root and dockerd (deploy/host/setup_sandbox_host.sh)"
        )
    with (
        tempfile.TemporaryDirectory(prefix="belayer-dockers-", dir="/tmp") as tmp,
        local_docker_engines(ENGINES, Path(tmp)) as engines,
    ):
        for engine in engines:
            ensure_busybox(engine)
        yield {engine.name: engine for engine in engines}


@pytest.fixture
def whole_engines(node_engines: dict[str, LocalDockerEngine]) -> Iterator[dict[str, LocalDockerEngine]]:
    """The session's engines, with every one the test killed (or stopped) started again afterwards."""
    yield node_engines
    for engine in node_engines.values():
        if not engine.running():
            engine.restart()


class Cluster:
    """The backend over nodes b and c, and how to lose and bring back the node a sandbox is on."""

    def __init__(
        self, ray: LocalRayCluster, engines: dict[str, LocalDockerEngine], backend: ClusterSandboxBackend
    ):
        self.ray, self.engines, self.backend = ray, engines, backend
        self.lost: list[str] = []

    def containers(self) -> dict[str, set[str]]:
        """Each node's Belayer sandbox containers now (an earlier test may have left some behind)."""
        return {name: sandboxes_on(engine) for name, engine in self.engines.items()}

    def name_of(self, sandbox_id: str) -> str:
        ip = self.backend.node_of(sandbox_id)
        return next(n.name for n in self.ray.nodes if n.ip == ip)

    def lose(self, name: str) -> None:
        """Node `name` gone as a machine goes: its Ray processes and its engine with its containers."""
        self.ray.kill_node(name)
        self.engines[name].kill()
        self.lost.append(name)

    def bring_back(self, name: str) -> None:
        self.engines[name].restart()
        self.ray.restart_node(name)

    def wait_state(self, name: str, state: str, timeout: float = 60.0) -> None:
        ip = self.ray.node(name).ip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(n["node"] == ip and n["state"] == state for n in self.backend.nodes()):
                return
            time.sleep(0.1)
        raise AssertionError(f"node {name} never {state}: {self.backend.nodes()}")


@pytest.fixture
def cluster(
    whole_cluster: LocalRayCluster, whole_engines: dict[str, LocalDockerEngine], tmp_path: Path
) -> Iterator[Cluster]:
    urls = {whole_cluster.node(name).ip: engine.url for name, engine in whole_engines.items()}
    config = ClusterConfig(
        address=whole_cluster.address, node_ip=whole_cluster.head.ip, docker_urls=urls,
        probe_interval_s=0.3, node_timeout_s=2.0,
    )  # fmt: skip
    backend = ClusterSandboxBackend(config, f"file://{tmp_path / 'store'}")
    made = Cluster(whole_cluster, whole_engines, backend)
    for name in whole_engines:  # a node restarted after the test before may still be on its way back
        made.wait_state(name, "alive")
    yield made
    made.backend.close()  # the one the test left (it may have started another)


def sandboxes_on(engine: LocalDockerEngine) -> set[str]:
    """The engine's Belayer sandbox containers, running or not."""
    return {name for name in engine.container_states() if name.startswith("belayer-sbx")}
