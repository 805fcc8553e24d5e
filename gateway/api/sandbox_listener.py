"""The gateway's second listener, the only thing a ``network="gateway"`` sandbox can reach.

It listens on the host's address on the sandbox network (`SandboxNetwork.gateway_address`), and the
network's firewall lets sandboxes reach that port and nothing else. It serves the same app, but a
request must come from a sandbox and name that sandbox's own session: ``/s/{its session}/…`` (and
``/health``). Everything else, the admin, sandbox and sessions APIs and other sessions included, is
refused with a 403 in the protocol's error JSON (so is its own sandbox API, ``/s/{its
session}/sandbox``, by `gateway.api.sandbox`: a harness inside runs its commands itself). The
request's source address tells the sandbox (`SandboxManager.owner_of`); sandboxes cannot spoof it, since they have no capabilities. It is the TCP
peer's address, never a header's: proxy headers are off (uvicorn would otherwise let ``X-Forwarded-For``
rename the client, from any peer with ``FORWARDED_ALLOW_IPS=*`` in the environment). Nor does the
listener log what a request carries: no access line (uvicorn writes one, full URL and all, whenever
``uvicorn.access`` has a handler, whatever its config says), and uvicorn's message log (TRACE level:
scopes with their query strings and headers) is left out of its app.

A fork child's sandbox is restored from its parent's checkpoint, so the processes in it (a harness
inside, restored with its memory) still hold the parent's URL. A request from such a sandbox for one
of the sessions it descends from (`SandboxManager.lineage_of`: its parent, the parent's parent...) is
rewritten to its own session, ``/s/{ancestor}/…`` -> ``/s/{child}/…``: a forked harness lands in its own
child session, never in its parent's or a sibling's. Any other session is still refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from core.errors import SandboxError
from gateway.http.access import SANDBOX_SCOPE_KEY
from gateway.http.errors import error_body, for_route
from sandbox.network import SandboxNetwork
from sandbox.sessions.manager import SandboxManager

log = logging.getLogger("belayer.gateway")
_SESSION_PATH = re.compile(r"/s/([^/]+)/")


class SandboxFacing:
    """ASGI wrapper: pass a sandbox's requests for its own session, refuse the rest (see above)."""

    def __init__(self, app: ASGIApp, manager: SandboxManager) -> None:
        self.app = app
        self.manager = manager

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            client = scope.get("client")
            owner = await self.manager.owner_of(client[0]) if client else None
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

    def _own_session(self, scope: Scope, owner: str) -> Scope:
        """The request with an ancestor's session id in its path replaced by the fork child's own."""
        match = _SESSION_PATH.match(scope["path"])
        if match is None or match.group(1) not in self.manager.lineage_of(owner):
            return scope
        path = f"/s/{owner}/{scope['path'][match.end() :]}"
        return {**scope, "path": path, "raw_path": path.encode()}

    @staticmethod
    def _refusal(path: str, owner: str | None) -> str | None:
        if path == "/health":
            return None
        if owner is None:
            return "this listener serves Belayer sandboxes only, and the request comes from none"
        match = _SESSION_PATH.match(path)
        if match is None or match.group(1) != owner:
            return f"a sandbox may only call its own session's model endpoints under /s/{owner}/"
        return None


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


class _UnloggedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol without its access line: uvicorn decides per connection, from whether
    the ``uvicorn.access`` logger has a handler anywhere up its tree, not from ``access_log=False``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.access_log = False


def _server(app: ASGIApp) -> uvicorn.Server:
    """uvicorn serving `app` as it is: the client is the TCP peer, whatever the headers or the
    environment say, and no request's query string or headers reach a log."""
    config = uvicorn.Config(
        app, http=_UnloggedHttp, lifespan="off", log_config=None, access_log=False, timeout_keep_alive=30,
        proxy_headers=False, forwarded_allow_ips=[],
    )  # fmt: skip
    config.load()
    # load() wraps the app in uvicorn's own middleware: its message logger when "uvicorn.error" logs at
    # TRACE (every scope, query string and headers included); the listener runs the bare app
    config.loaded_app = app
    return uvicorn.Server(config)


@contextlib.asynccontextmanager
async def serve_sandboxes(
    app: ASGIApp, manager: SandboxManager, network: SandboxNetwork | None, port: int
) -> AsyncIterator[str | None]:
    """Run the listener for the lifespan; yield its URL (None, with a warning, when it cannot run)."""
    if network is None:
        log.warning("no listener for network='gateway' sandboxes: the sandbox backend has no such network")
        yield None
        return
    try:
        host = await asyncio.to_thread(network.gateway_address)
        sock = _bind(host, port, manager.listener_port() if port == 0 else None)
        port = sock.getsockname()[1]
        await asyncio.to_thread(network.open_gateway, port)
    except (SandboxError, OSError) as exc:
        log.warning("no listener for network='gateway' sandboxes (%s); they cannot be created", exc)
        yield None
        return
    server = _server(SandboxFacing(app, manager))
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
