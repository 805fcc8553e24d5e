"""A cluster sandbox's identity at the sandbox listener: vouched for by its node, per connection, never
taken from an address that a local process could bind (issue 31, findings 1, 3 and 4).

The listener runs for real on loopback with the cluster's network (`ClusterNetwork`) over the fake
backend, and a real `Relay` plays the node: the test's client binds a loopback source address that the
relay maps to a sandbox, as a container's traffic arrives at its node's relay from its own address.
Before: the demux connected to a listener on 127.0.0.1 from a loopback alias per sandbox (127.77.x.y),
which any local user can bind, and the listener's refusal named the sandbox's session.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from starlette.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from core.net import free_port
from gateway.api.sandbox_listener import IDENTITY_SCOPE_KEY, serve_sandboxes
from gateway.config import ServerConfig
from gateway.http.access import SANDBOX_SCOPE_KEY
from sandbox.backend import SandboxSpec
from sandbox.cluster.network import ClusterNetwork
from sandbox.cluster.relay import Relay, challenge, vouch
from sandbox.config import PolicySettings, SandboxConfig
from sandbox.fake import FakeSandboxBackend
from sandbox.sessions.manager import SandboxManager
from store import SessionRecord, SqliteStore

GATEWAY = "127.0.0.2"  # the gateway's address on the cluster
NODE = "10.1.0.3"  # the node's name: what the gateway places sandboxes on
SOURCES = {"a": "127.0.0.9", "b": "127.0.0.10"}  # each session's sandbox, as the node's relay sees it


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """The app behind the listener: says which sandbox and session the listener saw."""
    body = {"identity": scope.get(IDENTITY_SCOPE_KEY), "session": scope.get(SANDBOX_SCOPE_KEY)}
    await JSONResponse(body)(scope, receive, send)


class RelayedBackend(FakeSandboxBackend):
    """The fake backend's sandboxes, placed on node `NODE` of a cluster network (`ClusterNetwork`)."""

    def __init__(self, relays: Callable[..., None]) -> None:
        super().__init__()
        self.cluster = ClusterNetwork(GATEWAY, 7199, relays, self.node_of)

    def node_of(self, sandbox_id: str) -> str | None:
        return NODE if self._network.address(sandbox_id) is not None else None

    @property
    def network(self) -> ClusterNetwork:  # type: ignore[override]
        return self.cluster


@dataclass
class Cluster:
    backend: RelayedBackend
    manager: SandboxManager
    listener: tuple[str, int] = ("", 0)
    key: bytes = b""
    relay: Relay | None = None
    at: dict[str, str] = field(default_factory=dict)  # the relay's map: source address -> sandbox

    def relays(self, target: tuple[str, int] | None, key_of: Callable[[str], bytes]) -> None:
        """The backend's callback: start (or stop) node `NODE`'s relay, with that node's key."""
        if self.relay is not None:
            self.relay.stop()
            self.relay = None
        if target is not None:
            self.listener, self.key = target, key_of(NODE)
            self.relay = Relay("127.0.0.1", free_port(), target, NODE, self.key, self.at.get, each=3)

    def box(self, session: str) -> str:
        return str(self.manager.describe(session)["sandbox_id"])

    async def get(self, source: str, path: str) -> httpx.Response:
        assert self.relay is not None
        url = f"http://127.0.0.1:{self.relay.server_port}"
        transport = httpx.AsyncHTTPTransport(local_address=source)
        async with httpx.AsyncClient(transport=transport, base_url=url, timeout=10) as client:
            return await client.get(path)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    made = Cluster(None, None)  # type: ignore[arg-type]  # filled below: the backend calls made.relays
    made.backend = RelayedBackend(made.relays)
    store = SqliteStore(tmp_path / "traj.db")
    settings = SandboxConfig(enabled=True, policy=PolicySettings(mode="never"), watch_interval_s=3600.0)
    made.manager = SandboxManager(made.backend, store, settings)
    limits = ServerConfig(sandbox_connections_each=2, sandbox_max_connections=3)
    async with serve_sandboxes(echo, made.manager, made.backend.network, 0, limits) as url:
        assert url == "http://belayer-gateway:7199" and made.listener[0] == GATEWAY
        for sid in SOURCES:
            store.create_session(SessionRecord(sid, time.time(), {}))
            await made.manager.create(sid, SandboxSpec(image="img", network="gateway"))
            made.at[SOURCES[sid]] = made.box(sid)
        yield made
    assert made.relay is None  # the listener's end stopped the relays
    await made.manager.close()
    store.close()


