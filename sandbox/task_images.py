"""Task images: a task's environment (its repository and setup steps) built once into an image and
reused by every episode, keyed by the hash of what went into it.

The key hashes the base image's id, the working directory, every repository file (path, mode, bytes)
and the setup commands, so a changed file, step or base image is a new image; the same inputs on another
day are the same image. Images carry labels (``belayer.task``, ``belayer.task.hash``) that
`prune_task_images` goes by.

Example::

    with backend_for() as backend:
        image, cached = ensure_task_image(backend, "fix-greet", "belayer-sandbox-python", files, ["pip install -e ."])
        box = backend.create(SandboxSpec(image=image))       # /workspace holds the repository, set up
"""

from __future__ import annotations

import hashlib
import io
import re
import tarfile
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from core.errors import ImageBuildError, TaskError

TASK_LABEL = "belayer.task"
HASH_LABEL = "belayer.task.hash"
REPOSITORY = "belayer-task"
SETUP_CAPS = frozenset({
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
})  # fmt: skip
"""The capabilities a task's setup may ask for (``setup_cap_add``) on its own: Docker's default set, less
``NET_RAW``. Any other (``SYS_ADMIN``, ``SYS_PTRACE``, ``NET_ADMIN``...) reaches past the container, on
every node that builds the image, so the operator must allow it by name (`ensure_task_image`'s
``allow_caps``, ``belayer task build --allow-setup-cap``)."""


Need = tuple[str, tuple[str, ...]]
"""What a sandbox runs from a task's image, and the paths that provide it (any one will do)."""
SANDBOX_NEEDS: tuple[Need, ...] = (
    ("/bin/sh (the sandbox's shells run every command with it)", ("/bin/sh",)),
    ("find (a clean verification empties the working directory with it)", ("/usr/bin/find", "/bin/find")),
    ("rm (stale reward files are removed with it before the tests run)", ("/bin/rm", "/usr/bin/rm")),
)
"""What every Belayer sandbox needs of an image it did not build itself: the supervisor (PID 1) and its
tools are Belayer's own static busybox, put in at start, and files move through the engine's archive
API (no ``tar`` in the image)."""


class TaskImageStore(Protocol):
    """What task images need from an engine (`DockerSandboxBackend` provides it)."""

    def has_image(self, name: str) -> bool: ...

    def image_id(self, name: str) -> str: ...

    def build_image(
        self,
        name: str,
        base: str,
        tar: bytes,
        script: str,
        *,
        labels: dict[str, str],
        workdir: str = "/workspace",
        timeout_s: float = 1800.0,
        network: bool = False,
        cap_add: tuple[str, ...] = (),
    ) -> str: ...

    def images(self, label: str) -> list[dict[str, Any]]: ...

    def remove_image(self, name: str) -> bool: ...


class DockerfileStore(TaskImageStore, Protocol):
    """What a task image built from a Dockerfile needs besides (`DockerSandboxBackend` provides it)."""

    def build_dockerfile(
        self,
        name: str,
        context: bytes,
        *,
        labels: dict[str, str],
        timeout_s: float = 600.0,
        network: bool = False,
    ) -> str: ...

    def missing_in_image(self, name: str, needs: list[Need]) -> list[str]: ...

    def derive_image(self, name: str, base: str, files: dict[str, Path]) -> None: ...


@dataclass(frozen=True, slots=True)
class TaskImage:
    name: str
    cached: bool
    """True: it was there already; False: built now."""
    seconds: float
    setup_output: str = ""


