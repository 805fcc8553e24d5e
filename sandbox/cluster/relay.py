"""How a harness inside a sandbox on a cluster node reaches the gateway, and only as its own session.

On one host the gateway's sandbox listener sits on the sandbox network itself and tells sandboxes apart
by their source address (`gateway.api.sandbox_listener`). A sandbox on another node cannot reach that
network, so on a cluster the path has two legs, and the gateway learns the sandbox from its node's word:

1. **In the sandbox:** the harness calls ``http://belayer-gateway:RELAY_PORT/s/<session>/…``. Every
   sandbox on the gateway network resolves ``belayer-gateway`` (its ``/etc/hosts``) to its own node's
   address on that network. The URL is the same on every node, so a harness restored on another node,
   with the URL in its memory, still reaches the gateway.
2. **On the node:** the `Relay`, in the node's `SandboxAgent`, listens there. The node's firewall chain
   lets sandboxes reach that port only (`sandbox.docker_backend.network`). The relay knows each
   connection's sandbox from its source address: the node's engine gave that address, and the network
   keeps sandboxes from sending as one another. It opens a connection to the gateway's sandbox listener,
   which sends a challenge first, ``BELAYER-CHALLENGE <nonce>`` (`challenge`: 128 random bits, new for
   each connection). The relay answers ``BELAYER <node> <sandbox id> <HMAC-SHA256 of nonce, node and
   sandbox>`` (`vouch`), keyed with its node's own key: `node_key` derives it from the gateway's master
   key and the node's address, and the gateway gives it to that node's agent only, over Ray. Then the
   relay passes the bytes through both ways.
3. **On the gateway** (the demux, in the listener's own protocol): `RelayVouching` checks the answer
   against the challenge it sent on that connection (a recorded answer is worth nothing on another)
   and against the key of the node it names (a node cannot speak for another), and the sandbox must be
   placed on that node (`ClusterSandboxBackend.node_of`). The connection then *is* that sandbox:
   its identity, ``<sandbox id>@<node>`` (`identity_of`, what `ClusterNetwork.address` gives the session
   manager), goes with every request on it into the ASGI scope. No second hop, no address to bind: a
   process on the gateway's host that connects to the listener holds no node's key, so it is closed
   after the challenge, having read nothing else.

An answer that does not check out (a wrong key, another connection's nonce, a byte outside ASCII, a line
over `LINE_MAX`) closes the connection with one log line and nothing else, never a traceback.

Limits. The relay holds at most ``each`` connections per sandbox and ``most`` in all (more are closed
at once), and waits at most `HANDSHAKE_S` for the gateway's challenge; a listener at its own limit
answers an HTTP 503 instead of a challenge, which the relay passes on to the sandbox. It adds no timeouts of its own to
a relayed connection: the listener's header, body and keep-alive timeouts close the gateway's leg, and
the relay closes the sandbox's with it; TCP keepalive ends a leg whose peer vanished. It copies
`CHUNK` bytes at a time, with backpressure: what it holds per connection is bounded.

In clear: the challenge stops replays, not an attacker who can read and inject into a live TCP stream
on the cluster's network; run the cluster on a network only its nodes reach.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import logging
import re
import secrets
import socket
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from sandbox.docker_backend.network import GATEWAY_HOST
from sandbox.network import Vouching

__all__ = [
    "GATEWAY_HOST", "LINE_MAX", "Relay", "RelayVouching", "challenge", "check", "identity_of", "node_key", "vouch",
]  # fmt: skip

log = logging.getLogger("belayer.sandbox.cluster")

LINE_MAX = 512
"""The longest challenge or answer line, in bytes."""
CHUNK = 1 << 16
HANDSHAKE_S = 10.0
"""How long the relay waits for the gateway to accept and send its challenge."""
_CHALLENGE = b"BELAYER-CHALLENGE "
_NONCE = re.compile(rb"[0-9a-f]{32}")
_TOKEN = re.compile(rb"[A-Za-z0-9._:\[\]-]{1,128}")
"""A node's address or a sandbox's id, as they may appear in a line: no spaces, ASCII only."""


def node_key(master: bytes, node: str) -> bytes:
    """The key by which the relay of node `node` vouches for its sandboxes, derived from the gateway's
    `master` key: each node gets its own, and one node's key says nothing of another's.

    >>> node_key(b"m", "10.0.0.2") == node_key(b"m", "10.0.0.2") != node_key(b"m", "10.0.0.3")
    True
    """
    return hmac.new(master, b"belayer relay node\0" + node.encode(), hashlib.sha256).digest()


def challenge() -> bytes:
    """A new connection's challenge line, with a fresh nonce."""
    return _CHALLENGE + secrets.token_hex(16).encode() + b"\n"


