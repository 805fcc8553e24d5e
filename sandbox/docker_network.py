"""The gateway network on Docker: how a harness inside a sandbox reaches the gateway, and nothing else.

Sandboxes with ``network="gateway"`` join one Docker bridge network created with ``internal=True``:
Docker routes nothing from it to the outside world. The host keeps an address on the bridge (its
gateway address), and the Belayer gateway listens there. Without more, every service of the host
that listens on all addresses would be reachable too, so an iptables chain on the bridge's INPUT
accepts TCP to the gateway's listening ports only and resets or drops everything else:

    INPUT  -i belayer-gw0 -j BELAYER-GATEWAY
    BELAYER-GATEWAY  -d <bridge address> -p tcp --dport <port> -j ACCEPT   (one per open gateway)
                     -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
                     -p tcp -j REJECT --reject-with tcp-reset
                     -j DROP

Rules are added and removed one by one (`iptables -C` first), so several gateways can share the network.

It is the Docker side of `sandbox.network.SandboxNetwork` (`DockerSandboxBackend.network` wraps it).

Example::

    net = GatewayNetwork(docker.APIClient())
    host = net.ensure()         # the host's address on the network
    net.open(8080)              # listen on host:8080; sandboxes on net.name reach only that
    net.close(8080)
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from typing import Any

import docker
import docker.errors

from core.errors import SandboxUnavailable

CHAIN = "BELAYER-GATEWAY"


class GatewayNetwork:
    """The internal bridge network and its firewall chain. Methods are idempotent and thread-safe."""

    def __init__(
        self, api: docker.APIClient, name: str = "belayer-gateway", bridge: str = "belayer-gw0"
    ) -> None:
        self._api = api
        self.name = name
        self.bridge = bridge
        self._lock = threading.Lock()
        self._host: str | None = None

    def ensure(self) -> str:
        """Create the network if needed; return the host's address on it."""
        with self._lock:
            if self._host is None:
                self._host = self._ensure_network()
            return self._host

    def open(self, port: int) -> None:
        """Let the network's sandboxes reach `port` on the host address (and lock the rest)."""
        host = self.ensure()
        with self._lock:
            self._ensure_chain()
            accept = ["-d", host, "-p", "tcp", "--dport", str(port), "-j", "ACCEPT"]
            if not _iptables("-C", CHAIN, *accept, check=False):
                _iptables("-I", CHAIN, "1", *accept)

    def close(self, port: int) -> None:
        if self._host is None:
            return
        with self._lock:
            accept = ["-d", self._host, "-p", "tcp", "--dport", str(port), "-j", "ACCEPT"]
            while _iptables("-C", CHAIN, *accept, check=False):
                _iptables("-D", CHAIN, *accept)

    def _ensure_network(self) -> str:
        try:
            info: dict[str, Any] = self._api.inspect_network(self.name)
        except docker.errors.NotFound:
            try:
                self._api.create_network(
                    self.name,
                    driver="bridge",
                    internal=True,
                    options={"com.docker.network.bridge.name": self.bridge},
                    labels={"belayer": "gateway-network"},
                )
            except docker.errors.APIError as exc:
                if exc.status_code != 409:  # 409: another gateway created it meanwhile
                    raise
            info = self._api.inspect_network(self.name)
        if not info.get("Internal"):
            raise SandboxUnavailable(
                f"docker network {self.name!r} exists but is not internal; remove it "
                f"(docker network rm {self.name}) and Belayer recreates it"
            )
        configs = (info.get("IPAM") or {}).get("Config") or []
        host = next((c.get("Gateway") for c in configs if c.get("Gateway")), None)
        if not host:
            raise SandboxUnavailable(f"docker network {self.name!r} has no gateway address")
        return str(host)

    def _ensure_chain(self) -> None:
        if not _iptables("-n", "-L", CHAIN, check=False):
            _iptables("-N", CHAIN)
        for rule in (
            ["-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
            ["-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"],
            ["-j", "DROP"],
        ):
            if not _iptables("-C", CHAIN, *rule, check=False):
                _iptables("-A", CHAIN, *rule)
        jump = ["-i", self.bridge, "-j", CHAIN]
        if not _iptables("-C", "INPUT", *jump, check=False):
            _iptables("-I", "INPUT", "1", *jump)


def _iptables(*args: str, check: bool = True) -> bool:
    """Run iptables; with `check=False` return whether it succeeded, else raise on failure."""
    exe = shutil.which("iptables")
    if exe is None:
        raise SandboxUnavailable(
            "iptables is not installed: sandboxes with network='gateway' need it to reach only the "
            "gateway (deploy/host/setup_sandbox_host.sh install adds it)"
        )
    done = subprocess.run([exe, "-w", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0 and check:
        raise SandboxUnavailable(f"iptables {' '.join(args)} failed: {done.stderr.strip()}; run as root")
    return done.returncode == 0
