"""How a harness inside a sandbox on a cluster node reaches the gateway, and only as its own session.

On one host the gateway's sandbox listener sits on the sandbox network itself and tells sandboxes apart
by their source address (`gateway.api.sandbox_listener`). A sandbox on another node cannot reach that
network, so on a cluster each path has three legs:

1. **In the sandbox:** the harness calls ``http://belayer-gateway:RELAY_PORT/s/<session>/…``. Every
   sandbox on the gateway network resolves ``belayer-gateway`` (its ``/etc/hosts``) to its own node's
   address on that network. The URL is the same on every node, so a harness restored on another node,
   with the URL in its memory, still reaches the gateway.
2. **On the node:** the `Relay`, in the node's `SandboxAgent`, listens there. The node's firewall chain
   lets sandboxes reach that port only (`sandbox.docker_backend.network`). The relay knows each
   connection's sandbox from its source address: the node's engine gave that address, and the network
   keeps sandboxes from sending as one another. It opens a connection to the gateway and sends one line
   first, ``BELAYER <sandbox id> <HMAC-SHA256 of the id>``, keyed with a secret the gateway gave the
   agent over Ray. Then it passes the bytes through both ways.
3. **On the gateway:** the `Demux` checks the line. It opens a connection to the sandbox listener from a
   loopback address of that sandbox's own (`ClusterNetwork.address`: 127.77.x.y, one per sandbox), and
   passes the bytes through. The listener then tells sessions apart exactly as on one host.

A line that does not check out, or a sandbox unknown on either side, closes the connection and
nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from sandbox.docker_backend.network import GATEWAY_HOST

__all__ = ["GATEWAY_HOST", "Demux", "Relay", "preamble", "sign", "verify"]

log = logging.getLogger("belayer.sandbox.cluster")

PREAMBLE_MAX = 256
CHUNK = 1 << 16


def sign(secret: bytes, sandbox_id: str) -> str:
    """The preamble's proof that the relay, holding `secret`, vouches for `sandbox_id`.

    >>> sign(b"k", "box") == sign(b"k", "box") != sign(b"k", "other")
    True
    """
    return hmac.new(secret, sandbox_id.encode(), hashlib.sha256).hexdigest()


def preamble(secret: bytes, sandbox_id: str) -> bytes:
    return f"BELAYER {sandbox_id} {sign(secret, sandbox_id)}\n".encode()


def verify(secret: bytes, line: bytes) -> str | None:
    """The sandbox id a preamble line vouches for, or None.

    >>> verify(b"k", preamble(b"k", "box")), verify(b"other", preamble(b"k", "box")), verify(b"k", b"GET /")
    ('box', None, None)
    """
    parts = line.decode("ascii", "replace").strip().split(" ")
    if len(parts) != 3 or parts[0] != "BELAYER":
        return None
    return parts[1] if hmac.compare_digest(sign(secret, parts[1]), parts[2]) else None


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
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


class _LoopThread:
    """An asyncio server on an event loop of its own thread (Ray actors and the gateway's worker threads
    call in from outside any loop)."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()
        self.server: asyncio.Server | None = None

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            with contextlib.suppress(Exception):
                self.run(_close(server), timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


async def _close(server: asyncio.Server) -> None:
    server.close()
    await server.wait_closed()


class Relay(_LoopThread):
    """The node's leg (module docstring): `host:port` on the node's gateway network, to `target`."""

    def __init__(self, host: str, port: int, target: tuple[str, int], secret: bytes,
                 sandbox_at: Callable[[str], str | None]) -> None:  # fmt: skip
        super().__init__("belayer-relay")
        self.target, self.secret, self.sandbox_at = target, secret, sandbox_at
        self.server_port = port
        self.server = self.run(asyncio.start_server(self._serve, host, port))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        box = await asyncio.to_thread(self.sandbox_at, peer[0]) if peer else None
        if box is None:
            log.warning("relay: a connection from %s, which is no sandbox of this node: closed", peer)
            writer.close()
            return
        try:
            upstream = await asyncio.wait_for(asyncio.open_connection(*self.target), 10)
        except (OSError, TimeoutError) as exc:
            log.warning("relay: the gateway at %s:%d does not answer (%s)", *self.target, exc)
            writer.close()
            return
        upstream[1].write(preamble(self.secret, box))
        await splice((reader, writer), upstream)


class Demux(_LoopThread):
    """The gateway's leg (module docstring): `host:port` (0: any free port), to the sandbox listener at
    `listener`, from the loopback address `alias_of` gives each sandbox."""

    def __init__(self, host: str, listener: tuple[str, int], secret: bytes,
                 alias_of: Callable[[str], str | None]) -> None:  # fmt: skip
        super().__init__("belayer-demux")
        self.listener, self.secret, self.alias_of = listener, secret, alias_of
        self.server = self.run(asyncio.start_server(self._serve, host, 0))
        self.address: tuple[str, int] = self.server.sockets[0].getsockname()[:2]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
        except (OSError, TimeoutError, ValueError):
            writer.close()
            return
        box = verify(self.secret, line[:PREAMBLE_MAX])
        alias = self.alias_of(box) if box is not None else None
        if alias is None:
            log.warning("sandbox relay: a connection that names %s: refused", box or "no sandbox it may")
            writer.close()
            return
        try:
            local = await asyncio.open_connection(*self.listener, local_addr=(alias, 0))
        except OSError as exc:
            log.warning("sandbox relay: the sandbox listener does not answer (%s)", exc)
            writer.close()
            return
        await splice((reader, writer), local)
