"""Sandboxes outlive the gateway, on real Docker + CRIU: a ``belayer serve --sandboxes`` process is killed
with SIGKILL and started again on the same store and checkpoint directory (`sandbox.sessions.adoption`).

- A running sandbox is adopted: the same container, its files, and a background process's in-memory
  counter intact; exec, a process inside calling the gateway through the sandbox listener, checkpoint
  and restore all work; closing the session leaves no container or checkpoint behind.
- A sandbox killed while the gateway was down is restored from its checkpoint with the journal since then
  replayed: the files read back exactly.
- A closed session's leaked container goes at start-up, with its checkpoint; containers without this
  store's label (another store's, or none) stay.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import httpx
import pytest

from core.errors import SandboxNotFound
from core.net import free_port
from sandbox.backend import SandboxSpec
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.workloads import PYTHON_COUNTER_QUERY, PYTHON_COUNTER_SERVER
from store import SqliteStore
from tests.support import ServerProcess, belayer_server

pytestmark = pytest.mark.docker

HARNESS = """
import json, os, time, urllib.request
body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
url = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
n = 0  # in memory only: numbered lines without a gap come from one process that lived through
while True:
    request = urllib.request.Request(url, body.encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status = json.load(response)["object"]
    except Exception as exc:
        status = type(exc).__name__
    n += 1
    with open("/workspace/harness.log", "a") as f:
        f.write(f"{n} {status}\\n")
    time.sleep(0.2)
"""
"""A harness inside the sandbox (Claude Code style): it calls its session through the sandbox listener
over and over, and goes on calling whatever the answer."""


@dataclass
class Restarts:
    """One store and checkpoint directory, and the gateway processes started on them in turn."""

    tmp: Path
    model: Path
    engine: str
    backend: DockerSandboxBackend
    port: int = 0
    starts: int = 0

    @property
    def store(self) -> Path:
        return self.tmp / "traj.db"

    @property
    def checkpoints(self) -> Path:
        return self.tmp / "checkpoints"

    def serve(self) -> Any:
        args = [
            "serve", "--model", str(self.model), "--engine-url", self.engine, "--store", str(self.store),
            "--sandboxes", "--checkpoint-dir", str(self.checkpoints), "--checkpoint-policy", "never",
        ]  # fmt: skip
        self.starts += 1
        return belayer_server(args, self.tmp / f"gw{self.starts}.log", port=self.port)

    def store_id(self) -> str:
        store = SqliteStore(self.store, recover=False)
        try:
            return store.store_id()
        finally:
            store.close()

    def own_containers(self) -> list[str]:
        return sorted(box.id for box in self.backend.list_sandboxes({"belayer.store": self.store_id()}))


@pytest.fixture
def restarts(
    tmp_path: Path, tiny_model_dir: Path, backend: DockerSandboxBackend, no_leaked_snapshots: None
) -> Iterator[Restarts]:
    with belayer_server(["fake-engine", "--tokens", "64"], tmp_path / "engine.log") as engine:
        env = Restarts(tmp_path, tiny_model_dir, engine.url, backend, port=free_port())
        try:
            yield env
        finally:  # a failed test may leave its store's containers: remove them, and only them
            if env.store.exists():
                for box in env.own_containers():
                    backend.destroy(box)


def kill9(gw: ServerProcess) -> None:
    os.killpg(gw.proc.pid, signal.SIGKILL)
    gw.proc.wait(timeout=10)


def call(url: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    r = httpx.request(method, f"{url}{path}", json=body, timeout=60)
    assert r.status_code in (200, 201), r.text
    return r.json()


def run(url: str, sid: str, command: str) -> dict[str, Any]:
    out: dict[str, Any] = call(url, "POST", f"/api/sessions/{sid}/sandbox/exec", {"command": command})
    return out


def count(url: str, sid: str) -> str:
    result = run(url, sid, PYTHON_COUNTER_QUERY)
    assert result["exit_code"] == 0, result
    return str(result["stdout"]).strip()


def harness_log(url: str, sid: str, done: Callable[[list[str]], bool]) -> list[str]:
    """The harness's lines, polled until `done` holds for them."""
    deadline = time.monotonic() + 30
    while True:
        result = run(url, sid, "cat harness.log 2>/dev/null")
        lines = str(result["stdout"]).splitlines()
        if lines and done(lines):
            return lines
        assert time.monotonic() < deadline, f"the harness inside never got there: {lines[-5:]}"


def start_counter(url: str, sid: str) -> None:
    """The background server, then its first hit (polled until it listens): its count is 1."""
    call(
        url,
        "PUT",
        f"/api/sessions/{sid}/sandbox/files",
        {"path": "server.py", "content": PYTHON_COUNTER_SERVER},
    )
    run(url, sid, "cd /workspace && python3 server.py >/dev/null 2>&1 &")
    deadline = time.monotonic() + 20
    while run(url, sid, PYTHON_COUNTER_QUERY)["exit_code"] != 0:
        assert time.monotonic() < deadline, "the counter server never listened"


def test_a_running_sandbox_is_adopted_by_the_restarted_gateway(restarts: Restarts, python_image: str) -> None:
    spec = {"image": python_image, "network": "gateway"}
    with restarts.serve() as gw:
        session = call(gw.url, "POST", "/api/sessions", {"sandbox": spec})
        sid, box = session["id"], session["sandbox"]["sandbox_id"]
        run(gw.url, sid, "cd /workspace && export X=kept && echo data > notes.txt")
        start_counter(gw.url, sid)
        first = call(gw.url, "POST", f"/api/sessions/{sid}/sandbox/checkpoints")
        assert count(gw.url, sid) == "2"
        call(gw.url, "PUT", f"/api/sessions/{sid}/sandbox/files", {"path": "harness.py", "content": HARNESS})
        run(gw.url, sid, "python3 harness.py >/dev/null 2>&1 & echo $! > harness.pid")
        before = harness_log(gw.url, sid, lambda lines: "chat.completion" in lines[-1])
        kill9(gw)
    assert restarts.backend.status(box).running  # the gateway died; its sandbox did not

    with restarts.serve() as gw:
        state = call(gw.url, "GET", f"/api/sessions/{sid}/sandbox")
        assert (state["sandbox_id"], state["status"]) == (box, "running")  # the same container
        assert [c["id"] for c in state["checkpoints"]] == [first["id"]]
        assert count(gw.url, sid) == "3"  # the process and its memory went on
        assert run(gw.url, sid, 'echo "$X"; cat notes.txt')["stdout"] == "kept\ndata\n"
        # the harness inside reaches its own session through the listener again, on the port it knows
        after = harness_log(
            gw.url, sid, lambda lines: len(lines) > len(before) and "chat.completion" in lines[-1]
        )
        assert [line.split()[0] for line in after] == [str(n) for n in range(1, len(after) + 1)]
        run(gw.url, sid, 'kill "$(cat harness.pid)"')
        turns = call(gw.url, "GET", f"/api/sessions/{sid}/trajectory")["turns"]
        assert sum(t["status"] == "complete" for t in turns) >= len(
            [x for x in after if "chat.completion" in x]
        )
        second = call(gw.url, "POST", f"/api/sessions/{sid}/sandbox/checkpoints")
        assert count(gw.url, sid) == "4"
        restored = call(gw.url, "POST", f"/api/sessions/{sid}/sandbox/restore", {})
        assert restored["checkpoint_id"] == second["id"] and restored["sandbox_id"] != box
        assert count(gw.url, sid) == "4"  # back to the second checkpoint's 3, plus this hit
        kinds = [e["kind"] for e in call(gw.url, "GET", f"/api/sessions/{sid}/trajectory")["events"]]
        assert kinds.count("sandbox_adopted") == 1
        call(gw.url, "POST", f"/api/sessions/{sid}/close")
        assert restarts.own_containers() == []
    assert list(restarts.checkpoints.iterdir()) == []


def test_a_sandbox_killed_while_the_gateway_was_down_is_restored(
    restarts: Restarts, busybox_image: str
) -> None:
    with restarts.serve() as gw:
        session = call(gw.url, "POST", "/api/sessions", {"sandbox": {"image": busybox_image}})
        sid, box = session["id"], session["sandbox"]["sandbox_id"]
        run(gw.url, sid, "echo one > /workspace/a")
        call(gw.url, "PUT", f"/api/sessions/{sid}/sandbox/files", {"path": "b", "content": "before\n"})
        ckpt = call(gw.url, "POST", f"/api/sessions/{sid}/sandbox/checkpoints")
        run(gw.url, sid, "cd /workspace && echo two >> a && export Y=replayed")
        call(gw.url, "PUT", f"/api/sessions/{sid}/sandbox/files", {"path": "c", "content": "after\n"})
        kill9(gw)
    docker.from_env().containers.get(box).kill()

    with restarts.serve() as gw:
        state = call(gw.url, "GET", f"/api/sessions/{sid}/sandbox")
        assert state["sandbox_id"] != box and state["status"] == "running"
        last = state["last_restore"]
        assert (last["mode"], last["checkpoint_id"], last["replayed"], last["diverged"]) == (
            "replay", ckpt["id"], 2, 0,
        )  # fmt: skip
        with pytest.raises(SandboxNotFound):
            restarts.backend.status(box)  # the dead container is gone
        files = {
            p: call(gw.url, "GET", f"/api/sessions/{sid}/sandbox/files?path={p}")["content"] for p in "abc"
        }
        assert files == {"a": "one\ntwo\n", "b": "before\n", "c": "after\n"}
        assert run(gw.url, sid, 'echo "$Y"; pwd')["stdout"] == "replayed\n/workspace\n"
        events = call(gw.url, "GET", f"/api/sessions/{sid}/trajectory")["events"]
        failure = next(e["data"] for e in events if e["kind"] == "sandbox_failure")
        assert failure["kind"] == "exited" and failure["sandbox_id"] == box
        assert failure["detail"].startswith(
            "the sandbox stopped while the gateway was down: container exited"
        )
        call(gw.url, "POST", f"/api/sessions/{sid}/close")
        assert restarts.own_containers() == []


def test_leaked_containers_are_removed_and_foreign_ones_left(
    restarts: Restarts, busybox_image: str, backend: DockerSandboxBackend
) -> None:
    foreign = [
        backend.create(SandboxSpec(image=busybox_image, labels={"belayer.store": "another-store"})),
        backend.create(SandboxSpec(image=busybox_image)),
    ]
    try:
        with restarts.serve() as gw:
            session = call(gw.url, "POST", "/api/sessions", {"sandbox": {"image": busybox_image}})
            sid, box = session["id"], session["sandbox"]["sandbox_id"]
            ckpt = call(gw.url, "POST", f"/api/sessions/{sid}/sandbox/checkpoints")
            kill9(gw)
        store = SqliteStore(restarts.store)  # the session was closed, and the gateway died before
        record = store.get_session(sid)  # it removed the sandbox
        assert record is not None
        record.status, record.closed_at = "closed", time.time()
        store.mark_closed(record)
        store.close()
        assert restarts.own_containers() == [box]

        with restarts.serve():
            assert restarts.own_containers() == []
            assert not Path(ckpt["location"]).exists()
            for other in foreign:
                assert backend.status(other.id).running
    finally:
        for other in foreign:
            backend.destroy(other.id)


def test_the_restart_bench_prints_adoption_against_restore(
    docker_engine: None, python_image: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from belayer.bench import sandbox_restart

    assert sandbox_restart.main(["--sandboxes", "2"]) == 0
    figures = dict(line.split(": ") for line in capsys.readouterr().out.splitlines())
    assert list(figures) == [
        "sandboxes", "adopt_per_sandbox_s", "adopt_startup_s", "restore_per_sandbox_s", "restore_startup_s",
        "adopt_speedup",
    ]  # fmt: skip
    assert float(figures["adopt_per_sandbox_s"]) < float(figures["restore_per_sandbox_s"])
