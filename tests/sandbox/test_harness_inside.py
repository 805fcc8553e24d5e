"""A harness that runs *inside* its sandbox, on real Docker + CRIU, through the gateway's sandbox listener.

The agent (stdlib Python, below) keeps its conversation in memory only and talks to the gateway over
the sandbox network, the one place it can reach. Its LLM calls are held at chosen steps (`Gate`) so
that the test can act inside a bubble without racing it:

- in turn 3's bubble the sandbox is checkpointed: the agent is frozen *waiting for* turn 3;
- in turn 5's bubble the container is killed. The watcher restores the checkpoint into a new
  container; the agent's connection comes back closed (CRIU `tcp-close`), so it retries turn 3, and
  the gateway, which discarded turns 3-5, extends turn 2 with it.

The same process (same nonce and PID, its memory intact) finishes the episode, every step ran exactly
once in the surviving filesystem, and the trajectory's kept branch is exactly the conversation the
agent holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import docker
import docker.errors
import httpx
import pytest

from engine_pool.fake import FakeEngine
from engine_pool.pool import EnginePool
from gateway.app import build_app
from gateway.config import FailoverConfig, GatewayConfig
from gateway.gateway import Gateway
from gateway.policy.tokenization import ChatTokenizer
from sandbox.backend import SandboxBackend
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.docker_backend import DockerSandboxBackend
from tests.sandbox.scripting import TOOLS, scripted, step_of

pytestmark = pytest.mark.docker

AGENT = r"""
import http.client, json, os, subprocess, sys, time, urllib.error, urllib.request, uuid

URL = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
TOOLS = json.loads(sys.argv[1])
nonce = uuid.uuid4().hex[:12]
with open("/workspace/agent.pid", "w") as f:
    f.write(str(os.getpid()))
messages = [{"role": "user", "content": f"agent {nonce}: run the steps"}]
executed = []  # in memory only: a restored agent remembers exactly what it had done


def ask():
    body = json.dumps({"model": "policy", "messages": messages, "tools": TOOLS, "temperature": 0}).encode()
    for attempt in range(200):
        try:
            request = urllib.request.Request(URL, body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=300) as response:
                return json.load(response)
        except urllib.error.HTTPError as exc:
            if exc.code < 500:
                raise
            print("retry", attempt, exc.code, flush=True)
        except (OSError, http.client.HTTPException) as exc:
            print("retry", attempt, repr(exc), flush=True)
        time.sleep(min(0.05 * (attempt + 1), 1.0))
    raise SystemExit("the gateway never answered")


while True:
    message = ask()["choices"][0]["message"]
    messages.append({k: message[k] for k in ("role", "content", "tool_calls") if message.get(k)})
    if not message.get("tool_calls"):
        break
    for call in message["tool_calls"]:
        command = json.loads(call["function"]["arguments"])["command"]
        out = subprocess.run(["sh", "-c", command], capture_output=True, text=True).stdout
        executed.append(command)
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"RESULT-{len(executed)}: {out}"})
with open("/workspace/agent-done.json", "w") as f:
    json.dump({"nonce": nonce, "pid": os.getpid(), "executed": executed, "messages": messages}, f)
