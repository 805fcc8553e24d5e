"""Sandbox configuration, in one place: what the gateway's ``[sandbox]`` section sets (`SandboxConfig`, with
the checkpoint policy's knobs, `PolicySettings`) and what the Docker backend needs (`DockerBackendConfig`).

`backend_for` (in `sandbox.backends`) builds the backend a `SandboxConfig` describes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Mode = Literal["adaptive", "always", "never"]


class PolicySettings(BaseModel):
    """The policy's knobs and its priors (used until there is something observed)."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    mode: Mode = "adaptive"
    """`always`: every bubble; `never`: no automatic checkpoints (explicit ones still work)."""
    margin: float = Field(default=1.2, gt=0)
    """Checkpoint when the predicted bubble is at least `margin` times the predicted cost."""
    max_deferred_turns: int = Field(default=4, ge=0)
    """Turns a sandbox may go without a checkpoint before one is forced."""
    alpha: float = Field(default=0.3, gt=0, le=1)
    """Weight of the newest observation in every moving average."""
    prior_prefill_tps: float = Field(default=4000.0, gt=0)
    prior_decode_tps: float = Field(default=50.0, gt=0)
    prior_output_tokens: float = Field(default=64.0, gt=0)
    prior_fixed_cost_s: float = Field(default=0.3, ge=0)
    prior_dump_bps: float = Field(default=200e6, gt=0)


