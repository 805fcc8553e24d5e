"""Engines the gateway did not launch, held as shadows (``--shadow-url``): a kill -9 of the remote active
engine mid-stream finishes the request on the remote shadow with exactly the tokens of a failure-free
run; the dead engine is fenced (out of routing) until it is back on its port and passes a health probe,
and then it is the pool's shadow. Real processes: fake engines (``python -m engine_pool.fake``, whose
autoregressive output makes resumption exact) and ``belayer serve``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from core.net import free_port
from tests.support import belayer_server, spawn, stop, wait_healthy

MAX_TOKENS = 150
KILL_AFTER = 20  # chunks received before the active engine is killed


class FakeEngineProcess:
    """``python -m engine_pool.fake`` on a fixed port, in its own process group; restartable."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "engine_pool.fake", "--port", str(self.port), "--token-delay", "0.02"]
        self.proc = spawn(argv, self.log)
        wait_healthy(f"{self.url}/health", [self.proc], 60.0, self.log)

    def kill(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop(self.proc)


@pytest.fixture
def engines(tmp_path: Path) -> Iterator[tuple[FakeEngineProcess, FakeEngineProcess]]:
    pair = FakeEngineProcess(tmp_path, "active"), FakeEngineProcess(tmp_path, "shadow")
    try:
        for engine in pair:
            engine.start()
        yield pair
    finally:
        for engine in pair:
            engine.stop()


def states(http: httpx.Client) -> dict[str, str]:
    return {e["name"]: e["state"] for e in http.get("/api/engines").json()["data"]}


def wait_for(what: Callable[[], bool], timeout: float, why: str) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.05)  # the gateway's probes run in another process: poll, bounded


def turn(http: httpx.Client, sid: str, on_chunk: Callable[[int], None] = lambda n: None) -> int:
    """One greedy streamed turn of session `sid`; returns the chunks received (a client error fails)."""
    body = {
        "model": "policy", "messages": [{"role": "user", "content": "fix the bug"}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
    }  # fmt: skip
    chunks = 0
    with http.stream("POST", f"/s/{sid}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                assert "error" not in json.loads(line[6:]), line
                chunks += 1
                on_chunk(chunks)
    return chunks


def test_a_remote_shadow_takes_over_and_the_fenced_engine_returns_as_the_shadow(
    tiny_model_dir: Path, tmp_path: Path, engines: tuple[FakeEngineProcess, FakeEngineProcess]
) -> None:
    active, shadow = engines
    args = ["serve", "--model", str(tiny_model_dir), "--engine-url", active.url, "--shadow-url", shadow.url,
            "--store", str(tmp_path / "t.db"), "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    with (
        belayer_server(args, tmp_path / "gateway.log") as gw,
        httpx.Client(base_url=gw.url, timeout=60) as http,
    ):
        assert states(http) == {"remote-0": "ready", "remote-1": "shadow"}

        reference = http.post("/api/sessions", json={}).json()["id"]
        turn(http, reference)
        assert states(http) == {"remote-0": "ready", "remote-1": "shadow"}  # a shadow takes no traffic

        def kill_midway(n: int) -> None:
            if n == KILL_AFTER:
                active.kill()

        failed = http.post("/api/sessions", json={}).json()["id"]
        turn(http, failed, kill_midway)
        assert states(http) == {"remote-0": "unhealthy", "remote-1": "ready"}  # fenced; promoted

        ref = http.get(f"/api/sessions/{reference}/trajectory").json()
        got = http.get(f"/api/sessions/{failed}/trajectory").json()
        assert len(got["turns"][0]["output_ids"]) == MAX_TOKENS
        assert got["turns"][0]["output_ids"] == ref["turns"][0]["output_ids"]  # exact across the failover
        assert got["turns"][0]["prompt_ids"] == ref["turns"][0]["prompt_ids"]
        [failover] = [e["data"] for e in got["events"] if e["kind"] == "failover"]
        assert (failover["from_worker"], failover["to_worker"]) == ("remote-0", "remote-1")
        assert KILL_AFTER - 5 <= failover["token_index"] < MAX_TOKENS

        active.start()  # back on the same port
        wait_for(lambda: states(http)["remote-0"] == "shadow", 30, f"not back as the shadow: {states(http)}")
        assert states(http) == {"remote-0": "shadow", "remote-1": "ready"}

        # and it is a shadow like any other: the active engine's death promotes it
        shadow.kill()
        after = http.post("/api/sessions", json={}).json()["id"]
        assert turn(http, after) > 0
        wait_for(
            lambda: states(http) == {"remote-0": "ready", "remote-1": "unhealthy"}, 30, str(states(http))
        )
        got = http.get(f"/api/sessions/{after}/trajectory").json()
        assert got["turns"][0]["output_ids"] == ref["turns"][0]["output_ids"]
