"""The HTTP server around the app: uvicorn, with the limits a production proxy has.

uvicorn alone lets a client hold a connection forever: it has no header or body timeout, its
connection limit answers plain text only once a request's headers are in, and its graceful shutdown
waits without end by default. Here, over uvicorn's httptools protocol:

- **header timeout**: a connection sends a request's complete headers within ``header_timeout_s``
  of its accept (or of the request's first byte, on a keep-alive connection), else it is answered 408
  and closed; a connection that sent nothing is closed. Between requests uvicorn's keep-alive
  timeout (``keep_alive_s``) closes an idle connection.
- **body timeout**: a request body that pauses for ``body_timeout_s`` ends in a 408 in the route's
  error format (``RequestTimeout`` through the error table; ``BodyTimeout`` wraps ``receive``), and the
  connection is closed. A body the app never reads is discarded under the same timeout.
- **max header size**: request line + headers over ``max_header_bytes`` are answered 431.
- **connection limit**: a connection beyond ``max_connections`` is answered 503 as soon as it is
  accepted (its descriptor is released at once, not after its headers) with a JSON body in both the
  OpenAI and the Anthropic shape, as its request is not read yet, and ``Retry-After``.
  The limit is lowered to fit the process's open-file limit: half the descriptors are kept for engine
  connections, so that client connections alone can never starve the gateway of them; the sandbox
  listener's connections (``sandbox_max_connections``) are counted in the same budget.

The protocol and the body timeout live in ``gateway.http.limits``: the sandbox listener
(``gateway.api.sandbox_listener``) runs under the same limits, with a cap per sandbox besides.
- **shutdown deadline**: on SIGTERM the server stops accepting, lets requests in flight finish for
  ``shutdown_grace_s``, then tells the turn runner (``TurnRunner.interrupting``) and cancels them:
  their turns are recorded ``interrupted`` with their tokens so far, and the lifespan closes the
  runner, sandboxes, pool and store.

Example::

    serve(build_app(config), config)                     # belayer serve; returns after a SIGTERM

    server = build_server(app, config)                   # in process (tests)
    await server.serve()
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

import uvicorn
from starlette.applications import Starlette

from gateway.config import GatewayConfig
from gateway.gateway import Gateway
from gateway.http.limits import (
    RESERVED_FDS,
    BodyTimeout,
    LimitedHttpProtocol,
    LimitsConfig,
    connection_budget,
)

__all__ = [
    "RESERVED_FDS", "BodyTimeout", "GatewayServer", "LimitedHttpProtocol", "build_server", "connection_budget",
    "serve",
]  # fmt: skip

log = logging.getLogger("belayer.gateway")

CANCEL_WAIT_S = 5
"""After the shutdown deadline, how long the cancelled requests have to record their turns."""


def build_server(app: Starlette, config: GatewayConfig) -> GatewayServer:
    """The gateway's uvicorn server, with the limits of ``config.server`` (see the module docstring)."""
    listener = config.sandbox.enabled and config.sandbox.sandbox_port is not None
    budget = connection_budget(config.server, sandbox_listener=listener)
    limits = config.server.model_copy(update={"max_connections": budget})
    options = LimitsConfig(
        BodyTimeout(app, limits.body_timeout_s),
        limits,
        host=config.host,
        port=config.port,
        http=LimitedHttpProtocol,
        ws="none",  # no WebSocket routes: an upgrade request is an ordinary (404) request
        timeout_keep_alive=limits.keep_alive_s,
        timeout_graceful_shutdown=CANCEL_WAIT_S,  # uvicorn's own wait, after ours: a backstop
        log_config=None,
        access_log=False,
    )

    def interrupt_turns() -> None:
        gateway = getattr(app.state, "gateway", None)
        if isinstance(gateway, Gateway):
            gateway.runner.interrupting = True

    def end_feeds() -> None:
        gateway = getattr(app.state, "gateway", None)
        if isinstance(gateway, Gateway):
            gateway.telemetry.close()

    return GatewayServer(options, limits.shutdown_grace_s, interrupt_turns, end_feeds)


def serve(app: Starlette, config: GatewayConfig) -> None:
    """Run the gateway until SIGTERM or SIGINT, then shut down within the grace period."""
    build_server(app, config).run()


class GatewayServer(uvicorn.Server):
    """uvicorn's server with a shutdown deadline: in-flight requests get ``grace`` seconds, then
    ``on_deadline`` runs and they are cancelled; then uvicorn's own shutdown (the lifespan)."""

    def __init__(
        self,
        config: uvicorn.Config,
        grace: float,
        on_deadline: Callable[[], None],
        on_shutdown: Callable[[], None] = lambda: None,
    ) -> None:
        super().__init__(config)
        self.grace = grace
        self.on_deadline = on_deadline
        self.on_shutdown = on_shutdown
        """Runs first: ends the live-feed streams (they never end by themselves)."""

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_shutdown()
        for server in self.servers:
            server.close()  # accept no more connections
        for connection in list(self.server_state.connections):
            connection.shutdown()  # idle ones close now, busy ones after their response
        tasks = self.server_state.tasks
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.grace
        if tasks:
            log.info("shutdown: waiting up to %.0fs for %d request(s)", self.grace, len(tasks))
        while tasks and not self.force_exit and (left := deadline - loop.time()) > 0:
            await asyncio.wait(set(tasks), timeout=min(left, 0.5))  # 0.5: notice a forced exit
        if tasks:
            running = set(tasks)
            log.warning("shutdown: grace period over, cancelling %d request(s)", len(running))
            self.on_deadline()
            quiet = _QuietCancellations()  # uvicorn logs each cancelled request with its traceback
            logging.getLogger("uvicorn.error").addFilter(quiet)
            try:
                for task in running:
                    task.cancel(msg="the gateway's shutdown grace period ran out")
                await asyncio.wait(running, timeout=CANCEL_WAIT_S)
            finally:
                logging.getLogger("uvicorn.error").removeFilter(quiet)
        await super().shutdown(sockets)


class _QuietCancellations(logging.Filter):
    """Drops uvicorn's "Exception in ASGI application" for a request the shutdown cancelled."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))
