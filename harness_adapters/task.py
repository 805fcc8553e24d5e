"""An episode's task (`harness_adapters.episode`): loaded from its directory, and its image built.

A task is a directory::

    task/
      instruction.md   what the agent is asked to do
      repo/            the repository snapshot: the sandbox's /workspace
      verify.sh        the verifier (sh, run from /workspace in the verify stage); exit code 0 means solved
      tests/           optional hidden tests (also hidden/): with verify.sh, never in the agent's sandbox
      task.json        optional: {"max_turns": 30, "timeout_s": 600, "image": "belayer-sandbox-python",
                                  "setup": ["pip install -e ."], "protected_paths": ["test_*.py"],
                                  "on_tamper": "reset", "verify_timeout_s": 300,
                                  "setup_network": false, "setup_cap_add": []}

A directory with ``task.toml`` is a Harbor-format task instead (`harness_adapters.harbor_task`, docs/harbor.md):
its image is a ``docker build`` of environment/ (`build_harbor_image`: base images found on this host or
mapped by the operator's ``base_images``, never pulled), its working directory, variables, CPUs, memory
and network come from task.toml, and the verify stage runs tests/test.sh on Harbor's reward files, on a
clean copy (the default) or in the agent's own sandbox (``verify="shared"``, or the task's
``[metadata] belayer_verify``).

The setup stage builds the task's image once and caches it by content hash (`sandbox.task_images`):
`build_task_image` for Belayer's format, `build_harbor_image` for Harbor's; a harness inside its sandbox
gets its files under it (`harness_image`) or on top of it (`harness_layer`).

Example::

    task = Task.load(Path("tasks/fix-greet"))
    image = build_task_image(task)   # image.name, image.cached
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

from core.errors import TaskError
from harness_adapters.base import HarnessAdapter
from harness_adapters.harbor_task import HarborSpec, interpreter, load_harbor, resolve_env
from sandbox.sessions.verify_tree import is_protected
from sandbox.task_images import TaskImage, ensure_task_image

TASK_KEYS = {
    "max_turns", "timeout_s", "image", "setup", "protected_paths", "on_tamper", "verify_timeout_s",
    "setup_network", "setup_cap_add",
}  # fmt: skip
HIDDEN_DIRS = ("tests", "hidden")


@dataclass(frozen=True, slots=True)
class Task:
    name: str
    root: Path
    instruction: str
    repo: Path
    verifier: Path
    max_turns: int = 30
    timeout_s: float = 600.0
    image: str | None = None
    setup: tuple[str, ...] = ()
    protected_paths: tuple[str, ...] = ()
    on_tamper: Literal["reset", "fail"] = "reset"
    verify_timeout_s: float = 300.0
    setup_network: bool = False
    setup_cap_add: tuple[str, ...] = ()
    workdir: str = "/workspace"
    """The agent's working directory: what a clean verification copies."""
    harbor: HarborSpec | None = None
    """A Harbor-format task's ``task.toml`` (`harness_adapters.harbor_task`); None: Belayer's format."""

    @classmethod
    def load(cls, root: Path) -> Task:
        """The task at `root`: Harbor's format when it holds ``task.toml``, else Belayer's."""
        root = root.resolve()
        if (root / "task.toml").is_file():
            return cls.load_harbor(root)
        need = {
            "instruction.md": root / "instruction.md",
            "repo/": root / "repo",
            "verify.sh": root / "verify.sh",
        }
        missing = [name for name, path in need.items() if not path.exists()]
        if missing:
            raise TaskError(
                f"task {root} lacks {', '.join(missing)} (a task has instruction.md, repo/, verify.sh)"
            )
        options = _options(root / "task.json")
        return cls(
            name=root.name,
            root=root,
            instruction=(root / "instruction.md").read_text().strip(),
            repo=root / "repo",
            verifier=root / "verify.sh",
            **options,
        )

    @classmethod
    def load_harbor(cls, root: Path) -> Task:
        """A Harbor task (`harness_adapters.harbor_task`): its image is its own, its repository in it."""
        spec, instruction = load_harbor(root)
        return cls(
            name=root.name, root=root, instruction=instruction, repo=root / "environment",
            verifier=root / "tests" / "test.sh", timeout_s=spec.agent_timeout_s or 600.0,
            verify_timeout_s=spec.verifier_timeout_s, workdir=spec.workdir or "", harbor=spec,
        )  # fmt: skip

    def files(self) -> list[tuple[str, bytes, int]]:
        """The repository's files: (relative path, content, mode); none for a Harbor task (its image holds
        them)."""
        return [] if self.harbor is not None else _tree(self.repo)

    def verifier_files(self) -> list[tuple[str, bytes, int]]:
        """What the verify stage gets and the agent never sees: verify.sh and the hidden directories (a
        Harbor task's tests/, relative to it)."""
        if self.harbor is not None:
            return _tree(self.root / "tests")
        files = [("verify.sh", self.verifier.read_bytes(), 0o644)]
        for name in HIDDEN_DIRS:
            files += [(f"{name}/{path}", data, mode) for path, data, mode in _tree(self.root / name)]
        return files

    def originals(self) -> list[tuple[str, bytes, int]]:
        """The repository's own versions of the protected files."""
        return [f for f in self.files() if is_protected(f[0], self.protected_paths)]


