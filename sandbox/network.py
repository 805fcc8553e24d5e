"""The gateway-network seam: how a harness inside a sandbox reaches the gateway, and nothing else.

A sandbox created with ``network="gateway"`` joins a network whose only reachable address is the host's
address on it (`gateway_address`), and there only the ports the gateway opened (`open_gateway`); the
sandboxes on it cannot reach one another. The gateway's sandbox listener binds that address and tells
its callers apart by an identity that `address` gives each sandbox, and that no other party can claim:

- **Its source address** (`vouching` is None): the listener's peer is the sandbox itself, so an
  implementation must keep one sandbox from sending as another, and the address must be one that no
  process on the gateway's host can connect from (a container's address on a bridge, which the host
  routes to the container: never a loopback address, which any local user can bind).
- **A vouch** (`vouching` gives a `Vouching`): the peer is a relay that speaks for the sandbox (a
  cluster node's, `sandbox.cluster.relay`). The listener sends each new connection a fresh challenge
  and takes the identity from the answer, never from the peer's address.

This is separate from `SandboxBackend` (containers): a backend offers its network, if it has one, as
`SandboxBackend.network`.

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


class Vouching(abc.ABC):
    """How the sandbox listener learns which sandbox a connection speaks for when its peer is a relay:
    it sends `challenge()` first, reads one line back (at most `max_line` bytes), and `identity` judges
    it. Thread-safe; `identity` never raises, whatever the bytes."""

    max_line = 512
    """The longest answer line, in bytes: a longer one closes the connection."""

    @abc.abstractmethod
    def challenge(self) -> bytes:
        """A fresh challenge line (ending in a newline) for a new connection: never the same twice."""

    @abc.abstractmethod
    def identity(self, challenge: bytes, line: bytes) -> str | None:
        """The identity (as `SandboxNetwork.address` gives it) of the sandbox that `line`, the answer to
        `challenge` on the same connection, vouches for; None refuses the connection."""


class SandboxNetwork(abc.ABC):
    """The network of ``network="gateway"`` sandboxes. Methods block and are thread-safe."""

    @abc.abstractmethod
    def address(self, sandbox_id: str) -> str | None:
        """The sandbox's identity on the network, by which the listener knows it (None when it is not
        on it): its source address, or with `vouching` what a vouch for it yields. No two live sandboxes
        share one."""

    def vouching(self) -> Vouching | None:
        """How connections to the listener say which sandbox they speak for; None: by their source
        address (see the module docstring)."""
        return None

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
