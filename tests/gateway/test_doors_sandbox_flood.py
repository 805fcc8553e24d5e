"""Code in a sandbox that floods the sandbox listener leaves the trainer's port answered (issue 31,
finding 2): the listener runs the main port's limits (header bytes and time), a cap per sandbox and
one for all sandboxes, and its connections are counted in the gateway's open-file budget.

The gateway runs as in production (`build_server`, its sandbox listener in its lifespan) over a fake
engine, with the fake sandbox backend on loopback: sandboxes at 127.0.0.N, as a container's traffic
arrives from its own address on the gateway network. Before: no header cap (a 256 MB header that never
ended took the gateway from 82 to 570 MB), no header timeout (500 idle connections still held after
45 s), no connection cap, and the main port's budget did not count these connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
from starlette.applications import Starlette

from core.net import free_port
from engine_pool.fake import FakeEngine
from engine_pool.pool import EnginePool
from gateway.app import build_app
from gateway.config import GatewayConfig, ServerConfig
from gateway.serve.server import build_server
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.fake import FakeNetwork, FakeSandboxBackend
from tests.support import REPO

EACH, ALL = 4, 6
T = TypeVar("T")
CHAT = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


class LoopbackNetwork(FakeNetwork):
    """The fake gateway network on loopback: the host at 127.0.0.1, sandboxes at 127.0.0.N."""

    GATEWAY = "127.0.0.1"

    def address(self, sandbox_id: str) -> str | None:
        address = super().address(sandbox_id)
        return address.replace("10.99.0.", "127.0.0.", 1) if address else None


@dataclass
class Served:
    url: str  # the main port: the trainer's
    listener: tuple[str, int]  # the sandbox listener
    app: Starlette
    sessions: dict[str, str]  # by name: "a", "b", "c"
    sources: dict[str, str]  # each one's sandbox address, by name

    def connect(self, name: str) -> socket.socket:
        return socket.create_connection(self.listener, timeout=30, source_address=(self.sources[name], 0))


@contextlib.asynccontextmanager
async def served(tmp_path: Path, model: Path, **limits: float) -> AsyncIterator[Served]:
    """The gateway on a socket, with three sessions ("a", "b", "c") that have a network="gateway" sandbox."""
    backend = FakeSandboxBackend()
    backend._network = LoopbackNetwork()
    config = GatewayConfig(
        model=str(model), store_path=str(tmp_path / "t.db"), port=free_port(),
        sandbox=SandboxConfig(enabled=True, policy=PolicySettings(mode="never"), watch_interval_s=3600.0),
        server=ServerConfig(sandbox_connections_each=EACH, sandbox_max_connections=ALL, **limits),
    )  # fmt: skip
    async with httpx.AsyncClient(transport=httpx.ASGITransport(FakeEngine().app())) as engine_http:
        pool = EnginePool(engine_http)
        pool.add_remote("http://fake-engine")
        app = build_app(config, pool=pool, sandbox_backend=backend)
        server = build_server(app, config)
        serving = asyncio.create_task(server.serve())
        try:
            while not server.started:
                assert not serving.done(), "the gateway did not start"
                await asyncio.sleep(0.01)
            url = f"http://127.0.0.1:{config.port}"
            manager = app.state.gateway.sandboxes
            sessions, sources = {}, {}
            async with httpx.AsyncClient(base_url=url, timeout=30) as trainer:
                for name in ("a", "b", "c"):
                    sid = sessions[name] = (await trainer.post("/api/sessions", json={})).json()["id"]
                    body = {"image": "img", "network": "gateway"}
                    r = await trainer.post(f"/api/sessions/{sid}/sandbox", json=body)
                    assert r.status_code == 201, r.text
                    sources[name] = backend.network.address(manager.sandbox_id(sid))
            host, port = manager.gateway_url.removeprefix("http://").split(":")
            yield Served(url, (host, int(port)), app, sessions, sources)
        finally:
            server.should_exit = True
            await asyncio.wait_for(serving, 30)


def answers(socks: list[socket.socket], count: int) -> list[bytes]:
    """The first `count` answers that arrive on `socks`, each read until its connection closes (a
    deadline, not a duration)."""
    got: list[bytes] = []
    with selectors.DefaultSelector() as sel:
        for sock in socks:
            sel.register(sock, selectors.EVENT_READ)
        end = time.monotonic() + 60
        while len(got) < count:
            assert time.monotonic() < end, f"{len(got)} of {count} answers"
            for key, _ in sel.select(timeout=1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                sel.unregister(sock)
                got.append(read_to_close(sock))
    return got


def read_to_close(sock: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def held(sock: socket.socket) -> bool:
    """Still open, nothing to read."""
    sock.setblocking(False)
    try:
        sock.recv(1)
    except BlockingIOError:
        return True
    finally:
        sock.setblocking(True)
    return False


async def in_thread(fn: Callable[..., T], *args: Any) -> T:
    """Blocking socket work, off the loop that serves the gateway."""
    return await asyncio.to_thread(fn, *args)


async def test_a_flooding_sandbox_is_capped_and_the_trainer_is_answered(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    async with served(tmp_path, tiny_model_dir, header_timeout_s=300.0) as gw:
        flood = [gw.connect("a") for _ in range(10)]
        try:
            refused = await in_thread(answers, flood, 10 - EACH)  # sandbox a: 4 held, the rest refused
            assert all(r.startswith(b"HTTP/1.1 503") and b'"too_many_connections"' in r for r in refused), (
                refused
            )
            assert b"holds its limit of 4 connections" in refused[0]
            assert sum(held(s) for s in flood) == EACH
            more = [gw.connect("b") for _ in range(4)]  # sandbox b: 2 more fill the listener's 6
            flood += more
            refused = await in_thread(answers, more, 2)
            assert all(b"serving its limit of 6 connections, all sandboxes" in r for r in refused), refused
            assert sum(held(s) for s in flood) == ALL

            async with httpx.AsyncClient(
                base_url=gw.url, timeout=30
            ) as trainer:  # the trainer's port answers
                assert (await trainer.get("/api/sessions")).status_code == 200
                r = await trainer.post(f"/s/{gw.sessions['c']}/v1/chat/completions", json=CHAT)
                assert r.status_code == 200, r.text
            c = gw.connect("c")  # and sandbox c waits for room on the listener: refused now
            assert b"serving its limit" in (await in_thread(answers, [c], 1))[0]
        finally:
            for sock in flood:
                sock.close()
        # the flood gone, its places are free again once the gateway has seen the closes (waited on)
        transport = httpx.AsyncHTTPTransport(local_address=gw.sources["c"], retries=0)
        async with httpx.AsyncClient(transport=transport, timeout=30) as sandbox:
            listener = f"http://{gw.listener[0]}:{gw.listener[1]}"
            for _ in range(600):
                r = await sandbox.get(f"{listener}/s/{gw.sessions['c']}/v1/models")
                if r.status_code != 503:
                    break
                await asyncio.sleep(0.05)  # the condition polled, up to a deadline of 600 tries
            assert r.status_code == 200, r.text


async def test_a_header_that_never_ends_is_cut_at_the_limit(tmp_path: Path, tiny_model_dir: Path) -> None:
    async with served(tmp_path, tiny_model_dir, max_header_bytes=8192) as gw:
        sock = gw.connect("a")
        try:

            def send_and_read() -> bytes:
                with contextlib.suppress(ConnectionError):  # the gateway may close while we still send
                    sock.sendall(b"GET /s/x/v1/models HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (4 << 20))
                return read_to_close(sock)

            answer = await in_thread(send_and_read)
        finally:
            sock.close()
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
        assert b"request_header_fields_too_large" in answer


async def test_idle_and_slow_connections_are_closed_by_the_header_timeout(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    async with served(tmp_path, tiny_model_dir, header_timeout_s=0.5) as gw:
        silent = [gw.connect("a") for _ in range(3)]
        slow = gw.connect("b")
        slow.sendall(b"GET /s/x/v1/models HTTP/1.1\r\n")  # and never the rest
        try:
            got = await in_thread(answers, [*silent, slow], 4)  # each closed by the gateway
        finally:
            for sock in [*silent, slow]:
                sock.close()
        assert sorted(g[:12] for g in got) == [b"", b"", b"", b"HTTP/1.1 408"], got


def test_the_listeners_connections_are_counted_in_the_descriptor_budget() -> None:
    """Under 400 descriptors, the main port and the listener share what is left after the reserve, in
    proportion: 2 x (121 + 15) + 128 = 400. Before, the main port took it all and the listener's
    connections came on top."""
    code = (
        "from gateway.config import ServerConfig; "
        "from gateway.http.limits import connection_budget, sandbox_connection_budget; "
        "limits = ServerConfig(); "
        "print(connection_budget(limits, sandbox_listener=True), sandbox_connection_budget(limits))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (400, 400)),
    )  # fmt: skip
    assert out.stdout.split() == ["121", "15"], out
