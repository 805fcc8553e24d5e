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
from collections.abc import Iterator
from pathlib import Path

import pytest

from belayer.testing.docker_local import LocalDockerEngine, ensure_busybox, local_docker_engines
from tests.sandbox.conftest import docker_config, docker_engine  # the gateway host's own engine

__all__ = ["docker_config", "docker_engine", "node_engines", "whole_engines"]

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
