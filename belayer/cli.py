"""The ``belayer`` command line.

belayer serve --model DIR [--engine-url URL]       start the gateway (launching a vLLM worker if no URL);
              [--config belayer.toml]             settings: defaults < file < BELAYER_* variables < flags
              [--worker-profile gpu --gpus 0,1 --tensor-parallel-size 2 --vllm-arg=--max-num-seqs=64]
              [--shadow-url URL]                  an engine it did not launch, held as a shadow
              [--ray auto|HOST:PORT]              workers and shadows as actors on a Ray cluster (docs/ray.md)
belayer model build-tiny DIR                       build the deterministic tiny test model
belayer export --store DB --format jsonl|parquet --out FILE   trajectories for a trainer (docs/export.md)
              [--status closed] [--rewarded-only] [--since 7d|2026-01-31] [--session ID]
belayer store prune --store DB --older-than 7d    delete closed sessions (--exported-only), shrink the file
belayer fake-engine --port P                       a scripted fake engine (benchmarks)
belayer bench gateway                              gateway overhead vs direct vs LiteLLM
belayer bench gateway-crash                        kill -9 the gateway under streaming sessions, restart, retry
belayer bench sandbox-restart                      a restarted gateway re-adopting its sandboxes vs restoring them
belayer sandbox build-image [busybox|python|all]   build (or find cached) the sandbox base images
belayer demo [--worker-kind fake]                  2 workers + 1 shadow, an SDK episode, a worker killed mid-stream
belayer run-episode --harness NAME --task DIR      one real harness episode on a task, with its verifier
              [--fork-at K --siblings N]          forked at turn K into N siblings, each verified
belayer --version

A start-up error (a setting that cannot work, Docker not running) is one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union, get_args, get_origin

from core.errors import ConfigError, NotFound, SandboxUnavailable
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


def _pairs(flag: str, values: list[str]) -> dict[str, str]:
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
    Flag("--max-workspace-bytes", "sandbox.max_workspace_bytes", metavar="BYTES"),
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
    Flag("--default-max-tokens", "default_max_tokens"),
    Flag("--max-tokens-cap", "max_tokens_cap"),
    Flag("--model-alias", "model_aliases", metavar="PATTERN=NAME"),
    Flag("--aux-model", "auxiliary_models", metavar="PATTERN=ROUTE"),
    Flag("--log-dir", "log_dir"),
    Flag("--log-level", "log_level"),
    Flag("--log-format", "log_format"),
    Flag("--no-metrics", "metrics", const=False),
)


def _field(path: str) -> FieldInfo:
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


def _add_setting_flag(p: argparse.ArgumentParser, flag: Flag) -> None:
    """The flag's type, default and help, from its field; only a flag that is given reaches the config."""
    field = _field(flag.path)
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


def _serve(args: argparse.Namespace) -> int:
    from gateway.config import ConfigLoader

    given: dict[str, object] = {}
    for flag in SERVE_FLAGS:
        if hasattr(args, flag.path):
            value = getattr(args, flag.path)
            table = _kind(_field(flag.path).annotation)[0] is dict  # PATTERN=VALUE, repeated
            given[flag.path] = _pairs(flag.name, value) if table else value
    loader = ConfigLoader(given, {flag.path: flag.name for flag in SERVE_FLAGS})
    config = loader.load()
    setup_logging(config.log_level, config.log_format)
    if config.processes > 1:
        from gateway.serve.processes import check_processes

        check_processes(config, loader.name)
    loader.preflight(config)
    if config.processes > 1:
        import functools

        from gateway.serve.processes import serve_processes

        return serve_processes(config, functools.partial(setup_logging, config.log_level, config.log_format))
    from gateway.app import build_app
    from gateway.serve.server import serve

    serve(build_app(config), config)
    return 0


def _build_tiny(args: argparse.Namespace) -> int:
    from belayer.tiny_model import build_tiny

    # refuses a directory holding anything else
    summary = build_tiny(args.dir, template=args.template, size=args.size)
    print(f"tiny model written to {args.dir}: {json.dumps(summary)}")
    return 0


DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}


