"""Fixtures for sandbox tests on a real Docker engine with CRIU (marker `docker`).

The engine is the one answering on the socket; when none does, `deploy/host/setup_sandbox_host.sh start`
starts one for the session and `... stop` stops it afterwards. Install the host first with
`deploy/host/setup_sandbox_host.sh install`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.errors import SandboxError, SandboxUnavailable
from sandbox.backend import Sandbox, SandboxSpec
from sandbox.backends import backend_for
from sandbox.config import DockerBackendConfig
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.images import ensure_busybox_image, ensure_python_image

SETUP = Path(__file__).resolve().parents[2] / "deploy" / "host" / "setup_sandbox_host.sh"


def _engine_answers(config: DockerBackendConfig) -> bool:
    try:
        with DockerSandboxBackend(config) as backend:
            return backend.has_image("belayer-probe-nonexistent") is False
    except SandboxUnavailable:
        return False


@pytest.fixture(scope="session")
def docker_config(tmp_path_factory: pytest.TempPathFactory) -> DockerBackendConfig:
    return DockerBackendConfig(checkpoint_dir=tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="session")
def docker_engine(docker_config: DockerBackendConfig) -> Iterator[None]:
    """A Docker engine for the session: the running one, or one started by the setup script."""
    if _engine_answers(docker_config):
        yield
        return
    if os.geteuid() != 0 or shutil.which("dockerd") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the Docker tests: run deploy/host/setup_sandbox_host.sh install first")
        pytest.skip("no Docker engine answers and dockerd cannot be started here (needs root + docker.io)")
    subprocess.run([str(SETUP), "start"], check=True)
    try:
        yield
    finally:
        subprocess.run([str(SETUP), "stop"], check=True)


@pytest.fixture(scope="session")
def backend(docker_engine: None, docker_config: DockerBackendConfig) -> Iterator[DockerSandboxBackend]:
    with backend_for(checkpoint_dir=docker_config.checkpoint_dir) as backend:
        yield backend


@pytest.fixture(scope="session")
def busybox_image(backend: DockerSandboxBackend) -> str:
    return ensure_busybox_image(backend)


@pytest.fixture(scope="session")
def python_image(backend: DockerSandboxBackend) -> str:
    return ensure_python_image(backend)


@pytest.fixture
def make_sandbox(backend: DockerSandboxBackend) -> Iterator[list[Sandbox]]:
    """Sandboxes appended to this list are destroyed after the test."""
    created: list[Sandbox] = []
    yield created
    for box in created:
        with contextlib.suppress(SandboxError):
            backend.destroy(box.id)


@pytest.fixture
def box(backend: DockerSandboxBackend, busybox_image: str, make_sandbox: list[Sandbox]) -> Sandbox:
    sandbox = backend.create(SandboxSpec(image=busybox_image))
    make_sandbox.append(sandbox)
    return sandbox


def snapshot_images(backend: DockerSandboxBackend) -> set[str]:
    images = backend._api.images(name="belayer-checkpoint")
    return {tag for image in images for tag in image.get("RepoTags") or []}


@pytest.fixture
def no_leaked_snapshots(backend: DockerSandboxBackend) -> Iterator[None]:
    """After the test (and its gateway) finished, no checkpoint snapshot image is left behind."""
    before = snapshot_images(backend)
    yield
    assert snapshot_images(backend) - before == set()
