"""Task images on a real Docker engine (`sandbox.task_images`): built once by content hash, reused,
pruned by count and age; the setup runs under a sandbox's limits (no network, no capability, unless the
task asks)."""

from __future__ import annotations

import time

import pytest

from sandbox.backend import SandboxSpec
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.task_images import TASK_LABEL, ensure_task_image, prune_task_images

pytestmark = pytest.mark.docker

FILES = [("hello.py", b"print('hi')\n", 0o644), ("pkg/run.sh", b"echo run\n", 0o755)]
SETUP = ["echo set-up > .setup-done", "test -x pkg/run.sh"]


def test_a_task_image_is_built_once_and_holds_the_repository_set_up(
    backend: DockerSandboxBackend, python_image: str
) -> None:
    task = f"t-{time.monotonic_ns()}"
    built = ensure_task_image(backend, task, python_image, FILES, SETUP)
    try:
        again = ensure_task_image(backend, task, python_image, FILES, SETUP)
        assert (built.cached, again.cached, again.name) == (False, True, built.name)
        assert again.seconds < built.seconds
        box = backend.create(SandboxSpec(image=built.name))
        try:
            out = backend.exec(box.id, "cat .setup-done; python3 hello.py; pkg/run.sh; pwd").stdout
            assert out == "set-up\nhi\nrun\n/workspace\n"
        finally:
            backend.destroy(box.id)
        changed = ensure_task_image(backend, task, python_image, [*FILES, ("new.txt", b"", 0o644)], SETUP)
        assert changed.cached is False and changed.name != built.name
        backend.remove_image(changed.name)
        labels = {img["name"]: img["labels"] for img in backend.images(TASK_LABEL)}
        assert labels[built.name][TASK_LABEL] == task
    finally:
        backend.remove_image(built.name)


def test_a_failing_setup_step_builds_nothing(backend: DockerSandboxBackend, python_image: str) -> None:
    from core.errors import ImageBuildError

    with pytest.raises(ImageBuildError, match="exited 3"):
        ensure_task_image(backend, "broken", python_image, FILES, ["echo nope; exit 3"])


def test_prune_keeps_the_newest_and_drops_the_old(backend: DockerSandboxBackend, python_image: str) -> None:
    task = f"prune-{time.monotonic_ns()}"  # only this test's images are pruned
    names = []
    for i in range(3):
        names.append(ensure_task_image(backend, task, python_image, [*FILES, (f"{i}", b"", 0o644)], []).name)
        time.sleep(1.1)  # Docker dates images to the second: make "newest" unambiguous
    try:
        removed, busy = prune_task_images(backend, keep=3, task=task)
        assert (removed, busy) == ([], [])
        removed, busy = prune_task_images(backend, keep=2, task=task)
        assert (removed, busy) == ([names[0]], [])  # the oldest
        box = backend.create(SandboxSpec(image=names[1]))
        try:
            removed, busy = prune_task_images(backend, keep=10, max_age_s=0, task=task, now=time.time() + 10)
            assert (removed, busy) == ([names[2]], [names[1]])  # a sandbox still uses it
        finally:
            backend.destroy(box.id)
    finally:
        for name in names:
            backend.remove_image(name)


PROBE = ["ls /sys/class/net | tr '\\n' ' '; echo", "grep -E '^(CapEff|NoNewPrivs)' /proc/self/status"]


@pytest.mark.parametrize("asked", [False, True])
def test_setup_has_no_network_and_no_capability_unless_the_task_asks(
    backend: DockerSandboxBackend, busybox_image: str, asked: bool
) -> None:
    files = [("nonce", str(time.monotonic_ns()).encode(), 0o644)]  # a new image every run
    image = ensure_task_image(
        backend, "limits", busybox_image, files, PROBE, setup_network=asked,
        setup_cap_add=("CHOWN",) if asked else (),
    )  # fmt: skip
    try:
        nets, cap_eff, no_new_privs = image.setup_output.splitlines()
        assert nets.split() == (["eth0", "lo"] if asked else ["lo"])
        assert cap_eff.split() == ["CapEff:", "0000000000000001" if asked else "0000000000000000"]
        assert no_new_privs.split() == ["NoNewPrivs:", "1"]
    finally:
        backend.remove_image(image.name)