def _options(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        options: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TaskError(f"{path} is not valid JSON: {exc}") from exc
    unknown = set(options) - TASK_KEYS
    if unknown:
        raise TaskError(f"{path}: unknown keys {sorted(unknown)} (known: {sorted(TASK_KEYS)})")
    if options.get("on_tamper", "reset") not in ("reset", "fail"):
        raise TaskError(f"{path}: on_tamper must be 'reset' or 'fail', not {options['on_tamper']!r}")
    if not isinstance(options.get("setup_network", False), bool):
        raise TaskError(f"{path}: setup_network must be true or false")
    for key in ("setup", "protected_paths", "setup_cap_add"):
        value = options.get(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise TaskError(f"{path}: {key} must be a list of strings")
        options[key] = tuple(value)
    return options


def _tree(root: Path) -> list[tuple[str, bytes, int]]:
    return [
        (str(p.relative_to(root)), p.read_bytes(), p.stat().st_mode & 0o777)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    ]


def build_task_image(task: Task, base: str | None = None, allow_caps: tuple[str, ...] = ()) -> TaskImage:
    """`task`'s image on `base` (default: task.json's ``image``, else the python sandbox image), from
    the cache or built now, on this host's Docker engine; setup capabilities beyond Docker's defaults
    only when the operator allows them (`allow_caps`, checked before anything is built)."""
    from sandbox.task_images import check_setup_caps

    if task.harbor is not None:
        return build_harbor_image(task, {})
    check_setup_caps(task.name, task.setup_cap_add, allow_caps)
    from sandbox.backends import backend_for
    from sandbox.images import ensure_python_image

    with backend_for() as backend:
        base = base or task.image or ensure_python_image(backend)
        return ensure_task_image(
            backend, task.name, base, task.files(), list(task.setup), setup_network=task.setup_network,
            setup_cap_add=task.setup_cap_add, allow_caps=allow_caps,
        )  # fmt: skip


def build_harbor_image(task: Task, base_images: Mapping[str, str], *, network: bool = False) -> TaskImage:
    """A Harbor task's image: ``docker build`` of environment/ (or of ``FROM [environment].docker_image``),
    its base images mapped by `base_images` and found on this host's engine first (never pulled), cached
    by content hash (`sandbox.task_images.ensure_dockerfile_image`); refused when it lacks what the sandbox
    runs from it (/bin/sh, find, tests/test.sh's interpreter)."""
    from sandbox.backends import backend_for
    from sandbox.task_images import SANDBOX_NEEDS, ensure_dockerfile_image

    spec = task.harbor
    if spec is None:
        raise TaskError(f"task {task.name} is not a Harbor task")
    if spec.docker_image is not None:
        context, where = (
            [("Dockerfile", f"FROM {spec.docker_image}\n".encode(), 0o644)],
            "[environment].docker_image",
        )
    else:
        context, where = _tree(task.root / "environment"), "environment/Dockerfile"
    needs = (*SANDBOX_NEEDS, *script_needs("tests/test.sh", task.verifier.read_bytes()))
    with backend_for() as backend:
        return ensure_dockerfile_image(
            backend, task.name, context, where=where, base_images=base_images, timeout_s=spec.build_timeout_s,
            network=network, needs=needs,
        )  # fmt: skip


def script_needs(name: str, script: bytes) -> list[tuple[str, tuple[str, ...]]]:
    """What an image needs to run `script` by its path, as Harbor runs it: its ``#!`` interpreter (for
    ``#!/usr/bin/env X``: env, and X on the usual PATH).

    >>> script_needs("tests/test.sh", b"#!/usr/bin/env bash\\n")[0]
    ('/usr/bin/env (tests/test.sh runs with it)', ('/usr/bin/env',))
    """
    paths = interpreter(script)
    first = script.split(b"\n", 1)[0].decode(errors="replace")
    if first.startswith("#!") and first[2:].split()[:1] == ["/usr/bin/env"] and len(paths) > 1:
        name_of = paths[0].rsplit("/", 1)[-1]
        return [
            (f"/usr/bin/env ({name} runs with it)", ("/usr/bin/env",)),
            (f"{name_of} on PATH ({name}'s interpreter)", paths),
        ]
    return [(f"{paths[0]} ({name}'s interpreter)", paths)]


def harbor_workdir(task: Task, image: str) -> Task:
    """`task` with its working directory: ``[environment].workdir``, else the image's ``WORKDIR``."""
    if task.harbor is None or task.workdir:
        return task
    from sandbox.backends import backend_for

    with backend_for() as backend:
        workdir = backend.image_workdir(image)
    if workdir in ("", "/"):
        raise TaskError(
            f"task {task.name}: its image sets no WORKDIR (or /) and task.toml no [environment].workdir; set "
            "one: the agent works there, and a clean verification copies it"
        )
    return replace(task, workdir=workdir)


def harbor_sandbox(task: Task, spec: HarborSpec, inside: bool) -> dict[str, Any]:
    """A Harbor task's sandbox fields: working directory, variables, CPUs, memory and network."""
    out: dict[str, Any] = {"workdir": task.workdir, "env": resolve_env(spec.env, "environment.env")}
    if spec.cpus is not None:
        out["cpus"] = spec.cpus
    if spec.memory_mb is not None:
        out["memory_mb"] = spec.memory_mb
    if spec.network == "public":
        if inside:
            raise TaskError(
                f"task {task.name}: environment.network_mode = 'public' gives the sandbox the network, but a "
                "harness inside its sandbox needs the gateway-only network; run a harness beside it (--beside, "
                "mini-swe-agent, openhands, oracle) or set network_mode = 'no-network'"
            )
        out["network"] = "full"
    return out


def harness_image(adapter: HarnessAdapter) -> str:
    """The image of `adapter`'s files (its installed version), on this host's Docker engine: the base
    of a Belayer task's image for a harness inside its sandbox."""
    from sandbox.backends import backend_for
    from sandbox.images import ensure_harness_image

    with backend_for() as backend:
        version = getattr(adapter, "installed_version", lambda: None)() or "latest"
        return ensure_harness_image(backend, adapter.name, version, adapter.image_files())


def harness_layer(task: Task, image: TaskImage, adapter: HarnessAdapter) -> TaskImage:
    """A Harbor task's `image` with `adapter`'s files added on top (for a harness inside its sandbox)."""
    from sandbox.backends import backend_for
    from sandbox.task_images import ensure_harness_layer

    with backend_for() as backend:
        version = getattr(adapter, "installed_version", lambda: None)() or "latest"
        files = adapter.image_files()
        layer = ensure_harness_layer(backend, task.name, image.name, adapter.name, version, files)
    return TaskImage(
        layer.name, image.cached and layer.cached, image.seconds + layer.seconds, image.setup_output
    )
