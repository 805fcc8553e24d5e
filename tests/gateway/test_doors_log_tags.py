"""No log line names a session by its id (issue 31, low): the id is the capability to drive the session
(``/s/{id}/…``), so logs show its tag (`core.logs.session_tag`) instead, in the words, the arguments
and the structured fields alike.

One gateway over two fake engine hosts (behind a `FaultInjector`) and the in-memory sandbox backend
goes through what the recovery and sandbox log lines are about: a failover, a fork (whose children's
routing group is named after the parent's id), a child moved off its worker for load, an explicit
restore whose newer checkpoint cannot be deleted, and a sandbox that dies and is recovered while its
old container cannot be removed. Every record logged meanwhile is read at DEBUG; only the test's own
client's request lines (httpx's, naming the URLs the test called) are left out.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from core.logs import extras, session_tag
from engine_pool.fake import FakeEngine, Fault, FaultInjector
from engine_pool.states import READY
from gateway.config import FailoverConfig, GatewayConfig
from gateway.gateway import Gateway
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.fake import FakeSandboxBackend
from sandbox.fake import Fault as SandboxFault
from tests.support import asgi_gateway

LOAD = 100_000
"""Outstanding tokens put on a child's worker, far over the spill threshold (2 × 0 + 8192)."""


def step(context: list[int]) -> int:
    return (sum(context[-3:]) * 31 + len(context) * 7) % 700 + 20


class Rig:
    def __init__(
        self, app: Any, client: httpx.AsyncClient, faults: FaultInjector, backend: FakeSandboxBackend
    ) -> None:
        self.app, self.client, self.faults, self.backend = app, client, faults, backend

    @property
    def gw(self) -> Gateway:
        gw: Gateway = self.app.state.gateway
        return gw

    async def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        r = await self.client.request(method, path, json=body)
        assert r.status_code in (200, 201), r.text
        return r.json()

    async def chat(self, sid: str) -> dict[str, Any]:
        """One LLM call; the session's newest turn."""
        body = {"model": "policy", "messages": [{"role": "user", "content": "go"}], "max_tokens": 8}
        await self.call("POST", f"/s/{sid}/v1/chat/completions", body)
        trajectory = await self.call("GET", f"/api/sessions/{sid}/trajectory")
        turn: dict[str, Any] = trajectory["turns"][-1]
        return turn

    async def exec(self, sid: str, command: str) -> None:
        answer = await self.call("POST", f"/api/sessions/{sid}/sandbox/exec", {"command": command})
        assert answer["exit_code"] == 0, answer

    async def both_ready(self) -> None:
        """Wait (with a deadline) until both workers are ready: a failover leaves its worker to the probes."""
        async with asyncio.timeout(10):
            while not all(m.state == READY for m in self.gw.pool.roster.members):
                await asyncio.sleep(0.01)


@pytest.fixture
async def rig(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Rig]:
    faults = FaultInjector(httpx.ASGITransport(FakeEngine(step=step, max_model_len=4096).app()))
    backend = FakeSandboxBackend()
    config = GatewayConfig(
        model=str(tiny_model_dir),
        store_path=str(tmp_path / "t.db"),
        failover=FailoverConfig(stall_timeout=0.3, no_worker_wait=1.0, max_failovers=3),
        sandbox=SandboxConfig(enabled=True, sandbox_port=None, policy=PolicySettings(mode="never")),
    )
    pool = {"probe_interval": 0.05, "probe_timeout": 0.2, "routing": "group"}
    hosts = ["http://e0", "http://e1"]
    async with asgi_gateway(config, faults, hosts=hosts, pool_options=pool, sandbox_backend=backend) as (
        app,
        client,
    ):
        yield Rig(app, client, faults, backend)


def gateway_records(caplog: pytest.LogCaptureFixture, client: httpx.AsyncClient) -> list[logging.LogRecord]:
    """Every record but the test client's own request lines (httpx logs each URL it was asked for)."""
    ours = str(client.base_url).rstrip("/")
    return [
        r
        for r in caplog.records
        if not (r.name == "httpx" and any(str(a).startswith(ours) for a in r.args or ()))
    ]


