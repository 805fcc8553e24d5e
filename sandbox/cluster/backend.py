"""`ClusterSandboxBackend`: sandboxes placed across the nodes of a Ray cluster, each node's Docker engine
behind a `SandboxAgent` actor on that node; a lost node's sandboxes reported as failed, so that the
session manager restores each one elsewhere from its newest checkpoint.

Nodes. A Ray node offers sandboxes by declaring the custom resource ``belayer_sandbox_slots`` (how many
it holds: ``ray start --resources '{"belayer_sandbox_slots": 16}'``). The backend starts one agent on
each (pinned with a hard node affinity) and asks it to `check` the node: an engine that answers, with
checkpoints (``--experimental``), overlay2 and CRIU. A node that fails is refused with one line in the
log, and asked again at each probe. The agent reaches the node's engine on `ClusterConfig.docker_urls`'s
entry for the node's address, else the node's default socket.

Placement. A new sandbox goes to the node with the most free slots (slots less the sandboxes this backend
holds there), then the fewest sandboxes, then the lowest address; a restore, the same way, among the
nodes alive now. Checkpoints are portable (`sandbox.docker_backend.portable`): they live in the
checkpoint store, never on the node that took them.

Node loss. Every `probe_interval_s` the backend lists the cluster's nodes and pings each agent (its engine
answers within `node_timeout_s`). A node whose Ray node is gone, whose agent died, or whose engine does
not answer is *lost*: every call on its sandboxes, including one already waiting, fails with `NodeLost`,
and `status` reports them stopped (``failure_kind == "node_lost"``); the session manager then restores
each from its newest checkpoint, on a node alive, in its recovery mode (replay or truncate). A node
that answers again (its engine back, or its Ray node started again on the same address) is swept before
it takes sandboxes: the containers this backend moved or destroyed while it was away are removed, so
none comes back to life and none is left behind.

Networks. The cluster's own services (Ray's ports on every node, the engines a pool launched there) ask
nobody who they are, so a ``network="full"`` sandbox (and a task's setup with network) is refused
unless the operator allows them (``allow_full_network``, ``--sandbox-allow-full-network-on-cluster``);
allowed, every node's firewall drops their packets to every node's address and the gateway's, before
one runs there (`_fence`, `sandbox.docker_backend.network.fence_full_network`). ``network="gateway"``
sandboxes reach their node's relay only (`sandbox.cluster.relay`).

Example::

    backend = ClusterSandboxBackend(ClusterConfig(address="127.0.0.2:6379"), "file:///shared/ckpt")
    box = backend.create(SandboxSpec(image="belayer-sandbox-busybox"))
    backend.node_of(box.id)           # '127.0.0.3'
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.errors import (
    ImageNotFound,
    NodeLost,
    NoSandboxSlot,
    SandboxArgumentError,
    SandboxError,
    SandboxNotFound,
    SandboxUnavailable,
)
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
from sandbox.cluster.agent import SandboxAgent
from sandbox.cluster.network import ClusterNetwork
from sandbox.config import DockerBackendConfig
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.docker_backend.checkpoints import checkpoint_to_json
from sandbox.docker_backend.portable import checkpoint_key

log = logging.getLogger("belayer.sandbox.cluster")

SLOTS = "belayer_sandbox_slots"
"""The Ray resource by which a node offers sandboxes (how many it holds)."""
State = Literal["alive", "lost", "refused"]
OWNER_LABELS = ("belayer.store", "belayer.gateway")
"""The labels by which the session manager marks a gateway's own sandboxes (`sandbox.sessions.adoption`):
a node back from a loss is swept of every sandbox that carries this backend's."""


