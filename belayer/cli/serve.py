"""``belayer serve``: its flags, each the command-line face of one `GatewayConfig` setting (type,
default and help come from the field), and the command that loads the settings and starts the gateway.

>>> next(f for f in SERVE_FLAGS if f.name == "--stall-timeout").path
'failover.stall_timeout'
"""

from __future__ import annotations

import argparse
import logging
import sys
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union, get_args, get_origin

from core.errors import ConfigError
from core.logs import LogFormat, formatter

if TYPE_CHECKING:
    from pydantic import BaseModel
    from pydantic.fields import FieldInfo


def setup_logging(level: str = "INFO", fmt: LogFormat = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(fmt))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    # httpx logs every engine request at INFO: noise, and measurable CPU on the hot path.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLevelName(level)))


def pairs(flag: str, values: list[str]) -> dict[str, str]:
    pairs: dict[str, str] = {}
    for text in values:
        pattern, sep, value = text.partition("=")
        if not sep or not pattern or not value:
            raise ConfigError(f"{flag} takes PATTERN=VALUE, e.g. 'claude-*=policy'; got {text!r}")
        pairs[pattern] = value
    return pairs


@dataclass(frozen=True, slots=True)
class Flag:
    """A ``belayer serve`` flag and the setting it sets (a dotted path in `GatewayConfig`); a switch
    (``const``) sets it to that value. Type, default and help come from the setting's field."""

    name: str
    path: str
    const: bool | None = None
    metavar: str | None = None


SERVE_FLAGS = (
    Flag("--config", "config_file", metavar="FILE"),
    Flag("--model", "model", metavar="DIR"),
    Flag("--engine-url", "engine_urls", metavar="URL"),
    Flag("--shadow-url", "shadow_urls", metavar="URL"),
    Flag("--workers", "workers"),
    Flag("--shadows", "shadows"),
    Flag("--worker-kind", "worker_kind"),
    Flag("--routing", "routing"),
    Flag("--routing-spill-factor", "routing_spill_factor", metavar="X"),
    Flag("--routing-spill-floor", "routing_spill_floor", metavar="TOKENS"),
    Flag("--worker-profile", "launch.profile"),
    Flag("--vllm-arg", "launch.vllm_args", metavar="ARG"),
    Flag("--gpus", "launch.gpus", metavar="0,1,..."),
    Flag("--tensor-parallel-size", "launch.tensor_parallel_size", metavar="N"),
    Flag("--weight-owner", "launch.weight_owner", const=True),
    Flag("--ray", "ray.address", metavar="auto|HOST:PORT"),
    Flag("--ray-node-ip", "ray.node_ip", metavar="IP"),
    Flag("--ray-namespace", "ray.namespace"),
    Flag("--ray-cpus-per-worker", "ray.cpus_per_worker", metavar="N"),
    Flag("--ray-resource", "ray.resources", metavar="NAME=AMOUNT"),
    Flag("--no-failover", "failover.enabled", const=False),
    Flag("--sandboxes", "sandbox.enabled", const=True),
    Flag("--checkpoint-dir", "sandbox.checkpoint_dir"),
    Flag("--checkpoint-policy", "sandbox.policy.mode"),
    Flag("--sandbox-port", "sandbox.sandbox_port"),
    Flag("--keep-sandboxes", "sandbox.keep_on_shutdown", const=True),
    Flag("--sandbox-standby", "sandbox.standby", const=True),
    Flag("--sandbox-ray", "sandbox.ray", metavar="auto|HOST:PORT|off"),
    Flag("--sandbox-ray-node-ip", "sandbox.ray_node_ip", metavar="IP"),
    Flag("--checkpoint-store", "sandbox.checkpoint_store", metavar="URL"),
    Flag("--checkpoint-key-file", "sandbox.checkpoint_key_file", metavar="FILE"),
    Flag("--sandbox-node-timeout", "sandbox.node_timeout_s", metavar="SECONDS"),
    Flag("--sandbox-docker-url", "sandbox.docker_urls", metavar="NODE_IP=URL"),
    Flag("--sandbox-relay-port", "sandbox.relay_port", metavar="PORT"),
    Flag("--sandbox-allow-full-network-on-cluster", "sandbox.allow_full_network_on_cluster", const=True),
    Flag("--max-workspace-bytes", "sandbox.max_workspace_bytes", metavar="BYTES"),
    Flag("--max-read-bytes", "sandbox.max_read_bytes", metavar="BYTES"),
    Flag("--max-journal-bytes", "sandbox.max_journal_bytes", metavar="BYTES"),
    Flag("--sandbox-disk-quota", "sandbox.disk_quota_bytes", metavar="BYTES"),
    Flag("--admin-token", "admin_token"),
    Flag("--admin-token-file", "admin_token_file", metavar="FILE"),
    Flag("--api-token", "api_token"),
    Flag("--api-token-file", "api_token_file", metavar="FILE"),
    Flag("--plain-v1", "plain_v1"),
    Flag("--allowed-hosts", "allowed_hosts", metavar="HOST"),
    Flag("--engine-allow", "engine_allow", metavar="NETWORK|HOST"),
    Flag("--weights-root", "weights_root", metavar="DIR"),
    Flag("--max-failovers", "failover.max_failovers"),
    Flag("--stall-timeout", "failover.stall_timeout"),
    Flag("--no-worker-wait", "failover.no_worker_wait"),
    Flag("--no-quarantine", "failover.quarantine.enabled", const=False),
    Flag("--quarantine-remember", "failover.quarantine.remember_s", metavar="SECONDS"),
    Flag("--quarantine-remember-max", "failover.quarantine.remember_max", metavar="N"),
    Flag("--quarantine-isolate-wait", "failover.quarantine.isolate_wait_s", metavar="SECONDS"),
    Flag("--quarantine-max-deaths", "failover.quarantine.max_deaths", metavar="N"),
    Flag("--served-model-name", "served_model_names", metavar="NAME"),
    Flag("--max-model-len", "max_model_len"),
    Flag("--tool-call-parser", "tool_call_parser"),
    Flag("--reasoning-parser", "reasoning_parser"),
    Flag("--store", "store_path"),
    Flag("--gateway-id", "gateway_id"),
    Flag("--host", "host"),
    Flag("--port", "port"),
    Flag("--processes", "processes", metavar="N"),
    Flag("--public-url", "public_url"),
    Flag("--max-body-bytes", "max_body_bytes"),
    Flag("--max-header-bytes", "server.max_header_bytes", metavar="BYTES"),
    Flag("--header-timeout", "server.header_timeout_s", metavar="SECONDS"),
    Flag("--body-timeout", "server.body_timeout_s", metavar="SECONDS"),
    Flag("--keep-alive-timeout", "server.keep_alive_s", metavar="SECONDS"),
    Flag("--max-connections", "server.max_connections", metavar="N"),
    Flag("--shutdown-grace", "server.shutdown_grace_s", metavar="SECONDS"),
    Flag("--sampling", "sampling"),
    Flag("--default-max-tokens", "default_max_tokens"),
    Flag("--max-tokens-cap", "max_tokens_cap"),
    Flag("--model-alias", "model_aliases", metavar="PATTERN=NAME"),
    Flag("--aux-model", "auxiliary_models", metavar="PATTERN=ROUTE"),
    Flag("--log-dir", "log_dir"),
    Flag("--log-level", "log_level"),
    Flag("--log-format", "log_format"),
    Flag("--no-metrics", "metrics", const=False),
)


