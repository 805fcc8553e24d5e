"""`ClusterNetwork`: the gateway network of sandboxes on a Ray cluster, as `sandbox.network.SandboxNetwork`.

It is the gateway's side of `sandbox.cluster.relay`. The listener binds a loopback address here
(`gateway_address`). `open_gateway` starts the `Demux` on the gateway's address on the cluster, and a
`Relay` on every node. Each sandbox's `address` is a loopback address of its own (127.77.x.y): the one
the demux connects to the listener from, once the relay has vouched for the sandbox. Sandboxes reach the
gateway at `sandbox_url`, which is the same on every node.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable

from core.errors import SandboxUnavailable
from sandbox.cluster.relay import GATEWAY_HOST, Demux
from sandbox.network import SandboxNetwork

ALIASES = 250 * 250


class ClusterNetwork(SandboxNetwork):
    """See the module docstring. `relays` starts (with the demux's address and the secret) or, given None,
    stops the node relays."""

    def __init__(self, host: str, relay_port: int, relays: Callable[[tuple[str, int] | None, bytes], None]) -> None:
        self.host, self.relay_port, self._relays = host, relay_port, relays
        self.secret = secrets.token_bytes(32)
        self._lock = threading.Lock()
        self._aliases: dict[str, str] = {}
        self._next = 0
        self._demux: Demux | None = None

    def address(self, sandbox_id: str) -> str:
        with self._lock:
            if sandbox_id not in self._aliases:
                n, self._next = self._next % ALIASES, self._next + 1
                self._aliases[sandbox_id] = f"127.77.{n // 250}.{n % 250 + 1}"
            return self._aliases[sandbox_id]

    def forget(self, sandbox_id: str) -> None:
        with self._lock:
            self._aliases.pop(sandbox_id, None)

    def alias_of(self, sandbox_id: str) -> str | None:
        with self._lock:
            return self._aliases.get(sandbox_id)

    def gateway_address(self) -> str:
        return "127.0.0.1"

    def sandbox_url(self, host: str, port: int) -> str:
        return f"http://{GATEWAY_HOST}:{self.relay_port}"

    def open_gateway(self, port: int) -> None:
        if self._demux is not None:
            return
        try:
            self._demux = Demux(self.host, (self.gateway_address(), port), self.secret, self.alias_of)
        except OSError as exc:
            raise SandboxUnavailable(f"cannot listen for the sandbox relays on {self.host}: {exc}") from exc
        self._relays(self._demux.address, self.secret)

    def close_gateway(self, port: int) -> None:
        if self._demux is None:
            return
        self._relays(None, self.secret)
        demux, self._demux = self._demux, None
        demux.stop()
