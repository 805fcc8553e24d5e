"""`backend_for`: what a `SandboxConfig` (or none) gives the Docker backend; no engine needed."""

from __future__ import annotations

from pathlib import Path

from sandbox.backends import docker_config
from sandbox.config import DockerBackendConfig, SandboxConfig


def test_without_a_config_the_local_engine_with_defaults_and_no_quota() -> None:
    assert docker_config() == DockerBackendConfig()
    assert docker_config().disk_quota_bytes is None


def test_a_gateway_config_names_the_engine_the_checkpoints_and_the_quota() -> None:
    config = SandboxConfig(docker_url="unix:///run/d.sock", checkpoint_dir="/srv/ckpt", disk_quota_bytes=5)
    built = docker_config(config)
    assert (built.base_url, built.checkpoint_dir, built.disk_quota_bytes) == (
        "unix:///run/d.sock", Path("/srv/ckpt"), 5,
    )  # fmt: skip
    assert docker_config(SandboxConfig(disk_quota_bytes=0)).disk_quota_bytes is None  # 0: no quota


def test_a_checkpoint_directory_given_apart_wins(tmp_path: Path) -> None:
    assert docker_config(checkpoint_dir=tmp_path) == DockerBackendConfig(checkpoint_dir=tmp_path)
    assert docker_config(SandboxConfig(), checkpoint_dir=tmp_path).checkpoint_dir == tmp_path
