"""The gateway network on Docker: how a harness inside a sandbox reaches the gateway, and nothing else.

Sandboxes with ``network="gateway"`` join one Docker bridge network created with ``internal=True``:
Docker routes nothing from it to the outside world. It is created with inter-container communication
off (``com.docker.network.bridge.enable_icc=false``): a sandbox cannot reach another's ports, nor
answer as another (the gateway tells sandboxes apart by their source address). A network of that name
that lacks either is replaced when it is Belayer's (its label) and no container is on it, and refused
otherwise, with the command that removes it. An engine whose DNS server could carry lookups out of the
network (CVE-2024-29018, `sandbox.engine_check`) is refused before the network is made. The host keeps an address on the bridge (its
gateway address), and the Belayer gateway listens there. Without more, every service of the host
that listens on all addresses would be reachable too, so an iptables chain on the bridge's INPUT
accepts TCP to the gateway's listening ports only and resets or drops everything else:

    INPUT  -i belayer-gw0 -j BELAYER-GATEWAY
    BELAYER-GATEWAY  -i belayer-gw0 -d <bridge address> -p tcp --dport <port> -j ACCEPT   (one per gateway)
                     -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
                     -p tcp -j REJECT --reject-with tcp-reset
                     -j DROP

Rules are added and removed one by one (`iptables -C` first), so several gateways can share the network.

IPv6. The chain is IPv4's; a sandbox's IPv6 is turned off instead (``net.ipv6.conf.all.disable_ipv6=1``
in every sandbox's sysctls, `sandbox.docker_backend.containers`), so that no link-local address reaches
the host's services past it, and a network with IPv6 on (``EnableIPv6``) is unfit, as one that is not
internal is.

``network="full"`` on a cluster node (`fence_full_network`, when the operator allows such sandboxes on a
cluster): they are on Docker's default bridge, with a way out, so that what stops them from reaching the
cluster's own unauthenticated services (Ray's ports, the engines) is a chain that drops their packets to
every node's address and to the bridge's own, on the way into the node and on the way through it:

    INPUT    -i docker0 -j BELAYER-FULL
    FORWARD  -i docker0 -j BELAYER-FULL
    BELAYER-FULL  -i docker0 -d <address> -j DROP   (one per cluster node, and the bridge's address)

`DockerNetwork` is the Docker side of `sandbox.network.SandboxNetwork` (`DockerSandboxBackend.network`):
it wraps `GatewayNetwork` and translates its Docker errors.

Example::

    net = GatewayNetwork(docker.APIClient())
    host = net.ensure()         # the host's address on the network
    net.open(8080)              # listen on host:8080; sandboxes on net.name reach only that
    net.close(8080)
"""

from __future__ import annotations

import ipaddress
import shutil
import subprocess
import threading
from collections.abc import Iterable
from typing import Any

import docker
import docker.errors

from core.errors import SandboxUnavailable
from sandbox import engine_check
from sandbox.docker_backend.engine import docker_errors
from sandbox.network import SandboxNetwork

CHAIN = "BELAYER-GATEWAY"
FULL_CHAIN = "BELAYER-FULL"
GATEWAY_HOST = "belayer-gateway"
"""The name by which a sandbox on the network reaches the host's address on it (its ``/etc/hosts``)."""
ICC = "com.docker.network.bridge.enable_icc"
LABELS = {"belayer": "gateway-network"}


class DockerNetwork(SandboxNetwork):
    """`SandboxNetwork` on Docker: the internal bridge and firewall chain of `GatewayNetwork`."""

    def __init__(self, api: docker.APIClient, name: str, bridge: str) -> None:
        self._api = api
        self._name = name
        self._gateway = GatewayNetwork(api, name, bridge)

    def address(self, sandbox_id: str) -> str | None:
        with docker_errors():
            networks = self._api.inspect_container(sandbox_id)["NetworkSettings"].get("Networks") or {}
        ip = (networks.get(self._name) or {}).get("IPAddress")
        return str(ip) if ip else None

    def gateway_address(self) -> str:
        with docker_errors(SandboxUnavailable):
            return self.ensure()

    def ensure(self) -> str:
        """Create the network if needed (Docker errors propagate untranslated); the host's address."""
        return self._gateway.ensure()

    def open_gateway(self, port: int) -> None:
        with docker_errors(SandboxUnavailable):
            self._gateway.open(port)

    def close_gateway(self, port: int) -> None:
        with docker_errors(SandboxUnavailable):
            self._gateway.close(port)


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
            accept = accept_rule(self.bridge, host, port)
            if not _iptables("-C", CHAIN, *accept, check=False):
                _iptables("-I", CHAIN, "1", *accept)

    def close(self, port: int) -> None:
        if self._host is None:
            return
        with self._lock:
            # and the rule as an older Belayer wrote it, without the bridge
            for accept in (accept_rule(self.bridge, self._host, port), accept_rule(None, self._host, port)):
                while _iptables("-C", CHAIN, *accept, check=False):
                    _iptables("-D", CHAIN, *accept)

    def _ensure_network(self) -> str:
        engine_check.check_engine(self._api)  # an engine that leaks DNS out of the network is refused
        info = self._inspect_or_create()
        unfit = _unfit(info)
        if unfit is not None:
            info = self._replace(info, unfit)
        configs = (info.get("IPAM") or {}).get("Config") or []
        host = next((c.get("Gateway") for c in configs if c.get("Gateway")), None)
        if not host:
            raise SandboxUnavailable(f"docker network {self.name!r} has no gateway address")
        return str(host)

    def _inspect_or_create(self) -> dict[str, Any]:
        try:
            info: dict[str, Any] = self._api.inspect_network(self.name)
            return info
        except docker.errors.NotFound:
            pass
        try:
            self._api.create_network(
                self.name,
                driver="bridge",
                internal=True,
                options={"com.docker.network.bridge.name": self.bridge, ICC: "false"},
                labels=LABELS,
            )
        except docker.errors.APIError as exc:
            if exc.status_code != 409:  # 409: another gateway created it meanwhile
                raise
        info = self._api.inspect_network(self.name)
        return info

    def _replace(self, info: dict[str, Any], unfit: str) -> dict[str, Any]:
        """A network made before it had to be as it is now (`unfit` says how it differs): created again
        when it is Belayer's and empty, else refused (removing it would cut its containers off)."""
        remove = (
            f"remove it (docker network rm {self.name}) once no sandbox is on it, and Belayer recreates it"
        )
        if (info.get("Labels") or {}).get("belayer") != LABELS["belayer"]:
            raise SandboxUnavailable(
                f"docker network {self.name!r} exists but {unfit}, and is not Belayer's; {remove}"
            )
        if info.get("Containers"):
            raise SandboxUnavailable(
                f"docker network {self.name!r} {unfit} (an older Belayer made it) and {len(info['Containers'])} "
                f"container(s) are on it; {remove}"
            )
        try:
            self._api.remove_network(self.name)
        except docker.errors.NotFound:
            pass  # another gateway replaced it meanwhile
        except docker.errors.APIError as exc:  # a container joined meanwhile
            raise SandboxUnavailable(
                f"docker network {self.name!r} {unfit} and cannot be replaced ({exc}); {remove}"
            ) from exc
        info = self._inspect_or_create()
        still = _unfit(info)
        if still is not None:
            raise SandboxUnavailable(f"docker network {self.name!r} {still} even when created again")
        return info

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


