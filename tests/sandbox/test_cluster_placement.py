"""Placement on the cluster's nodes (`sandbox.cluster.placement`) without Ray: the registry's node records
set by hand, as the prober would leave them."""

from __future__ import annotations

from typing import Any

import pytest

from core.errors import NoSandboxSlot, SandboxError, SandboxNotFound
from core.liveness import Liveness
from sandbox.backend import Sandbox, SandboxSpec
from sandbox.cluster.config import ClusterConfig
from sandbox.cluster.nodes import Node, NodeRegistry
from sandbox.cluster.placement import Placement
from sandbox.config import DockerBackendConfig

SPEC = SandboxSpec(image="belayer-sandbox-busybox", labels={"belayer.store": "s1", "belayer.session": "x"})


class _Ray:
    """What the registry asks of Ray when it is built: the agent's actor class."""

    @staticmethod
    def remote(cls: type) -> Any:
        return cls


def _placement(*nodes: Node) -> tuple[NodeRegistry, Placement]:
    registry = NodeRegistry(ClusterConfig(address="auto"), DockerBackendConfig(), _Ray(), host="10.0.0.1")
    registry.nodes = {n.ip: n for n in nodes}
    return registry, Placement(registry)


def _node(ip: str, slots: int, state: Liveness = Liveness.ALIVE, boxes: int = 0) -> Node:
    return Node(ip, f"ray-{ip}", slots, state=state, boxes={f"{ip}-{i}" for i in range(boxes)})


def test_a_new_sandbox_goes_to_the_most_free_slots_then_the_fewest_sandboxes_then_the_lowest_address() -> (
    None
):
    registry, placement = _placement(
        _node("10.0.0.4", 4, boxes=1), _node("10.0.0.3", 4, boxes=1), _node("10.0.0.2", 8, Liveness.LOST)
    )
    first = placement.reserve()
    assert (first.ip, first.reserved, first.free) == ("10.0.0.3", 1, 2)
    second = placement.reserve()  # the reservation counts: 10.0.0.4 has more free slots now
    assert (second.ip, second.free) == ("10.0.0.4", 2)
    box = placement.placing(first, SPEC, lambda: Sandbox("sbx-1", SPEC))
    assert (placement.node_of("sbx-1"), first.reserved, first.boxes) == (
        "10.0.0.3",
        0,
        {"10.0.0.3-0", "sbx-1"},
    )
    assert box.id == "sbx-1" and registry.owners == {"belayer.store": "s1"}  # the owner labels only


def test_a_failed_create_gives_its_slot_back_and_places_nothing() -> None:
    _, placement = _placement(_node("10.0.0.3", 1))
    node = placement.reserve()

    def fail() -> Sandbox:
        raise SandboxError("no such image")

    with pytest.raises(SandboxError):
        placement.placing(node, SPEC, fail)
    assert (node.reserved, node.free, node.boxes) == (0, 1, set())


def test_with_every_slot_taken_the_refusal_names_each_node_and_how_to_add_slots() -> None:
    full = _node("10.0.0.3", 1, boxes=1)
    refused = _node("10.0.0.4", 4, Liveness.REFUSED)
    refused.reason = "no CRIU on this node"
    _, placement = _placement(full, refused)
    with pytest.raises(NoSandboxSlot) as none:
        placement.reserve()
    assert str(none.value) == (
        "no node of the Ray cluster has a free sandbox slot (10.0.0.3 alive; 10.0.0.4 refused: no CRIU on "
        "this node): start nodes with --resources '{\"belayer_sandbox_slots\": N}' and Docker + CRIU"
    )


def test_a_sandbox_released_while_its_node_is_lost_is_removed_when_the_node_answers_again() -> None:
    registry, placement = _placement(_node("10.0.0.3", 4))
    node = placement.reserve()
    placement.placing(node, SPEC, lambda: Sandbox("sbx-1", SPEC))
    registry.lose(node, "its Ray node left the cluster")
    assert (node.state, node.lost, node.boxes, registry.node_losses) == (Liveness.LOST, {"sbx-1"}, set(), 1)
    assert placement.release("sbx-1") is None  # nothing to call now
    assert (node.lost, node.gone, placement.node_of("sbx-1")) == (set(), {"sbx-1"}, None)
    with pytest.raises(SandboxNotFound):
        placement.node("sbx-1")
    assert placement.release("sbx-1") is None  # unknown: nothing to do


def test_a_sandbox_released_on_a_node_alive_is_destroyed_there() -> None:
    _, placement = _placement(_node("10.0.0.3", 4))
    node = placement.reserve()
    placement.placing(node, SPEC, lambda: Sandbox("sbx-1", SPEC))
    assert placement.release("sbx-1") is node
    assert (node.boxes, node.gone, node.free) == (set(), set(), 4)
