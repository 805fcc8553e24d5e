"""A Harbor task's image on the gateway's Docker engine, with the local ``docker`` CLI: its
``docker_image`` (which must be there already), or its ``environment/Dockerfile`` built under a
content-hash tag. Nothing is ever pulled: a base image that is not on the engine is an error naming it.

Example::

    tag = image_tag("hello-world", environment_id)
    if not await has_image(tag):
        await build_image(tag, Path("task/environment"), None, logger)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import subprocess
from pathlib import Path

IMAGE_PREFIX = "belayer-harbor"


def image_tag(environment_name: str, environment_id: str) -> str:
    """``belayer-harbor-<task>:<content hash>``: the tag of a task's built image (Harbor's hash of the
    environment directory), so a later trial of the same task finds it."""
    name = re.sub(r"[^a-z0-9_.-]+", "-", environment_name.lower()).strip("-.") or "task"
    return f"{IMAGE_PREFIX}-{name}:{environment_id[:16]}"


async def prebuilt_image(docker_image: str | None) -> str:
    """The task's `docker_image`, once it is known to be on this Docker engine."""
    if docker_image is None or not await has_image(docker_image):
        raise RuntimeError(
            f"the task's docker_image {docker_image!r} is not on this Docker engine, and Belayer "
            "never pulls: load or build it first (docker load / docker build -t)"
        )
    return docker_image


async def build_image(
    tag: str, environment_dir: Path, build_network: str | None, logger: logging.Logger
) -> None:
    """``docker build`` of `environment_dir`'s Dockerfile as `tag`, its base images on this engine."""
    dockerfile = environment_dir / "Dockerfile"
    for base in base_images(dockerfile.read_text()):
        if not await has_image(base):
            raise RuntimeError(
                f"{dockerfile}: its base image {base!r} is not on this Docker engine, and Belayer never "
                "pulls: build or load it first"
            )
    argv = ["docker", "build", "-t", tag, "-f", str(dockerfile)]
    if build_network:
        argv += ["--network", build_network]
    logger.info("building %s from %s", tag, dockerfile)
    code, output = await _run(*argv, str(environment_dir))
    if code != 0:
        raise RuntimeError(f"docker build of {dockerfile} failed (exit {code}):\n{output[-4000:]}")


def base_images(dockerfile: str) -> list[str]:
    """The images a Dockerfile's stages start from, less ``scratch``, its own stages and names built
    from ARGs (which cannot be known here).

    >>> base_images("FROM belayer-sandbox-python AS base\\nRUN true\\nFROM base\\nFROM --platform=x scratch")
    ['belayer-sandbox-python']
    """
    images, stages = [], set()
    for line in dockerfile.splitlines():
        words = line.split()
        if len(words) < 2 or words[0].upper() != "FROM":
            continue
        rest = [w for w in words[1:] if not w.startswith("--")]
        if not rest:
            continue
        image = rest[0]
        if len(rest) >= 3 and rest[1].upper() == "AS":
            stages.add(rest[2].lower())
        if image.lower() not in stages and image != "scratch" and "$" not in image and image not in images:
            images.append(image)
    return images


async def _run(*argv: str) -> tuple[int, str]:
    """Run a command here; its exit code and its output (stdout and stderr together)."""
    proc = await asyncio.create_subprocess_exec(
        *argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    try:
        out, _ = await proc.communicate()
    except asyncio.CancelledError:  # Harbor's build timeout
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    return proc.returncode or 0, out.decode(errors="replace")


async def has_image(name: str) -> bool:
    code, _ = await _run("docker", "image", "inspect", "--format", "{{.Id}}", name)
    return code == 0


async def image_workdir(image: str) -> str:
    """The image's WORKDIR (``/`` when it sets none), where Harbor's commands start without a task workdir."""
    code, out = await _run("docker", "image", "inspect", "--format", "{{.Config.WorkingDir}}", image)
    return (out.strip() or "/") if code == 0 else "/"