def accept_rule(bridge: str | None, host: str, port: int) -> list[str]:
    """The rule that lets a gateway network's sandboxes reach `port` on the host's `host` address, and
    only from the network's `bridge` (None: as Belayer wrote it before it named the bridge).

    >>> " ".join(accept_rule("belayer-gw0", "172.30.0.1", 8080))
    '-i belayer-gw0 -d 172.30.0.1 -p tcp --dport 8080 -j ACCEPT'
    """
    via = ["-i", bridge] if bridge else []
    return [*via, "-d", host, "-p", "tcp", "--dport", str(port), "-j", "ACCEPT"]


def full_network_rules(bridge: str, addresses: Iterable[str]) -> list[list[str]]:
    """The rules of `FULL_CHAIN` for the bridge of ``network="full"`` sandboxes: their packets to each of
    `addresses` (the cluster's nodes, the bridge's own address) dropped.

    >>> [" ".join(r) for r in full_network_rules("docker0", ["10.0.0.2", "172.17.0.1", "10.0.0.2"])]
    ['-i docker0 -d 10.0.0.2 -j DROP', '-i docker0 -d 172.17.0.1 -j DROP']
    """
    ipv4 = {a for a in addresses if _is_ipv4(a)}  # a sandbox has no IPv6 (module docstring)
    return [["-i", bridge, "-d", address, "-j", "DROP"] for address in sorted(ipv4)]


def _is_ipv4(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).version == 4
    except ValueError:
        return False


def fence_full_network(bridge: str, addresses: Iterable[str]) -> list[str]:
    """Make `FULL_CHAIN` hold exactly `full_network_rules` (new rules first, stale ones removed after,
    so the fence never opens), jumped to from INPUT and FORWARD for packets from `bridge`. Returns the
    addresses fenced off. Raises `SandboxUnavailable` when iptables is missing or refuses (not root)."""
    wanted = full_network_rules(bridge, addresses)
    if not _iptables("-n", "-L", FULL_CHAIN, check=False):
        _iptables("-N", FULL_CHAIN)
    for rule in wanted:
        if not _iptables("-C", FULL_CHAIN, *rule, check=False):
            _iptables("-A", FULL_CHAIN, *rule)
    keep = {(r[1], r[3]) for r in wanted}
    for rule in _rules(FULL_CHAIN):  # as iptables prints them: -d 10.0.0.2/32 -i docker0 -j DROP
        spec = dict(zip(rule[::2], rule[1::2], strict=False))
        if (spec.get("-i"), spec.get("-d", "").removesuffix("/32")) not in keep:
            _iptables("-D", FULL_CHAIN, *rule)
    for hook in ("INPUT", "FORWARD"):
        jump = ["-i", bridge, "-j", FULL_CHAIN]
        if not _iptables("-C", hook, *jump, check=False):
            _iptables("-I", hook, "1", *jump)
    return [rule[3] for rule in wanted]


def _rules(chain: str) -> list[list[str]]:
    """The rules of `chain`, each as the arguments that follow ``-A <chain>`` in ``iptables -S``."""
    exe = shutil.which("iptables") or "iptables"
    done = subprocess.run([exe, "-w", "-S", chain], capture_output=True, text=True, check=False)
    prefix = f"-A {chain} "
    return [line[len(prefix) :].split() for line in done.stdout.splitlines() if line.startswith(prefix)]


def _unfit(info: dict[str, Any]) -> str | None:
    """How an existing network differs from what sandboxes need (None: it does not)."""
    if not info.get("Internal"):
        return "is not internal (it routes to the outside world)"
    if info.get("EnableIPv6"):  # the firewall chain is IPv4's
        return "has IPv6 on (the gateway network's firewall is IPv4's)"
    if (info.get("Options") or {}).get(ICC) != "false":
        return "lets containers reach each other (inter-container communication is on)"
    return None


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
