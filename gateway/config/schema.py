"""`GatewayConfig`: the one source of every setting and its default (its tables in
`gateway.config.sections`), and what follows from a config (`launch_devices`, `gateway_identity`, ...).

A setting comes from, in rising precedence: its default here, a TOML file (``config_file``; ``belayer
serve --config belayer.toml``), an environment variable ``BELAYER_<NAME>`` (nested with ``__``:
``BELAYER_FAILOVER__STALL_TIMEOUT=2``; lists and tables as JSON), and keyword arguments (the CLI's
flags): `GatewayConfig.settings_customise_sources`. Code that builds a config itself passes keyword
arguments: ``GatewayConfig(model="./tiny-model")``; ``belayer serve`` loads it with
`gateway.config.loader.ConfigLoader`.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import socket
import tomllib
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from core.errors import ConfigError
from core.logs import LogFormat
from engine_pool.settings import RoutingPolicy
from engine_pool.workers.launch import check_device_count, device_groups
from gateway.config.sections import (
    FailoverConfig,
    InflightConfig,
    LaunchConfig,
    RayConfig,
    ServerConfig,
)
from gateway.policy.parsers import ReasoningParserName, ToolParserName
from sandbox.config import SandboxConfig

SamplingMode = Literal["engine", "keyed"]
"""``core.keyed.SAMPLING_MODES``."""

ENV_PREFIX = "BELAYER_"
ENV_NESTING = "__"
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class GatewayConfig(BaseSettings):
    """Everything ``belayer serve`` needs. The tokenizer always comes from ``model`` (a directory)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter=ENV_NESTING, extra="forbid")

    config_file: str | None = Field(
        default=None,
        description="TOML file of settings (a key per setting, [failover], [inflight], [sandbox] and [server] "
        "tables); environment variables and flags override it",
    )
    model: str = Field(
        description="model directory: tokenizer and chat template, and weights for launched workers"
    )
    served_model_names: list[str] = Field(
        default_factory=lambda: ["policy"], description="model name(s) clients use"
    )
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
    engine_urls: list[str] = Field(
        default_factory=list, description="already-running vLLM servers to use instead of launching workers"
    )
    shadow_urls: list[str] = Field(
        default_factory=list,
        description="already-running vLLM servers held as shadows: no traffic until one is promoted in "
        "place of a failed worker",
    )

    @field_validator("auxiliary_models")
    @classmethod
    def _aux_routes(cls, value: dict[str, str]) -> dict[str, str]:
        for pattern, route in value.items():
            if route not in ("policy", "reject") and not route.startswith(("http://", "https://")):
                raise ValueError(
                    f"auxiliary route for {pattern!r} must be 'policy', 'reject' or 'http(s)://provider/v1#model'"
                )
        return value

    @field_validator("engine_urls", "shadow_urls")
    @classmethod
    def _engine_schemes(cls, value: list[str]) -> list[str]:
        for url in value:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} has no scheme; write it as http://{url.split('://')[-1]}")
        return value

    workers: int = Field(
        default=1, ge=0, description="active vLLM workers to launch when no engine URL is given"
    )
    shadows: int = Field(
        default=0, ge=0, description="pre-initialised standby workers, promoted on a failure"
    )
    worker_kind: Literal["vllm", "fake"] = Field(
        default="vllm",
        description=(
            "what launched workers run: vllm, or fake (scripted fake engines, real processes: for demos, "
            "dashboards and tests without a model server)"
        ),
    )
    routing: RoutingPolicy = Field(
        default="affinity",
        description=(
            "how requests are placed on workers: affinity (a session's last worker, else the one with the "
            "fewest outstanding tokens), group (affinity, and a session's group on the group's first "
            "worker; a session spills to the least-loaded worker under load), round-robin, least-loaded"
        ),
    )
    routing_spill_factor: float = Field(
        default=2.0,
        ge=1.0,
        description=(
            "group routing: a session leaves its worker once that worker's outstanding tokens (each running "
            "request's prompt and max_tokens) exceed "
            "this factor times the least-loaded worker's, plus routing_spill_floor"
        ),
    )
    routing_spill_floor: int = Field(
        default=8192,
        ge=0,
        description=(
            "group routing: the absolute part of the spill threshold, in tokens (so that one request "
            "against none does not move a session)"
        ),
    )
    metrics: bool = Field(default=True, description="serve /metrics and record Prometheus metrics")
    failover: FailoverConfig = Field(default_factory=FailoverConfig)
    launch: LaunchConfig = Field(default_factory=LaunchConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    inflight: InflightConfig = Field(default_factory=InflightConfig)
    admin_token: str | None = Field(
        default=None,
        description="bearer token for the admin endpoints (POST /api/engines, POST /api/weights); without "
        "one they are off. A flag's value shows in `ps`: prefer --admin-token-file or BELAYER_ADMIN_TOKEN",
    )
    admin_token_file: str | None = Field(
        default=None, description="a file that holds the admin token (instead of --admin-token)"
    )
    api_token: str | None = Field(
        default=None,
        description=(
            "bearer token the trainer side needs for every /api/* route (not /health); harnesses need none: "
            "a session's URL is its capability. Unset: the API is open to anyone who reaches the port. A "
            "flag's value shows in `ps`: prefer --api-token-file or BELAYER_API_TOKEN"
        ),
    )
    api_token_file: str | None = Field(
        default=None, description="a file that holds the API token (instead of --api-token)"
    )
    plain_v1: Literal["open", "token", "off"] | None = Field(
        default=None,
        description="plain /v1 requests (one-request sessions, stored responses): open, behind the API "
        "token, or off; unset: token when an API token is set, else open. External auxiliary models are "
        "never served on them (only on a session's /s/{id}/v1)",
    )
    allowed_hosts: list[str] = Field(
        default_factory=list,
        description=(
            "Host header values the gateway answers (others get a 400: no DNS-rebinding page gets in) and "
            "builds base_urls from; unset: the loopback names, --host, --public-url's host and IP "
            "addresses, with base_urls from --public-url or --host/--port"
        ),
    )
    engine_allow: list[str] = Field(
        default_factory=list,
        description=(
            "engines the gateway may be pointed at (--engine-url, --shadow-url, POST /api/engines): IP "
            "networks (10.0.0.0/8) or host name patterns (*.engines.internal); unset: any"
        ),
    )
    weights_root: str | None = Field(
        default=None,
        description="the directory every POST /api/weights path must lie in (unset: any readable directory)",
    )

    @field_validator("engine_allow")
    @classmethod
    def _allow_patterns(cls, value: list[str]) -> list[str]:
        for pattern in value:
            if not pattern or ("/" in pattern and _network(pattern) is None):
                raise ValueError(f"{pattern!r} is neither an IP network (10.0.0.0/8) nor a host name pattern")
        return value

    @model_validator(mode="after")
    def _tokens_and_engines(self) -> GatewayConfig:
        for name in ("api_token", "admin_token"):
            file = getattr(self, f"{name}_file")
            if file is None:
                continue
            if getattr(self, name) is not None:
                raise ValueError(f"give the {name.replace('_', ' ')} once: as a value or as a file, not both")
            setattr(self, name, _read_token(file))
        if self.plain_v1 is None:  # a gateway behind a token keeps its plain routes behind it too
            self.plain_v1 = "token" if self.api_token is not None else "open"
        for url in (*self.engine_urls, *self.shadow_urls):
            if not engine_allowed(url, self.engine_allow):
                raise ValueError(f"engine {url} is not in --engine-allow {self.engine_allow}")
        if self.sandbox.ray is None and self.ray.address:  # --ray: the sandboxes go on the cluster too
            self.sandbox.ray, self.sandbox.ray_node_ip = (
                self.ray.address,
                self.sandbox.ray_node_ip or self.ray.node_ip,
            )
        return self

    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    tool_call_parser: ToolParserName = Field(
        default="hermes",
        description="the model's tool-call format, by vLLM's name (as 'vllm serve --tool-call-parser')",
    )
    reasoning_parser: ReasoningParserName | None = Field(
        default=None,
        description=(
            "the model's reasoning format, by vLLM's name: <think> text goes to reasoning_content, thinking "
            "blocks and reasoning items (unset: it stays in the content)"
        ),
    )
    max_model_len: int | None = Field(
        default=None,
        gt=0,
        description="context window of launched workers (unset: the model's own, from its config.json)",
    )
    store_path: str = Field(
        default="belayer-trajectories.db",
        description="trajectory store: a SQLite file, or a postgresql:// URL shared by replicated gateways",
    )
    store_synchronous: str = Field(default="NORMAL", description="the store's SQLite synchronous mode")
    gateway_id: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description=(
            "this gateway's id among replicas on one store: its sandboxes carry it, and a restarted "
            "gateway takes back only its own (unset: HOSTNAME:PORT, stable while the replica keeps its "
            "host and port)"
        ),
    )
    host: str = Field(default="127.0.0.1", description="address the gateway listens on")
    port: int = Field(default=8000, ge=0, le=65535, description="port the gateway listens on")
    processes: int = Field(
        default=1,
        ge=1,
        le=256,
        description=(
            "gateway processes sharing the port (SO_REUSEPORT), each its own event loop; more than one "
            "needs a postgresql:// store and --engine-url engines (gateway.serve.processes)"
        ),
    )
    public_url: str | None = Field(
        default=None, description="the URL clients reach the gateway at (for session base_urls)"
    )
    max_body_bytes: int = Field(default=16 * 1024 * 1024, gt=0, description="largest request body")
    max_fork_siblings: int = Field(
        default=16, ge=1, le=1024, description="the most child sessions one fork request may create"
    )
    sampling: SamplingMode = Field(
        default="engine",
        description="how sampled tokens are drawn when a request does not say (its 'sampling' field): engine "
        "(the engine's own sampler: a failover re-draws the rest of a sampled turn) or keyed (each token a "
        "function of the policy's distribution, the turn's key and its position: a failover changes nothing)",
    )
    default_max_tokens: int | None = Field(
        default=None,
        gt=0,
        description="max_tokens for a request that gives none (unset: the rest of the context)",
    )
    max_tokens_cap: int | None = Field(
        default=None, gt=0, description="an upper bound on every request's max_tokens (short rollouts)"
    )
    log_dir: str = Field(default="logs", description="where launched workers' logs go")
    log_level: LogLevel = Field(default="INFO", description="the gateway's log level")
    log_format: LogFormat = Field(
        default="text",
        description="the gateway's log lines: text, or json (one object a line, for log shippers)",
    )
    worker_start_timeout: float = Field(
        default=300.0, gt=0, description="seconds a launched worker may take to become ready"
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Keyword arguments (flags) > ``BELAYER_*`` variables > the ``config_file`` (> defaults)."""
        given = init_settings.init_kwargs if isinstance(init_settings, InitSettingsSource) else {}
        file = given.get("config_file") or env_settings().get("config_file")
        if file is None:
            return init_settings, env_settings
        return init_settings, env_settings, _toml_source(settings_cls, str(file))


def _toml_source(settings_cls: type[BaseSettings], file: str) -> TomlConfigSettingsSource:
    if not Path(file).is_file():
        raise ConfigError(f"config file {file}: no such file")
    try:
        return TomlConfigSettingsSource(settings_cls, toml_file=file)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {file}: not valid TOML ({exc})") from None


def _read_token(file: str) -> str:
    try:
        token = Path(file).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the token file {file} ({exc.strerror})") from None
    if not token:
        raise ValueError(f"the token file {file} is empty")
    return token


def _network(pattern: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | None:
    try:
        return ipaddress.ip_network(pattern, strict=False)
    except ValueError:
        return None


def engine_allowed(url: str, allow: list[str]) -> bool:
    """Whether an engine at `url` may join the pool: any, with no allowlist; else its host must be in
    one of the networks or match one of the name patterns of `allow`.

    >>> allow = ["10.0.0.0/8", "*.engines.internal", "127.0.0.1"]
    >>> [engine_allowed(u, allow) for u in ("http://10.2.3.4:8000", "http://a.engines.internal:80",
    ...     "http://127.0.0.1:9", "http://169.254.169.254/latest", "http://evil.example")]
    [True, True, True, False, False]
    """
    if not allow:
        return True
    host = (urlsplit(url).hostname or "").lower()
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for pattern in allow:
        network = _network(pattern)
        if network is not None:
            if address is not None and address in network:
                return True
        elif fnmatch.fnmatchcase(host, pattern.lower()):
            return True
    return False


def launch_devices(config: GatewayConfig) -> tuple[tuple[int, ...], ...]:
    """The device groups of the workers `config` launches (none without ``launch.gpus``, or when it
    launches none); a `ConfigError` when they are too few for its workers and shadows."""
    if config.engine_urls or not config.launch.gpus:
        return ()
    try:
        groups = device_groups(config.launch.gpus, config.launch.tensor_parallel_size)
        check_device_count(groups, config.workers, config.shadows, colocate=gpu_weight_cache(config))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return groups


def gpu_weight_cache(config: GatewayConfig) -> bool:
    """Do launched workers map a vLLM weight cache per device group (``engine_pool.weights.cache``)?"""
    launch = config.launch
    return launch.weight_owner and launch.profile == "gpu" and config.worker_kind == "vllm"


def gateway_identity(config: GatewayConfig) -> str:
    """The gateway's id among replicas (`GatewayConfig.gateway_id`): given, or this host's name and the
    port, so that a replica restarted where it ran finds its own sandboxes (`sandbox.sessions.adoption`)."""
    return config.gateway_id or f"{socket.gethostname()}:{config.port}"