def since_timestamp(text: str, now: float) -> float:
    """``--since``: a duration back from `now` (``90m``, ``2h``, ``7d``, ``1w``) or an ISO date or
    datetime (local time unless it names its zone), as a Unix timestamp.

    >>> since_timestamp("2h", now=10_000.0)
    2800.0
    >>> since_timestamp("1970-01-02T00:00:00+00:00", now=0.0)
    86400.0
    """
    from datetime import datetime

    unit = DURATION_UNITS.get(text[-1:])
    if unit is not None:
        try:
            amount = float(text[:-1])
        except ValueError:
            amount = -1.0
        if amount >= 0 and amount != float("inf"):
            return now - amount * unit
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise ConfigError(
            f"--since {text}: not a time; give a duration back from now (30m, 2h, 7d, 1w) "
            "or an ISO date or datetime (2026-01-31, 2026-01-31T12:00:00Z)"
        ) from None


def _export(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from store import SessionQuery
    from store.export import export
    from store.factory import is_url, open_store

    if not is_url(args.store) and not Path(args.store).is_file():  # opening it would create an empty store
        raise ConfigError(f"--store {args.store}: no such file; give the store `belayer serve --store` wrote")
    if Path(args.out).is_dir():
        example = Path(args.out) / f"rollouts.{args.format}"
        raise ConfigError(f"--out {args.out}: is a directory; give a file to write, e.g. --out {example}")
    since = since_timestamp(args.since, time.time()) if args.since is not None else None
    query = None
    if args.status is not None or args.rewarded_only or since is not None:
        query = SessionQuery(
            status=args.status, has_reward=True if args.rewarded_only else None, created_after=since
        )
    store = open_store(args.store)
    try:
        n = export(store, args.out, args.format, args.session or None, query)
    except NotFound as exc:
        raise ConfigError(f"--session: {exc}") from None
    finally:
        store.close()
    print(f"exported {n} trajectories to {args.out}")
    return 0


def _older_than(text: str) -> float:
    """``--older-than``: a duration (``90s``, ``30m``, ``12h``, ``7d``) in seconds."""
    unit = DURATION_UNITS.get(text[-1:])
    try:
        amount = float(text[:-1]) if unit is not None else -1.0
    except ValueError:
        amount = -1.0
    if unit is None or not 0 <= amount < float("inf"):
        raise ConfigError(f"--older-than {text}: not a duration; give a number and a unit: 90s, 30m, 12h, 7d")
    return amount * unit


def _store_prune(args: argparse.Namespace) -> int:
    import time
    from datetime import datetime
    from pathlib import Path

    from store.factory import is_url, open_store

    if not is_url(args.store) and not Path(args.store).is_file():  # opening it would create an empty store
        raise ConfigError(f"--store {args.store}: no such file; give the store `belayer serve --store` wrote")
    cutoff = time.time() - _older_than(args.older_than)
    store = open_store(args.store, recover=False)  # a gateway may be running on it: leave its turns be
    try:
        before = store.size_bytes()
        pruned = store.prune(cutoff, exported_only=args.exported_only)
        store.vacuum()
        after = store.size_bytes()
    finally:
        store.close()
    which = "exported sessions" if args.exported_only else "sessions"
    when = datetime.fromtimestamp(cutoff).isoformat(timespec="seconds")
    shown = ", ".join(pruned[:20]) + (f" and {len(pruned) - 20} more" if len(pruned) > 20 else "")
    print(f"pruned {len(pruned)} {which} closed before {when}" + (f": {shown}" if pruned else ""))
    print(f"store {args.store}: {before} -> {after} bytes")
    return 0


def _fake_engine(args: argparse.Namespace) -> int:
    from engine_pool.fake import serve

    serve(args.host, args.port, args.model, args.tokens, args.token_delay)
    return 0


BENCHES = {
    "gateway": "belayer.bench.gateway",
    "gateway-crash": "belayer.bench.gateway_crash",
    "recovery": "belayer.bench.recovery",
    "env-recovery": "belayer.bench.env_recovery",
    "fork": "belayer.bench.fork",
    "store": "belayer.bench.store",
    "task-start": "belayer.bench.task_start",
    "sandbox-restart": "belayer.bench.sandbox_restart",
    "verify-copy": "belayer.bench.verify_copy",
}


def _bench(args: argparse.Namespace) -> int:
    import importlib

    name = args.rest[0] if args.rest else ""
    if name not in BENCHES:
        print(f"usage: belayer bench {{{','.join(BENCHES)}}} [options]", file=sys.stderr)
        return 2
    rc: int = importlib.import_module(BENCHES[name]).main(args.rest[1:])
    return rc


def _build_image(args: argparse.Namespace) -> int:
    from sandbox import images

    return images.main([args.which])


def _demo(args: argparse.Namespace) -> int:
    from belayer import demo

    return demo.run(args)


def _run_episode(args: argparse.Namespace) -> int:
    from pathlib import Path

    from core.errors import HarnessError, TaskError
    from harness_adapters.episode import EpisodeRunner, Task
    from harness_adapters.registry import adapter

    def progress(message: str) -> None:
        print(f"[episode] {message}", file=sys.stderr, flush=True)

    try:
        task = Task.load(Path(args.task))
        harness = adapter(args.harness, Path(args.cache), model=args.model)
        token = os.environ.get("BELAYER_API_TOKEN")  # the gateway's --api-token, if it has one
        runner = EpisodeRunner(args.gateway, harness, progress=progress, api_token=token)
        report = runner.run(
            task, inside=args.inside, keep=args.keep, fork_at=args.fork_at, siblings=args.siblings
        )
    except (TaskError, HarnessError) as exc:
        print(f"belayer run-episode: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    progress(
        f"verified={report['verified']} turns={report['turns']} prefix_reuse={report['prefix_reuse']} "
        f"branches={report['branches']} failovers={report['failovers']}"
    )
    for sibling in report.get("fork", {}).get("siblings", []):
        progress(
            f"sibling {sibling['session_id']}: verified={sibling['verified']} turns={sibling['turns']} "
            f"reused_output_tokens={sibling['reused_output_tokens']} "
            f"reused_tool_calls={sibling['reused_tool_calls']}"
        )
    return 0


def _leaf(p: argparse.ArgumentParser, func: Callable[[argparse.Namespace], int]) -> None:
    p.set_defaults(func=func, prog=p.prog)  # prog: "belayer export", to start an error line with


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("belayer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _docker_down(exc: SandboxUnavailable) -> str:
    where = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if "PermissionError" in str(exc) or "Permission denied" in str(exc):
        return f"Docker at {where} refused this user; run as root (or as a member of the docker group)"
    return (
        f"Docker is not running (nothing answers at {where}); start it with "
        "`sudo deploy/host/setup_sandbox_host.sh start`, or point DOCKER_HOST at a running engine"
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="belayer", description="Fault-tolerant rollout gateway for agentic RL")
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "serve",
        help="start the gateway",
        description="Start the gateway. Settings come from defaults < --config FILE < BELAYER_* environment "
        "variables (nested with __, e.g. BELAYER_FAILOVER__STALL_TIMEOUT=2) < these flags; [brackets] name "
        "each flag's setting (its key in the config file).",
    )
    for flag in SERVE_FLAGS:
        _add_setting_flag(s, flag)
    _leaf(s, _serve)

    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", required=True)
    bt = msub.add_parser("build-tiny", help="write the deterministic tiny Llama model + tokenizer")
    bt.add_argument("dir")
    bt.add_argument(
        "--template",
        choices=["hermes", "qwen3_coder"],
        default="hermes",
        help="chat template: Hermes JSON tool calls, or Qwen3-Coder XML ones with <think> reasoning "
        "(serve it with --tool-call-parser qwen3_coder --reasoning-parser qwen3)",
    )
    bt.add_argument(
        "--size", choices=["tiny", "500m"], default="tiny",
        help="dimensions: tiny (0.6M parameters in its layers), or 500m (~530M, 2.1 GB in float32: for benchmarks)",
    )  # fmt: skip
    _leaf(bt, _build_tiny)

    sb = sub.add_parser("sandbox", help="sandbox utilities")
    sbsub = sb.add_subparsers(dest="sandbox_command", required=True)
    bi = sbsub.add_parser("build-image", help="build the sandbox base images (cached; no registry needed)")
    bi.add_argument("which", nargs="?", choices=["busybox", "python", "all"], default="all")
    _leaf(bi, _build_image)

    e = sub.add_parser("export", help="write trajectories for a trainer")
    e.add_argument("--store", default="belayer-trajectories.db")
    e.add_argument("--format", choices=["jsonl", "parquet"], required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--session", action="append", help="only this session (repeatable)")
    e.add_argument("--status", choices=["open", "closed"], help="only sessions with this status")
    e.add_argument("--rewarded-only", action="store_true", help="only sessions that have a reward")
    e.add_argument(
        "--since",
        metavar="TIME",
        help="only sessions created since TIME: a duration back from now (30m, 2h, 7d, 1w) or an ISO "
        "date or datetime (local time unless it names its zone)",
    )
    _leaf(e, _export)

    st = sub.add_parser("store", help="trajectory store maintenance")
    stsub = st.add_subparsers(dest="store_command", required=True)
    pr = stsub.add_parser(
        "prune",
        help="delete closed sessions older than a duration, then shrink the file",
        description="Delete the sessions closed more than --older-than ago (with their turns and events), "
        "then VACUUM the file. Open sessions are kept. Safe while a gateway runs on the store.",
    )
    pr.add_argument("--store", default="belayer-trajectories.db")
    pr.add_argument("--older-than", required=True, metavar="DURATION", help="e.g. 90s, 30m, 12h, 7d")
    pr.add_argument("--exported-only", action="store_true", help="only sessions an export has written")
    _leaf(pr, _store_prune)

    f = sub.add_parser("fake-engine", help="serve a scripted fake engine (for benchmarks)")
    f.add_argument("--host", default="127.0.0.1")
    f.add_argument("--port", type=int, required=True)
    f.add_argument("--model", default="fake")
    f.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    f.add_argument("--token-delay", type=float, default=0.0, help="seconds between streamed tokens")
    _leaf(f, _fake_engine)

    b = sub.add_parser("bench", help="benchmarks (belayer bench gateway)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    _leaf(b, _bench)

    from belayer import demo

    d = sub.add_parser("demo", help="an episode through the SDKs with a worker killed mid-stream")
    demo.add_arguments(d)
    _leaf(d, _demo)

    from belayer import task_cli

    task_cli.add_arguments(sub, _leaf, _older_than)

    r = sub.add_parser("run-episode", help="run one harness episode on a task directory, then its verifier")
    r.add_argument(
        "--harness", required=True, help="claude-code | codex | mini-swe-agent | opencode | openhands"
    )
    r.add_argument(
        "--task", required=True, help="directory with instruction.md, repo/, verify.sh (+ tests/, task.json)"
    )
    r.add_argument("--gateway", default="http://127.0.0.1:8000", help="a running `belayer serve --sandboxes`")
    r.add_argument("--model", default="policy", help="the served model name the harness asks for")
    where = r.add_mutually_exclusive_group()
    where.add_argument(
        "--inside", dest="inside", action="store_true", default=None, help="run it in the sandbox"
    )
    where.add_argument(
        "--beside", dest="inside", action="store_false", help="run it here, commands in the sandbox"
    )
    r.add_argument(
        "--keep", action="store_true", help="keep the session open and the agent's sandbox (for inspection)"
    )
    r.add_argument("--cache", default=".cache/harness", help="where harnesses are installed")
    r.add_argument("--out", help="also write the JSON report here")
    r.add_argument(
        "--fork-at",
        type=int,
        metavar="K",
        help="fork the episode at turn K (a harness inside; the gateway with --checkpoint-policy always)",
    )
    r.add_argument("--siblings", type=int, default=2, metavar="N", help="how many siblings a fork makes")
    _leaf(r, _run_episode)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run a command; a start-up error is one line on stderr that says what to change (exit code 2)."""
    args = parser().parse_args(argv)
    try:
        rc: int = args.func(args)
    except ConfigError as exc:
        print(f"{args.prog}: {exc}", file=sys.stderr)
        return 2
    except SandboxUnavailable as exc:
        print(f"{args.prog}: {_docker_down(exc)}", file=sys.stderr)
        return 2
    return rc


if __name__ == "__main__":
    sys.exit(main())