class ClusterConfig(BaseModel):
    """Where the cluster is and how its nodes are watched (the gateway's ``[sandbox.cluster]`` table)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str = Field(description="the Ray cluster: auto, or the head's HOST:PORT")
    node_ip: str | None = Field(
        default=None, description="this machine's Ray node address, if Ray would guess it wrong"
    )
    namespace: str = Field(default="belayer", min_length=1, description="the Ray namespace of the agents")
    docker_urls: dict[str, str] = Field(
        default_factory=dict,
        description="a node's Docker engine address, by the node's address (default: the node's own socket)",
    )
    relay_port: int = Field(
        default=7199, ge=1, le=65535,
        description="the port of each node's relay for network=gateway sandboxes (the same on every node)",
    )  # fmt: skip
    probe_interval_s: float = Field(
        default=1.0, gt=0, description="how often the nodes are listed and pinged"
    )
    node_timeout_s: float = Field(
        default=3.0, gt=0, description="a node whose engine does not answer this long is lost"
    )
    agent_concurrency: int = Field(default=64, ge=1, description="calls one node's agent runs at once")
    allow_full_network: bool = Field(
        default=False,
        description="allow network=full sandboxes (and task setup with network); each node's firewall then "
        "drops their packets to every cluster node's address (`fence_full_network`)",
    )
    relay_connections_each: int = Field(
        default=32, ge=1, description="connections one sandbox may hold through its node's relay at once"
    )
    relay_max_connections: int = Field(
        default=1024, ge=1, description="connections one node's relay holds at once, all its sandboxes together",
    )  # fmt: skip


@dataclass(slots=True)
class Node:
    """One node that offers sandboxes, as this backend sees it."""

    ip: str
    ray_id: str
    slots: int
    agent: Any = None
    state: State = "refused"
    reason: str = ""
    facts: dict[str, Any] = field(default_factory=dict)
    boxes: set[str] = field(default_factory=set)
    """Sandboxes running here (what the slots count)."""
    reserved: int = 0
    """Slots promised to a create or restore in progress."""
    lost: set[str] = field(default_factory=set)
    """Sandboxes that were here when the node was lost, not yet given up by the session manager."""
    gone: set[str] = field(default_factory=set)
    """Sandboxes given up while the node was lost: their containers are removed when it answers again."""
    returning: bool = False
    """Lost, and not yet swept: it answers again after a loss."""
    fenced: tuple[str, ...] = ()
    """The cluster addresses its network=full sandboxes are fenced off from (`_fence`)."""

    @property
    def free(self) -> int:
        return self.slots - len(self.boxes) - self.reserved

    def view(self) -> dict[str, Any]:
        return {"node": self.ip, "state": self.state, "slots": self.slots, "sandboxes": len(self.boxes),
                "lost_sandboxes": len(self.lost), "reason": self.reason, **self.facts}  # fmt: skip


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
        self._lock = threading.RLock()
        self._nodes: dict[str, Node] = {}  # by address
        self._where: dict[str, str] = {}  # sandbox id -> node address
        self._images: dict[str, Callable[[Node], None]] = {}  # image -> how to build it on a node
        self.node_losses = 0
        self._owners: dict[str, str] = {}  # the owner labels of the sandboxes made here (`_rejoin`)
        self._source = _image_source(self._docker)
        self._stop = threading.Event()
        self._ray = _connect(config)
        self._agent_class = self._ray.remote(SandboxAgent)
        # the sandbox listener's address, and each node's relay key by the node's address
        self._relay: tuple[tuple[str, int], Callable[[str], bytes]] | None = None
        host = config.node_ip or self._ray.util.get_node_ip_address()
        self._host = host
        self._cluster: tuple[str, ...] = ()  # every node's address and the gateway's (allow_full_network)
        self._network = ClusterNetwork(host, config.relay_port, self._relays, self.node_of)
        self.probe()
        self._prober = threading.Thread(target=self._probe_loop, name="belayer-sandbox-nodes", daemon=True)
        self._prober.start()

    # ------------------------------------------------------------------ nodes
    def nodes(self) -> list[dict[str, Any]]:
        """Each node that offers sandboxes: address, state, slots, sandboxes here, why refused or lost."""
        with self._lock:
            return [n.view() for n in sorted(self._nodes.values(), key=lambda n: n.ip)]

    def node_of(self, sandbox_id: str) -> str | None:
        """The address of the node that holds `sandbox_id` (None when none does)."""
        with self._lock:
            return self._where.get(sandbox_id)

    def probe(self) -> None:
        """List the cluster's nodes and ping each agent once: register new nodes, mark lost ones, sweep
        and take back the ones that answer again."""
        seen = {}
        for n in self._ray.nodes():
            slots = int((n.get("Resources") or {}).get(SLOTS, 0))
            if n.get("Alive") and slots > 0:
                seen[str(n["NodeManagerAddress"])] = (str(n["NodeID"]), slots)
        with self._lock:
            known = dict(self._nodes)
        for ip, node in known.items():
            if ip not in seen or seen[ip][0] != node.ray_id:
                if node.state == "alive":
                    self._lose(node, "its Ray node left the cluster")
                if ip in seen:  # the node started again on the same address: a new agent
                    self._register(ip, *seen[ip], former=node)
            elif node.state != "refused" or node.agent is not None:
                self._ping(node)
            else:
                self._register(ip, *seen[ip], former=node)
        for ip, (ray_id, slots) in seen.items():
            if ip not in known:
                self._register(ip, ray_id, slots, former=None)
        if self.config.allow_full_network:
            self._cluster = tuple(
                sorted({str(n["NodeManagerAddress"]) for n in self._ray.nodes()} | {self._host})
            )
            for node in self._alive():
                with contextlib.suppress(SandboxError):  # logged; a full sandbox there waits for its fence
                    self._fence(node)

    def _fence(self, node: Node) -> None:
        """Fence `node`'s network=full sandboxes off from every address of the cluster (each node, the
        gateway's; `sandbox.docker_backend.network.fence_full_network`), once for each new set of them."""
        if node.fenced == self._cluster:
            return
        try:
            self._call(node, "call", "fence_full_network", list(self._cluster))
        except SandboxError as exc:
            log.error("sandbox node %s: network=full sandboxes not fenced off the cluster: %s", node.ip, exc)
            raise
        node.fenced = self._cluster

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.config.probe_interval_s):
            try:
                self.probe()
            except Exception:  # the head away, say: the next probe tries again
                log.exception("probing the sandbox nodes failed")

    def _register(self, ip: str, ray_id: str, slots: int, former: Node | None) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        docker = self._docker.model_copy(
            update={
                "base_url": self.config.docker_urls.get(ip, self._docker.base_url),
                # a bridge name of the node's own: nodes that share a machine (tests) must not collide
                "gateway_bridge": "bgw-" + "".join(c for c in ip if c.isalnum())[-10:],
            }
        )
        node = Node(ip, ray_id, slots)
        if former is not None:  # the same machine again (its Ray node started again): what it held is lost
            node.lost, node.gone = former.lost | former.boxes, set(former.gone)
            node.returning = former.returning or former.state == "alive"
        node.agent = self._agent_class.options(
            num_cpus=0, max_concurrency=self.config.agent_concurrency, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray_id, soft=False),
        ).remote(docker)  # fmt: skip
        with self._lock:
            self._nodes[ip] = node
        self._ping(node, first=True)

    def _ping(self, node: Node, *, first: bool = False) -> None:
        ray = self._ray
        try:
            if first or node.state != "alive":
                facts = ray.get(node.agent.check.remote(), timeout=max(30.0, self.config.node_timeout_s))
            else:
                ray.get(node.agent.ping.remote(), timeout=self.config.node_timeout_s)
        except Exception as exc:
            reason = _reason(exc)
            if node.state == "alive":
                self._lose(node, reason)
            elif node.reason != reason:
                node.reason = reason
                if node.state == "refused":
                    log.error("sandbox node %s refused: %s", node.ip, reason)
            return
        if node.state != "alive":
            self._rejoin(node, facts)

    @property
    def network(self) -> ClusterNetwork:
        return self._network

    def _relays(self, target: tuple[str, int] | None, key_of: Callable[[str], bytes]) -> None:
        """Start the relays of every node alive (and of nodes that join later) to the sandbox listener at
        `target`, each with its own node's key (`key_of`: never another node's); None: stop them."""
        self._relay = (target, key_of) if target is not None else None
        for node in self._alive():
            self._start_relay(node)

    def _start_relay(self, node: Node) -> None:
        try:
            if self._relay is None:
                self._call(node, "stop_relay")
            else:
                target, key_of = self._relay
                where = self._call(
                    node, "start_relay", target, node.ip, key_of(node.ip), self.config.relay_port,
                    each=self.config.relay_connections_each, most=self.config.relay_max_connections,
                )  # fmt: skip
                log.info("sandbox node %s: relay for network=gateway sandboxes on %s", node.ip, where)
        except SandboxError as exc:  # that node's network=gateway sandboxes cannot reach the gateway
            log.error("sandbox node %s: no relay for network=gateway sandboxes: %s", node.ip, exc)

    def _rejoin(self, node: Node, facts: dict[str, Any]) -> None:
        with self._lock:
            sweep = sorted(node.gone | node.lost)  # what it held is stale: removed, the lost ones too
            # a node back from a loss holds nothing of this backend's: every container of its owner goes
            owners = dict(self._owners) if node.returning and not node.boxes else None
        if sweep or owners:
            removed = self._ray.get(node.agent.sweep.remote(sweep, owners), timeout=60)
            if removed:
                log.info("sandbox node %s: removed %d containers left from before it was lost: %s",
                         node.ip, len(removed), removed)  # fmt: skip
        with self._lock:
            node.gone.clear()
            node.facts, node.reason, node.returning = facts, "", False
            was, node.state = node.state, "alive"
        log.info("sandbox node %s %s: %d slots, %s", node.ip, "back" if was == "lost" else "joined",
                 node.slots, facts)  # fmt: skip
        if self._relay is not None:
            self._start_relay(node)

    def _lose(self, node: Node, reason: str) -> None:
        with self._lock:
            if node.state != "alive":
                return
            node.state, node.reason, node.returning = "lost", reason, True
            node.lost |= node.boxes
            node.boxes = set()
            self.node_losses += 1
            count = len(node.lost)
        log.error(
            "sandbox node %s lost (%s): its %d sandboxes are restored elsewhere", node.ip, reason, count
        )

    # ------------------------------------------------------------------ calls
    def _node(self, sandbox_id: str) -> Node:
        with self._lock:
            ip = self._where.get(sandbox_id)
            if ip is None:
                raise SandboxNotFound(f"no sandbox {sandbox_id} on this cluster")
            return self._nodes[ip]

    def _place(self) -> Node:
        """The node for a new sandbox, its slot reserved (`_placed` or `_unreserve` ends the reservation)."""
        with self._lock:
            alive = [n for n in self._nodes.values() if n.state == "alive" and n.free > 0]
            if not alive:
                known = "; ".join(
                    f"{n.ip} {n.state}{': ' + n.reason if n.reason else ''}" for n in self._nodes.values()
                )
                raise NoSandboxSlot(
                    "no node of the Ray cluster has a free sandbox slot "
                    f"({known or 'no node declares ' + SLOTS}): start nodes with "
                    f"--resources '{{\"{SLOTS}\": N}}' and Docker + CRIU"
                )
            node = min(alive, key=lambda n: (-n.free, len(n.boxes), n.ip))
            node.reserved += 1
            return node

    def _call(self, node: Node, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._await(node, getattr(node.agent, method).remote(*args, **kwargs))

    def _await(self, node: Node, ref: Any) -> Any:
        """The agent's answer; `NodeLost` as soon as the node is (even while the call waits)."""
        ray = self._ray
        while True:
            if node.state == "lost":
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=False)
                raise NodeLost(f"sandbox node {node.ip} lost: {node.reason}")
            ready, _ = ray.wait([ref], timeout=0.2)
            if ready:
                break
        try:
            return ray.get(ref)
        except SandboxUnavailable as exc:  # the node's engine does not answer: the node, not the caller
            self._lose(node, str(exc))
            raise NodeLost(f"sandbox node {node.ip} lost: {exc}") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            raise cause from None
        except ray.exceptions.RayError as exc:  # the actor, its worker or its node died
            self._lose(node, _reason(exc))
            raise NodeLost(f"sandbox node {node.ip} lost: {_reason(exc)}") from exc

    def _box(self, sandbox_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        node = self._node(sandbox_id)
        if sandbox_id in node.lost:
            raise NodeLost(f"sandbox node {node.ip} was lost ({node.reason or 'it left the cluster'})")
        return self._call(node, "call", method, sandbox_id, *args, **kwargs)

    def _ensure_image(self, node: Node, image: str) -> None:
        """Image `image` on `node`: there already, or built as this backend built it elsewhere, or copied
        from the gateway host's own Docker engine (`image_source`), as a registry would give it."""
        if self._call(node, "call", "has_image", image):
            return
        build = self._images.get(image)
        if build is not None:
            build(node)
            return
        if self._source is not None and self._source.has_image(image):
            with tempfile.TemporaryFile() as tar:
                self._source.save_image(image, tar)
                tar.seek(0)
                data = tar.read()
            log.info("image %s: copied to sandbox node %s (%d MB)", image, node.ip, len(data) >> 20)
            self._call(node, "call", "load_image", data)
            return
        raise ImageNotFound(
            f"image {image} is on neither sandbox node {node.ip} nor this gateway's Docker engine: build it "
            "here (belayer sandbox build-image, or the task's image) or on every node"
        )

    def _placed(self, node: Node, box: Sandbox, *, reserved: bool = False) -> Sandbox:
        with self._lock:
            node.reserved -= reserved
            node.boxes.add(box.id)
            self._where[box.id] = node.ip
        return box

    def _placing(self, node: Node, spec: SandboxSpec, ask: Callable[[], Sandbox]) -> Sandbox:
        with self._lock:
            self._owners.update({k: v for k, v in spec.labels.items() if k in OWNER_LABELS})
        try:
            box = ask()
        except BaseException:
            with self._lock:
                node.reserved -= 1
            raise
        return self._placed(node, box, reserved=True)

    # ------------------------------------------------------------------ SandboxBackend
    def create(self, spec: SandboxSpec) -> Sandbox:
        self._check_network(spec.network == "full")
        node = self._place()

        def ask() -> Sandbox:
            if spec.network == "full":  # never one without its fence
                self._fence(node)
            self._ensure_image(node, spec.image)
            box: Sandbox = self._call(node, "call", "create", spec)
            return box

        return self._placing(node, spec, ask)

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
        node = self._place()

        def ask() -> Sandbox:
            if checkpoint.spec.network == "full":
                self._fence(node)
            self._ensure_image(node, checkpoint.spec.image)
            box: Sandbox = self._call(node, "call", "restore", checkpoint)
            return box

        return self._placing(node, checkpoint.spec, ask)

    def destroy(self, sandbox_id: str) -> None:
        try:
            node = self._node(sandbox_id)
        except SandboxNotFound:
            return
        with self._lock:
            node.boxes.discard(sandbox_id)
            self._where.pop(sandbox_id, None)
            if node.state != "alive" or sandbox_id in node.lost:
                node.lost.discard(sandbox_id)
                node.gone.add(sandbox_id)  # its container is removed once the node answers
                if node.state != "alive":
                    return
        try:
            if sandbox_id in node.gone:  # it was lost with its node, which is back: remove what is left
                self._call(node, "sweep", [sandbox_id])
            else:
                self._call(node, "call", "destroy", sandbox_id)
            with self._lock:
                node.gone.discard(sandbox_id)
        except NodeLost:
            with self._lock:
                node.gone.add(sandbox_id)

    def status(self, sandbox_id: str) -> SandboxStatus:
        node = self._node(sandbox_id)
        if node.state != "alive" or sandbox_id in node.lost:
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
        tar = self._call(self._node(sandbox_id), "archive", sandbox_id, path, max_bytes)
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
        for node in self._alive():
            for box in self._call(node, "call", "list_sandboxes", dict(labels)):
                found.append(self._placed(node, box))
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
        alive = self._alive()
        if not alive:
            return False, "no sandbox node is alive"
        answer: tuple[bool, str] = self._call(alive[0], "call", "disk_quota")
        return answer

    def close(self) -> None:
        self._stop.set()
        self._prober.join(timeout=5)
        for node in list(self._nodes.values()):
            with contextlib.suppress(Exception):
                self._ray.kill(node.agent, no_restart=True)
        if self._source is not None:
            self._source.close()

    def _alive(self) -> list[Node]:
        with self._lock:
            return [n for n in self._nodes.values() if n.state == "alive"]

    # ------------------------------------------------------------------ images, on every node
    def has_image(self, name: str) -> bool:
        """Whether every alive node has image `name`."""
        return all(self._call(n, "call", "has_image", name) for n in self._alive())

    def import_image(self, name: str, rootfs_tar: Path | bytes, changes: list[str]) -> None:
        data = rootfs_tar.read_bytes() if isinstance(rootfs_tar, Path) else rootfs_tar
        self._everywhere(name, lambda node: self._call(node, "call", "import_image", name, data, changes))

    def derive_image(self, name: str, base: str, files: dict[str, Path]) -> None:
        data = {target: path.read_bytes() for target, path in files.items()}

        def build(node: Node) -> None:
            self._ensure_image(node, base)
            self._call(node, "derive_image", name, base, data)

        self._everywhere(name, build)

    def build_image(self, name: str, base: str, tar: bytes, script: str, **kwargs: Any) -> str:
        self._check_network(bool(kwargs.get("network")), "a task's setup with network (setup_network)")
        outputs: list[str] = []

        def build(node: Node) -> None:
            if kwargs.get("network"):
                self._fence(node)
            self._ensure_image(node, base)
            outputs.append(self._call(node, "call", "build_image", name, base, tar, script, **kwargs))

        self._everywhere(name, build)
        return outputs[0] if outputs else ""

    def image_id(self, name: str) -> str:
        alive = self._alive()
        if not alive:
            raise SandboxUnavailable("no sandbox node is alive")
        image: str = self._call(alive[0], "call", "image_id", name)
        return image

    def _everywhere(self, name: str, build: Callable[[Node], None]) -> None:
        """Build image `name` on every alive node that lacks it, and remember how, for nodes that join
        later (`_ensure_image`)."""
        self._images[name] = build
        for node in self._alive():
            if not self._call(node, "call", "has_image", name):
                build(node)


def _image_source(docker: DockerBackendConfig) -> DockerSandboxBackend | None:
    """The gateway host's own Docker engine, where images missing on a node are copied from (None when
    this host has no engine answering)."""
    try:
        return DockerSandboxBackend(docker.model_copy(update={"checkpoint_store": None}))
    except SandboxUnavailable:
        return None


def _connect(config: ClusterConfig) -> Any:
    os.environ.setdefault("RAY_gcs_rpc_server_reconnect_timeout_s", "3600")
    import ray

    kwargs: dict[str, Any] = {"_node_ip_address": config.node_ip} if config.node_ip else {}
    if not ray.is_initialized():
        ray.init(
            address=config.address, namespace=config.namespace, log_to_driver=False, configure_logging=False,
            ignore_reinit_error=True, **kwargs,
        )  # fmt: skip
        return ray
    joined = str(ray.get_runtime_context().gcs_address)
    if config.address not in ("auto", joined):  # a process joins one cluster (the engine pool's, say)
        raise SandboxArgumentError(
            f"this gateway already joined the Ray cluster at {joined} (the engine pool's --ray); a process "
            f"joins one cluster, so its sandboxes cannot go to {config.address}: give --sandbox-ray that "
            "cluster's address too (or auto), or keep them here with --sandbox-ray off"
        )
    return ray


def _reason(exc: BaseException) -> str:
    """Why a node did not answer, in one line."""
    kind = type(exc).__name__
    if kind in ("ActorDiedError", "ActorUnavailableError", "RayActorError"):
        return f"its sandbox agent is gone: its Ray node or worker died ({kind})"
    if kind == "GetTimeoutError":
        return "its sandbox agent did not answer in time"
    text = str(getattr(exc, "cause", None) or exc).strip().splitlines()
    return (text[-1] if text else kind)[:300]