def talk(address: tuple[str, int], lines: list[bytes], source: str = "127.0.0.1") -> tuple[bytes, bytes]:
    """Connect to the listener, read its challenge, send `lines` (the first may answer it), then read
    until the listener closes: (its challenge, everything after it)."""
    with socket.create_connection(address, timeout=30, source_address=(source, 0)) as conn:
        got = b""
        while b"\n" not in got:
            chunk = conn.recv(600)
            assert chunk, got
            got += chunk
        conn.sendall(b"".join(lines))
        rest = got[got.index(b"\n") + 1 :]
        while chunk := conn.recv(4096):
            rest += chunk
        return got[: got.index(b"\n") + 1], rest


REQUEST = b"GET /s/a/v1/models HTTP/1.1\r\nHost: belayer-gateway\r\nConnection: close\r\n\r\n"


async def test_a_relayed_sandbox_reaches_its_own_session_and_is_told_no_session_id(cluster: Cluster) -> None:
    a, b = cluster.box("a"), cluster.box("b")
    r = await cluster.get(SOURCES["a"], "/s/a/v1/models")
    assert (r.status_code, r.json()) == (200, {"identity": f"{a}@{NODE}", "session": "a"})
    r = await cluster.get(SOURCES["b"], "/s/b/v1/models")
    assert (r.status_code, r.json()) == (200, {"identity": f"{b}@{NODE}", "session": "b"})
    r = await cluster.get(SOURCES["a"], "/s/b/v1/models")
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
    assert "/s/a" not in r.text and '"a"' not in r.text and a not in r.text  # nothing names the owner
    with pytest.raises(httpx.TransportError):  # no sandbox of the node's at this address: closed
        await cluster.get("127.0.0.11", "/s/a/v1/models")


NOBODY_SCRIPT = r"""
import json, socket, sys
targets, sources, recorded = json.loads(sys.argv[1])
seen = []
for host, port in targets:
    for source in sources:
        for first in ([], [recorded.encode()]):
            try:
                conn = socket.create_connection((host, port), timeout=20, source_address=(source, 0))
            except OSError as exc:
                seen.append(["refused", host, source, str(exc)])
                continue
            got = b""
            try:
                conn.settimeout(2)
                try:
                    got += conn.recv(600)  # the challenge, if any
                except socket.timeout:
                    pass
                conn.settimeout(20)
                conn.sendall(b"".join(x for x in first) + b"GET /s/a/v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
                while chunk := conn.recv(4096):
                    got += chunk
            except OSError as exc:
                got += b"|" + str(exc).encode()
            finally:
                conn.close()
            seen.append(["answered", host, source, got.decode("latin-1")])
print(json.dumps([__import__("os").getuid(), seen]))
"""


async def test_a_local_user_on_a_sandboxs_old_alias_address_gets_nothing(cluster: Cluster) -> None:
    """Finding 1: run as ``nobody``, bound to the address the demux used to connect from (127.77.0.1, the
    first sandbox's alias) and to the sandbox's address at its node, a process connects to the listener
    (and to 127.0.0.1 on its port, where it used to be) with and without a recorded vouch: it reads a
    challenge and is closed; no session id, no answer, no route. (The node's relay is not tried: on a
    node it maps container addresses on the Docker bridge, which the host routes to the containers.)"""
    if os.geteuid() != 0:
        pytest.skip("dropping to the nobody user needs root")
    host, port = cluster.listener
    old = challenge()  # a vouch the node's relay gave on another connection (recorded off the wire)
    recorded = vouch(cluster.key, NODE, cluster.box("a"), old)
    assert recorded is not None
    arg = json.dumps([[[host, port], ["127.0.0.1", port]], ["127.77.0.1", SOURCES["a"]], recorded.decode()])
    out = await asyncio.to_thread(
        subprocess.run,
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "/usr/bin/python3", "-c",
         NOBODY_SCRIPT, arg],
        capture_output=True, text=True, timeout=120, check=True, cwd="/",
    )  # fmt: skip
    uid, seen = json.loads(out.stdout)
    assert uid != 0
    assert len(seen) == 8
    for outcome, target, source, got in seen:
        if target == "127.0.0.1":  # nothing listens there any more
            assert outcome == "refused", (target, source, got)
            continue
        assert outcome == "answered" and got.startswith("BELAYER-CHALLENGE "), (source, got)
        assert got.count("\n") == 1 and got.endswith("\n"), (source, got)  # the challenge, then closed
    text = " ".join(got for *_, got in seen)
    assert "HTTP/1.1" not in text and "forbidden" not in text and cluster.box("a") not in text


async def test_a_recorded_vouch_is_refused_on_any_other_connection(cluster: Cluster) -> None:
    """Finding 4: the answer to one connection's challenge is worth nothing on the next (a new nonce)."""
    box = cluster.box("a")
    heard, rest = await asyncio.to_thread(
        talk, cluster.listener, []
    )  # a challenge, answered by nothing: closed
    fresh = vouch(cluster.key, NODE, box, heard)
    assert fresh is not None
    for _ in range(3):  # replayed three times, as in the finding
        _, rest = await asyncio.to_thread(talk, cluster.listener, [fresh, REQUEST])
        assert rest == b""


