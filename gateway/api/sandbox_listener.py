"""The gateway's second listener, the only thing a ``network="gateway"`` sandbox can reach.

It listens on the host's address on the sandbox network (`SandboxNetwork.gateway_address`), and the
network's firewall lets sandboxes reach that port and nothing else. It serves the same app, but a
request must come from a sandbox and name that sandbox's own session: ``/s/{its session}/…`` (and
``/health``). Everything else, the admin, sandbox and sessions APIs and other sessions included, is
refused with a 403 in the protocol's error JSON (so is its own sandbox API, ``/s/{its
session}/sandbox``, by `gateway.api.sandbox`: a harness inside runs its commands itself). No refusal
names a session: the caller learns nothing it did not send.

**Who is calling.** Each connection carries the identity of one sandbox (`IDENTITY_SCOPE_KEY` in each
request's scope), which the session manager maps to its session (`SandboxManager.owner_of`):

- On one host the identity is the TCP peer's address, a container's address on the Docker bridge. A
  sandbox cannot spoof it (no capabilities), and no process on the host can connect from it (the host
  routes that address to the container). It is the peer's, never a header's: proxy headers are off
  (uvicorn would otherwise let ``X-Forwarded-For`` rename the client, from any peer with
  ``FORWARDED_ALLOW_IPS=*`` in the environment).
- On a cluster (`SandboxNetwork.vouching`) the peer is a node's relay, and the address tells nothing.
  The listener sends each new connection a challenge, reads one line back, and takes the identity from
  the node's vouch in it (`sandbox.cluster.relay`); without a vouch that checks out the connection is
  closed before a byte of HTTP is read. The request is handed to the app in-process with the identity
  in its scope: there is no second hop and no address to bind.

**Limits.** The listener runs the main port's protocol (`gateway.http.limits`: header bytes and header
timeout, body timeout, keep-alive timeout, a connection limit answered 503 in JSON), under its own
``sandbox_max_connections``, which is counted with the main port's in the gateway's open-file budget;
and a sandbox holds at most ``sandbox_connections_each`` connections (more are answered 503 at once).
So a sandbox that floods the listener leaves the trainer's port its descriptors.

Nor does the listener log what a request carries: no access line (uvicorn writes one, full URL and all,
whenever ``uvicorn.access`` has a handler, whatever its config says), and uvicorn's message log (TRACE
level: scopes with their query strings and headers) is left out of its app.

A fork child's sandbox is restored from its parent's checkpoint, so the processes in it (a harness
inside, restored with its memory) still hold the parent's URL. A request from such a sandbox for one
of the sessions it descends from (`SandboxManager.lineage_of`: its parent, the parent's parent...) is
rewritten to its own session, ``/s/{ancestor}/…`` -> ``/s/{child}/…``: a forked harness lands in its own
child session, never in its parent's or a sibling's. Any other session is still refused.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.server import ServerState

from core.errors import SandboxError
from gateway.config import ServerConfig
from gateway.http.access import SANDBOX_SCOPE_KEY
from gateway.http.errors import error_body, for_route
from gateway.http.limits import BodyTimeout, LimitedHttpProtocol, LimitsConfig, sandbox_connection_budget
from sandbox.network import SandboxNetwork, Vouching
from sandbox.sessions.manager import SandboxManager

log = logging.getLogger("belayer.gateway")
_SESSION_PATH = re.compile(r"/s/([^/]+)/")
IDENTITY_SCOPE_KEY = "belayer.sandbox_identity"
"""The scope key under which the listener's protocol puts the identity of the connection's sandbox."""


class SandboxFacing:
    """ASGI wrapper: pass a sandbox's requests for its own session, refuse the rest (see above).

    The sandbox is the scope's `IDENTITY_SCOPE_KEY` (the listener's protocol sets it); without one, the
    client address, unless `vouched` (a relay's peer address names no sandbox)."""

    def __init__(self, app: ASGIApp, manager: SandboxManager, *, vouched: bool = False) -> None:
        self.app = app
        self.manager = manager
        self.vouched = vouched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            identity = self._identity(scope)
            owner = await self.manager.owner_of(identity) if identity else None
            if owner is not None:
                scope = self._own_session(scope, owner)
            refusal = self._refusal(scope["path"], owner)
            if refusal is not None:
                body = error_body(refusal, "permission_error", None, "forbidden")
                await JSONResponse(for_route(scope["path"], 403, body), status_code=403)(scope, receive, send)
                return
            scope = {**scope, SANDBOX_SCOPE_KEY: owner}
        elif scope["type"] != "lifespan":
            return
        await self.app(scope, receive, send)

    def _identity(self, scope: Scope) -> str | None:
        identity = scope.get(IDENTITY_SCOPE_KEY)
        if identity is None and not self.vouched:
            client = scope.get("client")
            identity = client[0] if client else None
        return identity if isinstance(identity, str) else None

    def _own_session(self, scope: Scope, owner: str) -> Scope:
        """The request with an ancestor's session id in its path replaced by the fork child's own."""
        match = _SESSION_PATH.match(scope["path"])
        if match is None or match.group(1) not in self.manager.lineage_of(owner):
            return scope
        path = f"/s/{owner}/{scope['path'][match.end() :]}"
        return {**scope, "path": path, "raw_path": path.encode()}

    @staticmethod
    def _refusal(path: str, owner: str | None) -> str | None:
        """Why the request is refused, in words that name no session (not even the caller's own)."""
        if path == "/health":
            return None
        if owner is None:
            return "this listener serves Belayer sandboxes only, and the request comes from none"
        match = _SESSION_PATH.match(path)
        if match is None or match.group(1) != owner:
            return (
                "a sandbox may only call its own session's model endpoints: use the URL in its "
                "BELAYER_SESSION_URL (OPENAI_BASE_URL, ANTHROPIC_BASE_URL)"
            )
        return None


class ListenerConfig(LimitsConfig):
    """The listener's uvicorn configuration: the limits, how connections are vouched for (None: by their
    source address), and the connections held now per sandbox (shared by the server's protocols)."""

    def __init__(self, app: ASGIApp, limits: ServerConfig, vouching: Vouching | None, **options: Any) -> None:
        super().__init__(app, limits, **options)
        self.vouching = vouching
        self.held: collections.Counter[str] = collections.Counter()


class SandboxProtocol(LimitedHttpProtocol):
    """The main port's protocol (`LimitedHttpProtocol`) with the sandbox's identity: vouched for first,
    when the network vouches, else the peer's address; at most ``sandbox_connections_each`` connections
    per identity. No access line (uvicorn decides that per connection, from whether the
    ``uvicorn.access`` logger has a handler anywhere up its tree, not from ``access_log=False``)."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        assert isinstance(config, ListenerConfig)
        self.access_log = False
        self._vouching, self._held = config.vouching, config.held
        self.identity: str | None = None
        self._challenge: bytes | None = None  # sent, and not answered yet
        self._answer = bytearray()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self._refused:
            return
        if self._vouching is None:
            self._admit(self.client[0] if self.client else "")
        else:
            self._challenge = self._vouching.challenge()
            transport.write(self._challenge)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.identity is not None:
            self._held[self.identity] -= 1
            if self._held[self.identity] <= 0:
                del self._held[self.identity]
            self.identity = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._challenge is not None:  # the header timeout, armed at the accept, bounds the wait
            data = self._vouched(data)
            if not data:
                return
        super().data_received(data)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[IDENTITY_SCOPE_KEY] = self.identity  # type: ignore[literal-required]

    def _vouched(self, data: bytes) -> bytes:
        """Take the answer line from `data`: once it is in and checks out, the bytes after it (HTTP)."""
        assert self._vouching is not None and self._challenge is not None
        if self._refused:
            return b""
        self._answer += data
        end = self._answer.find(b"\n")
        if end < 0:
            if len(self._answer) > self._vouching.max_line:
                self._close_unvouched(f"a line over {self._vouching.max_line} bytes")
            return b""
        line, rest = bytes(self._answer[:end]), bytes(self._answer[end + 1 :])
        challenge, self._challenge, self._answer = self._challenge, None, bytearray()
        identity = self._vouching.identity(challenge, line)
        if identity is None:
            self._close_unvouched("no vouch that checks out")
            return b""
        return rest if self._admit(identity) else b""

    def _close_unvouched(self, why: str) -> None:
        log.warning("sandbox listener: a connection from %s with %s: closed", self.client, why)
        self._refused = True
        self._stop_deadline()
        self.transport.close()

    def _refuse_connection(self, message: str | None = None) -> None:
        limit = self.limits.max_connections
        super()._refuse_connection(
            message
            or f"the gateway's sandbox listener is serving its limit of {limit} connections, all sandboxes "
            "together; retry shortly (Retry-After)"
        )

    def _admit(self, identity: str) -> bool:
        each = self.limits.sandbox_connections_each
        if self._held[identity] >= each:
            self._refuse_connection(
                f"this sandbox holds its limit of {each} connections to the gateway; close one, or retry "
                "shortly (Retry-After)"
            )
            return False
        self._held[identity] += 1
        self.identity = identity
        return True


def _bind(host: str, port: int, earlier: int | None) -> socket.socket:
    """The listener's socket on `port`; with any port (0), first on the `earlier` one that the sandboxes a
    restarted gateway took back were given (their harnesses call it again)."""
    if earlier:
        try:
            return _socket(host, earlier)
        except OSError as exc:
            log.warning("sandbox listener: port %d of the adopted sandboxes is taken (%s)", earlier, exc)
    return _socket(host, port)


def _socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def _server(app: ASGIApp, limits: ServerConfig, vouching: Vouching | None) -> uvicorn.Server:
    """uvicorn serving `app` under `limits`: the client is the TCP peer (or the vouched sandbox),
    whatever the headers or the environment say, and no request's query string or headers reach a log."""
    config = ListenerConfig(
        BodyTimeout(app, limits.body_timeout_s), limits, vouching, http=SandboxProtocol, ws="none",
        lifespan="off", log_config=None, access_log=False, timeout_keep_alive=limits.keep_alive_s,
        proxy_headers=False, forwarded_allow_ips=[],
    )  # fmt: skip
    config.load()
    # load() wraps the app in uvicorn's own middleware: its message logger when "uvicorn.error" logs at
    # TRACE (every scope, query string and headers included); the listener runs the bare app
    config.loaded_app = config.app
    return uvicorn.Server(config)


@contextlib.asynccontextmanager
async def serve_sandboxes(
    app: ASGIApp,
    manager: SandboxManager,
    network: SandboxNetwork | None,
    port: int,
    limits: ServerConfig | None = None,
) -> AsyncIterator[str | None]:
    """Run the listener for the lifespan, under `limits` (the gateway's ``server`` table); yield its URL
    (None, with a warning, when it cannot run)."""
    if network is None:
        log.warning("no listener for network='gateway' sandboxes: the sandbox backend has no such network")
        yield None
        return
    vouching = network.vouching()
    try:
        host = await asyncio.to_thread(network.gateway_address)
        # a vouched network's sandboxes were given their relay's port, not the listener's
        earlier = manager.listener_port() if port == 0 and vouching is None else None
        sock = _bind(host, port, earlier)
        port = sock.getsockname()[1]
        await asyncio.to_thread(network.open_gateway, port)
    except (SandboxError, OSError) as exc:
        log.warning("no listener for network='gateway' sandboxes (%s); they cannot be created", exc)
        yield None
        return
    limits = limits or ServerConfig()
    limits = limits.model_copy(update={"max_connections": sandbox_connection_budget(limits)})
    server = _server(SandboxFacing(app, manager, vouched=vouching is not None), limits, vouching)
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]))
    url = network.sandbox_url(host, port)
    manager.gateway_url = url
    log.info("sandbox listener on http://%s:%d; sandboxes reach it at %s", host, port, url)
    try:
        yield url
    finally:
        manager.gateway_url = None
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await task
        sock.close()
        with contextlib.suppress(SandboxError):
            await asyncio.to_thread(network.close_gateway, port)
