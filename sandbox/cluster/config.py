"""`ClusterConfig`: where the Ray cluster is and how its nodes are watched (the gateway's
``[sandbox.cluster]`` table), and `SLOTS`, the Ray resource by which a node offers sandboxes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

SLOTS = "belayer_sandbox_slots"
"""The Ray resource by which a node offers sandboxes (how many it holds)."""


class ClusterConfig(BaseModel):
    """Where the cluster is and how its nodes are watched (the gateway's ``[sandbox.cluster]`` table)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    address: str = Field(description="the Ray cluster: auto, or the head's HOST:PORT")
    node_ip: str | None = Field(
        default=None, description="this machine's Ray node address, if Ray would guess it wrong"
    )
    namespace: str = Field(default="belayer", min_length=1, description="the Ray namespace of the agents")
    docker_urls: dict[str, str] = Field(
        default_factory=dict,
        description="a node's Docker engine address, by the node's address (default: the node's own socket)",
    )
    relay_port: int = Field(
        default=7199, ge=1, le=65535,
        description="the port of each node's relay for network=gateway sandboxes (the same on every node)",
    )  # fmt: skip
    probe_interval_s: float = Field(
        default=1.0, gt=0, description="how often the nodes are listed and pinged"
    )
    node_timeout_s: float = Field(
        default=3.0, gt=0, description="a node whose engine does not answer this long is lost"
    )
    agent_concurrency: int = Field(default=64, ge=1, description="calls one node's agent runs at once")
    allow_full_network: bool = Field(
        default=False,
        description="allow network=full sandboxes (and task setup with network); each node's firewall then "
        "drops their packets to every cluster node's address (`fence_full_network`)",
    )
    relay_connections_each: int = Field(
        default=32, ge=1, description="connections one sandbox may hold through its node's relay at once"
    )
    relay_max_connections: int = Field(
        default=1024, ge=1, description="connections one node's relay holds at once, all its sandboxes together",
    )  # fmt: skip
