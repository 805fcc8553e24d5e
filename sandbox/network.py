"""The gateway-network seam: how a harness inside a sandbox reaches the gateway, and nothing else.

A sandbox created with ``network="gateway"`` joins a network whose only reachable address is the host's
address on it (`gateway_address`), and there only the ports the gateway opened (`open_gateway`); the
sandboxes on it cannot reach one another. The gateway's sandbox listener binds that address and tells
its callers apart by their source address (`address`), so an implementation must keep one sandbox from
sending as another. This is separate from `SandboxBackend` (containers): a backend offers its network, if it
has one, as `SandboxBackend.network`.

Implementations: `sandbox.docker_backend.DockerNetwork` (an internal Docker bridge plus an iptables
chain, see `sandbox.docker_backend.network`) and `sandbox.fake.FakeNetwork`.

Example::

    network = backend.network              # None: the backend has no gateway network
    host = network.gateway_address()       # bind the listener here
    network.open_gateway(8080)             # sandboxes on the network reach host:8080, nothing else
    session = by_address[network.address(box.id)]
    network.close_gateway(8080)
"""

from __future__ import annotations

import abc


class SandboxNetwork(abc.ABC):
    """The network of ``network="gateway"`` sandboxes. Methods block and are thread-safe."""

    @abc.abstractmethod
    def address(self, sandbox_id: str) -> str | None:
        """The sandbox's address on the network (None when it is not on it)."""

    @abc.abstractmethod
    def gateway_address(self) -> str:
        """Prepare the network; return the host's address on it."""

    @abc.abstractmethod
    def open_gateway(self, port: int) -> None:
        """Let the network's sandboxes reach `port` at `gateway_address()`, and nothing else
        (idempotent; several gateways may share the network)."""

    @abc.abstractmethod
    def close_gateway(self, port: int) -> None:
        """Withdraw what `open_gateway(port)` allowed."""

    def sandbox_url(self, host: str, port: int) -> str:
        """The URL at which the network's sandboxes reach a listener on `host`:`port`."""
        return f"http://{host}:{port}"
