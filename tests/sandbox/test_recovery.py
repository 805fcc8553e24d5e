"""Sandboxes through the gateway on real Docker + CRIU: an episode survives its container's death.

A scripted harness (outside the sandbox) asks the gateway for each step; the fake engine answers with
the next tool call, chosen by how many tool results the prompt already holds. The harness runs each
call through the sandbox API.

- With ``recovery: truncate``, a call answers 409 `sandbox_restored`; the harness rebuilds its messages
  from the gateway's trajectory up to `keep_through` and carries on.
- With ``recovery: replay`` (the default) the harness notices nothing: the gateway restores the
  checkpoint, replays the tool calls since it, and answers the call; no turn is discarded.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
import httpx
import pytest

from engine_pool.fake import FakeEngine, LatentEngine
from engine_pool.pool import EnginePool
from gateway.app import build_app
from gateway.config import FailoverConfig, GatewayConfig
from gateway.gateway import Gateway
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.docker_backend import DockerSandboxBackend
from tests.sandbox.scripting import COUNTER_SERVER, TOOLS, scripted

pytestmark = pytest.mark.docker


def step_command(i: int) -> str:
    bump = 'kill -USR1 "$(cat /workspace/server.pid)"; while [ "$(cat /workspace/count 2>/dev/null)" != "{n}" ]; do sleep 0.05; done'
    if i == 0:
        return COUNTER_SERVER
    return f"echo {i} >> /workspace/log; " + bump.replace("{n}", str(i)) + "; cat /workspace/count"


@dataclass
class Env:
    client: httpx.AsyncClient
    gw: Gateway
    engine: FakeEngine


@pytest.fixture
async def env(
    tmp_path: Path,
    tiny_model_dir: Path,
    backend: DockerSandboxBackend,
    busybox_image: str,
    no_leaked_snapshots: None,
) -> AsyncIterator[Env]:
    engine = FakeEngine(max_model_len=8192)
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "traj.db"),
        failover=FailoverConfig(no_worker_wait=0.3, stall_timeout=1.0),
        sandbox=SandboxConfig(enabled=True, policy=PolicySettings(mode="always"), exec_grace_s=5.0),
    )
    engine_http = httpx.AsyncClient(transport=httpx.ASGITransport(LatentEngine(engine.app(), 0.2)))
    pool = EnginePool(engine_http)
    pool.add_remote("http://fake-engine")
    app = build_app(config, pool=pool, sandbox_backend=backend)
    async with app.router.lifespan_context(app):
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://localhost", timeout=120)
        yield Env(client, app.state.gateway, engine)
        await client.aclose()
    await engine_http.aclose()


class Harness:
    """The agent loop outside the sandbox, with the recovery protocol."""

    def __init__(self, env: Env, sid: str) -> None:
        self.env, self.sid = env, sid
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": "run the steps"}]
        self.restores: list[dict[str, Any]] = []
        self.on_exec: Any = None  # async hook(step) run while a tool call is in flight

    async def run(self, max_llm_calls: int = 40) -> None:
        for _ in range(max_llm_calls):
            r = await self.env.client.post(
                f"/s/{self.sid}/v1/chat/completions",
                json={"model": "policy", "messages": self.messages, "tools": TOOLS, "temperature": 0},
            )
            assert r.status_code == 200, r.text
            message = r.json()["choices"][0]["message"]
            self.messages.append({k: message[k] for k in ("role", "content", "tool_calls") if message.get(k)})
            if not message.get("tool_calls"):
                return
            await self.run_tools(message["tool_calls"])
        raise AssertionError("the episode did not finish")

    async def run_tools(self, calls: list[dict[str, Any]]) -> None:
        for call in calls:
            command = json.loads(call["function"]["arguments"])["command"]
            step = sum(m["role"] == "tool" for m in self.messages)
            exec_ = self.env.client.post(f"/api/sessions/{self.sid}/sandbox/exec", json={"command": command})
            if self.on_exec is not None:
                hook, self.on_exec = self.on_exec, None
                r, _ = await asyncio.gather(exec_, hook(step))
            else:
                r = await exec_
            if r.status_code == 409 and r.json()["error"]["code"] == "sandbox_restored":
                await self.resume()
                return
            assert r.status_code == 200, r.text
            out = r.json()
            self.messages.append(
                {"role": "tool", "tool_call_id": call["id"], "content": f"RESULT-{step}: {out['stdout']}"}
            )

    async def resume(self) -> None:
        """Rebuild the conversation through turn `keep_through` and re-run that turn's tool calls."""
        state = (await self.env.client.get(f"/api/sessions/{self.sid}/sandbox")).json()
        keep = state["last_restore"]["keep_through"]
        self.restores.append(state["last_restore"])
        traj = (await self.env.client.get(f"/api/sessions/{self.sid}/trajectory")).json()
        [turn] = [t for t in traj["turns"] if t["index"] == keep]
        message = turn["response"]["message"]
        self.messages = [*turn["request"]["messages"], {k: v for k, v in message.items() if v}]
        await self.run_tools(message["tool_calls"])


