"""`ClusterSandboxBackend`: sandboxes placed across the nodes of a Ray cluster, each node's Docker engine
behind a `SandboxAgent` actor on that node; a lost node's sandboxes reported as failed, so that the
session manager restores each one elsewhere from its newest checkpoint.

This module is the backend's face, the `SandboxBackend` methods, over four parts:

- `sandbox.cluster.nodes`: the `NodeRegistry`: which nodes offer sandboxes, their agents, the prober
  that loses and takes back nodes, and every call to an agent;
- `sandbox.cluster.placement`: `Placement`: which node holds each sandbox, where a new one goes, and the
  slots reserved for creates and restores in progress;
- `sandbox.cluster.images`: `NodeImages`: images on every node, built there or copied from this host;
- `sandbox.cluster.network`: `ClusterNetwork` and `NodeRelays`: the relays that bring ``network="gateway"``
  sandboxes to the gateway (`sandbox.cluster.relay`).

Checkpoints are portable (`sandbox.docker_backend.portable`): they live in the checkpoint store, never on
the node that took them; the gateway signs each one (`sandbox.checkpoint_auth`), the nodes never hold
the key. A lost node's sandboxes fail every call with `NodeLost`, and `status` reports them stopped
(``failure_kind == "node_lost"``); the session manager then restores each from its newest checkpoint,
on a node alive, in its recovery mode (replay or truncate).

Networks. The cluster's own services (Ray's ports on every node, the engines a pool launched there) ask
nobody who they are, so a ``network="full"`` sandbox (and a task's setup with network) is refused
unless the operator allows them (``allow_full_network``, ``--sandbox-allow-full-network-on-cluster``);
allowed, every node's firewall drops their packets to every node's address and the gateway's, before
one runs there (`NodeRegistry.fence`, `sandbox.docker_backend.network.fence_full_network`).
``network="gateway"`` sandboxes reach their node's relay only (`sandbox.cluster.relay`).

Example::

    backend = ClusterSandboxBackend(ClusterConfig(address="127.0.0.2:6379"), "file:///shared/ckpt")
    box = backend.create(SandboxSpec(image="belayer-sandbox-busybox"))
    backend.node_of(box.id)           # '127.0.0.3'
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from core.errors import NodeLost, SandboxArgumentError
from core.liveness import Liveness
from sandbox.backend import (
    DEFAULT_SESSION,
    Checkpoint,
    ExecResult,
    Sandbox,
    SandboxBackend,
    SandboxSpec,
    SandboxStatus,
    TarStream,
    copy_bounded,
)
from sandbox.checkpoint_auth import CheckpointKey
from sandbox.checkpoint_store import CheckpointStore, store_for
from sandbox.cluster.config import ClusterConfig
from sandbox.cluster.images import NodeImages
from sandbox.cluster.network import ClusterNetwork, NodeRelays
from sandbox.cluster.nodes import NodeRegistry, connect
from sandbox.cluster.placement import Placement
from sandbox.config import DockerBackendConfig
from sandbox.docker_backend.checkpoints import checkpoint_to_json
from sandbox.docker_backend.portable import checkpoint_key


class ClusterSandboxBackend(SandboxBackend):
    """Sandboxes on the cluster's nodes (module docstring). Methods block; thread-safe."""

    def __init__(
        self, config: ClusterConfig, store: str | CheckpointStore, docker: DockerBackendConfig | None = None
    ) -> None:
        self.config = config
        self.store = store_for(store) if isinstance(store, str) else store
        docker = docker or DockerBackendConfig()
        # The key stays here: nodes record their checkpoints' digests, the gateway signs and checks them.
        self._key = CheckpointKey.load(docker.checkpoint_key_file) if docker.checkpoint_key_file else None
        self._docker = docker.model_copy(
            update={"checkpoint_store": self.store.url, "checkpoint_key_file": None}
        )
        ray = connect(config)
        host = config.node_ip or ray.util.get_node_ip_address()
        self._registry = NodeRegistry(config, self._docker, ray, host)
        self._placement = Placement(self._registry)
        self._images = NodeImages(self._registry, self._docker)
        self._relays = NodeRelays(self._registry, config)
        self._registry.on_join(self._relays.start)
        self._network = ClusterNetwork(host, config.relay_port, self._relays.set, self._placement.node_of)
        self._registry.start()

    # ------------------------------------------------------------------ nodes
    def nodes(self) -> list[dict[str, Any]]:
        """Each node that offers sandboxes: address, state, slots, sandboxes here, why refused or lost."""
        return self._registry.views()

    def node_of(self, sandbox_id: str) -> str | None:
        """The address of the node that holds `sandbox_id` (None when none does)."""
        return self._placement.node_of(sandbox_id)

    @property
    def node_losses(self) -> int:
        """How many times a node was lost."""
        return self._registry.node_losses

    def probe(self) -> None:
        """List the cluster's nodes and ping each agent once (`NodeRegistry.probe`)."""
        self._registry.probe()

    @property
    def network(self) -> ClusterNetwork:
        return self._network

    def _box(self, sandbox_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """The agent's answer to `method` on the sandbox; `NodeLost` once its node was lost."""
        node = self._placement.node(sandbox_id)
        if sandbox_id in node.lost:
            raise NodeLost(f"sandbox node {node.ip} was lost ({node.reason or 'it left the cluster'})")
        return self._registry.call(node, "call", method, sandbox_id, *args, **kwargs)

    # ------------------------------------------------------------------ SandboxBackend
    def create(self, spec: SandboxSpec) -> Sandbox:
        self._check_network(spec.network == "full")
        node = self._placement.reserve()

        def ask() -> Sandbox:
            if spec.network == "full":  # never one without its fence
                self._registry.fence(node)
            self._images.ensure(node, spec.image)
            box: Sandbox = self._registry.call(node, "call", "create", spec)
            return box

        return self._placement.placing(node, spec, ask)

    def _check_network(self, full: bool, what: str = "a network='full' sandbox") -> None:
        """Refuse `what` unless the operator allowed full networking on the cluster (module docstring)."""
        if full and not self.config.allow_full_network:
            raise SandboxArgumentError(
                f"{what} is refused on a Ray cluster: it would reach the cluster's own services (Ray's "
                "ports, the engines), which ask nobody who they are. Use network='none' or 'gateway', or "
                "start the gateway with --sandbox-allow-full-network-on-cluster (each node's firewall then "
                "drops such sandboxes' packets to the cluster's addresses)"
            )

    def restore(self, checkpoint: Checkpoint) -> Sandbox:
        if self._key is not None:
            self._key.verify(checkpoint)  # before a node fetches anything (it checks the parts' digests)
        node = self._placement.reserve()

        def ask() -> Sandbox:
            if checkpoint.spec.network == "full":
                self._registry.fence(node)
            self._images.ensure(node, checkpoint.spec.image)
            box: Sandbox = self._registry.call(node, "call", "restore", checkpoint)
            return box

        return self._placement.placing(node, checkpoint.spec, ask)

    def destroy(self, sandbox_id: str) -> None:
        node = self._placement.release(sandbox_id)
        if node is None:
            return
        try:
            if sandbox_id in node.gone:  # it was lost with its node, which is back: remove what is left
                self._registry.call(node, "sweep", [sandbox_id])
            else:
                self._registry.call(node, "call", "destroy", sandbox_id)
            with self._registry.lock:
                node.gone.discard(sandbox_id)
        except NodeLost:
            with self._registry.lock:
                node.gone.add(sandbox_id)

    def status(self, sandbox_id: str) -> SandboxStatus:
        node = self._placement.node(sandbox_id)
        if node.state != Liveness.ALIVE or sandbox_id in node.lost:
            reason = node.reason or "it left the cluster"
            return SandboxStatus(
                running=False, node_lost=True, detail=f"sandbox node {node.ip} lost: {reason}"
            )
        try:
            status: SandboxStatus = self._box(sandbox_id, "status")
        except NodeLost as exc:
            return SandboxStatus(running=False, node_lost=True, detail=str(exc))
        return status

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
        result: ExecResult = self._box(
            sandbox_id, "exec", command, timeout_s=timeout_s, cwd=cwd, env=env, session=session,
            max_output_bytes=max_output_bytes,
        )  # fmt: skip
        return result

    def read_file(self, sandbox_id: str, path: str, *, max_bytes: int | None = None) -> bytes:
        data: bytes = self._box(sandbox_id, "read_file", path, max_bytes=max_bytes)
        return data

    def write_file(self, sandbox_id: str, path: str, data: bytes, *, mode: int = 0o644) -> None:
        self._box(sandbox_id, "write_file", path, data, mode=mode)

    def archive(self, sandbox_id: str, path: str, out: IO[bytes], *, max_bytes: int | None = None) -> int:
        tar = self._registry.call(self._placement.node(sandbox_id), "archive", sandbox_id, path, max_bytes)
        return copy_bounded([tar], out, max_bytes)

    def extract(self, sandbox_id: str, tar: TarStream) -> None:
        self._box(sandbox_id, "extract", tar if isinstance(tar, bytes) else b"".join(tar))

    def checkpoint(self, sandbox_id: str, *, label: str = "") -> Checkpoint:
        ckpt: Checkpoint = self._box(sandbox_id, "checkpoint", label=label)
        if self._key is None:
            return ckpt
        signed = self._key.sign(ckpt)
        self.store.put_bytes(checkpoint_key(ckpt.id, "meta.json"), checkpoint_to_json(signed).encode())
        return signed

    def delete_checkpoint(self, checkpoint: Checkpoint) -> None:
        self.store.delete_prefix(checkpoint_key(checkpoint.id))

    def has_checkpoint(self, checkpoint: Checkpoint) -> bool:
        return self.store.exists(checkpoint_key(checkpoint.id, "meta.json"))

    def kill(self, sandbox_id: str) -> None:
        self._box(sandbox_id, "kill")

    def list_sandboxes(self, labels: Mapping[str, str]) -> list[Sandbox]:
        """Every alive node's sandboxes with `labels`; each is placed where it was found (adoption)."""
        found = []
        for node in self._registry.alive():
            for box in self._registry.call(node, "call", "list_sandboxes", dict(labels)):
                found.append(self._placement.placed(node, box))
        return found

    def changed_paths(self, sandbox_id: str) -> list[tuple[str, str]]:
        paths: list[tuple[str, str]] = self._box(sandbox_id, "changed_paths")
        return paths

    def processes(self, sandbox_id: str) -> list[str]:
        found: list[str] = self._box(sandbox_id, "processes")
        return found

    def writable_bytes(self, sandbox_id: str) -> int | None:
        size: int | None = self._box(sandbox_id, "writable_bytes")
        return size

    @property
    def disk_quota_bytes(self) -> int | None:
        return self._docker.disk_quota_bytes

    def disk_quota(self) -> tuple[bool, str]:
        alive = self._registry.alive()
        if not alive:
            return False, "no sandbox node is alive"
        answer: tuple[bool, str] = self._registry.call(alive[0], "call", "disk_quota")
        return answer

    def close(self) -> None:
        self._registry.close()
        self._images.close()

    # ------------------------------------------------------------------ images, on every node
    def has_image(self, name: str) -> bool:
        """Whether every alive node has image `name`."""
        return self._images.has_image(name)

    def import_image(self, name: str, rootfs_tar: Path | bytes, changes: list[str]) -> None:
        self._images.import_image(name, rootfs_tar, changes)

    def derive_image(self, name: str, base: str, files: dict[str, Path]) -> None:
        self._images.derive_image(name, base, files)

    def build_image(self, name: str, base: str, tar: bytes, script: str, **kwargs: Any) -> str:
        self._check_network(bool(kwargs.get("network")), "a task's setup with network (setup_network)")
        return self._images.build_image(name, base, tar, script, **kwargs)

    def image_id(self, name: str) -> str:
        return self._images.image_id(name)
