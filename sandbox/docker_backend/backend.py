"""`DockerSandboxBackend`: the `SandboxBackend` on a local Docker engine, composed of its parts.

Each part owns one concern (`sandbox.docker_backend` lists them); this class holds them together and
keeps the one face its callers use: the `SandboxBackend` ABC, plus what image building
(`sandbox.images`, `sandbox.task_images`), tests and benchmarks ask of Docker.

Example::

    backend = DockerSandboxBackend(DockerBackendConfig())
    box = backend.create(SandboxSpec(image="belayer-sandbox-busybox"))
    print(backend.exec(box.id, "uname -a").stdout)
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

import docker

from core.errors import RestoreError, SandboxError, SandboxUnavailable
from sandbox import supervisor
from sandbox.backend import (
    DEFAULT_SESSION,
    Checkpoint,
    ExecResult,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
    SandboxStatus,
    TarStream,
)
from sandbox.checkpoint_auth import CheckpointKey
from sandbox.checkpoint_store import store_for
from sandbox.config import DockerBackendConfig
from sandbox.docker_backend.checkpoints import Checkpoints
from sandbox.docker_backend.containers import Containers, DiskQuota
from sandbox.docker_backend.engine import DockerEngine, docker_errors
from sandbox.docker_backend.exec import Exec
from sandbox.docker_backend.files import Files
from sandbox.docker_backend.images import Images
from sandbox.docker_backend.network import DockerNetwork, fence_full_network
from sandbox.docker_backend.portable import PortableCheckpoints


class DockerSandboxBackend(SandboxBackend):
    """Sandboxes as Docker containers; checkpoints as commit + CRIU dump (`sandbox.docker_backend`)."""

    def __init__(self, config: DockerBackendConfig, client: docker.DockerClient | None = None) -> None:
        self._config = config
        self._engine = DockerEngine(config, client)
        self._api = self._engine.api  # tests look at containers and networks through it
        self._network = DockerNetwork(self._api, config.gateway_network, config.gateway_bridge)
        self._quota = DiskQuota(self._engine)
        self._containers = Containers(self._engine, self._network, self._quota)
        self._files = Files(self._engine)
        self._exec = Exec(self._engine, self._containers, self._files)
        self._images = Images(self._engine, self._containers)
        self._checkpoints = Checkpoints(self._engine, self._containers, self._images)
        if config.checkpoint_store is not None:
            key = CheckpointKey.load(config.checkpoint_key_file) if config.checkpoint_key_file else None
            store = store_for(config.checkpoint_store)
            self._checkpoints = PortableCheckpoints(self._engine, self._containers, self._images, store, key)

    @property
    def config(self) -> DockerBackendConfig:
        return self._config

    # ------------------------------------------------------------------ lifecycle
    def create(self, spec: SandboxSpec) -> Sandbox:
        bundle = supervisor.bundle_tar(self._config.busybox)  # the supervisor, PID 1 in the sandbox
        name = self._containers.create_for(spec)
        try:
            self._containers.start(name, spec, bundle)
            self.exec(name, ":", timeout_s=10)  # supervisor up, main session spawned
        except BaseException:
            with contextlib.suppress(SandboxError):
                self.destroy(name)
            raise
        return Sandbox(id=name, spec=spec)

    def destroy(self, sandbox_id: str) -> None:
        with docker_errors():
            image = self._containers.remove(sandbox_id)
            self._checkpoints.drop_orphan_snapshot(image)
        self._engine.forget(sandbox_id)

    def close(self) -> None:
        self._engine.close()

    def info(self) -> dict[str, Any]:
        """The engine's ``docker info`` (`SandboxUnavailable` when it does not answer)."""
        with docker_errors(SandboxUnavailable):
            info: dict[str, Any] = self._api.info()
        return info

    def ping(self) -> None:
        """Returns when the engine answers; `SandboxUnavailable` when it does not."""
        with docker_errors(SandboxUnavailable):
            self._api.ping()

    def kill(self, sandbox_id: str) -> None:
        """Stop the sandbox now (SIGKILL), as a crash would; it stays until `destroy` (tests, benchmarks)."""
        self._containers.kill(sandbox_id)

    def status(self, sandbox_id: str) -> SandboxStatus:
        return self._containers.status(sandbox_id)

    @property
    def network(self) -> DockerNetwork:
        return self._network

    def fence_full_network(self, addresses: list[str]) -> list[str]:
        """Drop what ``network="full"`` sandboxes send to `addresses` (a cluster's nodes) and to their
        bridge's own address (`sandbox.docker_backend.network.fence_full_network`); what was fenced off."""
        with docker_errors(SandboxUnavailable):
            bridge = self._api.inspect_network("bridge")
        name = (bridge.get("Options") or {}).get("com.docker.network.bridge.name", "docker0")
        own = [c["Gateway"] for c in (bridge.get("IPAM") or {}).get("Config") or [] if c.get("Gateway")]
        return fence_full_network(str(name), [*addresses, *own])

    def network_members(self) -> dict[str, dict[str, Any]]:
        """The containers on the gateway network, by id: ``Name`` and ``IPv4Address`` (``a.b.c.d/nn``)."""
        with docker_errors():
            info = self._api.inspect_network(self._config.gateway_network)
        return dict(info.get("Containers") or {})

    def list_sandboxes(self, labels: Mapping[str, str]) -> list[Sandbox]:
        """Belayer's containers (they carry the spec label) with every one of `labels`, running or not;
        each one's id is its name, as `create` and `restore` gave it."""
        return self._containers.find(labels)

    def changed_paths(self, sandbox_id: str) -> list[tuple[str, str]]:
        return self._containers.changed_paths(sandbox_id)

    def processes(self, sandbox_id: str) -> list[str]:
        return self._containers.processes(sandbox_id)

    def writable_bytes(self, sandbox_id: str) -> int:
        """The container's writable layer (``SizeRw``: the engine walks it, so it takes a while on a
        large one)."""
        return self._containers.writable_bytes(sandbox_id)

    @property
    def disk_quota_bytes(self) -> int | None:
        return self._quota.limit

    def disk_quota(self) -> tuple[bool, str]:
        """Whether the storage driver enforces `DockerBackendConfig.disk_quota_bytes`, and why (or why
        not); see `sandbox.docker_backend.containers.DiskQuota`."""
        return self._quota.answer()

    # ------------------------------------------------------------------ exec and files
    def exec(
        self,
        sandbox_id: str,
        command: str,
        *,
        timeout_s: float = 30.0,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        session: str = DEFAULT_SESSION,
        max_output_bytes: int = 1 << 20,
    ) -> ExecResult:
        return self._exec.run(
            sandbox_id, command, timeout_s=timeout_s, cwd=cwd, env=env, session=session,
            max_output_bytes=max_output_bytes,
        )  # fmt: skip

    def read_file(self, sandbox_id: str, path: str, *, max_bytes: int | None = None) -> bytes:
        return self._files.read(sandbox_id, path, max_bytes=max_bytes)

    def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        self._files.write(sandbox_id, path, data, mode=mode)

    def archive(self, sandbox_id: str, path: str, out: IO[bytes], *, max_bytes: int | None = None) -> int:
        return self._files.archive(sandbox_id, path, out, max_bytes=max_bytes)

    def extract(self, sandbox_id: str, tar: TarStream) -> None:
        self._files.extract(sandbox_id, tar)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(self, sandbox_id: str, *, label: str = "") -> Checkpoint:
        return self._checkpoints.take(sandbox_id, label=label)

    def restore(self, checkpoint: Checkpoint) -> Sandbox:
        return self._checkpoints.restore(checkpoint)

    @property
    def keeps_standbys(self) -> bool:
        return True

    def restore_standby(self, checkpoint: Checkpoint) -> Sandbox:
        """`restore`, then ``docker pause`` (the cgroup freezer) as soon as the start returns: a few
        milliseconds in which the restored processes run, in their own container and namespaces. A
        standby that cannot be frozen is removed."""
        box = self.restore(checkpoint)
        try:
            with docker_errors(RestoreError):
                self._api.pause(box.id)
        except BaseException:
            with contextlib.suppress(SandboxError):
                self.destroy(box.id)
            raise
        return box

    def activate(self, sandbox_id: str) -> None:
        """``docker unpause``."""
        with docker_errors():
            self._api.unpause(sandbox_id)

    def delete_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Remove the dump and the snapshot image (Docker keeps an image that a sandbox still uses)."""
        self._checkpoints.delete(checkpoint)

    def has_checkpoint(self, checkpoint: Checkpoint) -> bool:
        """Its process dump is on disk and its snapshot image in the engine."""
        return self._checkpoints.exists(checkpoint)

    def load_checkpoint(self, checkpoint_id: str) -> Checkpoint:
        """Read a checkpoint's record back from `checkpoint_dir` (e.g. after a restart)."""
        return self._checkpoints.load(checkpoint_id)

    # ------------------------------------------------------------------ images
    def has_image(self, name: str) -> bool:
        """Whether the engine has image `name` (see `sandbox.images`)."""
        return self._images.has(name)

    def image_id(self, name: str) -> str:
        """Image `name`'s id (``sha256:…``)."""
        return self._images.id_of(name)

    def image_layers(self, name: str) -> int:
        """How many layers image `name` has (Docker refuses to stack more than 125)."""
        return self._images.layers(name)

    def import_image(self, name: str, rootfs_tar: Path | bytes, changes: list[str]) -> None:
        """`docker import` a root filesystem tarball (a path or bytes) as `name:latest`."""
        self._images.import_rootfs(name, rootfs_tar, changes)

    def derive_image(self, name: str, base: str, files: dict[str, Path]) -> None:
        """Build image `name` (tag included) as `base` plus `files` (container path → host file)."""
        self._images.derive(name, base, files)

    def build_image(
        self,
        name: str,
        base: str,
        tar: bytes,
        script: str,
        *,
        labels: dict[str, str],
        workdir: str = "/workspace",
        timeout_s: float = 1800.0,
        network: bool = False,
        cap_add: tuple[str, ...] = (),
    ) -> str:
        """Build image `name` (tag included): `base`, plus `tar` unpacked at ``/``, after ``sh -c script``
        ran in `workdir`; returns the script's output. The image carries `labels`.

        The script runs under a sandbox's own limits (`SandboxSpec`'s defaults: every capability
        dropped but `cap_add`, no-new-privileges, its memory, process and CPU limits, the disk quota),
        with no network unless `network` (then the engine's default bridge)."""
        return self._images.build(
            name, base, tar, script, labels=labels, workdir=workdir, timeout_s=timeout_s, network=network,
            cap_add=cap_add,
        )  # fmt: skip

    def build_dockerfile(
        self,
        name: str,
        context: bytes,
        *,
        labels: dict[str, str],
        timeout_s: float = 600.0,
        network: bool = False,
    ) -> str:
        """``docker build`` of the build context `context` (a tar holding ``Dockerfile``) as image `name`
        with `labels`; returns the builder's output. Never pulls (the caller checked every base image:
        `sandbox.dockerfiles`); its ``RUN`` steps have no network unless `network`."""
        return self._images.build_dockerfile(
            name, context, labels=labels, timeout_s=timeout_s, network=network
        )

    def missing_in_image(self, name: str, needs: list[tuple[str, tuple[str, ...]]]) -> list[str]:
        """What of `needs` (what, alternative absolute paths) image `name` lacks (none of the paths is in it)."""
        return self._images.missing(name, needs)

    def image_workdir(self, name: str) -> str:
        """Image `name`'s ``WORKDIR`` ("" when it sets none)."""
        return self._images.workdir_of(name)

    def save_image(self, name: str, out: IO[bytes]) -> None:
        """``docker save`` image `name` into `out` (for another engine's `load_image`)."""
        self._images.save(name, out)

    def load_image(self, tar: bytes) -> None:
        """``docker load`` what `save_image` wrote."""
        self._images.load(tar)

    def images(self, label: str) -> list[dict[str, Any]]:
        """Images carrying `label`: name (first tag), id, created (epoch s), size (bytes), labels."""
        return self._images.labelled(label)

    def remove_image(self, name: str) -> bool:
        """Remove image `name`; False when a container still uses it (it is kept)."""
        return self._images.remove(name)
