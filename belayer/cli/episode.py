"""``belayer run-episode``: one real harness episode on a task directory through a running gateway,
then the task's verifier (`harness_adapters.episode`); forked at a turn into siblings with ``--fork-at``.
A Harbor-format task (``task.toml``) works too (`harness_adapters.harbor_task`), with ``--harness oracle``
for its reference solution, ``--base-image`` for its Dockerfile offline and ``--verify clean|shared``.

Example::

    belayer run-episode --harness mini-swe-agent --task tasks/fix-greet --gateway http://127.0.0.1:8000
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from belayer.cli.task import add_allow_setup_cap, add_harbor_image_flags


def add_arguments(r: argparse.ArgumentParser) -> None:
    """The flags of ``belayer run-episode``."""
    r.add_argument(
        "--harness", required=True,
        help="claude-code | codex | mini-swe-agent | opencode | openhands | oracle (a Harbor task's "
        "solution/solve.sh, no model)",
    )  # fmt: skip
    r.add_argument(
        "--task", required=True,
        help="a task directory: Belayer's (instruction.md, repo/, verify.sh, + tests/, task.json) or Harbor's "
        "(task.toml, instruction.md, environment/, tests/test.sh, solution/)",
    )  # fmt: skip
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
    add_allow_setup_cap(r)
    add_harbor_image_flags(r)
    r.add_argument(
        "--verify", choices=["clean", "shared"],
        help="clean (default): the tests run on a copy of the agent's working directory in a new sandbox from "
        "the clean image, so nothing the agent left elsewhere counts; shared: in the agent's own sandbox, as "
        "Harbor runs them. Over the task's [metadata] belayer_verify",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from core.errors import HarnessError, ImageBuildError, TaskError
    from harness_adapters.episode import EpisodeRunner
    from harness_adapters.registry import adapter
    from harness_adapters.task import Task

    def progress(message: str) -> None:
        print(f"[episode] {message}", file=sys.stderr, flush=True)

    try:
        task = Task.load(Path(args.task))
        harness = adapter(args.harness, Path(args.cache), model=args.model)
        token = os.environ.get("BELAYER_API_TOKEN")  # the gateway's --api-token, if it has one
        runner = EpisodeRunner(
            args.gateway, harness, progress=progress, api_token=token,
            allow_setup_caps=tuple(args.allow_setup_cap), base_images=dict(args.base_image), verify=args.verify,
            build_network=args.build_network,
        )  # fmt: skip
        report = runner.run(
            task, inside=args.inside, keep=args.keep, fork_at=args.fork_at, siblings=args.siblings
        )
    except (TaskError, HarnessError, ImageBuildError) as exc:
        print(f"belayer run-episode: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    progress(
        f"verified={report['verified']} reward={report['reward']} verify={report['verify_mode']} "
        f"turns={report['turns']} prefix_reuse={report['prefix_reuse']} "
        f"branches={report['branches']} failovers={report['failovers']}"
    )
    for sibling in report.get("fork", {}).get("siblings", []):
        progress(
            f"sibling {sibling['session_id']}: verified={sibling['verified']} turns={sibling['turns']} "
            f"reused_output_tokens={sibling['reused_output_tokens']} "
            f"reused_tool_calls={sibling['reused_tool_calls']}"
        )
    return 0
