"""Configuration, loaded once (from the CLI) and passed down explicitly."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator

from gateway.sandboxes.policy import PolicySettings


class FailoverConfig(BaseModel):
    """Mid-stream failover: on a worker's death or stall, resubmit prompt + generated ids elsewhere."""

    enabled: bool = True
    max_failovers: int = Field(default=4, ge=0, description="failovers allowed within one request")
    stall_timeout: float = Field(
        default=5.0, gt=0, description="seconds without a token before probing the worker"
    )
    no_worker_wait: float = Field(
        default=120.0, ge=0, description="how long a request waits for a ready worker"
    )


class SandboxConfig(BaseModel):
    """Per-session Docker sandboxes with checkpoints in inference bubbles (off unless ``enabled``)."""

    enabled: bool = False
    docker_url: str | None = Field(default=None, description="engine address; None reads DOCKER_HOST")
    checkpoint_dir: str = "/var/lib/belayer/checkpoints"
    policy: PolicySettings = Field(default_factory=PolicySettings)
    keep_checkpoints: int = Field(default=3, ge=1, description="checkpoints kept per session (retention)")
    exec_grace_s: float = Field(
        default=15.0, gt=0, description="a tool call unanswered timeout_s + this long has hung the sandbox"
    )
    auto_restore: bool = Field(default=True, description="restore the newest checkpoint on a failure")
    watch_interval_s: float = Field(
        default=0.5, gt=0, description="how often idle sandboxes are checked for a stopped container"
    )
    sandbox_port: int | None = Field(
        default=0,
        ge=0,
        le=65535,
        description=(
            "port of the listener that network='gateway' sandboxes reach (on the sandbox network's host "
            "address; it serves only each sandbox's own session); 0 picks a free one, None turns it off"
        ),
    )


class GatewayConfig(BaseModel):
    """Everything ``belayer serve`` needs. The tokenizer always comes from ``model`` (a directory)."""

    model: str = Field(
        description="model directory: tokenizer and chat template, and weights for launched workers"
    )
    served_model_names: list[str] = Field(default_factory=lambda: ["policy"])
    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description="model names (fnmatch patterns, e.g. 'claude-*') answered by a served model",
    )
    auxiliary_models: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "model-name patterns (fnmatch) of a harness's auxiliary calls -> 'policy' (recorded in the "
            "session's -aux side session), 'http(s)://provider/v1#model' (passed through) or 'reject'"
        ),
    )
    engine_urls: list[str] = Field(default_factory=list, description="already-running vLLM servers")

    @field_validator("auxiliary_models")
    @classmethod
    def _aux_routes(cls, value: dict[str, str]) -> dict[str, str]:
        for pattern, route in value.items():
            if route not in ("policy", "reject") and not route.startswith(("http://", "https://")):
                raise ValueError(
                    f"auxiliary route for {pattern!r} must be 'policy', 'reject' or 'http(s)://provider/v1#model'"
                )
        return value

    workers: int = Field(
        default=1, ge=0, description="active vLLM workers to launch when no engine URL is given"
    )
    shadows: int = Field(
        default=0, ge=0, description="pre-initialised standby workers, promoted on a failure"
    )
    failover: FailoverConfig = Field(default_factory=FailoverConfig)
    admin_token: str | None = Field(
        default=None, description="bearer token for admin endpoints (None: disabled)"
    )
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    max_model_len: int = 65536
    store_path: str = "belayer-trajectories.db"
    store_synchronous: str = "NORMAL"
    host: str = "127.0.0.1"
    port: int = 8000
    public_url: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    default_max_tokens: int | None = None
    """max_tokens for a request that gives none (None: the rest of the context)."""
    max_tokens_cap: int | None = None
    """An upper bound on every request's max_tokens (e.g. short rollouts on a slow engine)."""
    log_dir: str = "logs"
    worker_start_timeout: float = 300.0
