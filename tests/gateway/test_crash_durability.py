"""A gateway killed with SIGKILL mid-stream loses no committed turn; a restart reads them back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.worker import free_port, wait_http_ok


def _spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "belayer.cli", *args],
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _wait(url: str, proc: subprocess.Popen[bytes]) -> None:
    wait_http_ok(url, proc, 60.0)


def _stop(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
    proc.wait(timeout=30)


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    proc = _spawn(
        ["fake-engine", "--port", str(port), "--tokens", "400", "--token-delay", "0.005"],
        tmp_path / "engine.log",
    )
    url = f"http://127.0.0.1:{port}"
    _wait(f"{url}/health", proc)
    yield url
    _stop(proc)


def test_sigkill_mid_stream_keeps_committed_turns(engine: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    store = tmp_path / "t.db"
    port = free_port()
    args = [
        "serve",
        "--model",
        str(tiny_model_dir),
        "--engine-url",
        engine,
        "--port",
        str(port),
        "--store",
        str(store),
    ]
    url = f"http://127.0.0.1:{port}"
    gw = _spawn(args, tmp_path / "gw.log")
    try:
        _wait(f"{url}/health", gw)
        sid = httpx.post(f"{url}/api/sessions", json={}).json()["id"]
        msgs: list[dict[str, Any]] = [{"role": "user", "content": "a"}]
        done = []
        for i in range(2):
            r = httpx.post(
                f"{url}/s/{sid}/v1/chat/completions",
                json={"model": "policy", "messages": msgs, "max_tokens": 20},
                timeout=30,
            )
            assert r.status_code == 200
            msgs += [r.json()["choices"][0]["message"], {"role": "user", "content": f"next {i}"}]
            done.append(httpx.get(f"{url}/api/sessions/{sid}/trajectory").json()["turns"][i])
        body = {"model": "policy", "messages": msgs, "stream": True}
        with httpx.stream("POST", f"{url}/s/{sid}/v1/chat/completions", json=body, timeout=30) as r:
            for n, _ in enumerate(r.iter_lines()):
                if n == 10:
                    os.killpg(gw.pid, signal.SIGKILL)
                    break
        gw.wait(timeout=10)
    finally:
        _stop(gw, signal.SIGKILL)

    gw = _spawn(args, tmp_path / "gw2.log")
    try:
        _wait(f"{url}/health", gw)
        turns = httpx.get(f"{url}/api/sessions/{sid}/trajectory").json()["turns"]
    finally:
        _stop(gw)
    assert [t["status"] for t in turns] == ["complete", "complete", "interrupted"], [
        (t["status"], len(t["output_ids"]), t["timings"], t["finish_reason"]) for t in turns
    ]
    for before, after in zip(done, turns, strict=False):
        assert after["prompt_ids"] == before["prompt_ids"] and after["output_ids"] == before["output_ids"]
        assert after["output_logprobs"] == before["output_logprobs"]
    base = turns[1]["prompt_ids"] + turns[1]["output_ids"]
    assert turns[2]["prompt_ids"][: len(base)] == base