def record_text(record: logging.LogRecord) -> str:
    """All a record carries that a handler may write: its message, its arguments, its extra fields."""
    return f"{record.getMessage()} {record.args!r} {extras(record)!r}"


async def test_recovery_and_sandbox_log_lines_name_sessions_by_their_tags_only(
    rig: Rig, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    parent = (await rig.call("POST", "/api/sessions", {"sandbox": {"image": "img"}}))["id"]

    # a failover: the first worker drops the stream after three tokens
    rig.faults.faults["e0"] = [Fault("drop_after", 3)]
    failed_over = await rig.chat(parent)
    await rig.exec(parent, "echo 0 > /workspace/turn-0")
    first = await rig.call("POST", f"/api/sessions/{parent}/sandbox/checkpoints")

    # a fork: each child is in the group named after the parent's id
    forked = await rig.call("POST", f"/api/sessions/{parent}/fork", {"at_turn": 0, "n": 2})
    children = [c["id"] for c in forked["data"]]
    assert [(await rig.call("GET", f"/api/sessions/{c}"))["group"] for c in children] == [parent, parent]

    # a child moved off its worker for load (group routing): the line names its group
    await rig.both_ready()
    home = (await rig.chat(children[0]))["worker"]
    [crowded] = [m for m in rig.gw.pool.roster.members if m.name == home]
    crowded.outstanding_tokens += LOAD
    moved_to = (await rig.chat(children[0]))["worker"]
    crowded.outstanding_tokens -= LOAD
    assert moved_to != home

    # an explicit restore to the first checkpoint: the newer one cannot be deleted, the old sandbox not removed
    await rig.chat(parent)
    await rig.exec(parent, "echo 1 > /workspace/turn-1")
    newer = await rig.call("POST", f"/api/sessions/{parent}/sandbox/checkpoints")
    replaced = (await rig.call("GET", f"/api/sessions/{parent}/sandbox"))["sandbox_id"]
    rig.backend.inject(SandboxFault("delete_checkpoint"), SandboxFault("destroy", sandbox_id=replaced))
    await rig.call("POST", f"/api/sessions/{parent}/sandbox/restore", {"checkpoint_id": first["id"]})

    # a sandbox that dies is recovered at the next call
    dead = (await rig.call("GET", f"/api/sessions/{parent}/sandbox"))["sandbox_id"]
    rig.backend.kill(dead)
    await rig.exec(parent, "echo back")

    records = gateway_records(caplog, rig.client)
    leaks = [record_text(r) for r in records if any(sid in record_text(r) for sid in (parent, *children))]
    assert leaks == []
    messages = [r.getMessage() for r in records]
    tag, child = session_tag(parent), session_tag(children[0])
    assert (
        f"session {child} (group {tag}): moved from worker {home} ({LOAD} outstanding tokens) to {moved_to} (0) "
        "for load"
    ) in messages
    assert (
        f"session {tag}: could not delete checkpoint {newer['id']} (its storage leaks): "
        "delete_checkpoint failed (injected fault)"
    ) in messages
    assert f"session {tag}: could not remove sandbox {replaced}: destroy failed (injected fault)" in messages
    recovery = [m for r, m in zip(records, messages, strict=True) if r.name == "belayer.recovery"]
    lost = f"session {tag} turn {failed_over['id']}: worker remote-0 lost at token 3 (dead), resumed on remote-1 "
    [failover] = [m for m in recovery if " lost at token " in m]
    assert failover.startswith(lost) and failover.endswith(" ms")
    assert sum(m.startswith(f"session {tag}: sandbox restored ") for m in recovery) == 2
    assert any(m.startswith(f"session {tag}: sandbox {dead} failed ") for m in recovery)
    assert {extras(r)["session_tag"] for r in records if r.name == "belayer.recovery"} == {tag, child}
