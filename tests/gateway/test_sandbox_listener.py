"""The sandbox listener as a real server on loopback: requests come from real source addresses.

Each fake sandbox gets a loopback address (127.0.0.N), and the test's client binds it as its source,
as a container's traffic arrives from its own address on the gateway network.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from gateway.api.sandbox_listener import serve_sandboxes
from gateway.http.access import SANDBOX_SCOPE_KEY
from sandbox.backend import SandboxSpec
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.fake import FakeNetwork, FakeSandboxBackend
from sandbox.sessions.manager import SandboxManager
from store import SessionRecord, SqliteStore


class LoopbackNetwork(FakeNetwork):
    """The fake gateway network on loopback: the host at 127.0.0.1, sandboxes at 127.0.0.N."""

    GATEWAY = "127.0.0.1"

    def address(self, sandbox_id: str) -> str | None:
        address = super().address(sandbox_id)
        return address.replace("10.99.0.", "127.0.0.", 1) if address else None


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """The app behind the listener: says which client and session the listener saw."""
    body = {"client": scope["client"][0], "sandbox": scope.get(SANDBOX_SCOPE_KEY)}
    await JSONResponse(body)(scope, receive, send)


@dataclass
class Listener:
    url: str
    manager: SandboxManager

    def address(self, session_id: str) -> str:
        box = self.manager.describe(session_id)["sandbox_id"]
        address = self.manager.network.address(box) if self.manager.network else None
        assert address is not None
        return address

    async def get(self, source: str, path: str, headers: dict[str, str] | None = None) -> httpx.Response:
        transport = httpx.AsyncHTTPTransport(local_address=source)
        async with httpx.AsyncClient(transport=transport, base_url=self.url, timeout=10) as client:
            return await client.get(path, headers=headers)


@pytest.fixture
async def listener(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Listener]:
    """The listener, started where uvicorn would trust every peer's proxy headers."""
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "*")
    backend = FakeSandboxBackend()
    network = LoopbackNetwork()
    backend._network = network  # the fake backend's own network, on loopback
    store = SqliteStore(tmp_path / "traj.db")
    settings = SandboxConfig(enabled=True, policy=PolicySettings(mode="never"), watch_interval_s=3600.0)
    manager = SandboxManager(backend, store, settings)
    async with serve_sandboxes(echo, manager, network, 0) as url:
        assert url is not None and url.startswith("http://127.0.0.1:")
        for sid in ("a", "b"):
            store.create_session(SessionRecord(sid, time.time(), {}))
            await manager.create(sid, SandboxSpec(image="img", network="gateway"))
        yield Listener(url, manager)
    await manager.close()
    store.close()


async def test_a_forwarded_for_header_cannot_borrow_another_sandboxs_address(listener: Listener) -> None:
    """uvicorn trusts ``X-Forwarded-For`` from the peers in FORWARDED_ALLOW_IPS (``*``: from anyone); the
    listener ignores it: a sandbox is judged by its own source address."""
    a, b = listener.address("a"), listener.address("b")
    assert (a, b) == ("127.0.0.2", "127.0.0.3")
    spoof = {"X-Forwarded-For": b, "Forwarded": f"for={b}", "X-Real-IP": b}

    r = await listener.get(a, "/s/b/v1/models", spoof)
    assert r.status_code == 403, r.text
    assert "own session's model endpoints" in r.json()["error"]["message"]  # judged as sandbox a
    assert "/s/a/" not in r.text and "/s/b/" not in r.text  # and told no session's id
    r = await listener.get(a, "/s/a/v1/models", spoof)
    assert (r.status_code, r.json()) == (200, {"client": a, "sandbox": "a"})
    r = await listener.get("127.0.0.9", "/s/b/v1/models", spoof)  # no sandbox has this address
    assert r.status_code == 403 and "comes from none" in r.json()["error"]["message"]


async def test_a_refusal_on_an_anthropic_route_is_in_anthropics_shape(listener: Listener) -> None:
    r = await listener.get(listener.address("a"), "/s/b/v1/messages")
    assert r.status_code == 403 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "permission_error" and "/s/a/" not in r.json()["error"]["message"]


async def test_the_listener_logs_no_query_string(
    listener: Listener, caplog: pytest.LogCaptureFixture
) -> None:
    """Not with a handler on ``uvicorn.access`` (uvicorn then writes its access line, full URL and all,
    whatever its config says), nor with uvicorn's loggers at TRACE (5), where it logs every ASGI scope."""
    caplog.set_level(5)
    a = listener.address("a")
    for path in ("/s/a/v1/models?key=sekrit-own", "/s/b/v1/models?key=sekrit-other", "/health?key=sekrit-h"):
        r = await listener.get(a, path, {"Authorization": "Bearer sekrit-token"})
        assert r.status_code in (200, 403)
    served = [r for r in caplog.records if not r.name.startswith(("httpx", "httpcore"))]  # not the client's
    assert served  # the server logged (its connections' trace lines) ...
    assert [r.getMessage() for r in served if "sekrit" in r.getMessage()] == []  # ... no query or header