def answered(address: tuple[str, int], answer: Callable[[bytes], bytes | None]) -> bytes:
    """Connect, answer the listener's challenge with `answer(challenge)`, send `REQUEST`; what comes back."""
    with socket.create_connection(address, timeout=30) as conn:
        line = b""
        while not line.endswith(b"\n"):
            line += conn.recv(1)
        made = answer(line)
        assert made is not None
        conn.sendall(made + REQUEST)
        got = b""
        while chunk := conn.recv(4096):
            got += chunk
        return got


async def test_a_vouch_holds_only_with_its_own_challenge_and_its_nodes_key(cluster: Cluster) -> None:
    box = cluster.box("a")
    got = await asyncio.to_thread(
        answered, cluster.listener, lambda line: vouch(cluster.key, NODE, box, line)
    )
    assert got.startswith(b"HTTP/1.1 200") and f'"identity":"{box}@{NODE}"'.encode() in got, got

    other = cluster.backend.network.node_key("10.1.0.4")
    forged = [
        lambda line: vouch(other, "10.1.0.4", box, line),  # a node's own key, for a sandbox placed elsewhere
        lambda line: vouch(other, NODE, box, line),  # another node's key, in this node's name
    ]
    for answer in forged:
        got = await asyncio.to_thread(answered, cluster.listener, answer)
        assert got == b""  # closed, nothing answered


async def test_a_line_with_a_byte_outside_ascii_is_refused_without_a_traceback(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    mac = "0" * 64
    for line in (f"BELAYER {NODE} box-é {mac}\n".encode(), b"BELAYER \xff\xfe x y\n", b"\x80" * 600):
        _, rest = await asyncio.to_thread(talk, cluster.listener, [line, REQUEST])
        assert rest == b""
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info]
    assert tracebacks == []
    refusals = [
        r.getMessage() for r in caplog.records if r.name == "belayer.gateway" and "closed" in r.getMessage()
    ]
    assert len(refusals) == 3, refusals
    r = await cluster.get(SOURCES["a"], "/s/a/v1/models")  # and the listener serves on
    assert r.status_code == 200


async def test_two_live_sandboxes_never_share_an_identity(cluster: Cluster) -> None:
    """Finding 3: the alias counter wrapped at 62,500 sandboxes and gave a live sandbox's address to a new
    one. An identity is the sandbox's own id on its node: as many sandboxes, as many identities."""
    network = ClusterNetwork(GATEWAY, 7199, lambda *_: None, lambda box: NODE)
    ids = [f"belayer-{i:012x}" for i in range(62_501)]
    identities = {network.address(box) for box in ids}
    assert len(identities) == 62_501 and None not in identities
    assert network.address(ids[0]) != network.address(ids[62_500])
    # and through the listener: each of two sandboxes lands in its own session, never the other's
    for sid, source in SOURCES.items():
        r = await cluster.get(source, f"/s/{sid}/v1/models")
        assert r.json()["session"] == sid


def relayed(port: int, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))


def refusal(conn: socket.socket) -> bytes:
    got = b""
    while chunk := conn.recv(4096):
        got += chunk
    return got


async def test_a_relayed_sandbox_over_its_caps_is_answered_503_through_its_relay(cluster: Cluster) -> None:
    """Finding 2 on a cluster: the listener's caps (2 per sandbox, 3 in all here) hold for relayed
    connections, and the refusal reaches the sandbox through its relay (before or after the vouch)."""
    assert cluster.relay is not None
    port = cluster.relay.server_port
    held = [relayed(port, SOURCES["a"]), relayed(port, SOURCES["a"])]
    try:
        got = await asyncio.to_thread(refusal, relayed(port, SOURCES["a"]))
        assert got.startswith(b"HTTP/1.1 503") and b"holds its limit of 2 connections" in got, got
        held.append(relayed(port, SOURCES["b"]))
        got = await asyncio.to_thread(refusal, relayed(port, SOURCES["b"]))  # 3 in all: refused at once
        assert got.startswith(b"HTTP/1.1 503") and b"serving its limit of 3 connections" in got, got
        for conn, sid in zip(held, "aab", strict=True):  # the held ones are served, each as its sandbox
            conn.sendall(REQUEST.replace(b"/s/a/", f"/s/{sid}/".encode()))
        answers = await asyncio.gather(*(asyncio.to_thread(refusal, conn) for conn in held))
        assert [a.split(b"\r\n", 1)[0] for a in answers] == [b"HTTP/1.1 200 OK"] * 3
    finally:
        for conn in held:
            conn.close()
