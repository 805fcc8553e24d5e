"""Forking a session on real Docker + CRIU: each child gets the parent's files and running processes.

A session's sandbox (the python image) holds a file and a background counter process; it is checkpointed
at turn 1 and forked into two children. Each child's counter goes on from where the parent's was (its
memory came back with CRIU), the siblings then diverge, and the parent is untouched. A fork that is
refused, or that fails half-way, leaves no container and no snapshot image behind.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.errors import RestoreError
from engine_pool.fake import FakeEngine
from engine_pool.pool import EnginePool
from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.gateway import Gateway
from sandbox.backend import Checkpoint, Sandbox
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.docker_backend import DockerSandboxBackend
from sandbox.sessions.adoption import STORE_LABEL

pytestmark = pytest.mark.docker

COUNTER = """
import time
n = 0
while True:
    n += 1
    with open("/workspace/count.tmp", "w") as f:
        f.write(str(n))
    import os; os.replace("/workspace/count.tmp", "/workspace/count")
    time.sleep(0.05)
"""


@dataclass
class Env:
    client: httpx.AsyncClient
    gw: Gateway
    engine: FakeEngine
    backend: DockerSandboxBackend

    async def turn(self, sid: str, messages: list[dict[str, Any]], reply: str) -> list[dict[str, Any]]:
        tok = self.gw.tokenizer
        self.engine.outputs.append([*tok.encode(reply), tok.encode(tok.eos_token)[0]])
        body = {"model": "policy", "messages": messages, "max_tokens": 16}
        r = await self.client.post(f"/s/{sid}/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "next"}]

    async def exec(self, sid: str, command: str) -> tuple[int, str]:
        r = await self.client.post(f"/api/sessions/{sid}/sandbox/exec", json={"command": command})
        assert r.status_code == 200, r.text
        return int(r.json()["exit_code"]), str(r.json()["stdout"])

    async def count(self, sid: str) -> int:
        code, out = await self.exec(sid, "cat /workspace/count")
        assert code == 0, out
        return int(out)

    async def counter_runs_on(self, sid: str, since: int) -> None:
        """The counter process is alive and counts on from (at least) `since`."""
        code, out = await self.exec(sid, 'kill -0 "$(cat /workspace/counter.pid)" && echo alive')
        assert (code, out) == (0, "alive\n")
        first = await self.count(sid)
        assert first >= since
        await asyncio.sleep(0.4)
        assert await self.count(sid) > first

    def containers(self) -> set[str]:
        """The containers of this gateway's sessions: those labelled with its store (``belayer.store``),
        not those of another run sharing the Docker engine."""
        owner = f"{STORE_LABEL}={self.gw.store.store_id()}"
        found = self.backend._api.containers(all=True, filters={"label": ["belayer.session", owner]})
        return {c["Id"] for c in found}


@pytest.fixture
async def env(
    tmp_path: Path,
    tiny_model_dir: Path,
    backend: DockerSandboxBackend,
    python_image: str,
    no_leaked_snapshots: None,
) -> AsyncIterator[Env]:
    engine = FakeEngine(max_model_len=4096)
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "traj.db"),
        sandbox=SandboxConfig(enabled=True, policy=PolicySettings(mode="never")),
        max_fork_siblings=4,
    )
    engine_http = httpx.AsyncClient(transport=httpx.ASGITransport(engine.app()))
    pool = EnginePool(engine_http)
    pool.add_remote("http://fake-engine")
    app = build_app(config, pool=pool, sandbox_backend=backend)
    async with app.router.lifespan_context(app):
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost", timeout=120)
        yield Env(client, app.state.gateway, engine, backend)
        await client.aclose()
    await engine_http.aclose()


async def episode_to_checkpoint(env: Env, python_image: str) -> tuple[str, int]:
    """A session with a file and a running counter, checkpointed at turn 1; its count at that point."""
    r = await env.client.post("/api/sessions", json={"sandbox": {"image": python_image}})
    assert r.status_code == 201, r.text
    sid = str(r.json()["id"])
    convo = await env.turn(sid, [{"role": "user", "content": "start"}], "step 0")
    await env.exec(sid, f"mkdir -p /workspace && cat > /workspace/counter.py <<'EOF'\n{COUNTER}\nEOF")
    await env.exec(sid, "echo from-the-parent > /workspace/data.txt")
    start = "nohup python3 /workspace/counter.py >/dev/null 2>&1 & echo $! > /workspace/counter.pid"
    await env.exec(sid, start)
    await env.turn(sid, convo, "step 1")
    await env.counter_runs_on(sid, 1)
    assert env.gw.sandboxes is not None
    info = await env.gw.sandboxes.checkpoint(sid)
    assert info.keep_through == 1
    return sid, await env.count(sid)


async def test_children_get_the_files_and_processes_and_diverge(env: Env, python_image: str) -> None:
    parent, at_checkpoint = await episode_to_checkpoint(env, python_image)
    r = await env.client.post(f"/api/sessions/{parent}/fork", json={"at_turn": 1, "n": 2})
    assert r.status_code == 201, r.text
    children = [c["id"] for c in r.json()["data"]]
    assert len(env.containers()) == 3
    for i, child in enumerate(children):
        assert await env.exec(child, "cat /workspace/data.txt") == (0, "from-the-parent\n")
        await env.counter_runs_on(child, at_checkpoint)  # the process, with its memory
        await env.exec(child, f"echo {i} > /workspace/mine; echo child-{i} >> /workspace/data.txt")
    for i, child in enumerate(children):
        assert await env.exec(child, "cat /workspace/mine") == (0, f"{i}\n")
        assert await env.exec(child, "cat /workspace/data.txt") == (0, f"from-the-parent\nchild-{i}\n")
    assert await env.exec(parent, "cat /workspace/data.txt") == (0, "from-the-parent\n")
    assert (await env.exec(parent, "cat /workspace/mine"))[0] != 0
    await env.counter_runs_on(parent, at_checkpoint)

    # a child's sandbox dies: it comes back from its own fork checkpoint, its calls replayed
    assert env.gw.sandboxes is not None
    [base] = env.gw.sandboxes.checkpoints(children[0])
    assert base.trigger == "fork"
    env.backend.destroy(env.gw.sandboxes.describe(children[0])["sandbox_id"])
    assert await env.exec(children[0], "cat /workspace/mine") == (0, "0\n")
    await env.counter_runs_on(children[0], at_checkpoint)
    for sid in (*children, parent):
        assert (await env.client.post(f"/api/sessions/{sid}/close")).status_code == 200
    assert env.containers() == set()


async def test_refused_and_failed_forks_leave_no_container(
    env: Env, python_image: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent, _ = await episode_to_checkpoint(env, python_image)
    before = env.containers()
    assert len(before) == 1
    # turn 0 is before the checkpoint, and the journal starts after it: no way back there
    r = await env.client.post(f"/api/sessions/{parent}/fork", json={"at_turn": 0, "n": 2})
    assert r.status_code == 409 and r.json()["error"]["code"] == "no_checkpoint", r.text
    assert env.containers() == before

    restore, calls = env.backend.restore, []

    def second_fails(checkpoint: Checkpoint) -> Sandbox:
        calls.append(checkpoint.id)
        if len(calls) == 2:
            raise RestoreError("injected: the second restore fails")
        return restore(checkpoint)

    monkeypatch.setattr(env.backend, "restore", second_fails)
    r = await env.client.post(f"/api/sessions/{parent}/fork", json={"at_turn": 1, "n": 3})
    assert r.status_code == 500 and r.json()["error"]["code"] == "checkpoint_failed", r.text
    assert len(calls) == 3
    assert env.containers() == before
    assert len(env.gw.store.list_sessions()) == 1
    monkeypatch.undo()
    assert (await env.client.post(f"/api/sessions/{parent}/close")).status_code == 200
    assert env.containers() == set()
