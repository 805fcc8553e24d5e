"""A session's sandbox under its capability URL, ``/s/{id}/sandbox/...``, on a gateway with an API token
and the in-memory sandbox backend: a harness runs its tool calls with its session id only, reaches that
session's sandbox and no other, and the trainer's sandbox routes stay behind the token."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine_pool.fake import FakeEngine
from gateway.api.sandbox_listener import SandboxFacing
from gateway.config import GatewayConfig
from gateway.gateway import Gateway
from sandbox.config import SandboxConfig
from sandbox.fake import FakeSandboxBackend
from sandbox.sessions.manager import SandboxManager
from tests.support import asgi_gateway

TOKEN = {"authorization": "Bearer t0ken"}
ROUTES = [
    ("GET", "/sandbox", None),
    ("POST", "/sandbox/exec", {"command": "echo hi"}),
    ("GET", "/sandbox/files?path=/workspace/a.txt", None),
    ("PUT", "/sandbox/files", {"path": "/workspace/a.txt", "content": "x"}),
]
SANDBOX_WORK = ("exec", "read_file", "write_file", "archive", "extract", "checkpoint", "restore")


class Rig:
    def __init__(self, app: Any, client: httpx.AsyncClient, backend: FakeSandboxBackend) -> None:
        self.app, self.client, self.backend = app, client, backend

    @property
    def manager(self) -> SandboxManager:
        gw: Gateway = self.app.state.gateway
        assert gw.sandboxes is not None
        return gw.sandboxes

    async def session(self, **sandbox: Any) -> str:
        """A session with a sandbox, made by the trainer (with the token)."""
        body = {"sandbox": {"image": "img", **sandbox}}
        r = await self.client.post("/api/sessions", json=body, headers=TOKEN)
        assert r.status_code == 201, r.text
        return str(r.json()["id"])

    async def exec(self, sid: str, command: str) -> httpx.Response:
        return await self.client.post(f"/s/{sid}/sandbox/exec", json={"command": command})


@pytest.fixture
async def rig(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Rig]:
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        api_token="t0ken",
        sandbox=SandboxConfig(enabled=True, sandbox_port=None),
    )
    engine = FakeEngine(max_model_len=4096, script=lambda prompt: [11, 12])
    backend = FakeSandboxBackend()
    async with asgi_gateway(config, httpx.ASGITransport(engine.app()), sandbox_backend=backend) as (app, c):
        yield Rig(app, c, backend)


def check_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, r.text


async def test_a_harness_runs_its_tool_calls_with_only_its_session_id(rig: Rig) -> None:
    sid = await rig.session()
    r = await rig.client.put(
        f"/s/{sid}/sandbox/files", json={"path": "/workspace/notes.txt", "content": "one\n"}
    )
    assert r.status_code == 200 and r.json() == {"path": "/workspace/notes.txt", "size": 4}, r.text
    r = await rig.exec(sid, "cd /workspace && cat notes.txt && export X=2")
    assert r.status_code == 200 and (r.json()["exit_code"], r.json()["stdout"]) == (0, "one\n"), r.text
    r = await rig.exec(sid, 'echo "$X" > x.txt')  # the shell session persists, as under /api/
    assert r.status_code == 200 and r.json()["exit_code"] == 0, r.text
    r = await rig.client.get(f"/s/{sid}/sandbox/files", params={"path": "/workspace/x.txt"})
    assert r.status_code == 200 and r.json()["content"] == "2\n", r.text
    state = (await rig.client.get(f"/s/{sid}/sandbox")).json()
    assert (state["session_id"], state["status"], state["journaled_calls"]) == (sid, "running", 3)
    trainer = (await rig.client.get(f"/api/sessions/{sid}/sandbox", headers=TOKEN)).json()
    assert state == {k: v for k, v in trainer.items() if k in state}  # the same handler, the same sandbox
    assert {"checkpoints", "forked_from", "sandbox_id"} <= set(trainer) - set(state)  # the trainer's only


async def test_a_fork_childs_sandbox_state_does_not_name_its_parent(rig: Rig) -> None:
    """A harness beside a fork child's sandbox would otherwise hold its parent's capability."""
    parent = await rig.session()
    chat = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert (await rig.client.post(f"/s/{parent}/v1/chat/completions", json=chat)).status_code == 200
    assert (
        await rig.client.post(f"/api/sessions/{parent}/sandbox/checkpoints", headers=TOKEN)
    ).status_code == 201
    r = await rig.client.post(f"/api/sessions/{parent}/fork", json={"at_turn": 0}, headers=TOKEN)
    assert r.status_code == 201, r.text
    [child] = [c["id"] for c in r.json()["data"]]
    trainer = (await rig.client.get(f"/api/sessions/{child}/sandbox", headers=TOKEN)).json()
    assert trainer["forked_from"] == parent
    r = await rig.client.get(f"/s/{child}/sandbox")
    assert r.status_code == 200 and r.json()["session_id"] == child and parent not in r.text, r.text


async def test_the_trainers_sandbox_routes_still_need_the_token(rig: Rig) -> None:
    sid = await rig.session()
    r = await rig.client.post(f"/api/sessions/{sid}/sandbox/exec", json={"command": "echo hi"})
    check_error(r, 401, "invalid_api_token")
    r = await rig.client.post(f"/api/sessions/{sid}/sandbox/exec", json={"command": "echo hi"}, headers=TOKEN)
    assert r.status_code == 200 and r.json()["stdout"] == "hi\n", r.text


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/sandbox"),  # create
        ("DELETE", "/sandbox"),
        ("POST", "/sandbox/verify"),  # a harness never judges itself ...
        ("POST", "/sandbox/restore"),  # ... nor rewinds its own trajectory
        ("GET", "/sandbox/checkpoints"),
        ("POST", "/sandbox/checkpoints"),
        ("POST", "/reward"),
        ("POST", "/close"),
    ],
)
async def test_the_capability_url_offers_tool_calls_only(rig: Rig, method: str, path: str) -> None:
    sid = await rig.session()
    r = await rig.client.request(method, f"/s/{sid}{path}", json={"image": "img", "reward": 1.0})
    assert r.status_code in (404, 405) and "error" in r.json(), r.text
    state = (await rig.client.get(f"/api/sessions/{sid}", headers=TOKEN)).json()
    assert (state["status"], state["reward"]) == ("open", None)
    assert (await rig.exec(sid, "echo alive")).json()["stdout"] == "alive\n"
    assert [op for op, _ in rig.backend.calls if op in ("checkpoint", "restore", "destroy", "archive")] == []


@pytest.mark.parametrize(("method", "path", "body"), ROUTES)
async def test_an_unknown_or_closed_session_is_a_404(
    rig: Rig, method: str, path: str, body: dict[str, Any] | None
) -> None:
    other = await rig.session()  # a sandbox exists, and stays out of reach
    for sid in ("ses_" + "0" * 32, "nope", other + "x"):
        r = await rig.client.request(method, f"/s/{sid}{path}", json=body)
        check_error(r, 404, "session_not_found")
    closed = await rig.session()
    assert (await rig.client.post(f"/api/sessions/{closed}/close", headers=TOKEN)).status_code == 200
    r = await rig.client.request(method, f"/s/{closed}{path}", json=body)
    check_error(r, 404, "session_closed")
    assert [op for op, _ in rig.backend.calls if op in SANDBOX_WORK] == []  # nothing reached a sandbox


async def test_a_session_reaches_its_own_sandbox_and_no_other(rig: Rig) -> None:
    a, b = await rig.session(), await rig.session()
    box_a, box_b = rig.manager.sandbox_id(a), rig.manager.sandbox_id(b)
    await rig.client.put(f"/s/{a}/sandbox/files", json={"path": "/workspace/secret", "content": "a's"})
    r = await rig.client.get(f"/s/{b}/sandbox/files", params={"path": "/workspace/secret"})
    check_error(r, 404, "file_not_found")
    assert (await rig.exec(b, "cat /workspace/secret")).json()["exit_code"] != 0
    assert (await rig.exec(a, "cat /workspace/secret")).json()["stdout"] == "a's"
    touched = {box for op, box in rig.backend.calls if op in ("exec", "read_file", "write_file")}
    assert touched == {box_a, box_b}
    # a path that names two sessions reaches neither
    for path in (f"/s/{a}%2F..%2F{b}/sandbox/exec", f"/s/{a}/s/{b}/sandbox/exec", f"/s/{a}/{b}/sandbox/exec"):
        r = await rig.client.post(path, json={"command": "echo x > /workspace/owned"})
        assert r.status_code == 404, r.text
    for sid in (a, b):
        r = await rig.client.get(f"/s/{sid}/sandbox/files", params={"path": "/workspace/owned"})
        check_error(r, 404, "file_not_found")


async def test_a_sandbox_cannot_call_its_own_sandbox_api(rig: Rig) -> None:
    """Through the sandbox listener a sandbox reaches its model endpoints, not its sandbox API: a harness
    inside runs its commands itself, and nothing in a sandbox writes to its tool-call journal."""
    rig.manager.gateway_url = "http://10.99.0.1:9000"
    sid = await rig.session(network="gateway")
    address = rig.backend.network.address(rig.manager.sandbox_id(sid))
    assert address is not None
    transport = httpx.ASGITransport(SandboxFacing(rig.app, rig.manager), client=(address, 5555))
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as box:
        for method, path, body in ROUTES:
            r = await box.request(method, f"/s/{sid}{path}", json=body)
            check_error(r, 403, "forbidden")
        r = await box.get(f"/s/{sid}/v1/models")  # its model endpoints it does reach
        assert r.status_code == 200, r.text
    assert rig.manager.describe(sid)["journaled_calls"] == 0
