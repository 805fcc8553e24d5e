"""Sandboxes across a Ray cluster: `ClusterSandboxBackend` (placement, node loss) and the `SandboxAgent` actor
it runs on each node. Ray is imported only when a `ClusterSandboxBackend` is built."""

from sandbox.cluster.backend import SLOTS, ClusterConfig, ClusterSandboxBackend

__all__ = ["SLOTS", "ClusterConfig", "ClusterSandboxBackend"]
