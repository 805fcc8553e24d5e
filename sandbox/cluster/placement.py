"""`Placement`: which node holds each sandbox, and where a new one goes, its slot reserved until it is there.

A new sandbox goes to the node alive with the most free slots (slots less the sandboxes the backend
holds there and the slots reserved for creates and restores in progress), then the fewest sandboxes,
then the lowest address; a restore, the same way, among the nodes alive now. A slot is reserved when
the node is chosen (`reserve`) and the reservation ends when the sandbox is there (`placing`), or its
call failed. A sandbox given up while its node is lost is remembered there (`Node.gone`) and its
container removed once the node answers again (`sandbox.cluster.nodes`).

It keeps its records in the registry's nodes, under the registry's lock.

Example::

    placement = Placement(registry)
    node = placement.reserve()                                 # NoSandboxSlot when every node is full
    box = placement.placing(node, spec, lambda: registry.call(node, "call", "create", spec))
    placement.node_of(box.id)                                  # '127.0.0.3'
"""

from __future__ import annotations

from collections.abc import Callable

from core.errors import NoSandboxSlot, SandboxNotFound
from core.liveness import Liveness
from sandbox.backend import Sandbox, SandboxSpec
from sandbox.cluster.config import SLOTS
from sandbox.cluster.nodes import OWNER_LABELS, Node, NodeRegistry


class Placement:
    """Sandboxes to nodes (module docstring). Thread-safe."""

    def __init__(self, registry: NodeRegistry) -> None:
        self._registry = registry
        self._lock = registry.lock
        self._where: dict[str, str] = {}  # sandbox id -> node address

    def node_of(self, sandbox_id: str) -> str | None:
        """The address of the node that holds `sandbox_id` (None when none does)."""
        with self._lock:
            return self._where.get(sandbox_id)

    def node(self, sandbox_id: str) -> Node:
        """The node that holds `sandbox_id`; `SandboxNotFound` when none does."""
        with self._lock:
            ip = self._where.get(sandbox_id)
            if ip is None:
                raise SandboxNotFound(f"no sandbox {sandbox_id} on this cluster")
            return self._registry.nodes[ip]

    def reserve(self) -> Node:
        """The node for a new sandbox, its slot reserved (`placing` ends the reservation)."""
        with self._lock:
            nodes = self._registry.nodes.values()
            alive = [n for n in nodes if n.state == Liveness.ALIVE and n.free > 0]
            if not alive:
                known = "; ".join(f"{n.ip} {n.state}{': ' + n.reason if n.reason else ''}" for n in nodes)
                raise NoSandboxSlot(
                    "no node of the Ray cluster has a free sandbox slot "
                    f"({known or 'no node declares ' + SLOTS}): start nodes with "
                    f"--resources '{{\"{SLOTS}\": N}}' and Docker + CRIU"
                )
            node = min(alive, key=lambda n: (-n.free, len(n.boxes), n.ip))
            node.reserved += 1
            return node

    def placing(self, node: Node, spec: SandboxSpec, ask: Callable[[], Sandbox]) -> Sandbox:
        """`ask()` for the sandbox of `spec` on `node`, whose slot `reserve` reserved: the reservation
        ends, and the sandbox is placed there, when it answers (only the reservation, when it fails)."""
        with self._lock:
            self._registry.owners.update({k: v for k, v in spec.labels.items() if k in OWNER_LABELS})
        try:
            box = ask()
        except BaseException:
            with self._lock:
                node.reserved -= 1
            raise
        return self.placed(node, box, reserved=True)

    def placed(self, node: Node, box: Sandbox, *, reserved: bool = False) -> Sandbox:
        """`box` is on `node` (a sandbox found there, or made in a slot `reserved` for it)."""
        with self._lock:
            node.reserved -= reserved
            node.boxes.add(box.id)
            self._where[box.id] = node.ip
        return box

    def release(self, sandbox_id: str) -> Node | None:
        """Forget `sandbox_id`: the node whose container to remove now, None when there is none to
        remove now (unknown, or its node is not alive: removed when the node answers again)."""
        try:
            node = self.node(sandbox_id)
        except SandboxNotFound:
            return None
        with self._lock:
            node.boxes.discard(sandbox_id)
            self._where.pop(sandbox_id, None)
            if node.state != Liveness.ALIVE or sandbox_id in node.lost:
                node.lost.discard(sandbox_id)
                node.gone.add(sandbox_id)  # its container is removed once the node answers
                if node.state != Liveness.ALIVE:
                    return None
        return node