async def wait_until_running(sandbox_id: str, marker: str) -> None:
    """Poll (with a deadline, not a blind sleep) until `marker` exists in the container."""
    container = docker.from_env().containers.get(sandbox_id)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            rc, _ = await asyncio.to_thread(
                container.exec_run, ["/.belayer/bin/busybox", "test", "-e", marker]
            )
        except docker.errors.APIError as exc:  # paused by a checkpoint still in progress
            assert exc.status_code == 409, exc
            continue
        if rc == 0:
            return
    raise AssertionError(f"{marker} never appeared")


def kill(sandbox_id: str) -> None:
    docker.from_env().containers.get(sandbox_id).kill()


async def start(env: Env, commands: list[str], recovery: str = "truncate") -> tuple[str, Harness]:
    env.engine.script = scripted(env.gw.tokenizer, commands)
    sid = (await env.client.post("/api/sessions", json={})).json()["id"]
    spec = {"image": "belayer-sandbox-busybox", "recovery": recovery}
    r = await env.client.post(f"/api/sessions/{sid}/sandbox", json=spec)
    assert r.status_code == 201, r.text
    return sid, Harness(env, sid)


async def check_consistent(env: Env, sid: str, steps: int) -> dict[str, Any]:
    await env.gw.sandboxes.idle()  # type: ignore[union-attr]  # the last bubble's checkpoint
    traj: dict[str, Any] = (await env.client.get(f"/api/sessions/{sid}/trajectory")).json()
    turns = traj["turns"]
    assert [t["index"] for t in turns] == list(range(len(turns)))  # numbering has no gap
    kept = [t for t in turns if t["status"] != "discarded"]
    assert [t["status"] for t in kept] == ["complete"] * (steps + 1)
    # the kept turns form one chain: each extends the previous kept one
    assert [t["parent_index"] for t in kept] == [None, *[t["index"] for t in kept[:-1]]]
    log = (await env.client.get(f"/api/sessions/{sid}/sandbox/files", params={"path": "log"})).json()
    assert log["content"] == "".join(f"{i}\n" for i in range(1, steps))  # every step ran exactly once
    count = await env.client.post(
        f"/api/sessions/{sid}/sandbox/exec", json={"command": "cat /workspace/count"}
    )
    assert count.json()["stdout"] == f"{steps - 1}\n"  # the server's in-memory counter came back
    return traj


async def test_container_killed_between_tool_calls(env: Env) -> None:
    commands = [step_command(i) for i in range(6)]
    sid, harness = await start(env, commands)

    async def kill_after(step: int) -> None:
        if step == 3:
            kill(env.gw.sandboxes.sandbox_id(sid))  # type: ignore[union-attr]

    original = harness.run_tools

    async def run_tools(calls: list[dict[str, Any]]) -> None:
        step = sum(m["role"] == "tool" for m in harness.messages)
        await original(calls)
        if not harness.restores:
            await kill_after(step)

    harness.run_tools = run_tools  # type: ignore[method-assign]
    await harness.run()

    [restore] = harness.restores
    # killed after tool call 3: turn 4's bubble checkpoint failed, tool call 4 found the container dead,
    # and the newest checkpoint (turn 3's bubble, before tool call 3) was restored
    assert (restore["turn_index"], restore["keep_through"], restore["discarded_turns"]) == (3, 3, [4])
    traj = await check_consistent(env, sid, len(commands))
    statuses = [(t["index"], t["status"], t["branch"]) for t in traj["turns"]]
    assert statuses[4] == (4, "discarded", 0)
    assert statuses[5][2] != 0  # the continuation opened a new branch from turn 3
    kinds = [e["kind"] for e in traj["events"]]
    for kind in ("sandbox_checkpoint_failed", "sandbox_failure", "sandbox_restored", "turns_discarded"):
        assert kinds.count(kind) == 1, kind
    failure = next(e for e in traj["events"] if e["kind"] == "sandbox_failure")
    assert failure["data"]["kind"] == "exited"  # found by the watcher or by tool call 4, whichever came first
    assert "exit code 137" in failure["data"]["detail"]


