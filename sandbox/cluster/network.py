"""`ClusterNetwork`: the gateway network of sandboxes on a Ray cluster, as `sandbox.network.SandboxNetwork`.

It is the gateway's side of `sandbox.cluster.relay`. The sandbox listener binds the gateway's own
address on the cluster (`gateway_address`), and knows each connection's sandbox by its node's vouch
(`vouching`: a challenge per connection, a key per node), never by its source address. `open_gateway`
starts a `Relay` on every node, pointed at the listener, each with its own node's key (`node_key`, from
a master key that this object draws and never hands out). Each sandbox's identity (`address`) is
``<sandbox id>@<node>``: the node it is placed on is part of it, and two live sandboxes never share
one (Docker names a node's containers uniquely). Sandboxes reach the gateway at `sandbox_url`, which is
the same on every node.

`NodeRelays` starts and stops those relays: on every node alive when the listener opens or closes, and on
each node that joins or comes back later (`sandbox.cluster.nodes.NodeRegistry.on_join`).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

from core.errors import SandboxError
from sandbox.cluster.config import ClusterConfig
from sandbox.cluster.nodes import Node, NodeRegistry
from sandbox.cluster.relay import GATEWAY_HOST, RelayVouching, identity_of, node_key
from sandbox.network import SandboxNetwork, Vouching

log = logging.getLogger("belayer.sandbox.cluster")

Relays = Callable[[tuple[str, int] | None, Callable[[str], bytes]], None]
"""Start every node's relay towards the listener's address, each with the key that the given function
derives for its node; given None, stop them."""


class ClusterNetwork(SandboxNetwork):
    """See the module docstring. `relays` starts or stops the node relays; `node_of` is the node a
    sandbox is placed on (`ClusterSandboxBackend.node_of`)."""

    def __init__(
        self, host: str, relay_port: int, relays: Relays, node_of: Callable[[str], str | None]
    ) -> None:
        self.host, self.relay_port, self._relays, self._node_of = host, relay_port, relays, node_of
        self._master = secrets.token_bytes(32)
        self._vouching = RelayVouching(self._master, node_of)
        self._open = False

    def address(self, sandbox_id: str) -> str | None:
        node = self._node_of(sandbox_id)
        return identity_of(sandbox_id, node) if node is not None else None

    def vouching(self) -> Vouching:
        return self._vouching

    def node_key(self, node: str) -> bytes:
        """The key of node `node`'s relay (`sandbox.cluster.relay.node_key`): for that node's agent only."""
        return node_key(self._master, node)

    def gateway_address(self) -> str:
        return self.host

    def sandbox_url(self, host: str, port: int) -> str:
        return f"http://{GATEWAY_HOST}:{self.relay_port}"

    def open_gateway(self, port: int) -> None:
        if not self._open:
            self._open = True
            self._relays((self.host, port), self.node_key)

    def close_gateway(self, port: int) -> None:
        if self._open:
            self._open = False
            self._relays(None, self.node_key)


class NodeRelays:
    """Each node's relay for its network=gateway sandboxes, towards the sandbox listener (module docstring).
    `set` is `ClusterNetwork`'s `relays`; `start` runs on each node that joins."""

    def __init__(self, registry: NodeRegistry, config: ClusterConfig) -> None:
        self._registry, self._config = registry, config
        # the sandbox listener's address, and each node's relay key by the node's address
        self._relay: tuple[tuple[str, int], Callable[[str], bytes]] | None = None

    def set(self, target: tuple[str, int] | None, key_of: Callable[[str], bytes]) -> None:
        """Start the relays of every node alive (and of nodes that join later) to the sandbox listener at
        `target`, each with its own node's key (`key_of`: never another node's); None: stop them."""
        self._relay = (target, key_of) if target is not None else None
        for node in self._registry.alive():
            self._apply(node)

    def start(self, node: Node) -> None:
        """`node` joined, or came back: its relay, if the listener is open."""
        if self._relay is not None:
            self._apply(node)

    def _apply(self, node: Node) -> None:
        try:
            if self._relay is None:
                self._registry.call(node, "stop_relay")
            else:
                target, key_of = self._relay
                where = self._registry.call(
                    node, "start_relay", target, node.ip, key_of(node.ip), self._config.relay_port,
                    each=self._config.relay_connections_each, most=self._config.relay_max_connections,
                )  # fmt: skip
                log.info("sandbox node %s: relay for network=gateway sandboxes on %s", node.ip, where)
        except SandboxError as exc:  # that node's network=gateway sandboxes cannot reach the gateway
            log.error("sandbox node %s: no relay for network=gateway sandboxes: %s", node.ip, exc)