"""


class Gate:
    """ASGI wrapper of the engine: a completion for a held step waits until the test releases it."""

    def __init__(self, app: Any, tok: ChatTokenizer, held: list[int]) -> None:
        self.app, self.tok = app, tok
        self.arrived = {step: asyncio.Event() for step in held}
        self.release = {step: asyncio.Event() for step in held}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("/completions"):
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        step = step_of(self.tok, json.loads(body)["prompt"])
        if step in self.release and not self.release[step].is_set():
            self.arrived[step].set()
            await self.release[step].wait()

        sent = False

        async def replay() -> dict[str, Any]:
            # the body once, then the real channel: a streamed answer waits on it for the disconnect (a
            # replay that returned the body forever kept the response's disconnect listener spinning)
            nonlocal sent
            if sent:
                return dict(await receive())
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


@dataclass
class Env:
    client: httpx.AsyncClient
    gw: Gateway
    engine: FakeEngine
    gate: Gate
    ids: list[str] = field(default_factory=list)


@pytest.fixture
async def env(
    tmp_path: Path,
    tiny_model_dir: Path,
    backend: DockerSandboxBackend,
    python_image: str,
    no_leaked_snapshots: None,
) -> AsyncIterator[Env]:
    async with gated_gateway(backend, tmp_path, tiny_model_dir) as made:
        yield made


@contextlib.asynccontextmanager
async def gated_gateway(
    backend: SandboxBackend, tmp_path: Path, tiny_model_dir: Path, timeout: float = 120
) -> AsyncIterator[Env]:
    """A gateway with sandboxes on `backend`, over a fake engine whose turns 3 and 5 are held (`Gate`)."""
    tok = ChatTokenizer.load(tiny_model_dir)
    engine = FakeEngine(max_model_len=8192)
    gate = Gate(engine.app(), tok, held=[3, 5])
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "traj.db"),
        failover=FailoverConfig(no_worker_wait=0.3, stall_timeout=600.0),
        sandbox=SandboxConfig(enabled=True, policy=PolicySettings(mode="never"), watch_interval_s=0.2),
    )
    engine_http = httpx.AsyncClient(transport=httpx.ASGITransport(gate), timeout=None)
    pool = EnginePool(engine_http)
    pool.add_remote("http://fake-engine")
    app = build_app(config, pool=pool, sandbox_backend=backend)
    async with app.router.lifespan_context(app):
        client = httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://localhost", timeout=timeout
        )
        yield Env(client, app.state.gateway, engine, gate)
        await client.aclose()
    await engine_http.aclose()


async def new_session(env: Env, image: str) -> str:
    spec = {"image": image, "network": "gateway", "harness_inside": True}
    r = await env.client.post("/api/sessions", json={"sandbox": spec})
    assert r.status_code == 201, r.text
    assert r.json()["sandbox"]["harness_inside"] is True
    return str(r.json()["id"])


async def sh(env: Env, sid: str, command: str, timeout_s: float = 30) -> dict[str, Any]:
    r = await env.client.post(
        f"/api/sessions/{sid}/sandbox/exec", json={"command": command, "timeout_s": timeout_s}
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


async def read(env: Env, sid: str, path: str) -> str | None:
    r = await env.client.get(f"/api/sessions/{sid}/sandbox/files", params={"path": path})
    return str(r.json()["content"]) if r.status_code == 200 else None


async def wait_for_file(env: Env, sid: str, path: str, timeout: float = 90) -> str:
    """Wait (bounded) for the agent, a separate process, to write `path`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = await read(env, sid, path)
        if content is not None:
            return content
        await asyncio.sleep(0.2)
    raise AssertionError(f"{path} never appeared; agent log: {await read(env, sid, 'agent.log')}")


async def test_harness_inside_is_restored_mid_call_and_continues(env: Env, python_image: str) -> None:
    commands = [f"echo {i} >> /workspace/steps" for i in range(6)]
    env.engine.script = scripted(env.gw.tokenizer, commands)
    sid = await new_session(env, python_image)
    manager = env.gw.sandboxes
    assert manager is not None
    r = await env.client.put(
        f"/api/sessions/{sid}/sandbox/files", json={"path": "agent.py", "content": AGENT}
    )
    assert r.status_code == 200
    tools = json.dumps(json.dumps(TOOLS))
    await sh(env, sid, f"python3 /workspace/agent.py {tools} > /workspace/agent.log 2>&1 &")

    # turn 3's bubble: checkpoint the agent while it waits for its LLM call
    await asyncio.wait_for(env.gate.arrived[3].wait(), 60)
    ckpt = await manager.checkpoint(sid)
    assert (ckpt.turn_index, ckpt.in_bubble, ckpt.keep_through) == (3, True, 2)
    pid_before = await read(env, sid, "agent.pid")
    env.gate.release[3].set()

    # turn 5's bubble: the container dies; the watcher restores the checkpoint
    await asyncio.wait_for(env.gate.arrived[5].wait(), 60)
    first_box = manager.sandbox_id(sid)
    await asyncio.to_thread(lambda: docker.from_env().containers.get(first_box).kill())
    env.gate.release[5].set()

    done = json.loads(await wait_for_file(env, sid, "agent-done.json"))
    state = (await env.client.get(f"/api/sessions/{sid}/sandbox")).json()
    restore = state["last_restore"]
    assert state["sandbox_id"] != first_box
    assert (restore["turn_index"], restore["keep_through"]) == (3, 2)
    assert restore["reason"].startswith("exited: sandbox stopped: container exited, exit code 137")

    # the same process, memory intact: each command ran once after the restore, in its own memory ...
    assert done["executed"] == commands
    assert str(done["pid"]) == pid_before
    assert done["nonce"] in done["messages"][0]["content"]
    # ... and in the filesystem, where the rolled-back steps 3-4 are gone and were run again
    assert await read(env, sid, "steps") == "".join(f"{i}\n" for i in range(6))
    agent_log = await read(env, sid, "agent.log") or ""
    assert "retry" in agent_log, agent_log  # its in-flight call broke at the restore and was re-sent

    traj = (await env.client.get(f"/api/sessions/{sid}/trajectory")).json()
    turns = traj["turns"]
    assert [t["index"] for t in turns] == list(range(len(turns)))  # no gap in the numbering
    discarded = [t["index"] for t in turns if t["status"] == "discarded"]
    assert discarded[:3] == [3, 4, 5]  # the checkpointed turn 3 and everything after it
    assert sorted(restore["discarded_turns"] + discarded[3:]) == discarded
    kept = [t for t in turns if t["status"] != "discarded"]
    assert len(kept) == len(commands) + 1
    assert [t["status"] for t in kept] == ["complete"] * len(kept)
    assert [t["parent_index"] for t in kept] == [None, *[t["index"] for t in kept[:-1]]]
    assert kept[3]["parent_index"] == 2  # the retry extended turn 2
    # the kept branch is exactly what the agent believes
    last = kept[-1]
    assert last["request"]["messages"] == done["messages"][:-1]
    assert last["response"]["message"]["content"] == done["messages"][-1]["content"] == "All done."
    for turn, assistant in zip(kept, [m for m in done["messages"] if m["role"] == "assistant"], strict=True):
        text = env.gw.tokenizer.decode(turn["output_ids"])
        assert (
            text == (assistant.get("content") or "") or assistant["tool_calls"][0]["function"]["name"] in text
        )
    kinds = [e["kind"] for e in traj["events"]]
    assert kinds.count("sandbox_failure") == 1 and kinds.count("sandbox_restored") == 1