def _mac(key: bytes, nonce: bytes, node: bytes, box: bytes) -> bytes:
    return hmac.new(key, b"\n".join((nonce, node, box)), hashlib.sha256).hexdigest().encode()


def _nonce(line: bytes) -> bytes | None:
    nonce = line.removeprefix(_CHALLENGE).rstrip(b"\r\n")
    return nonce if line.startswith(_CHALLENGE) and _NONCE.fullmatch(nonce) else None


def vouch(key: bytes, node: str, sandbox_id: str, challenge_line: bytes) -> bytes | None:
    """The relay's answer to `challenge_line`: node `node` (holding `key`) vouches for `sandbox_id`;
    None when the line is no challenge.

    >>> line = challenge()
    >>> check(b"m", line, vouch(node_key(b"m", "n1"), "n1", "box", line))
    ('n1', 'box')
    """
    nonce = _nonce(challenge_line)
    node_b, box_b = node.encode(), sandbox_id.encode()
    if nonce is None or not (_TOKEN.fullmatch(node_b) and _TOKEN.fullmatch(box_b)):
        return None
    return b"BELAYER " + node_b + b" " + box_b + b" " + _mac(key, nonce, node_b, box_b) + b"\n"


def check(master: bytes, challenge_line: bytes, line: bytes) -> tuple[str, str] | None:
    """``(node, sandbox id)`` that `line` vouches for in answer to `challenge_line`, with the key
    `node_key` derives from `master` for the node it names; None for anything else (never raises).

    >>> line = challenge()
    >>> answer = vouch(node_key(b"m", "n1"), "n1", "box", line)
    >>> check(b"m", challenge(), answer), check(b"m", line, vouch(node_key(b"m", "n2"), "n1", "box", line))
    (None, None)
    >>> check(b"m", line, b"BELAYER n1 b\\xc3\\xa9 00"), check(b"m", line, b"GET / HTTP/1.1")
    (None, None)
    """
    nonce = _nonce(challenge_line)
    parts = line.rstrip(b"\r\n").split(b" ")
    if nonce is None or len(parts) != 4 or parts[0] != b"BELAYER":
        return None
    _, node, box, mac = parts
    if not (_TOKEN.fullmatch(node) and _TOKEN.fullmatch(box)):  # ASCII from here on
        return None
    expected = _mac(node_key(master, node.decode()), nonce, node, box)
    return (node.decode(), box.decode()) if hmac.compare_digest(expected, mac) else None


def identity_of(sandbox_id: str, node: str) -> str:
    """A relayed sandbox's identity for the listener and the session manager: its id on its node."""
    return f"{sandbox_id}@{node}"