def task_image_key(base_id: str, workdir: str, files: list[tuple[str, bytes, int]], setup: list[str]) -> str:
    """The content hash of a task's environment.

    >>> task_image_key("sha256:0", "/workspace", [("a.py", b"x", 0o644)], [])[:12]
    '14d41f5d15c1'
    """
    h = hashlib.sha256()
    for part in (base_id, workdir, *setup):
        h.update(part.encode() + b"\0")
    for path, data, mode in sorted(files):
        h.update(f"{path}\0{mode:o}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()


def task_image_name(task: str, key: str) -> str:
    """``belayer-task:<task>-<key[:16]>`` (the task's name made tag-safe).

    >>> task_image_name("Fix greet!", "0123456789abcdef0123")
    'belayer-task:fix-greet-0123456789abcdef'
    """
    slug = re.sub(r"[^a-z0-9_.-]+", "-", task.lower()).strip("-.")[:64] or "task"
    return f"{REPOSITORY}:{slug}-{key[:16]}"


def ensure_task_image(
    store: TaskImageStore,
    task: str,
    base: str,
    files: list[tuple[str, bytes, int]],
    setup: list[str],
    *,
    workdir: str = "/workspace",
    setup_timeout_s: float = 1800.0,
    setup_network: bool = False,
    setup_cap_add: tuple[str, ...] = (),
    allow_caps: Collection[str] = (),
) -> TaskImage:
    """The task's image: found by its content hash, or built from `base` (repository files unpacked in
    `workdir`, then the `setup` commands run there as ``sh -ec``).

    Setup runs under a sandbox's own limits: every capability dropped but `setup_cap_add`,
    no-new-privileges, the sandbox's memory, process and disk limits, and no network unless
    `setup_network` (a task that downloads its dependencies says so). Neither is part of the key: the
    same inputs make the same image, or none. A capability outside `SETUP_CAPS` and the operator's
    `allow_caps` is a `TaskError`, before anything is built."""
    check_setup_caps(task, setup_cap_add, allow_caps)
    started = time.monotonic()
    key = task_image_key(store.image_id(base), workdir, files, setup)
    name = task_image_name(task, key)
    if store.has_image(name):
        return TaskImage(name, True, time.monotonic() - started)
    script = "set -e\n" + "\n".join(setup or [":"]) + "\n"
    labels = {TASK_LABEL: task, HASH_LABEL: key, "belayer.task.base": base}
    output = store.build_image(
        name, base, repository_tar(files, workdir), script, labels=labels, workdir=workdir,
        timeout_s=setup_timeout_s, network=setup_network, cap_add=setup_cap_add,
    )  # fmt: skip
    return TaskImage(name, False, time.monotonic() - started, output)


def ensure_dockerfile_image(
    store: DockerfileStore,
    task: str,
    context: list[tuple[str, bytes, int]],
    *,
    dockerfile: str = "Dockerfile",
    where: str = "environment/Dockerfile",
    base_images: Mapping[str, str] | None = None,
    timeout_s: float = 600.0,
    network: bool = False,
    needs: tuple[Need, ...] = SANDBOX_NEEDS,
) -> TaskImage:
    """The task's image built by ``docker build`` of `context` (files relative to the build context,
    `dockerfile` among them), found by its content hash or built now.

    Offline first: every image the Dockerfile builds from (`sandbox.dockerfiles`), after the operator's
    `base_images` mapping (``NAME`` → a local image), must be on the engine, or nothing is built and the
    error says how to provide it; the engine never asks a registry. The key hashes those images' ids, the
    mapped Dockerfile and every context file, so a new mapping or a changed base is a new image. The
    builder's ``RUN`` steps have no network unless `network`. A new image that lacks one of `needs`
    (`SANDBOX_NEEDS`, plus e.g. the test script's interpreter) is removed again and refused by name."""
    from sandbox.dockerfiles import map_bases, missing_base_message

    started = time.monotonic()
    files = {path: (data, mode) for path, data, mode in context}
    if dockerfile not in files:
        raise TaskError(f"task {task}: {where} is missing")
    mapped, bases = map_bases(files[dockerfile][0].decode(errors="replace"), base_images or {})
    missing = [b for b in bases if not store.has_image(b)]
    if missing:
        raise ImageBuildError(missing_base_message(task, where, missing))
    files[dockerfile] = (mapped.encode(), files[dockerfile][1])
    tree = [(p, d, m) for p, (d, m) in files.items()]
    key = task_image_key("\0".join(store.image_id(b) for b in bases), "dockerfile:" + dockerfile, tree, [])
    name = task_image_name(task, key)
    if store.has_image(name):
        return TaskImage(name, True, time.monotonic() - started)
    labels = {TASK_LABEL: task, HASH_LABEL: key, "belayer.task.base": ",".join(bases)}
    output = store.build_dockerfile(
        name, context_tar(tree), labels=labels, timeout_s=timeout_s, network=network
    )
    lacks = store.missing_in_image(name, list(needs))
    if lacks:
        store.remove_image(name)
        raise ImageBuildError(
            f"task {task}: its image (from {where}) lacks {'; '.join(lacks)}; install it in the Dockerfile or "
            "build from a base image that has it"
        )
    return TaskImage(name, False, time.monotonic() - started, output)


def ensure_harness_layer(
    store: DockerfileStore, task: str, base: str, harness: str, version: str, files: dict[str, Path]
) -> TaskImage:
    """Task image `base` plus a harness's files (container path → host file), for a harness that runs
    inside the sandbox of a task that brings its own image (a Harbor task); keyed by the base's id, the
    harness and its version."""
    started = time.monotonic()
    key = task_image_key(store.image_id(base), f"harness:{harness}:{version}", [], sorted(files))
    name = task_image_name(task, key)
    if store.has_image(name):
        return TaskImage(name, True, time.monotonic() - started)
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise ImageBuildError(
            f"cannot add {harness} {version} to {base}: missing {missing}; install it first"
        )
    store.derive_image(name, base, files)
    return TaskImage(name, False, time.monotonic() - started)


def check_setup_caps(task: str, asked: Collection[str], allowed: Collection[str] = ()) -> None:
    """Refuse a task's setup capabilities outside `SETUP_CAPS` and the operator's `allowed` (names as
    Docker takes them, with or without ``CAP_``, in any case).

    >>> check_setup_caps("t", ["chown"])
    >>> check_setup_caps("t", ["SYS_ADMIN"], allowed=["cap_sys_admin"])
    >>> check_setup_caps("t", ["SYS_ADMIN", "CHOWN"])
    Traceback (most recent call last):
    ...
    core.errors.TaskError: task t asks for capability SYS_ADMIN during setup (setup_cap_add), which reaches past its container; allow it with belayer task build --allow-setup-cap SYS_ADMIN (or run-episode's), or drop it from task.json
    """
    permitted = SETUP_CAPS | {_cap(c) for c in allowed}
    refused = sorted({_cap(c) for c in asked} - permitted)
    if refused:
        names = ", ".join(refused)
        flags = " ".join(f"--allow-setup-cap {c}" for c in refused)
        raise TaskError(
            f"task {task} asks for capability {names} during setup (setup_cap_add), which reaches past its "
            f"container; allow it with belayer task build {flags} (or run-episode's), or drop it from task.json"
        )


def _cap(name: str) -> str:
    return name.strip().upper().removeprefix("CAP_")


def prune_task_images(
    store: TaskImageStore,
    *,
    keep: int = 20,
    max_age_s: float | None = None,
    task: str | None = None,
    now: float | None = None,
) -> tuple[list[str], list[str]]:
    """Remove task images (only `task`'s, when given) beyond the `keep` newest, and any older than
    `max_age_s`. Returns (removed, kept because a container still uses them)."""
    now = time.time() if now is None else now
    label = TASK_LABEL if task is None else f"{TASK_LABEL}={task}"
    found = sorted(store.images(label), key=lambda img: img["created"], reverse=True)
    removed: list[str] = []
    busy: list[str] = []
    for rank, img in enumerate(found):
        too_old = max_age_s is not None and now - img["created"] > max_age_s
        if rank < keep and not too_old:
            continue
        (removed if store.remove_image(img["name"]) else busy).append(img["name"])
    return removed, busy


def repository_tar(files: list[tuple[str, bytes, int]], workdir: str) -> bytes:
    """The repository's files under `workdir`, as a tar to unpack at ``/``."""
    buf = io.BytesIO()
    root = workdir.strip("/")
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(root)
        info.type, info.mode = tarfile.DIRTYPE, 0o755
        tar.addfile(info)
        for path, data, mode in sorted(files):
            info = tarfile.TarInfo(f"{root}/{path}")
            info.size, info.mode, info.mtime = len(data), mode, int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def context_tar(files: list[tuple[str, bytes, int]]) -> bytes:
    """A build context: `files` under their relative paths (dated 0: the same files, the same tar)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path, data, mode in sorted(files):
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
