"""`NodeRegistry`: the Ray cluster's nodes that offer sandboxes, their agents, their prober, and every
call to an agent (a call that finds its node gone loses the node).

Nodes. A Ray node offers sandboxes by declaring the custom resource ``belayer_sandbox_slots`` (`SLOTS`:
how many it holds: ``ray start --resources '{"belayer_sandbox_slots": 16}'``). The registry starts one
`SandboxAgent` on each (pinned with a hard node affinity) and asks it to `check` the node: an engine
that answers, with checkpoints (``--experimental``), overlay2 and CRIU. A node that fails is *refused*
with one line in the log, and asked again at each probe. The agent reaches the node's engine on
`ClusterConfig.docker_urls`'s entry for the node's address, else the node's default socket.

Node loss. Every `ClusterConfig.probe_interval_s` the prober thread lists the cluster's nodes and pings
each agent (its engine answers within `node_timeout_s`). A node whose Ray node is gone, whose agent
died, or whose engine does not answer is *lost*: every call on it, including one already waiting, fails
with `NodeLost`. A node that answers again (its engine back, or its Ray node started again on the same
address) is swept before it takes sandboxes: the containers the backend moved or destroyed while it was
away are removed, so none comes back to life and none is left behind; then the hooks given to `on_join`
run (the node's relay, `sandbox.cluster.network.NodeRelays`). A node's state is a `core.liveness.Liveness`
(``alive``, ``lost``, ``refused``).

The prober is a daemon thread, and the registry's one `threading.RLock` guards every node's record,
the placement's included (`sandbox.cluster.placement`): the backend's methods block, and are called
from the session manager's thread pools.

Example::

    registry = NodeRegistry(config, docker, connect(config), host="127.0.0.2")
    registry.start()                  # probe once, then every probe_interval_s in the prober thread
    registry.views()                  # [{'node': '127.0.0.3', 'state': 'alive', 'slots': 16, ...}]
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.errors import NodeLost, SandboxArgumentError, SandboxError, SandboxUnavailable
from core.liveness import Liveness
from sandbox.cluster.agent import SandboxAgent
from sandbox.cluster.config import SLOTS, ClusterConfig
from sandbox.config import DockerBackendConfig

log = logging.getLogger("belayer.sandbox.cluster")

OWNER_LABELS = ("belayer.store", "belayer.gateway")
"""The labels by which the session manager marks a gateway's own sandboxes (`sandbox.sessions.adoption`):
a node back from a loss is swept of every sandbox that carries this backend's."""


@dataclass(slots=True)
class Node:
    """One node that offers sandboxes, as the backend sees it."""

    ip: str
    ray_id: str
    slots: int
    agent: Any = None
    state: Liveness = Liveness.REFUSED
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
    """The cluster addresses its network=full sandboxes are fenced off from (`NodeRegistry.fence`)."""

    @property
    def free(self) -> int:
        return self.slots - len(self.boxes) - self.reserved

    def view(self) -> dict[str, Any]:
        return {"node": self.ip, "state": self.state.value, "slots": self.slots, "sandboxes": len(self.boxes),
                "lost_sandboxes": len(self.lost), "reason": self.reason, **self.facts}  # fmt: skip