async def test_container_killed_during_a_tool_call(env: Env) -> None:
    commands = [step_command(i) for i in range(5)]
    commands[3] = "touch /workspace/started; sleep 3; " + commands[3]
    sid, harness = await start(env, commands)

    async def killer(step: int) -> None:
        assert step == 3
        box = env.gw.sandboxes.sandbox_id(sid)  # type: ignore[union-attr]
        await wait_until_running(box, "/workspace/started")
        kill(box)

    original = harness.run_tools

    async def run_tools(calls: list[dict[str, Any]]) -> None:
        if sum(m["role"] == "tool" for m in harness.messages) == 3 and not harness.restores:
            harness.on_exec = killer
        await original(calls)

    harness.run_tools = run_tools  # type: ignore[method-assign]
    await harness.run()

    [restore] = harness.restores
    assert (restore["turn_index"], restore["keep_through"], restore["discarded_turns"]) == (3, 3, [])
    traj = await check_consistent(env, sid, len(commands))
    assert [t["status"] for t in traj["turns"]] == ["complete"] * 6
    decisions = [e for e in traj["events"] if e["kind"] == "sandbox_checkpoint_decision"]
    assert [d["data"]["action"] for d in decisions] == ["checkpoint"] * 6
    checkpoints = [e["data"] for e in traj["events"] if e["kind"] == "sandbox_checkpoint"]
    assert [c["turn_index"] for c in checkpoints] == [0, 1, 2, 3, 4, 5]
    assert all(c["keep_through"] == c["turn_index"] for c in checkpoints)