async def test_gateway_network_reaches_only_its_own_session(env: Env, python_image: str) -> None:
    sid = await new_session(env, python_image)
    other = (await env.client.post("/api/sessions", json={})).json()["id"]
    manager = env.gw.sandboxes
    assert manager is not None and manager.gateway_url is not None
    host = manager.gateway_url.removeprefix("http://").split(":")[0]
    bystander = socket.create_server((host, 0))  # another service of the host, on the same address
    bystander_port = bystander.getsockname()[1]
    probe = f"""
import json, os, socket, urllib.error, urllib.request
def get(url, body=None):
    try:
        r = urllib.request.urlopen(urllib.request.Request(url, body, {{"Content-Type": "application/json"}}), timeout=5)
        return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)
def connect(addr, port):
    try:
        socket.create_connection((addr, port), timeout=3).close()
        return "open"
    except OSError as e:
        return type(e).__name__
base = "{manager.gateway_url}"
chat = json.dumps({{"model": "policy", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 2}}).encode()
msg = json.dumps({{"model": "policy", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 2}}).encode()
print(json.dumps({{
    "env": os.environ["OPENAI_BASE_URL"],
    "own": get(os.environ["OPENAI_BASE_URL"] + "/chat/completions", chat)[0],
    "other": get(base + "/s/{other}/v1/chat/completions", chat),
    "anthropic_other": get(base + "/s/{other}/v1/messages", msg),
    "plain": get(base + "/v1/chat/completions", chat)[0],
    "sessions": get(base + "/api/sessions"),
    "engines": get(base + "/api/engines")[0],
    "sandbox": get(base + "/api/sessions/{sid}/sandbox")[0],
    "other_port": connect("{host}", {bystander_port}),
    "outside": connect("1.1.1.1", 80),
}}))
"""
    r = await env.client.put(
        f"/api/sessions/{sid}/sandbox/files", json={"path": "probe.py", "content": probe}
    )
    assert r.status_code == 200
    with bystander:
        out = await sh(env, sid, "python3 /workspace/probe.py")
    assert out["exit_code"] == 0, out
    seen = json.loads(out["stdout"])
    assert seen["env"] == f"{manager.gateway_url}/s/{sid}/v1"
    assert seen["own"] == 200  # its own session's model endpoint works ...
    status, body = seen["other"]  # ... and nothing else does
    assert (status, body["error"]["type"], body["error"]["code"]) == (403, "permission_error", "forbidden")
    assert sid not in json.dumps(body) and "BELAYER_SESSION_URL" in body["error"]["message"]  # no session
    status, body = seen["anthropic_other"]
    assert (status, body["type"], body["error"]["type"]) == (403, "error", "permission_error")
    assert seen["sessions"][0] == seen["plain"] == seen["engines"] == seen["sandbox"] == 403
    assert seen["other_port"] == "ConnectionRefusedError"  # the firewall resets other host ports
    assert seen["outside"] in ("TimeoutError", "OSError", "ConnectionRefusedError")  # no route out
    # the own call was recorded in the sandbox's session; the other session got nothing
    assert len(env.gw.store.get_turns(sid)) == 1
    assert env.gw.store.get_turns(other) == []
    # closing the session removes its sandbox (the trajectory stays)
    box = manager.sandbox_id(sid)
    r = await env.client.post(f"/api/sessions/{sid}/close")
    assert (r.status_code, r.json()["status"], manager.has_sandbox(sid)) == (200, "closed", False)
    with pytest.raises(docker.errors.NotFound):
        docker.from_env().containers.get(box)
    assert len(env.gw.store.get_turns(sid)) == 1
