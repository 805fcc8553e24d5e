"""Sandboxes across a Ray cluster: `ClusterSandboxBackend` (the face, `backend`) over the node registry
and its prober (`nodes`), placement with reservations (`placement`), images on every node (`images`) and
the relays of the gateway network (`network`, `relay`), and the `SandboxAgent` actor it runs on each node
(`agent`). Ray is imported only when a `ClusterSandboxBackend` is built."""

from sandbox.cluster.backend import ClusterSandboxBackend
from sandbox.cluster.config import SLOTS, ClusterConfig

__all__ = ["SLOTS", "ClusterConfig", "ClusterSandboxBackend"]