class SandboxConfig(BaseModel):
    """Per-session Docker sandboxes with checkpoints in inference bubbles (off unless ``enabled``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=False, description="per-session Docker sandboxes with checkpoints (needs Docker + CRIU)"
    )
    docker_url: str | None = Field(default=None, description="engine address; None reads DOCKER_HOST")
    checkpoint_dir: str = Field(
        default="/var/lib/belayer/checkpoints", description="where sandbox checkpoints go"
    )
    policy: PolicySettings = Field(default_factory=PolicySettings)
    keep_checkpoints: int = Field(default=3, ge=1, description="checkpoints kept per session (retention)")
    exec_grace_s: float = Field(
        default=15.0, gt=0, description="a tool call unanswered timeout_s + this long has hung the sandbox"
    )
    auto_restore: bool = Field(default=True, description="restore the newest checkpoint on a failure")
    watch_interval_s: float = Field(
        default=0.5, gt=0, description="how often idle sandboxes are checked for a stopped container"
    )
    exec_threads: int = Field(
        default=128,
        ge=1,
        description="threads for tool-call execs (one per exec in flight, as long as it runs)",
    )
    op_threads: int = Field(
        default=16,
        ge=1,
        description="threads for short sandbox operations (checkpoint, restore, files, status)",
    )
    sandbox_port: int | None = Field(
        default=0,
        ge=0,
        le=65535,
        description=(
            "port of the listener that network=gateway sandboxes reach (on the sandbox network's host "
            "address; it serves only each sandbox's own session); 0: any free port, -1: none"
        ),
    )

    standby: bool = Field(
        default=False,
        description="keep a standby of each sandbox: its newest checkpoint restored ahead of time, in an "
        "inference bubble, and frozen (docker pause), so that a recovery unfreezes it instead of restoring "
        "from disk. Costs a second copy of each sandbox's memory (frozen, still resident) and a restore's "
        "CPU per checkpoint; only for network=none sandboxes, and only where the backend can (local Docker)",
    )
    keep_on_shutdown: bool = Field(
        default=False,
        description="leave the sandboxes and their checkpoints as they are when the gateway shuts down: "
        "the next gateway on the same store adopts them (off: they are removed)",
    )
    max_workspace_bytes: int = Field(
        default=1 << 30,
        ge=1,
        description="the verify stage copies at most this much of a sandbox's working directory (its tar); "
        "a larger one is not verified (reason workspace_too_large, reward 0)",
    )
    max_read_bytes: int = Field(
        default=16 << 20,
        ge=1,
        description="the largest file the sandbox file API reads (the gateway holds it whole to answer); "
        "a larger one is refused with a 413 (file_too_large), told by its size before any byte is read",
    )
    max_journal_bytes: int = Field(
        default=64 << 20,
        ge=1,
        description="what the tool calls since a sandbox's last checkpoint may hold for replay (file data "
        "once per content, commands); a call that would pass it checkpoints first, or is refused with a "
        "429 (sandbox_journal_full) when no checkpoint can be taken",
    )
    disk_quota_bytes: int = Field(
        default=10 << 30,
        ge=0,
        description="each sandbox's disk quota (its writable layer), where the storage driver takes one; "
        "elsewhere a checkpoint of a larger layer is refused. 0: none",
    )

    ray: str | None = Field(
        default=None,
        description="place sandboxes on the nodes of this Ray cluster that declare belayer_sandbox_slots: "
        "auto or the head's HOST:PORT; unset: the engine pool's --ray if any; off: this host's Docker engine",
    )
    ray_node_ip: str | None = Field(
        default=None, description="this machine's Ray node address, if Ray would guess it wrong"
    )
    checkpoint_store: str | None = Field(
        default=None,
        description="where checkpoints go so that any node can restore them: a directory every node mounts "
        "(file:///path) or s3://BUCKET/PREFIX?endpoint=URL; needed with sandboxes on Ray",
    )
    checkpoint_key_file: str | None = Field(
        default=None,
        description="the key (a 0600 file, 32+ bytes) with which the gateway signs the checkpoints it puts "
        "in the checkpoint store, and checks them before a restore; unset: CHECKPOINT_DIR/checkpoint.key, "
        "made at the first start. A gateway that takes over another's sessions needs that one's file",
    )
    node_timeout_s: float = Field(
        default=3.0, gt=0, description="a sandbox node whose Docker engine does not answer this long is lost"
    )
    relay_port: int = Field(
        default=7199,
        ge=1,
        le=65535,
        description="with sandboxes on Ray: the port of each node's relay, by which network=gateway "
        "sandboxes reach the gateway (the same on every node)",
    )
    docker_urls: dict[str, str] = Field(
        default_factory=dict,
        description="a sandbox node's Docker engine address by the node's IP (NODE_IP=URL; default: the "
        "node's own socket)",
    )
    allow_full_network_on_cluster: bool = Field(
        default=False,
        description="with sandboxes on Ray: allow network=full sandboxes (and task setup with network). "
        "Off, they are refused: the cluster's own services (Ray's ports, the engines) answer anyone on "
        "the nodes' network. On, each node's firewall drops their packets to every node's address",
    )

    @property
    def on_ray(self) -> bool:
        return self.ray not in (None, "off")

    @field_validator("sandbox_port", mode="before")
    @classmethod
    def _minus_one_is_none(cls, value: object) -> object:
        # TOML and the environment have no null: -1 turns the listener off there (and on the flag).
        return None if value in (-1, "-1") else value


class DockerBackendConfig(BaseModel):
    """Where the engine is and where checkpoints go."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    base_url: str | None = None
    """Engine address, e.g. `unix:///var/run/docker.sock`; None reads DOCKER_HOST like the CLI."""
    checkpoint_dir: Path = Path("/var/lib/belayer/checkpoints")
    checkpoint_store: str | None = None
    """Keep checkpoints in this store (`sandbox.checkpoint_store.store_for`: a shared directory or
    ``s3://…``) so that any node can restore them (`sandbox.docker_backend.portable`); None: this
    engine's images plus `checkpoint_dir`, restorable here only."""
    checkpoint_key_file: Path | None = None
    """The gateway's key for the store's checkpoints (`sandbox.checkpoint_auth.CheckpointKey`, made there
    when absent); None: no MAC, only the parts' digests (a cluster node's backend: the gateway signs)."""
    busybox: Path = Path("/bin/busybox")
    """A *static* busybox on the host; it is copied into every sandbox to run the supervisor."""
    api_timeout_s: float = 120.0
    max_image_layers: int = 100
    """Flatten a sandbox's snapshot image before its layer chain reaches Docker's limit of 125."""
    name_prefix: str = "belayer-sbx"
    checkpoint_repository: str = "belayer-checkpoint"
    gateway_network: str = "belayer-gateway"
    """The internal network of `network="gateway"` sandboxes (see `sandbox.network`)."""
    gateway_bridge: str = "belayer-gw0"
    dump_retry_s: float = 10.0
    """How long a process dump is retried while containerd still holds the last dump's identical blobs
    (see `sandbox.docker_backend.containerd`); past it the checkpoint fails."""
    disk_quota_bytes: int | None = None
    """Each sandbox's writable-layer quota (``--storage-opt size``), where the storage driver has one
    (see `DockerSandboxBackend.disk_quota`); None: no quota."""
