"""What a sandbox on a cluster node reaches (issue 31, finding 8 and the firewall's Low items): no
``network="full"`` sandbox on a cluster unless the operator allows it by name, and then a firewall that
drops its packets to every cluster address; the gateway network's ACCEPT rules name their bridge; IPv6
off in every sandbox; no task setup capability beyond Docker's defaults unless the operator allows it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from belayer.cli import parser
from core.errors import SandboxArgumentError, TaskError
from gateway.config import GatewayConfig
from sandbox.backend import SandboxSpec
from sandbox.cluster import ClusterConfig, ClusterSandboxBackend
from sandbox.config import SandboxConfig
from sandbox.docker_backend.containers import NO_IPV6
from sandbox.docker_backend.network import _unfit, accept_rule, full_network_rules
from sandbox.task_images import TaskImage, ensure_task_image

FLAG = "--sandbox-allow-full-network-on-cluster"


def _unconnected(allow: bool) -> ClusterSandboxBackend:
    """The cluster backend's refusals come before it asks Ray or any node: one built without a cluster."""
    backend = object.__new__(ClusterSandboxBackend)
    backend.config = ClusterConfig(address="127.0.0.2:6379", allow_full_network=allow)
    return backend


def test_a_full_network_sandbox_on_a_cluster_is_refused_with_the_flag_to_allow_it() -> None:
    backend = _unconnected(allow=False)
    with pytest.raises(SandboxArgumentError) as refused:
        backend.create(SandboxSpec(image="belayer-sandbox-busybox", network="full"))
    assert str(refused.value).startswith("a network='full' sandbox is refused on a Ray cluster")
    assert FLAG in str(refused.value)
    with pytest.raises(SandboxArgumentError) as setup:
        backend.build_image("belayer-task:t-0", "base", b"", ":", network=True, cap_add=())
    assert str(setup.value).startswith(
        "a task's setup with network (setup_network) is refused on a Ray cluster"
    )


def test_the_operator_allows_full_network_sandboxes_on_a_cluster_by_name(tmp_path: Path) -> None:
    args = parser().parse_args(["serve", "--model", str(tmp_path), FLAG])
    assert getattr(args, "sandbox.allow_full_network_on_cluster") is True
    assert GatewayConfig(model="m").sandbox.allow_full_network_on_cluster is False
    allowed = GatewayConfig(model="m", sandbox=SandboxConfig(allow_full_network_on_cluster=True))
    assert allowed.sandbox.allow_full_network_on_cluster is True


def test_full_network_sandboxes_are_fenced_off_every_cluster_address() -> None:
    rules = full_network_rules("docker0", ["10.0.0.3", "10.0.0.2", "172.17.0.1", "fe80::1", "10.0.0.2"])
    assert rules == [
        ["-i", "docker0", "-d", "10.0.0.2", "-j", "DROP"],
        ["-i", "docker0", "-d", "10.0.0.3", "-j", "DROP"],
        ["-i", "docker0", "-d", "172.17.0.1", "-j", "DROP"],
    ]  # IPv6 is off in sandboxes (NO_IPV6): iptables (IPv4) would refuse an IPv6 address


def test_the_gateway_networks_accept_rules_name_the_bridge() -> None:
    assert accept_rule("belayer-gw0", "172.30.0.1", 8080) == [
        "-i", "belayer-gw0", "-d", "172.30.0.1", "-p", "tcp", "--dport", "8080", "-j", "ACCEPT",
    ]  # fmt: skip


def test_sandboxes_have_no_ipv6_and_a_gateway_network_with_ipv6_is_unfit() -> None:
    assert NO_IPV6 == {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"}
    fit = {"Internal": True, "Options": {"com.docker.network.bridge.enable_icc": "false"}}
    assert _unfit(fit) is None
    assert _unfit({**fit, "EnableIPv6": True}) == "has IPv6 on (the gateway network's firewall is IPv4's)"


class _Store:
    """A task image store that records what it was asked to build."""

    def __init__(self) -> None:
        self.built: list[dict[str, Any]] = []

    def has_image(self, name: str) -> bool:
        return False

    def image_id(self, name: str) -> str:
        return "sha256:0"

    def build_image(self, name: str, base: str, tar: bytes, script: str, **kwargs: Any) -> str:
        self.built.append({"name": name, **kwargs})
        return ""

    def images(self, label: str) -> list[dict[str, Any]]:
        return []

    def remove_image(self, name: str) -> bool:
        return True


@pytest.mark.parametrize("cap", ["SYS_ADMIN", "SYS_PTRACE", "NET_ADMIN", "ALL", "cap_sys_module"])
def test_a_task_cannot_grant_its_setup_a_capability_the_operator_did_not_allow(cap: str) -> None:
    store = _Store()
    with pytest.raises(TaskError) as refused:
        ensure_task_image(store, "t", "base", [], ["true"], setup_cap_add=(cap, "CHOWN"))
    name = cap.upper().removeprefix("CAP_")
    assert str(refused.value) == (
        f"task t asks for capability {name} during setup (setup_cap_add), which reaches past its container; "
        f"allow it with belayer task build --allow-setup-cap {name} (or run-episode's), or drop it from task.json"
    )
    assert store.built == []  # refused before anything ran
    image = ensure_task_image(
        store, "t", "base", [], ["true"], setup_cap_add=(cap, "CHOWN"), allow_caps=[cap]
    )
    assert isinstance(image, TaskImage) and store.built[0]["cap_add"] == (cap, "CHOWN")


def test_docker_default_capabilities_need_no_allowance() -> None:
    store = _Store()
    ensure_task_image(store, "t", "base", [], ["true"], setup_cap_add=("CHOWN", "SETUID", "DAC_OVERRIDE"))
    assert store.built[0]["cap_add"] == ("CHOWN", "SETUID", "DAC_OVERRIDE")
