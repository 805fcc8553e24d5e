"""The gateway network on a real Docker engine: sandboxes reach the gateway's port, and not each other.

Each test has its own network and bridge (other tests on this engine use the default one).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
from collections.abc import Iterator

import docker.errors
import pytest

from core.errors import SandboxUnavailable
from sandbox.backend import Sandbox, SandboxSpec
from sandbox.config import DockerBackendConfig
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.docker_backend.network import CHAIN, ICC, LABELS

pytestmark = pytest.mark.docker


@pytest.fixture
def own_network(docker_engine: None, docker_config: DockerBackendConfig) -> Iterator[DockerSandboxBackend]:
    """A backend whose gateway network is this test's own; removed after it, with its firewall jump."""
    name, bridge = f"belayer-test-{os.getpid()}", f"blt{os.getpid()}"[:15]
    config = docker_config.model_copy(update={"gateway_network": name, "gateway_bridge": bridge})
    with DockerSandboxBackend(config) as backend:
        yield backend
        with contextlib.suppress(docker.errors.APIError):
            backend._api.remove_network(name)
    subprocess.run(
        ["iptables", "-w", "-D", "INPUT", "-i", bridge, "-j", CHAIN], capture_output=True, check=False
    )


@pytest.fixture
def gateway_port(own_network: DockerSandboxBackend) -> Iterator[int]:
    """A stand-in for the gateway's listener on the host's address on the network: says "gateway"."""
    server = socket.create_server((own_network.network.gateway_address(), 0))
    port = server.getsockname()[1]
    own_network.network.open_gateway(port)

    def answer() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                with conn:
                    conn.sendall(b"gateway\n")

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    yield port
    own_network.network.close_gateway(port)
    server.shutdown(socket.SHUT_RDWR)
    server.close()
    thread.join(5)


def test_sandboxes_reach_the_gateway_but_not_each_other(
    own_network: DockerSandboxBackend, gateway_port: int, busybox_image: str, make_sandbox: list[Sandbox]
) -> None:
    backend = own_network
    a, b = (backend.create(SandboxSpec(image=busybox_image, network="gateway")) for _ in range(2))
    make_sandbox.extend([a, b])
    host = backend.network.gateway_address()
    b_address = backend.network.address(b.id)
    assert b_address is not None
    listen = (
        "nc -ll -p 7000 -e echo b </dev/null >/dev/null 2>&1 & "
        "for i in $(seq 100); do netstat -ltn | grep -q ':7000 ' && exit 0; sleep 0.05; done; exit 1"
    )
    assert backend.exec(b.id, listen).exit_code == 0
    assert backend.exec(b.id, f"nc -w 3 {b_address} 7000 </dev/null").stdout == "b\n"  # b's port is up

    reach_b = backend.exec(a.id, f"nc -w 2 {b_address} 7000 </dev/null; echo exit=$?")
    assert "b\n" not in reach_b.stdout and "exit=0" not in reach_b.stdout, reach_b  # a cannot reach b
    for box in (a, b):  # and both reach the gateway
        assert backend.exec(box.id, f"nc -w 3 {host} {gateway_port} </dev/null").stdout == "gateway\n"
    info = backend._api.inspect_network(backend._config.gateway_network)
    assert (info["Internal"], info["Options"].get(ICC)) == (True, "false")


def test_an_older_network_with_inter_container_traffic_is_replaced_when_empty_else_refused(
    own_network: DockerSandboxBackend, busybox_image: str, make_sandbox: list[Sandbox]
) -> None:
    """A network of the name made by an older Belayer (inter-container traffic on) is created again while
    no container is on it, and refused, with what to do, while one is."""
    api, name = own_network._api, own_network._config.gateway_network
    api.create_network(name, driver="bridge", internal=True, labels=LABELS)
    holder = api.create_container(
        busybox_image, "sleep 600", host_config=api.create_host_config(network_mode=name)
    )
    try:
        api.start(holder)  # a network lists only the containers that run on it
        with pytest.raises(
            SandboxUnavailable, match=rf"lets containers reach each other .*docker network rm {name}"
        ):
            own_network.network.gateway_address()
    finally:
        api.remove_container(holder, force=True)
    own_network.network.gateway_address()
    assert api.inspect_network(name)["Options"][ICC] == "false"