class RelayVouching(Vouching):
    """The gateway's side (module docstring, leg 3): a vouch checks out with the named node's key, for a
    sandbox that `node_of` places on that node, or on none yet (a restore that has not returned: the
    identity then matches no session until it is placed there)."""

    max_line = LINE_MAX

    def __init__(self, master: bytes, node_of: Callable[[str], str | None]) -> None:
        self._master, self._node_of = master, node_of

    def challenge(self) -> bytes:
        return challenge()

    def identity(self, challenge: bytes, line: bytes) -> str | None:
        vouched = check(self._master, challenge, line)
        if vouched is None:
            return None
        node, box = vouched
        placed = self._node_of(box)
        if placed not in (None, node):
            log.warning("sandbox relay: node %s vouched for a sandbox placed on %s: refused", node, placed)
            return None
        return identity_of(box, node)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(ConnectionError, OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


async def splice(
    a: tuple[asyncio.StreamReader, asyncio.StreamWriter], b: tuple[asyncio.StreamReader, asyncio.StreamWriter]
) -> None:
    """Pass bytes both ways until both sides are done; then close both."""
    try:
        await asyncio.gather(_pipe(a[0], b[1]), _pipe(b[0], a[1]))
    finally:
        for _, writer in (a, b):
            await _closed(writer)


async def _closed(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()


class _LoopThread:
    """An asyncio server on an event loop of its own thread (Ray actors call in from outside any loop)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.server: asyncio.Server | None = None

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        """Stop listening, end the connections relayed now, and the loop."""
        server, self.server = self.server, None
        with contextlib.suppress(Exception):
            self.run(_close(server), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()


async def _close(server: asyncio.Server | None) -> None:
    if server is not None:
        server.close()
    # the connections' own tasks: cancelled and awaited here, not left to die with the loop
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    if server is not None:
        await server.wait_closed()


class Relay(_LoopThread):
    """The node's leg (module docstring): `host:port` on the node's gateway network, to the sandbox
    listener at `target`, vouching as node `node` with `key` (`node_key`) for the sandboxes that
    `sandbox_at` finds at a connection's source address; at most `each` connections per sandbox and
    `most` in all."""

    def __init__(self, host: str, port: int, target: tuple[str, int], node: str, key: bytes,
                 sandbox_at: Callable[[str], str | None], *, each: int = 32, most: int = 1024) -> None:  # fmt: skip
        super().__init__("belayer-relay")
        self.target, self.node, self.key, self.sandbox_at = target, node, key, sandbox_at
        self.each, self.most = each, most
        self.held: collections.Counter[str] = collections.Counter()
        """Connections relayed now, by sandbox (read by tests from outside the loop: a copy is safe)."""
        self._full: set[str] = set()  # sandboxes at their limit, told once in the log
        self._tasks: set[asyncio.Task[Any] | None] = set()
        self.server_port = port
        self.server = self.run(asyncio.start_server(self._serve, host, port))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        box = await asyncio.to_thread(self.sandbox_at, peer[0]) if peer else None
        if box is None:
            log.warning("relay: a connection from %s, which is no sandbox of this node: closed", peer)
            await _closed(writer)
            return
        if self.held[box] >= self.each or self.held.total() >= self.most:
            if box not in self._full:
                self._full.add(box)
                log.warning("relay: sandbox %s is at its limit of %d connections (%d in all): closing more",
                            box, self.each, self.most)  # fmt: skip
            await _closed(writer)
            return
        self.held[box] += 1
        task = asyncio.current_task()
        self._tasks.add(task)  # held here: a task only the loop refers to (weakly) may be collected
        try:
            await self._relay(box, reader, writer)
        finally:
            self._tasks.discard(task)
            self.held[box] -= 1
            if self.held[box] <= 0:
                del self.held[box]
                self._full.discard(box)

    async def _relay(self, box: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            upstream = await asyncio.wait_for(
                asyncio.open_connection(*self.target, limit=LINE_MAX), HANDSHAKE_S
            )
        except (OSError, TimeoutError) as exc:
            log.warning("relay: the gateway at %s:%d does not answer (%s)", *self.target, exc)
            await _closed(writer)
            return
        _keepalive(writer)
        _keepalive(upstream[1])
        try:  # ValueError: a line over the reader's limit
            line = await asyncio.wait_for(upstream[0].readline(), HANDSHAKE_S)
        except (OSError, TimeoutError, ValueError):
            line = b""
        answer = vouch(self.key, self.node, box, line)
        if answer is not None:
            upstream[1].write(answer)
        elif line.startswith(b"HTTP/"):  # the listener refused at once (its connection limit): passed on
            writer.write(line)
        else:
            log.warning("relay: the gateway at %s:%d sent no challenge: closed", *self.target)
            await _closed(upstream[1])
            await _closed(writer)
            return
        await splice((reader, writer), upstream)


def _keepalive(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
