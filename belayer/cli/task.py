"""``belayer task build DIR`` and ``belayer task prune``: the cached task images (`sandbox.task_images`).

``build`` builds a task's environment image (its base image, repo/ and task.json's ``setup`` steps; for a
Harbor task, ``docker build`` of environment/ with its base images found here first: `sandbox.dockerfiles`)
unless one with the same content hash exists, and prints its name; ``run-episode`` then starts from it.
``prune`` removes task images beyond the ``--keep`` newest and those older than ``--older-than``.

Example::

    belayer task build tasks/fix-greet                 # belayer-task:fix-greet-3f1c…  built in 2.1s
    belayer task build harbor/hello --base-image ubuntu:24.04=belayer-sandbox-python
    belayer task prune --keep 50 --older-than 14d
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def add_arguments(
    sub: argparse._SubParsersAction[argparse.ArgumentParser],
    leaf: Callable[[argparse.ArgumentParser, Callable[[argparse.Namespace], int]], None],
    older_than: Callable[[str], float],
) -> None:
    t = sub.add_parser("task", help="task images: build once, reuse in every episode")
    tsub = t.add_subparsers(dest="task_command", required=True)
    b = tsub.add_parser("build", help="build a task's environment image (cached by content hash)")
    b.add_argument(
        "dir",
        help="the task directory: Belayer's (instruction.md, repo/, verify.sh, task.json) or Harbor's (task.toml)",
    )
    b.add_argument("--harness", help="build on this harness's image (one that runs inside the sandbox)")
    b.add_argument("--cache", default=".cache/harness", help="where harnesses are installed")
    add_allow_setup_cap(b)
    add_harbor_image_flags(b)
    leaf(b, _build)
    p = tsub.add_parser("prune", help="remove old task images")
    p.add_argument("--keep", type=int, default=20, help="keep this many of the newest (default 20)")
    p.add_argument("--older-than", metavar="DURATION", help="also remove any older than this (7d, 12h)")
    p.add_argument("--task", help="only this task's images (its directory name)")

    def prune(args: argparse.Namespace) -> int:
        return _prune(args, older_than(args.older_than) if args.older_than else None)

    leaf(p, prune)


def add_allow_setup_cap(p: argparse.ArgumentParser) -> None:
    """``--allow-setup-cap CAP``: the operator lets a task's setup have one capability beyond Docker's
    default ones (`sandbox.task_images.SETUP_CAPS`); a task cannot grant itself one."""
    p.add_argument(
        "--allow-setup-cap", action="append", default=[], metavar="CAP",
        help="let a task's setup_cap_add hold this capability (SYS_PTRACE...) beyond Docker's default "
        "ones; repeatable. Without it such a task is refused: the capability reaches past its container",
    )  # fmt: skip


def add_harbor_image_flags(p: argparse.ArgumentParser) -> None:
    """``--base-image NAME=LOCAL`` and ``--build-network``: how a Harbor task's Dockerfile is built here."""
    p.add_argument(
        "--base-image", action="append", default=[], metavar="NAME=LOCAL", type=base_image,
        help="build a Harbor task's Dockerfile FROM the local image LOCAL where it says FROM NAME (e.g. "
        "ubuntu:24.04=belayer-sandbox-python); repeatable, part of the image's cache key. Belayer never "
        "pulls: a base image that is neither here nor mapped is an error that names it",
    )  # fmt: skip
    p.add_argument(
        "--build-network", action="store_true",
        help="give a Harbor Dockerfile's RUN steps the network while it is built (default: none)",
    )  # fmt: skip


def base_image(text: str) -> tuple[str, str]:
    """``NAME=LOCAL`` as a pair (argparse's type for ``--base-image``)."""
    name, sep, local = text.partition("=")
    if not sep or not name.strip() or not local.strip():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not NAME=LOCAL (e.g. ubuntu:24.04=belayer-sandbox-python)"
        )
    return name.strip(), local.strip()


def _build(args: argparse.Namespace) -> int:
    from core.errors import HarnessError, ImageBuildError, TaskError
    from harness_adapters.episode import EpisodeRunner
    from harness_adapters.registry import adapter
    from harness_adapters.task import Task, build_harbor_image, build_task_image

    try:
        task = Task.load(Path(args.dir))
        if args.harness:
            harness = adapter(args.harness, Path(args.cache))
            harness.install()
            runner = EpisodeRunner(
                "http://unused", harness, allow_setup_caps=tuple(args.allow_setup_cap),
                base_images=dict(args.base_image), build_network=args.build_network,
            )  # fmt: skip
            image = runner.task_image(task, inside=True)
        elif task.harbor is not None:
            image = build_harbor_image(task, dict(args.base_image), network=args.build_network)
        else:
            image = build_task_image(task, allow_caps=tuple(args.allow_setup_cap))
    except (TaskError, HarnessError, ImageBuildError) as exc:
        sys.stderr.write(f"belayer task build: {exc}\n")
        return 2
    how = "cached" if image.cached else "built"
    sys.stdout.write(f"{image.name}  {how} in {image.seconds:.2f}s\n")
    return 0


def _prune(args: argparse.Namespace, max_age_s: float | None) -> int:
    from sandbox.backends import backend_for
    from sandbox.task_images import prune_task_images

    with backend_for() as backend:
        removed, busy = prune_task_images(backend, keep=args.keep, max_age_s=max_age_s, task=args.task)
    sys.stdout.write(
        f"removed {len(removed)} task images" + (f": {', '.join(removed)}" if removed else "") + "\n"
    )
    if busy:
        sys.stdout.write(f"kept {len(busy)} still used by a container: {', '.join(busy)}\n")
    return 0