class NodeRegistry:
    """The nodes, their agents and their prober (module docstring). Methods block; thread-safe."""

    def __init__(self, config: ClusterConfig, docker: DockerBackendConfig, ray: Any, host: str) -> None:
        self.config, self._docker, self._ray, self._host = config, docker, ray, host
        self.lock = threading.RLock()
        """Guards every node's record (the placement's bookkeeping too)."""
        self.nodes: dict[str, Node] = {}  # by address
        self.node_losses = 0
        self.owners: dict[str, str] = {}
        """The owner labels of the sandboxes made on the cluster (a returning node is swept of theirs)."""
        self._joined: list[Callable[[Node], None]] = []
        self._cluster: tuple[str, ...] = ()  # every node's address and the gateway's (allow_full_network)
        self._agent_class = ray.remote(SandboxAgent)
        self._stop = threading.Event()
        self._prober = threading.Thread(target=self._probe_loop, name="belayer-sandbox-nodes", daemon=True)

    def on_join(self, hook: Callable[[Node], None]) -> None:
        """Run `hook` on each node that joins, or comes back, once it is swept and alive."""
        self._joined.append(hook)

    def start(self) -> None:
        """Probe once (the nodes there now take sandboxes at once), then in the prober thread."""
        self.probe()
        self._prober.start()

    def views(self) -> list[dict[str, Any]]:
        """Each node that offers sandboxes: address, state, slots, sandboxes here, why refused or lost."""
        with self.lock:
            return [n.view() for n in sorted(self.nodes.values(), key=lambda n: n.ip)]

    def alive(self) -> list[Node]:
        with self.lock:
            return [n for n in self.nodes.values() if n.state == Liveness.ALIVE]

    # ------------------------------------------------------------------ probing
    def probe(self) -> None:
        """List the cluster's nodes and ping each agent once: register new nodes, mark lost ones, sweep
        and take back the ones that answer again."""
        seen = {}
        for n in self._ray.nodes():
            slots = int((n.get("Resources") or {}).get(SLOTS, 0))
            if n.get("Alive") and slots > 0:
                seen[str(n["NodeManagerAddress"])] = (str(n["NodeID"]), slots)
        with self.lock:
            known = dict(self.nodes)
        for ip, node in known.items():
            if ip not in seen or seen[ip][0] != node.ray_id:
                if node.state == Liveness.ALIVE:
                    self.lose(node, "its Ray node left the cluster")
                if ip in seen:  # the node started again on the same address: a new agent
                    self._register(ip, *seen[ip], former=node)
            elif node.state != Liveness.REFUSED or node.agent is not None:
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
            for node in self.alive():
                with contextlib.suppress(SandboxError):  # logged; a full sandbox there waits for its fence
                    self.fence(node)

    def fence(self, node: Node) -> None:
        """Fence `node`'s network=full sandboxes off from every address of the cluster (each node, the
        gateway's; `sandbox.docker_backend.network.fence_full_network`), once for each new set of them."""
        if node.fenced == self._cluster:
            return
        try:
            self.call(node, "call", "fence_full_network", list(self._cluster))
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
            node.returning = former.returning or former.state == Liveness.ALIVE
        node.agent = self._agent_class.options(
            num_cpus=0, max_concurrency=self.config.agent_concurrency, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(ray_id, soft=False),
        ).remote(docker)  # fmt: skip
        with self.lock:
            self.nodes[ip] = node
        self._ping(node, first=True)

    def _ping(self, node: Node, *, first: bool = False) -> None:
        ray = self._ray
        try:
            if first or node.state != Liveness.ALIVE:
                facts = ray.get(node.agent.check.remote(), timeout=max(30.0, self.config.node_timeout_s))
            else:
                ray.get(node.agent.ping.remote(), timeout=self.config.node_timeout_s)
        except Exception as exc:
            reason = _reason(exc)
            if node.state == Liveness.ALIVE:
                self.lose(node, reason)
            elif node.reason != reason:
                node.reason = reason
                if node.state == Liveness.REFUSED:
                    log.error("sandbox node %s refused: %s", node.ip, reason)
            return
        if node.state != Liveness.ALIVE:
            self._rejoin(node, facts)

    def _rejoin(self, node: Node, facts: dict[str, Any]) -> None:
        with self.lock:
            sweep = sorted(node.gone | node.lost)  # what it held is stale: removed, the lost ones too
            # a node back from a loss holds nothing of this backend's: every container of its owner goes
            owners = dict(self.owners) if node.returning and not node.boxes else None
        if sweep or owners:
            removed = self._ray.get(node.agent.sweep.remote(sweep, owners), timeout=60)
            if removed:
                log.info("sandbox node %s: removed %d containers left from before it was lost: %s",
                         node.ip, len(removed), removed)  # fmt: skip
        with self.lock:
            node.gone.clear()
            node.facts, node.reason, node.returning = facts, "", False
            was, node.state = node.state, Liveness.ALIVE
        log.info("sandbox node %s %s: %d slots, %s", node.ip, "back" if was == Liveness.LOST else "joined",
                 node.slots, facts)  # fmt: skip
        for hook in self._joined:
            hook(node)

    def lose(self, node: Node, reason: str) -> None:
        """`node` stopped answering: its sandboxes are lost (restored elsewhere by the session manager)."""
        with self.lock:
            if node.state != Liveness.ALIVE:
                return
            node.state, node.reason, node.returning = Liveness.LOST, reason, True
            node.lost |= node.boxes
            node.boxes = set()
            self.node_losses += 1
            count = len(node.lost)
        log.error(
            "sandbox node %s lost (%s): its %d sandboxes are restored elsewhere", node.ip, reason, count
        )

    # ------------------------------------------------------------------ calls
    def call(self, node: Node, method: str, *args: Any, **kwargs: Any) -> Any:
        """The answer of `node`'s agent to `method(*args, **kwargs)`; `NodeLost` as soon as the node is
        (even while the call waits), and when the call finds its node gone."""
        return self._await(node, getattr(node.agent, method).remote(*args, **kwargs))

    def _await(self, node: Node, ref: Any) -> Any:
        ray = self._ray
        while True:
            if node.state == Liveness.LOST:
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=False)
                raise NodeLost(f"sandbox node {node.ip} lost: {node.reason}")
            ready, _ = ray.wait([ref], timeout=0.2)
            if ready:
                break
        try:
            return ray.get(ref)
        except SandboxUnavailable as exc:  # the node's engine does not answer: the node, not the caller
            self.lose(node, str(exc))
            raise NodeLost(f"sandbox node {node.ip} lost: {exc}") from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            raise cause from None
        except ray.exceptions.RayError as exc:  # the actor, its worker or its node died
            self.lose(node, _reason(exc))
            raise NodeLost(f"sandbox node {node.ip} lost: {_reason(exc)}") from exc

    def close(self) -> None:
        """Stop the prober, and every node's agent."""
        self._stop.set()
        if self._prober.is_alive():
            self._prober.join(timeout=5)
        for node in list(self.nodes.values()):
            with contextlib.suppress(Exception):
                self._ray.kill(node.agent, no_restart=True)


def connect(config: ClusterConfig) -> Any:
    """The `ray` module, joined to the cluster at ``config.address`` (a process joins one cluster)."""
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
