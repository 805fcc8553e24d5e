"""`backend_for`: the one place where a sandbox backend is built from configuration.

The gateway builds its backend from its ``[sandbox]`` section (`SandboxConfig`); the tools that need the
local engine without a gateway configuration (image builds, the task CLI, harness episodes, benchmarks)
call it without one. Tests of what sits above the seam pass `sandbox.fake.FakeSandboxBackend` instead.

Example::

    with backend_for(SandboxConfig(enabled=True, checkpoint_dir="/tmp/ckpt")) as backend:
        box = backend.create(SandboxSpec(image="belayer-sandbox-busybox"))
"""

from __future__ import annotations

from pathlib import Path

from core.errors import SandboxArgumentError
from sandbox.backend import SandboxBackend
from sandbox.config import DockerBackendConfig, SandboxConfig
from sandbox.docker_backend import DockerSandboxBackend


def backend_for(
    config: SandboxConfig | None = None, *, checkpoint_dir: Path | None = None
) -> DockerSandboxBackend:
    """The backend `config` describes: the Docker engine at ``docker_url`` (None: DOCKER_HOST, as the CLI
    reads it), checkpoints under ``checkpoint_dir``, each sandbox's disk quota (0: none).

    Without `config`: the engine DOCKER_HOST names, `DockerBackendConfig`'s defaults and no disk quota.
    `checkpoint_dir`, when given, is where checkpoints go instead (a benchmark's temporary directory).
    Raises `SandboxUnavailable` when the engine cannot be reached."""
    return DockerSandboxBackend(docker_config(config, checkpoint_dir=checkpoint_dir))


def sandbox_backend(config: SandboxConfig) -> SandboxBackend:
    """The gateway's backend: on the Ray cluster's nodes when ``config.ray`` names one
    (`sandbox.cluster`), else the local engine (`backend_for`)."""
    if not config.on_ray:
        return backend_for(config)
    from sandbox.cluster import ClusterConfig, ClusterSandboxBackend

    if config.checkpoint_store is None:
        raise SandboxArgumentError(
            "sandboxes on a Ray cluster need a checkpoint store that every node reads: set --checkpoint-store "
            "(a shared directory, or s3://BUCKET/PREFIX), or --sandbox-ray off to keep them on this host"
        )
    cluster = ClusterConfig(
        address=str(config.ray), node_ip=config.ray_node_ip, docker_urls=config.docker_urls,
        node_timeout_s=config.node_timeout_s, relay_port=config.relay_port,
        allow_full_network=config.allow_full_network_on_cluster,
    )  # fmt: skip
    return ClusterSandboxBackend(cluster, config.checkpoint_store, docker_config(config))


def docker_config(
    config: SandboxConfig | None = None, *, checkpoint_dir: Path | None = None
) -> DockerBackendConfig:
    """What `backend_for` gives the Docker backend for `config`."""
    settings: dict[str, object] = {}
    if config is not None:
        staged = checkpoint_dir or Path(config.checkpoint_dir)
        settings = {
            "base_url": config.docker_url,
            "checkpoint_dir": staged,
            "disk_quota_bytes": config.disk_quota_bytes or None,
            # the gateway's own state, kept where it stages checkpoints (used with a checkpoint store)
            "checkpoint_key_file": Path(config.checkpoint_key_file or staged / "checkpoint.key"),
        }
    elif checkpoint_dir is not None:
        settings["checkpoint_dir"] = checkpoint_dir
    return DockerBackendConfig.model_validate(settings)
