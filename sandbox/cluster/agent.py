"""The sandbox agent: one Ray actor on each node that offers sandboxes, holding that node's Docker client.

The gateway never reaches a node's Docker engine over the network: it calls this actor, which runs on
the node (pinned there by `sandbox.cluster.nodes.NodeRegistry`) and talks to the engine on the node's own socket. It
is a thin shell over `DockerSandboxBackend` with portable checkpoints (`sandbox.docker_backend.portable`),
so that what the gateway asks of a node is exactly what it asks of its local engine; it adds what only
the node can answer: whether it can hold sandboxes at all (`check`), whether its engine still answers
(`ping`), and the removal of containers that a gateway has given up on (`sweep`).

Ray runs the actor's methods in a thread pool (``max_concurrency``), so calls on different sandboxes
run at once; the backend serialises the calls on one sandbox itself.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any

from core.errors import SandboxError, SandboxUnavailable
from sandbox.backend import copy_bounded
from sandbox.cluster.relay import Relay
from sandbox.config import DockerBackendConfig
from sandbox.docker_backend import DockerSandboxBackend

log = logging.getLogger("belayer.sandbox.cluster")

CALLS = frozenset({
    "create", "exec", "read_file", "write_file", "extract", "checkpoint", "restore", "destroy", "kill",
    "status", "list_sandboxes", "changed_paths", "processes", "writable_bytes", "has_image", "image_id",
    "import_image", "build_image", "remove_image", "images", "disk_quota", "delete_checkpoint", "load_image",
    "fence_full_network",
})  # fmt: skip
"""The backend methods the gateway may call through `SandboxAgent.call`."""


class SandboxAgent:
    """One node's Docker engine, for the gateway (module docstring). Built by Ray on its node."""

    def __init__(self, config: DockerBackendConfig) -> None:
        self.config = config
        self.backend: DockerSandboxBackend | None = None
        self.relay: Relay | None = None
        self.reason = ""
        try:
            self.backend = DockerSandboxBackend(config)
        except SandboxError as exc:
            self.reason = str(exc)

    def check(self) -> dict[str, Any]:
        """What this node offers, or one line saying why it cannot hold sandboxes (`SandboxUnavailable`):
        no engine answering, an engine without checkpoints (not ``--experimental``), a storage driver other
        than overlay2, no CRIU."""
        info = self._backend().info()
        where = self.config.base_url or "the default Docker socket"
        if not info.get("ExperimentalBuild"):
            raise SandboxUnavailable(
                f"the Docker engine at {where} cannot checkpoint: start dockerd with --experimental"
            )
        if info.get("Driver") != "overlay2":
            raise SandboxUnavailable(
                f"the Docker engine at {where} uses the {info.get('Driver')} storage driver; sandboxes across a "
                "cluster need overlay2"
            )
        criu = shutil.which("criu") or next(
            (p for p in ("/usr/local/sbin/criu", "/usr/sbin/criu") if Path(p).is_file()), None
        )
        if criu is None:
            raise SandboxUnavailable(
                "no CRIU on this node: install CRIU >= 3.17 (deploy/host/setup_sandbox_host.sh)"
            )
        version = subprocess.run([criu, "--version"], capture_output=True, text=True, timeout=10).stdout
        return {
            "docker": str(info.get("ServerVersion", "?")), "driver": "overlay2",
            "criu": version.split("\n", 1)[0].removeprefix("Version: ").strip(), "data_root": info.get("DockerRootDir"),
        }  # fmt: skip

    def ping(self) -> None:
        """Returns when the node's engine answers; `SandboxUnavailable` when it does not."""
        self._backend().ping()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """`DockerSandboxBackend.<method>(*args, **kwargs)`, for the methods in `CALLS`."""
        if method not in CALLS:
            raise SandboxError(f"the sandbox agent has no call {method!r}")
        return getattr(self._backend(), method)(*args, **kwargs)

    def archive(self, sandbox_id: str, path: str, max_bytes: int | None) -> bytes:
        """`DockerSandboxBackend.archive`, the tar returned whole (at most `max_bytes` and one piece)."""
        with tempfile.TemporaryFile() as out:
            self._backend().archive(sandbox_id, path, out, max_bytes=max_bytes)
            out.seek(0)
            return out.read()

    def derive_image(self, name: str, base: str, files: dict[str, bytes]) -> None:
        """`DockerSandboxBackend.derive_image` from the files' bytes (the gateway's paths mean nothing here)."""
        with tempfile.TemporaryDirectory() as tmp:
            paths = {}
            for i, (target, data) in enumerate(files.items()):
                paths[target] = Path(tmp) / str(i)
                paths[target].write_bytes(data)
                paths[target].chmod(0o755)
            self._backend().derive_image(name, base, paths)

    def sweep(self, names: list[str], owners: dict[str, str] | None = None) -> list[str]:
        """Remove the containers `names` that are still on this node (a gateway moved or closed them while
        the node was away), and with `owners`, every sandbox whose labels carry all of them (a gateway's
        own, none of which it holds here: one made by a call whose answer the node's loss cut off); the
        ones removed."""
        if owners:
            names = sorted({*names, *(box.id for box in self._backend().list_sandboxes(owners))})
        removed = []
        for name in names:
            with contextlib.suppress(SandboxError):
                self._backend().status(name)  # SandboxNotFound: nothing to remove
                self._backend().destroy(name)
                removed.append(name)
        return removed

    def start_relay(
        self, target: tuple[str, int], node: str, key: bytes, port: int, *, each: int = 32, most: int = 1024
    ) -> str:
        """Let this node's ``network="gateway"`` sandboxes reach the gateway's sandbox listener at `target`
        through a relay on `port` of the node's gateway network (`sandbox.cluster.relay`), vouching for
        them as node `node` with `key` (this node's own); at most `each` connections per sandbox and
        `most` in all. Returns where it listens."""
        network = self._backend().network
        host = network.gateway_address()
        self.stop_relay()
        network.open_gateway(port)
        self.relay = Relay(host, port, target, node, key, self._sandbox_at, each=each, most=most)
        return f"{host}:{port}"

    def stop_relay(self) -> None:
        """Stop the relay and withdraw its port from the node's firewall chain."""
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.stop()
            port = relay.server_port
            self._backend().network.close_gateway(port)

    def _sandbox_at(self, ip: str) -> str | None:
        """The sandbox whose address on this node's gateway network is `ip` (its container's name)."""
        for container in self._backend().network_members().values():
            if str(container.get("IPv4Address", "")).split("/")[0] == ip:
                return str(container.get("Name"))
        return None

    def _backend(self) -> DockerSandboxBackend:
        if self.backend is None:
            where = self.config.base_url or "the default Docker socket"
            raise SandboxUnavailable(f"no Docker engine answers at {where} on this node: {self.reason}")
        return self.backend


def write_to(out: IO[bytes], tar: bytes, max_bytes: int | None) -> int:
    """What `SandboxBackend.archive` returns, from the agent's whole tar."""
    return copy_bounded([tar], out, max_bytes)
