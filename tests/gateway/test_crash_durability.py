"""A gateway killed with SIGKILL mid-stream loses no committed turn; a restart reads them back."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.net import free_port
from tests.support import belayer_server


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[str]:
    args = ["fake-engine", "--tokens", "400", "--token-delay", "0.005"]
    with belayer_server(args, tmp_path / "engine.log") as server:
        yield server.url


def test_sigkill_mid_stream_keeps_committed_turns(engine: str, tmp_path: Path, tiny_model_dir: Path) -> None:
    store = tmp_path / "t.db"
    port = free_port()
    args = ["serve", "--model", str(tiny_model_dir), "--engine-url", engine, "--store", str(store)]
    with belayer_server(args, tmp_path / "gw.log", port=port) as gw:
        url = gw.url
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
                    os.killpg(gw.proc.pid, signal.SIGKILL)
                    break
        gw.proc.wait(timeout=10)

    with belayer_server(args, tmp_path / "gw2.log", port=port):  # the same port: the same URL
        turns = httpx.get(f"{url}/api/sessions/{sid}/trajectory").json()["turns"]
    assert [t["status"] for t in turns] == ["complete", "complete", "interrupted"], [
        (t["status"], len(t["output_ids"]), t["timings"], t["finish_reason"]) for t in turns
    ]
    for before, after in zip(done, turns, strict=False):
        assert after["prompt_ids"] == before["prompt_ids"] and after["output_ids"] == before["output_ids"]
        assert after["output_logprobs"] == before["output_logprobs"]
    base = turns[1]["prompt_ids"] + turns[1]["output_ids"]
    assert turns[2]["prompt_ids"][: len(base)] == base
