"""The Docker backend on a real engine with real CRIU: sessions, timeouts, files, checkpoint/restore."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from core.errors import (
    PathEscapeError,
    SandboxError,
    SandboxFileNotFound,
    SandboxNotFound,
    SandboxTimeout,
)
from sandbox.backend import Sandbox, SandboxSpec
from sandbox.config import DockerBackendConfig
from sandbox.docker_backend import DockerSandboxBackend, containerd
from sandbox.workloads import PYTHON_COUNTER_QUERY as PY_GET
from sandbox.workloads import PYTHON_COUNTER_SERVER as SERVER
from sandbox.workloads import SHELL_COUNTER_SERVER as COUNTER_SERVER
from tests.support import poll

pytestmark = pytest.mark.docker

BUMP = 'kill -USR1 "$(cat /workspace/server.pid)"; sleep 0.4; cat /workspace/count'


def test_exec_returns_output_and_exit_code(backend: DockerSandboxBackend, box: Sandbox) -> None:
    result = backend.exec(box.id, "echo out; echo err >&2; false")
    assert (result.exit_code, result.stdout, result.stderr) == (1, "out\n", "err\n")
    assert not result.stdout_truncated and not result.stderr_truncated


def test_session_keeps_cwd_and_variables(backend: DockerSandboxBackend, box: Sandbox) -> None:
    backend.exec(box.id, "cd /tmp; X=42")
    assert backend.exec(box.id, 'echo "$X $(pwd)"').stdout == "42 /tmp\n"
    result = backend.exec(box.id, 'echo "$GREETING $(pwd)"', cwd="/workspace", env={"GREETING": "hi 'there'"})
    assert result.stdout == "hi 'there' /workspace\n"
    assert backend.exec(box.id, 'echo "$GREETING $(pwd)"').stdout == "hi 'there' /workspace\n"


def test_sessions_are_independent(backend: DockerSandboxBackend, box: Sandbox) -> None:
    backend.exec(box.id, "cd /tmp; V=a", session="a")
    assert backend.exec(box.id, 'echo "$V $(pwd)"', session="b").stdout == " /workspace\n"
    assert backend.exec(box.id, 'echo "$V $(pwd)"', session="a").stdout == "a /tmp\n"


def test_exit_and_syntax_errors_are_results(backend: DockerSandboxBackend, box: Sandbox) -> None:
    backend.exec(box.id, "cd /tmp; export KEPT=1")
    assert backend.exec(box.id, "exit 7").exit_code == 7
    assert backend.exec(box.id, 'echo "$KEPT $(pwd)"').stdout == "1 /tmp\n"  # respawned, resumed
    bad = backend.exec(box.id, "if then")
    assert bad.exit_code == 2
    assert "syntax error" in bad.stderr


def test_timeout_kills_only_the_command(backend: DockerSandboxBackend, box: Sandbox) -> None:
    backend.exec(box.id, "X=1; sleep 300 >/dev/null 2>&1 & echo $! > /workspace/bg.pid")
    started = time.monotonic()
    with pytest.raises(SandboxTimeout) as caught:
        backend.exec(box.id, "echo started; sleep 1000", timeout_s=1)
    # Ended by its timeout, not by the command (which sleeps 1000 s): the bound is generous because a
    # loaded machine delays `docker exec` and the kill by seconds.
    assert 1.0 <= time.monotonic() - started < 60
    assert caught.value.stdout == "started\n"
    # the shell survived (X is still set) and so did the earlier background process
    result = backend.exec(box.id, 'echo "$X"; kill -0 "$(cat /workspace/bg.pid)" && echo bg-alive')
    assert result.stdout == "1\nbg-alive\n"


def test_timeout_in_a_builtin_loop_respawns_the_session(backend: DockerSandboxBackend, box: Sandbox) -> None:
    backend.exec(box.id, "cd /tmp; export KEEP=yes; LOST=1")
    started = time.monotonic()
    with pytest.raises(SandboxTimeout):
        backend.exec(box.id, "while :; do :; done", timeout_s=1)
    assert time.monotonic() - started < 60  # the loop never ends: the timeout ended it (see above)
    # exported variables and cwd are resumed; plain shell variables die with the shell
    assert backend.exec(box.id, 'echo "$KEEP-$LOST-$(pwd)"').stdout == "yes--/tmp\n"


def test_output_is_bounded(backend: DockerSandboxBackend, box: Sandbox) -> None:
    result = backend.exec(box.id, "yes | head -c 100000", max_output_bytes=1000)
    assert result.stdout == "y\n" * 500
    assert result.stdout_truncated and not result.stderr_truncated


def test_files_round_trip(backend: DockerSandboxBackend, box: Sandbox) -> None:
    payload = bytes(range(256)) * 3
    backend.write_file(box.id, "sub/dir/data.bin", payload)
    assert backend.read_file(box.id, "/workspace/sub/dir/data.bin") == payload
    backend.write_file(box.id, "/workspace/note.txt", b"hello\n")
    assert backend.exec(box.id, "cat note.txt").stdout == "hello\n"
    with pytest.raises(SandboxFileNotFound):
        backend.read_file(box.id, "missing.txt")


@pytest.mark.parametrize(
    "path", ["../etc/passwd", "/etc/passwd", "sub/../../etc/shadow", "/workspace/../root/x", "/workspace", ""]
)
def test_paths_cannot_escape_the_root(backend: DockerSandboxBackend, box: Sandbox, path: str) -> None:
    with pytest.raises(PathEscapeError):
        backend.read_file(box.id, path)
    with pytest.raises(PathEscapeError):
        backend.write_file(box.id, path, b"x")


def test_symlink_out_of_the_root_is_refused(backend: DockerSandboxBackend, box: Sandbox) -> None:
    backend.exec(box.id, "ln -s /etc/passwd /workspace/link")
    with pytest.raises(PathEscapeError):
        backend.read_file(box.id, "link")


def test_unknown_sandbox(backend: DockerSandboxBackend, docker_config: DockerBackendConfig) -> None:
    with pytest.raises(SandboxNotFound):
        backend.exec("belayer-sbx-doesnotexist", "true")
    before = set(docker_config.checkpoint_dir.iterdir())
    with pytest.raises(SandboxNotFound):
        backend.checkpoint("belayer-sbx-doesnotexist")
    assert set(docker_config.checkpoint_dir.iterdir()) == before  # the failed checkpoint left nothing
    with pytest.raises(SandboxNotFound):
        backend.destroy("belayer-sbx-doesnotexist")
    with pytest.raises(SandboxNotFound):
        backend.load_checkpoint("doesnotexist")
    with pytest.raises(SandboxNotFound):
        backend.create(SandboxSpec(image="belayer-no-such-image"))


def test_checkpoint_restores_processes_and_files_in_a_new_container(
    backend: DockerSandboxBackend, box: Sandbox, make_sandbox: list[Sandbox]
) -> None:
    backend.exec(box.id, COUNTER_SERVER)
    assert backend.exec(box.id, BUMP).stdout == "1\n"
    assert backend.exec(box.id, BUMP).stdout == "2\n"
    backend.write_file(box.id, "kept.txt", b"before\n")
    backend.write_file(box.id, "deleted.txt", b"gone\n")
    backend.exec(box.id, "rm /workspace/deleted.txt; mkdir -p /workspace/sub; cd /workspace/sub; FOO=bar")

    ckpt = backend.checkpoint(box.id, label="turn-2")
    # the sandbox keeps running after a checkpoint; what happens next must not leak into the restore
    assert backend.exec(box.id, 'echo "$FOO $(pwd)"').stdout == "bar /workspace/sub\n"
    backend.write_file(box.id, "after.txt", b"after\n")
    backend.write_file(box.id, "kept.txt", b"changed\n")
    assert backend.exec(box.id, BUMP).stdout == "3\n"
    backend.destroy(box.id)

    restored = backend.restore(backend.load_checkpoint(ckpt.id))  # the record on disk is enough
    make_sandbox.append(restored)
    assert restored.id != box.id
    # where the restore's time went: this engine runs containerd itself, so CRIU's log is found
    phases = dict(restored.restore_phases)
    assert list(phases) == ["container_create", "dump_stage", "engine_start", "criu_restore"]
    assert all(seconds >= 0 for seconds in phases.values()), phases
    assert backend.exec(restored.id, 'echo "$FOO $(pwd)"').stdout == "bar /workspace/sub\n"
    assert backend.exec(restored.id, BUMP).stdout == "3\n"  # n was 2 in memory at the checkpoint
    assert backend.read_file(restored.id, "kept.txt") == b"before\n"
    for gone in ("after.txt", "deleted.txt"):
        with pytest.raises(SandboxFileNotFound):
            backend.read_file(restored.id, gone)
    backend.destroy(restored.id)
    backend.delete_checkpoint(ckpt)


def test_background_output_does_not_block_checkpoints(backend: DockerSandboxBackend, box: Sandbox) -> None:
    # The job's stdout is the request's output file; deleting it would leave CRIU a 3 MB ghost file.
    backend.exec(box.id, "sh -c 'head -c 3000000 /dev/zero; echo done; sleep 1000' &")
    assert backend.exec(box.id, "echo next").stdout == "next\n"
    ckpt = backend.checkpoint(box.id)
    backend.delete_checkpoint(ckpt)
    kept = backend.exec(box.id, "cat /.belayer/s/main/bg/*.out | wc -c").stdout
    assert kept == "3000005\n"


def test_python_server_state_survives_restore(
    backend: DockerSandboxBackend, python_image: str, make_sandbox: list[Sandbox]
) -> None:
    box = backend.create(SandboxSpec(image=python_image, shell="/bin/bash"))
    make_sandbox.append(box)
    backend.write_file(box.id, "server.py", SERVER.encode())
    backend.exec(box.id, "python3 server.py >/dev/null 2>&1 & sleep 0.1")
    backend.exec(box.id, "for i in $(seq 50); do " + PY_GET + " >/dev/null 2>&1 && break; sleep 0.1; done")
    assert backend.exec(box.id, PY_GET).stdout == "2\n"

    started = time.monotonic()
    ckpt = backend.checkpoint(box.id)
    checkpoint_s = time.monotonic() - started
    backend.destroy(box.id)
    started = time.monotonic()
    restored = backend.restore(ckpt)
    restore_s = time.monotonic() - started
    make_sandbox.append(restored)

    assert backend.exec(restored.id, PY_GET).stdout == "3\n"
    print(
        f"\n[timing] python server: checkpoint {checkpoint_s:.2f}s (fs {ckpt.fs_seconds:.2f}s, "
        f"criu {ckpt.process_seconds:.2f}s), restore into a new container {restore_s:.2f}s"
    )
    backend.destroy(restored.id)
    backend.delete_checkpoint(ckpt)


def test_repeated_restores_flatten_the_image_chain(
    docker_config: DockerBackendConfig, busybox_image: str, docker_engine: None
) -> None:
    config = docker_config.model_copy(update={"max_image_layers": 3})
    with DockerSandboxBackend(config) as backend:
        box = backend.create(SandboxSpec(image=busybox_image))
        backend.exec(box.id, COUNTER_SERVER)
        layers, checkpoints = [], []
        try:
            for generation in range(1, 5):
                assert backend.exec(box.id, BUMP).stdout == f"{generation}\n"
                backend.exec(box.id, f"echo {generation} >> /workspace/history")
                ckpt = backend.checkpoint(box.id)
                checkpoints.append(ckpt)
                layers.append(backend.image_layers(ckpt.image))
                backend.destroy(box.id)
                box = backend.restore(ckpt)
            assert backend.read_file(box.id, "history") == b"1\n2\n3\n4\n"
            assert max(layers) <= 3
            assert 1 in layers[1:]  # flattened at least once
        finally:
            backend.destroy(box.id)
            for ckpt in reversed(checkpoints):  # newest first: each commit is its successor's parent
                backend.delete_checkpoint(ckpt)


def test_locked_down_by_default(backend: DockerSandboxBackend, box: Sandbox) -> None:
    status = backend.exec(
        box.id, "grep -E '^(CapEff|CapBnd|NoNewPrivs):' /proc/self/status; ls /sys/class/net"
    )
    assert status.stdout.split() == [
        "CapEff:", "0000000000000000", "CapBnd:", "0000000000000000", "NoNewPrivs:", "1", "lo",
    ]  # fmt: skip
    host = backend._api.inspect_container(box.id)["HostConfig"]
    spec = SandboxSpec(image=box.spec.image)
    assert (host["Memory"], host["MemorySwap"], host["PidsLimit"], host["NanoCpus"]) == (
        spec.memory_bytes, spec.memory_bytes, spec.pids_limit, int(spec.cpus * 1e9),
    )  # fmt: skip
    assert (host["NetworkMode"], host["SecurityOpt"]) == ("none", ["no-new-privileges"])
    assert backend.status(box.id).running and backend.network.address(box.id) is None


def test_pids_limit_holds_and_a_fork_bomb_is_a_sandbox_failure(
    backend: DockerSandboxBackend, busybox_image: str, make_sandbox: list[Sandbox]
) -> None:
    box = backend.create(SandboxSpec(image=busybox_image, pids_limit=32))
    make_sandbox.append(box)
    r = backend.exec(box.id, "for i in $(seq 64); do sleep 600 & done")
    assert (r.exit_code, "can't fork" in r.stderr) == (2, True)  # the limit held
    # Every slot is taken: the session shell died of it, and the supervisor cannot fork a new one (ash
    # exits when it cannot fork), so the container stops. The error says why: the container exited, or
    # (when the exec's error comes before the container's exit is seen, which the backend waits for only
    # a second: a loaded machine) the slots ran out. Either way the manager then restores.
    with pytest.raises(SandboxError, match=r"container exited, exit code \d+|out of process slots"):
        backend.exec(box.id, "echo hello")
    poll(lambda: True if not backend.status(box.id).running else None, "the container stopped", 60.0)


def test_status_reports_a_stopped_container(
    backend: DockerSandboxBackend, busybox_image: str, make_sandbox: list[Sandbox]
) -> None:
    box = backend.create(SandboxSpec(image=busybox_image))
    make_sandbox.append(box)
    backend._api.kill(box.id)
    backend._api.wait(box.id, timeout=20)
    status = backend.status(box.id)
    assert (status.running, status.exit_code, status.oom_killed, status.failure_kind) == (
        False,
        137,
        False,
        "exited",
    )
    backend.destroy(box.id)
    with pytest.raises(SandboxNotFound):
        backend.status(box.id)


def test_back_to_back_checkpoints_of_one_container(backend: DockerSandboxBackend, box: Sandbox) -> None:
    """containerd keeps each dump's blobs (the container's spec among them, the same every time) until its
    garbage collector runs, seconds later under load; a dump whose blob is still there used to fail with
    "content sha256:…: already exists" (moby#42900, the dump side). Every checkpoint in a burst succeeds."""
    init_pid = backend._api.inspect_container(box.id)["State"]["Pid"]
    where = containerd.shim_address(init_pid)
    assert where is not None and Path(where[0]).is_socket() and where[1] == "moby"
    assert containerd.shim_address(os.getpid()) is None  # not a container's process
    backend.exec(box.id, COUNTER_SERVER)
    taken = []
    for turn in range(5):
        assert backend.exec(box.id, BUMP).stdout == f"{turn + 1}\n"
        taken.append(backend.checkpoint(box.id, label=f"turn-{turn}"))
    restored = backend.restore(taken[2])
    try:
        assert backend.exec(restored.id, BUMP).stdout == "4\n"  # n was 3 in memory at the third checkpoint
    finally:
        backend.destroy(restored.id)
        for ckpt in taken:
            backend.delete_checkpoint(ckpt)