async def test_bad_input_gets_clear_errors_and_harms_nothing(env: Env) -> None:
    sid, _ = await start(env, [])
    base = f"/api/sessions/{sid}/sandbox"
    other = (await env.client.post("/api/sessions", json={})).json()["id"]
    bad = await env.client.post(f"/api/sessions/{other}/sandbox", json={"image": "belayer-no-such-image"})
    assert (bad.status_code, bad.json()["error"]["code"], bad.json()["error"]["param"]) == (
        400,
        "image_not_found",
        "image",
    )
    r = await env.client.post(base, json={"image": "belayer-sandbox-busybox"})
    assert (r.status_code, r.json()["error"]["code"]) == (409, "sandbox_exists")
    r = await env.client.post(f"{base}/restore", json={})
    assert (r.status_code, r.json()["error"]["code"]) == (409, "no_checkpoint")
    r = await env.client.post(f"{base}/exec", json={"command": "echo partial; sleep 100", "timeout_s": 1})
    assert (r.status_code, r.json()["error"]["code"]) == (408, "command_timeout")
    assert "'partial\\n'" in r.json()["error"]["message"]
    r = await env.client.post(
        f"{base}/exec", json={"command": "yes | head -c 5000000", "max_output_bytes": 1000}
    )
    assert (r.status_code, r.json()["stdout"], r.json()["stdout_truncated"]) == (200, "y\n" * 500, True)
    r = await env.client.post(f"{base}/exec", json={"command": "printf '\\377\\376ok'"})
    assert (r.status_code, r.json()["output_not_utf8"]) == (200, True)
    for path in ("../etc/passwd", "/etc/passwd"):
        r = await env.client.get(f"{base}/files", params={"path": path})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "path_outside_sandbox")
        r = await env.client.put(f"{base}/files", json={"path": path, "content": "x"})
        assert (r.status_code, r.json()["error"]["code"]) == (400, "path_outside_sandbox")
    r = await env.client.get(f"{base}/files", params={"path": "missing"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "file_not_found")
    r = await env.client.put(f"{base}/files", json={"path": "b.bin", "content": "AAH/", "encoding": "base64"})
    assert r.status_code == 200
    r = await env.client.get(f"{base}/files", params={"path": "b.bin"})
    assert (r.json()["encoding"], r.json()["content"]) == ("base64", "AAH/")
    r = await env.client.post(f"/api/sessions/{other}/sandbox/exec", json={"command": "true"})
    assert (r.status_code, r.json()["error"]["code"]) == (404, "sandbox_not_found")
    # none of it hurt the sandbox: the same container, still answering, no failure recorded
    state = (await env.client.get(base)).json()
    r = await env.client.post(f"{base}/exec", json={"command": "echo fine"})
    assert (r.json()["stdout"], state["status"], state["last_restore"]) == ("fine\n", "running", None)
    kinds = {e.kind for e in env.gw.store.get_events(sid)}
    assert "sandbox_failure" not in kinds


async def test_replay_recovery_is_invisible_to_the_harness(env: Env) -> None:
    commands = [step_command(i) for i in range(6)]
    sid, harness = await start(env, commands, recovery="replay")

    async def run_tools(calls: list[dict[str, Any]]) -> None:
        step = sum(m["role"] == "tool" for m in harness.messages)
        await original(calls)
        if step == 3:  # after tool call 3, before turn 4's bubble checkpoint
            kill(env.gw.sandboxes.sandbox_id(sid))  # type: ignore[union-attr]

    original = harness.run_tools
    harness.run_tools = run_tools  # type: ignore[method-assign]
    await harness.run()

    assert harness.restores == []  # no 409: the harness never noticed
    traj = await check_consistent(env, sid, len(commands))
    assert [t["status"] for t in traj["turns"]] == ["complete"] * (len(commands) + 1)
    assert {t["branch"] for t in traj["turns"]} == {0}  # nothing discarded, no branch
    [restored] = [e["data"] for e in traj["events"] if e["kind"] == "sandbox_restored"]
    # turn 4's bubble checkpoint failed on the dead container; turn 3's (taken before tool call 3)
    # was restored, tool call 3 replayed (same output), and tool call 4 ran on the new sandbox
    assert (restored["mode"], restored["turn_index"], restored["replayed"], restored["diverged"]) == (
        "replay", 3, 1, 0,
    )  # fmt: skip
    assert restored["discarded_turns"] == [] and restored["keep_through"] == 4


async def test_a_call_that_breaks_the_sandbox_twice_is_refused(env: Env) -> None:
    sid, _ = await start(env, [], recovery="replay")
    base = f"/api/sessions/{sid}/sandbox"
    r = await env.client.post(f"{base}/exec", json={"command": "echo kept > /workspace/a"})
    assert r.status_code == 200
    assert (await env.client.post(f"{base}/checkpoints")).status_code == 201
    r = await env.client.post(f"{base}/exec", json={"command": "echo also-kept >> /workspace/a"})
    # the command kills the exec client it runs under: the call breaks every time it runs
    command = "kill -9 $(ps -o pid,args | grep '[c]lient.sh' | awk '{print $1}'); sleep 5"
    r = await env.client.post(f"{base}/exec", json={"command": command})
    assert (r.status_code, r.json()["error"]["code"]) == (422, "command_broke_sandbox"), r.text
    assert "after a restore and a replay of the 1 tool calls before it" in r.json()["error"]["message"]
    r = await env.client.get(f"{base}/files", params={"path": "a"})
    assert r.json()["content"] == "kept\n"  # back at the checkpoint, nothing replayed
    r = await env.client.post(f"{base}/exec", json={"command": "echo fine"})
    assert r.json()["stdout"] == "fine\n"
    kinds = [e.kind for e in env.gw.store.get_events(sid)]
    assert (kinds.count("sandbox_failure"), kinds.count("sandbox_restored")) == (2, 2)