def setting_field(path: str) -> FieldInfo:
    from gateway.config import GatewayConfig

    model: type[BaseModel] = GatewayConfig
    *parents, leaf = path.split(".")
    for part in parents:
        model = model.model_fields[part].annotation  # type: ignore[assignment]  # a nested model
    return model.model_fields[leaf]


def _shown(value: object) -> str:
    """A default as --help shows it."""
    if value is None or value == [] or value == {}:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


def _kind(annotation: object) -> tuple[object, tuple[object, ...]]:
    """``int | None`` -> (int, ()); ``list[str]`` -> (list, (str,)); ``Literal["a", "b"]`` -> (Literal, ("a", "b"))."""
    if isinstance(annotation, types.UnionType) or get_origin(annotation) is Union:
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    return get_origin(annotation) or annotation, get_args(annotation)


def add_setting_flag(p: argparse.ArgumentParser, flag: Flag) -> None:
    """The flag's type, default and help, from its field; only a flag that is given reaches the config."""
    field = setting_field(flag.path)
    about = (field.description or "").rstrip(".")
    if field.is_required():
        default = "required"
    else:
        default = f"default: {_shown(field.get_default(call_default_factory=True))}"
    kind, args = _kind(field.annotation)
    if flag.const is not None:
        about = f"turn {'on' if flag.const else 'off'}: {about}"
        help_text = f"{about} ({default}) [{flag.path}]".replace("%", "%%")
        p.add_argument(flag.name, dest=flag.path, action="store_const", const=flag.const,
                       default=argparse.SUPPRESS, help=help_text)  # fmt: skip
        return
    repeat = kind in (list, dict)
    help_text = f"{about} ({default}{'; repeatable' if repeat else ''}) [{flag.path}]".replace("%", "%%")
    metavar = flag.metavar or flag.path.rsplit(".", 1)[-1].upper()
    if kind is Literal:
        metavar = "{" + ",".join(str(a) for a in args) + "}"
    p.add_argument(
        flag.name,
        dest=flag.path,
        type=kind if kind in (int, float) else str,
        action="append" if repeat else "store",
        metavar=metavar,
        default=argparse.SUPPRESS,
        help=help_text,
    )


def run(args: argparse.Namespace) -> int:
    from gateway.config.loader import ConfigLoader
    from gateway.config.preflight import preflight

    given: dict[str, object] = {}
    for flag in SERVE_FLAGS:
        if hasattr(args, flag.path):
            value = getattr(args, flag.path)
            table = _kind(setting_field(flag.path).annotation)[0] is dict  # PATTERN=VALUE, repeated
            given[flag.path] = pairs(flag.name, value) if table else value
    loader = ConfigLoader(given, {flag.path: flag.name for flag in SERVE_FLAGS})
    config = loader.load()
    setup_logging(config.log_level, config.log_format)
    if config.processes > 1:
        from gateway.serve.processes import check_processes

        check_processes(config, loader.name)
    preflight(config, loader)
    if config.processes > 1:
        import functools

        from gateway.serve.processes import serve_processes

        return serve_processes(config, functools.partial(setup_logging, config.log_level, config.log_format))
    from gateway.app import build_app
    from gateway.serve.server import serve

    serve(build_app(config), config)
    return 0
