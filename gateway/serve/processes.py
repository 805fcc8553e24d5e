"""Several gateway processes on one machine (``belayer serve --processes N``): when one process's event
loop is the limit, N processes serve one port, each with its own event loop.

Each child binds the port itself with ``SO_REUSEPORT``, so the kernel spreads new connections over
the children's listening sockets (evenly, by a hash of the connection, unlike one shared listening
socket, where the busiest loop tends to accept most). A child listens only once its lifespan has
started, and a child that dies leaves the group at once: new connections go to the others.

The parent serves nothing. It holds the port (bound, not listening: a ``--port 0`` is resolved once),
starts the children, and restarts one that exits while the gateway is not stopping (and says so in its
log); on SIGTERM or SIGINT it sends SIGTERM to each child once, and each shuts down with its grace
period. Each child runs in its own session, so a terminal's Ctrl-C reaches the parent only, and it
asks the kernel for a SIGTERM when the parent dies.

What is per process, and why that is safe:

- **the store**: the children are replicated gateways on one PostgreSQL store (the same code as
  gateways on several machines: a session started in one process continues in another with exact
  prefix reuse, read from the store). SQLite is refused: one file written by several processes
  is not what the SQLite store is built and tested for.
- **the engine pool**: each child has its own `EnginePool` over the same ``--engine-url`` engines
  (its own health probes and load view). Launched workers are refused: each child would launch and
  supervise its own. Launch them with one ``belayer serve`` (or by hand) and point the processes at
  their URLs.
- **sandboxes** are refused: one sandbox manager must own the containers.
- **telemetry and metrics** are per process: ``/metrics``, ``/api/events`` and the dashboard show
  the process that accepted the connection. ``/health`` names it (``pid``), and so does each
  generation's ``x-belayer-pid`` response header.

Example::

    check_processes(config, name)          # a ConfigError naming the setting, or nothing
    serve_processes(config, init_logging)  # returns when stopped
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from types import FrameType

from core.errors import ConfigError
from gateway.config import GatewayConfig

log = logging.getLogger("belayer.gateway")

RESTART_WINDOW_S = 10.0
"""A child that exits sooner than this after its start counts as a failed start."""
MAX_FAILED_STARTS = 3
"""Failed starts in a row after which the parent gives up (a child that cannot start never will)."""
_PR_SET_PDEATHSIG = 1


def is_postgres(store: str) -> bool:
    return store.startswith(("postgresql://", "postgres://"))


def check_processes(config: GatewayConfig, name: Callable[[str], str]) -> None:
    """Refuse ``processes > 1`` where processes would not share state safely (see the module docstring);
    `name` says how a setting was given (`ConfigLoader.name`)."""
    if config.processes <= 1:
        return
    flag = name("processes")
    if not is_postgres(config.store_path):
        raise ConfigError(
            f"{flag} {config.processes}: several processes need a PostgreSQL store "
            f"({name('store_path')} postgresql://...); the SQLite store is for one process"
        )
    if not config.engine_urls:
        raise ConfigError(
            f"{flag} {config.processes}: several processes share engines given by URL ({name('engine_urls')}); "
            "launch the workers with one `belayer serve` and point the processes at them"
        )
    if config.sandbox.enabled:
        raise ConfigError(
            f"{flag} {config.processes}: sandboxes need one process; drop --sandboxes or {flag}"
        )


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with ``SO_REUSEPORT`` (not listening yet)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def serve_processes(config: GatewayConfig, init: Callable[[], None]) -> int:
    """Run ``config.processes`` gateway processes on one port until SIGTERM or SIGINT; `init` runs first
    in each child (logging). The exit code: 0, or 1 when children kept failing to start."""
    holder = reuse_port_socket(config.host, config.port)
    try:
        child = config.model_copy(update={"port": holder.getsockname()[1], "processes": 1})
        return _Supervisor(child, config.processes, init).run()
    finally:
        holder.close()


def _child_main(config: GatewayConfig, init: Callable[[], None]) -> None:
    os.setsid()  # a terminal's Ctrl-C reaches the parent only; it sends one SIGTERM
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    init()
    from gateway.app import build_app
    from gateway.serve.server import build_server

    sock = reuse_port_socket(config.host, config.port)
    build_server(build_app(config), config).run(sockets=[sock])


class _Supervisor:
    def __init__(self, config: GatewayConfig, n: int, init: Callable[[], None]) -> None:
        self.config, self.n, self.init = config, n, init
        self.ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self.children: list[BaseProcess] = []
        self.started: list[float] = []
        self.stopping = False

    def run(self) -> int:
        previous = {s: signal.signal(s, self._stop) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for _ in range(self.n):
                self.children.append(self._start())
                self.started.append(time.monotonic())
            log.info(
                "gateway: %d processes on %s:%d (pids %s)",
                self.n,
                self.config.host,
                self.config.port,
                ", ".join(str(p.pid) for p in self.children),
            )
            return self._watch()
        finally:
            self._stop_children()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _start(self) -> BaseProcess:
        proc = self.ctx.Process(target=_child_main, args=(self.config, self.init), name="belayer-gateway")
        proc.start()
        return proc

    def _watch(self) -> int:
        failed = 0
        while not self.stopping:
            multiprocessing.connection.wait([p.sentinel for p in self.children], timeout=0.5)
            for i, proc in enumerate(self.children):
                if proc.is_alive() or self.stopping:
                    continue
                lived = time.monotonic() - self.started[i]
                failed = failed + 1 if lived < RESTART_WINDOW_S else 0
                if failed >= MAX_FAILED_STARTS:
                    log.error("gateway process %d exited with %s %d times in a row; stopping", proc.pid,
                              proc.exitcode, failed)  # fmt: skip
                    return 1
                self.children[i] = self._start()
                self.started[i] = time.monotonic()
                log.warning("gateway process %d exited with %s after %.0fs; restarted as %d", proc.pid,
                            proc.exitcode, lived, self.children[i].pid)  # fmt: skip
        return 0

    def _stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def _stop_children(self) -> None:
        for proc in self.children:
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.config.server.shutdown_grace_s + 15
        for proc in self.children:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("gateway process %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.join(5)
