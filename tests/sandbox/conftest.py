"""Fixtures for sandbox tests on a real Docker engine with CRIU (marker `docker`).

The engine is the one answering on the socket; when none does, `deploy/host/setup_sandbox_host.sh start`
starts one for the session and `... stop` stops it afterwards. Install the host first with
`deploy/host/setup_sandbox_host.sh install`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from core.errors import SandboxError, SandboxUnavailable
from core.net import free_port
from sandbox.backend import Sandbox, SandboxSpec
from sandbox.backends import backend_for
from sandbox.config import DockerBackendConfig
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.images import ensure_busybox_image, ensure_python_image
from tests.support import spawn, stop

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


@pytest.fixture(scope="session")
def moto_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 for the session, stopped (by its process group) at the end."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    proc = spawn([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], log)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, f"moto_server exited: {log.read_text(errors='replace')[-2000:]}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "moto_server did not listen within 30s"
                time.sleep(0.1)  # the server is starting
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc, grace=10)


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Dummy credentials for this test only; no profile, config file or instance metadata to consult."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
