"""The in-memory sandbox backend (no Docker): its shell, files, checkpoints and scripted faults."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from core.errors import (
    CheckpointError,
    PathEscapeError,
    RestoreError,
    SandboxArgumentError,
    SandboxError,
    SandboxFileNotFound,
    SandboxNotFound,
    SandboxTimeout,
)
from sandbox.backend import Sandbox, SandboxSpec
from sandbox.fake import FakeSandboxBackend, Fault, Shell


@pytest.fixture
def backend() -> FakeSandboxBackend:
    return FakeSandboxBackend()


@pytest.fixture
def box(backend: FakeSandboxBackend) -> Sandbox:
    return backend.create(SandboxSpec(image="img", env={"GREETING": "hi"}))


def test_the_shell_keeps_its_session_and_runs_simple_scripts(
    backend: FakeSandboxBackend, box: Sandbox
) -> None:
    r = backend.exec(box.id, "cd /tmp; export X=1 Y='a b'\necho \"$X ${Y} $GREETING\"; pwd")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "1 a b hi\n/tmp\n", "")
    assert backend.exec(box.id, "echo $X; pwd").stdout == "1\n/tmp\n"  # the session persists
    assert backend.exec(box.id, "pwd", session="other").stdout == "/workspace\n"
    r = backend.exec(box.id, "false && echo no || echo yes; nope; echo $?")
    assert (r.exit_code, r.stdout, r.stderr) == (0, "yes\n127\n", "sh: nope: not found\n")
    assert backend.exec(box.id, "exit 3; echo never").exit_code == 3
    assert backend.exec(box.id, "echo n", cwd="/w", env={"Z": "z"}).stdout == "n\n"
    assert backend.exec(box.id, "echo $Z; pwd").stdout == "z\n/w\n"  # cwd and env persist too
    with pytest.raises(SandboxArgumentError, match="does not support"):
        backend.exec(box.id, "echo a | cat")


def test_files_through_the_shell_and_the_api(backend: FakeSandboxBackend, box: Sandbox) -> None:
    backend.exec(box.id, "echo one > a; echo two >> a; touch e; mkdir -p d")
    assert backend.read_file(box.id, "a") == b"one\ntwo\n"
    backend.write_file(box.id, "/workspace/d/b", b"bee")
    assert backend.exec(box.id, "cat d/b e; rm a; cat a").stdout == "bee"
    with pytest.raises(SandboxFileNotFound):
        backend.read_file(box.id, "a")
    with pytest.raises(SandboxError, match="is a directory"):
        backend.read_file(box.id, "d")
    with pytest.raises(PathEscapeError):
        backend.read_file(box.id, "../etc/passwd")


def test_timeouts_and_output_limits(backend: FakeSandboxBackend, box: Sandbox) -> None:
    with pytest.raises(SandboxTimeout) as raised:
        backend.exec(box.id, "echo partial; sleep 5", timeout_s=0.05)
    assert raised.value.stdout == "partial\n"
    r = backend.exec(box.id, "echo 0123456789", max_output_bytes=4)
    assert (r.stdout, r.stdout_truncated) == ("0123", True)


def test_a_checkpoint_is_a_copy_restored_into_a_new_sandbox(
    backend: FakeSandboxBackend, box: Sandbox
) -> None:
    backend.exec(box.id, "cd /tmp; N=1; echo kept > /workspace/f")
    ckpt = backend.checkpoint(box.id, label="turn-1")
    backend.exec(box.id, "N=2; echo later >> /workspace/f")
    backend.destroy(box.id)

    restored = backend.restore(ckpt)

    assert restored.id != box.id and backend.sandboxes == [restored.id]
    assert backend.exec(restored.id, "echo $N; pwd; cat /workspace/f").stdout == "1\n/tmp\nkept\n"
    assert (ckpt.label, ckpt.dump_bytes, ckpt.sandbox_id) == ("turn-1", 5, box.id)
    backend.delete_checkpoint(ckpt)
    with pytest.raises(SandboxNotFound):
        backend.restore(ckpt)
    assert backend.ops("restore") == [ckpt.id, ckpt.id]


def test_status_kill_and_destroy(backend: FakeSandboxBackend, box: Sandbox) -> None:
    assert backend.status(box.id).running
    backend.kill(box.id, oom=True)
    status = backend.status(box.id)
    assert (status.running, status.exit_code, status.failure_kind) == (False, 137, "oom")
    with pytest.raises(SandboxError, match="is not running"):
        backend.exec(box.id, "true")
    with pytest.raises(CheckpointError):
        backend.checkpoint(box.id)
    backend.destroy(box.id)
    for call in (lambda: backend.status(box.id), lambda: backend.destroy(box.id)):
        with pytest.raises(SandboxNotFound):
            call()


@pytest.mark.parametrize(
    ("op", "error"),
    [("checkpoint", CheckpointError), ("delete_checkpoint", CheckpointError), ("restore", RestoreError)],
)
def test_fail_faults_raise_the_operations_error_once(
    backend: FakeSandboxBackend, box: Sandbox, op: str, error: type[Exception]
) -> None:
    ckpt = backend.checkpoint(box.id)
    backend.inject(Fault(op))  # type: ignore[arg-type]
    calls: dict[str, Callable[[], object]] = {
        "checkpoint": lambda: backend.checkpoint(box.id),
        "delete_checkpoint": lambda: backend.delete_checkpoint(ckpt),
        "restore": lambda: backend.restore(ckpt),
    }
    with pytest.raises(error, match="injected fault"):
        calls[op]()
    calls[op]()  # consumed: the next call works
    assert backend.faults == []


def test_exec_faults(backend: FakeSandboxBackend, box: Sandbox) -> None:
    other = backend.create(SandboxSpec(image="img"))
    backend.inject(Fault("exec", "break", sandbox_id=other.id))
    assert backend.exec(box.id, "echo fine").stdout == "fine\n"  # the fault waits for its sandbox
    with pytest.raises(SandboxError, match="transport broke"):
        backend.exec(other.id, "echo x > ran")
    assert backend.status(other.id).running and backend.exec(other.id, "cat ran").exit_code == 1
    backend.inject(Fault("exec", "kill"))
    with pytest.raises(SandboxError, match="exit code 137"):
        backend.exec(box.id, "true")
    assert not backend.status(box.id).running


def test_a_hung_exec_ends_when_its_sandbox_is_destroyed(backend: FakeSandboxBackend, box: Sandbox) -> None:
    backend.inject(Fault("exec", "hang"))
    failed: list[BaseException] = []

    def call() -> None:
        try:
            backend.exec(box.id, "true")
        except SandboxError as exc:
            failed.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.05)
    assert thread.is_alive()
    backend.destroy(box.id)
    thread.join(timeout=30)  # returns as soon as it ends; 30: a loaded machine, not a hang
    assert not thread.is_alive() and len(failed) == 1


def test_block_faults_and_command_handlers_wait_for_an_event(
    backend: FakeSandboxBackend, box: Sandbox
) -> None:
    go = threading.Event()

    def wait_go(shell: Shell, argv: list[str]) -> int:
        shell.wait(go)
        shell.print("went\n")
        return 0

    backend.commands["wait-go"] = wait_go
    results: list[str] = []
    thread = threading.Thread(target=lambda: results.append(backend.exec(box.id, "wait-go").stdout))
    thread.start()
    time.sleep(0.05)
    assert results == []
    go.set()
    thread.join(timeout=30)  # returns as soon as it ends; 30: a loaded machine, not a hang
    assert results == ["went\n"]
    release = threading.Event()
    backend.inject(Fault("checkpoint", "block", release=release))
    threading.Timer(0.05, release.set).start()
    started = time.monotonic()
    backend.checkpoint(box.id)
    assert time.monotonic() - started >= 0.04


def test_the_fake_network_addresses_gateway_sandboxes(backend: FakeSandboxBackend) -> None:
    on = backend.create(SandboxSpec(image="img", network="gateway"))
    off = backend.create(SandboxSpec(image="img"))
    assert (backend.network.address(on.id), backend.network.address(off.id)) == ("10.99.0.2", None)
    backend.network.open_gateway(8080)
    assert (backend.network.gateway_address(), backend.network.open_ports) == ("10.99.0.1", {8080})
    backend.destroy(on.id)
    assert backend.network.address(on.id) is None
