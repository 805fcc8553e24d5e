"""``belayer serve --processes N``: several gateway processes on one port (SO_REUSEPORT) and one
PostgreSQL store. Real parts: a PostgreSQL server, a fake engine process (autoregressive: the test
knows every token it produces), and the gateway's processes.

A connection stays with the process that accepted it, so the test holds one keep-alive connection per
process (each found by ``/health``'s ``pid``) and sends a session's turns over them: turn 1 to one
process, turn 2 to the other, which finds turn 1 in the store (exact prefix reuse). Each generation
names its process in ``x-belayer-pid``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.net import free_port
from engine_pool.fake import FakeEngine, autoregressive
from gateway.policy.tokenization import ChatTokenizer
from tests.postgres_server import PostgresServer
from tests.support import belayer_argv, belayer_server, held_engine, poll

FIRST = [{"role": "user", "content": "list the files"}]


def _pinned(
    url: str, pid: int | None = None, exclude: frozenset[int] = frozenset()
) -> tuple[int, httpx.Client]:
    """A client holding one keep-alive connection to a gateway process: the one with `pid`, or any
    not in `exclude`. New connections are spread by the kernel: open them until one lands there."""

    def connect() -> tuple[int, httpx.Client] | None:
        client = httpx.Client(
            base_url=url, limits=httpx.Limits(max_connections=1), timeout=60, trust_env=False
        )
        with contextlib.suppress(httpx.HTTPError):
            r = client.get("/health")
            got = r.json()["pid"] if r.status_code == 200 else None
            if got is not None and (got == pid if pid is not None else got not in exclude):
                return got, client
        client.close()
        return None

    return poll(connect, f"a connection to gateway process {pid or f'not in {set(exclude)}'}", timeout=60)


def _chat(client: httpx.Client, sid: str, messages: list[dict[str, Any]], max_tokens: int) -> tuple[str, int]:
    body = {"model": "policy", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = client.post(f"/s/{sid}/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"], int(r.headers["x-belayer-pid"])


def _turns(client: httpx.Client, sid: str) -> list[dict[str, Any]]:
    r = client.get(f"/api/sessions/{sid}/trajectory")
    assert r.status_code == 200, r.text
    turns: list[dict[str, Any]] = r.json()["turns"]
    return turns


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def _children(parent: int) -> set[int]:
    """The live child processes of `parent` (from ``/proc``)."""
    out = set()
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                fields = Path(f"/proc/{entry.name}/stat").read_bytes().rsplit(b")", 1)[1].split()
                if int(fields[1]) == parent and fields[0] != b"Z":
                    out.add(int(entry.name))
    return out


@pytest.mark.parametrize(
    ("extra", "refusal"),
    [
        ([], "--processes 2: several processes need a PostgreSQL store"),
        (
            ["--store", "postgresql://127.0.0.1:1/x"],
            "--processes 2: several processes share engines given by URL",
        ),
        (
            ["--store", "postgresql://127.0.0.1:1/x", "--engine-url", "http://127.0.0.1:1", "--sandboxes"],
            "--processes 2: sandboxes need one process",
        ),
    ],
)
def test_processes_are_refused_where_they_would_not_share_state(
    tiny_model_dir: Path, tmp_path: Path, extra: list[str], refusal: str
) -> None:
    args = ["serve", "--model", str(tiny_model_dir), "--processes", "2", "--port", str(free_port()), *extra]
    if "--engine-url" not in extra and "--store" not in extra:
        args += ["--engine-url", "http://127.0.0.1:1", "--store", str(tmp_path / "t.db")]
    done = subprocess.run(belayer_argv(*args), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"belayer serve: {refusal}"), done.stderr


@pytest.mark.postgres
def test_two_processes_share_sessions_and_survive_a_kill_9_of_one(
    postgres: PostgresServer, tmp_path: Path, tiny_model_dir: Path, tokenizer: ChatTokenizer
) -> None:
    args = ["serve", "--model", str(tiny_model_dir), "--store", postgres.new_database(), "--processes", "2"]
    with (
        held_engine(tmp_path, 0.02) as (engine, _),
        belayer_server([*args, "--engine-url", engine], tmp_path / "gw.log") as gw,
    ):
        a_pid, a = _pinned(gw.url)
        b_pid, b = _pinned(gw.url, exclude=frozenset({a_pid}))
        assert {a_pid, b_pid} <= _children(gw.proc.pid)  # the parent serves nothing itself

        # a session's turns on both processes: B continues A's turn with its exact tokens
        sid = a.post("/api/sessions", json={}).json()["id"]
        answer, pid1 = _chat(a, sid, FIRST, 12)
        second = [
            *FIRST,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "now the tests"},
        ]
        _, pid2 = _chat(b, sid, second, 8)
        assert (pid1, pid2) == (a_pid, b_pid)
        t1, t2 = _turns(a, sid)
        assert t1["prompt_ids"] == tokenizer.encode(tokenizer.render(FIRST, None, add_generation_prompt=True))
        assert t1["output_ids"] == FakeEngine(step=autoregressive).greedy(t1["prompt_ids"], 12)
        reused = len(t1["prompt_ids"]) + len(t1["output_ids"])
        assert t2["prompt_ids"][:reused] == t1["prompt_ids"] + t1["output_ids"]
        assert t2["events"][0]["data"]["reused_tokens"] == reused
        assert t2["output_ids"] == FakeEngine(step=autoregressive).greedy(t2["prompt_ids"], 8)
        assert _turns(b, sid) == [t1, t2]  # either process reads the whole session

        # kill -9 of process A while it streams a turn: B keeps serving the session
        other = a.post("/api/sessions", json={}).json()["id"]
        body = {"model": "policy", "messages": FIRST, "max_tokens": 200, "temperature": 0, "stream": True}
        with (
            pytest.raises(httpx.HTTPError),
            a.stream("POST", f"/s/{other}/v1/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200 and r.headers["x-belayer-pid"] == str(a_pid)
            for line in r.iter_lines():
                if '"content":"' in line and '"content":""' not in line:
                    os.kill(a_pid, signal.SIGKILL)  # a token is out: mid-stream
        a.close()
        _, pid3 = _chat(b, other, FIRST, 12)  # the harness's retry, on the survivor
        assert pid3 == b_pid
        retried = [t for t in _turns(b, other) if t["status"] == "complete"]
        assert [t["output_ids"] for t in retried] == [
            FakeEngine(step=autoregressive).greedy(t1["prompt_ids"], 12)
        ]
        # new connections go to B until the parent has restarted A's process (it says so in its log)
        c_pid, c = _pinned(gw.url, exclude=frozenset({a_pid, b_pid}))
        assert {b_pid, c_pid} <= _children(gw.proc.pid) and not _alive(a_pid)
        _, pid4 = _chat(
            c, sid, [*second, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}], 4
        )
        assert pid4 == c_pid
        assert f"gateway process {a_pid} exited with -9" in gw.log.read_text()
        for client in (b, c):
            client.close()
        assert gw.stop() == 0  # SIGTERM to the parent: it stops its children, and exits cleanly
        assert not any(_alive(pid) for pid in (b_pid, c_pid))
