"""Helpers shared by the tests (fixtures stay in the conftest files).

Two ways to run a gateway:

- in process: ``asgi_gateway(config, engine_transport)`` builds the app over an engine transport (a
  fake engine's ``httpx.ASGITransport``, a ``FaultInjector``), runs its lifespan, and gives a client
  at ``http://gw``; ``GatewayHarness`` wraps the common case (one scripted ``FakeEngine``);
- as a real process: ``belayer_server(["serve", ...], log)`` runs ``belayer`` on a free port in its own
  process group, waits until ``/health`` answers while checking it is alive, and stops the whole group
  on the way out (SIGTERM, then SIGKILL after a grace period). ``spawn``, ``wait_healthy`` and ``stop``
  are its parts, for tests that start several processes.

``post_body`` sends a request body as JSON, or as raw bytes when the test wants to send what is not
JSON. ``sdk_http`` is the httpx the installed ``anthropic`` SDK runs on, for its ASGI transport.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from importlib import import_module
from importlib.util import find_spec
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import httpx
from starlette.applications import Starlette
from starlette.routing import Route

from core.net import free_port
from engine_pool.fake import FakeEngine
from engine_pool.pool import EnginePool, PoolSettings
from gateway.app import build_app
from gateway.config import GatewayConfig
from gateway.gateway import Gateway
from gateway.http.access import HostRule

REPO = Path(__file__).resolve().parent.parent

# anthropic>=2 runs on httpx2 (httpx's API under a new name); older releases run on httpx.
sdk_http: ModuleType = import_module("httpx2") if find_spec("httpx2") else httpx


# --- a gateway in process ---------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def asgi_gateway(
    config: GatewayConfig,
    engine: httpx.AsyncBaseTransport,
    *,
    hosts: Sequence[str] = ("http://fake-engine",),
    pool_options: Mapping[str, Any] | None = None,
    engine_timeout: float | None = 5.0,
    timeout: float | None = 5.0,
    **app_options: Any,
) -> AsyncIterator[tuple[Starlette, httpx.AsyncClient]]:
    """The gateway app over ``engine`` (one pool member per host, all through that transport), its
    lifespan running, and a client to it at ``http://gw`` when the config allows that host (else at
    ``http://localhost``: a gateway answers only the hosts it allows). ``pool_options`` go to ``PoolSettings`` and
    ``app_options`` to ``build_app`` (``aux_transport``, ``sandbox_backend``, ``observers``)."""
    async with httpx.AsyncClient(transport=engine, timeout=engine_timeout) as engine_http:
        pool = EnginePool(engine_http, PoolSettings(**(pool_options or {})))
        for host in hosts:
            pool.add_remote(host)
        app = build_app(config, pool=pool, **app_options)
        async with (
            app.router.lifespan_context(app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app), base_url=client_root(config), timeout=timeout
            ) as client,
        ):
            yield app, client


def app_routes(app: Starlette, prefix: str = "/") -> list[tuple[str, str]]:
    """Every (method, path) of the app's routes under `prefix`, HEAD left out, with sample values for
    the path parameters (a session, an engine, a response)."""
    samples = {"{session_id}": "ses_x", "{name}": "remote-0", "{response_id}": "resp_x"}
    out = []
    for route in app.routes:
        if isinstance(route, Route) and route.path.startswith(prefix):
            path = route.path
            for param, value in samples.items():
                path = path.replace(param, value)
            out += [(method, path) for method in sorted(route.methods or ()) if method != "HEAD"]
    return out


def client_root(config: GatewayConfig) -> str:
    """Where `asgi_gateway`'s client reaches the app: ``http://gw`` when `config` allows that host."""
    return "http://gw" if HostRule(config).allows("gw") else "http://localhost"


class GatewayHarness:
    """A gateway app over a scripted fake engine, reachable through ``httpx.ASGITransport``."""

    def __init__(self, app: Starlette, client: httpx.AsyncClient, engine: FakeEngine) -> None:
        self.app = app
        self.client = client
        self.engine = engine

    @property
    def gw(self) -> Gateway:
        gw: Gateway = self.app.state.gateway
        return gw

    def encode_reply(self, text: str, eos: bool = True) -> list[int]:
        tok = self.gw.tokenizer
        return tok.encode(text) + ([tok.encode(tok.eos_token)[0]] if eos else [])

    def queue_replies(self, *texts: str, eos: bool = True) -> list[list[int]]:
        """The engine's next replies: each text encoded (with EOS unless ``eos=False``), queued in
        order; returns the encoded replies."""
        replies = [self.encode_reply(text, eos) for text in texts]
        self.engine.outputs += [list(r) for r in replies]
        return replies

    async def new_session(self, **metadata: object) -> tuple[str, str]:
        r = await self.client.post("/api/sessions", json={"metadata": metadata})
        assert r.status_code == 201, r.text
        return r.json()["id"], r.json()["base_url"]


async def post_body(client: httpx.AsyncClient, url: str, payload: Any) -> httpx.Response:
    """POST ``payload`` as JSON; ``bytes`` go as they are (malformed JSON, a bad encoding), still
    labelled ``application/json``."""
    if isinstance(payload, bytes):
        return await client.post(url, content=payload, headers={"content-type": "application/json"})
    return await client.post(url, json=payload)


# --- server processes -------------------------------------------------------------------------------


def belayer_argv(*args: str) -> list[str]:
    """The command line of ``belayer ARGS`` run by this interpreter."""
    return [sys.executable, "-m", "belayer.cli", *args]


def spawn(argv: Sequence[str], log: Path, nofile: int | None = None) -> subprocess.Popen[bytes]:
    """Start ``argv`` in the repository, in its own process group (``stop`` reaches its children; a
    Ctrl-C of the test run does not reach it), its output appended to ``log``; with `nofile`, its
    open-file limit (soft and hard) is that."""

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with log.open("ab") as out:
        return subprocess.Popen(
            list(argv),
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=limit if nofile is not None else None,
        )


def log_tail(log: Path | None, chars: int = 3000) -> str:
    if log is None:
        return ""
    try:
        return f"\n--- {log} (end) ---\n{log.read_text(errors='replace')[-chars:]}"
    except OSError:
        return f"\n(no log at {log})"


def wait_healthy(
    url: str, procs: Sequence[subprocess.Popen[bytes]], timeout: float, log: Path | None = None
) -> None:
    """Poll ``url`` until it answers 200, with a deadline; fail at once (with the end of ``log``)
    when any of ``procs`` has exited."""
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            assert p.poll() is None, f"{p.args!r} exited with {p.returncode}{log_tail(log)}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} not healthy after {timeout:.0f}s{log_tail(log)}")
        time.sleep(0.2)  # a server starting up: poll its health


def stop(
    proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, grace: float = 60.0, require_exit: bool = True
) -> int:
    """Send ``sig`` to ``proc``'s process group and return its exit code. A group still there after
    ``grace`` seconds is killed (SIGKILL), and then, with ``require_exit``, the test fails."""
    with contextlib.suppress(ProcessLookupError):  # nothing left in the group
        os.killpg(proc.pid, sig)
    try:
        return proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
        if require_exit:
            name = signal.Signals(sig).name
            raise AssertionError(f"{proc.args!r} did not exit within {grace:.0f}s of {name}") from None
        return code


@dataclass(frozen=True, slots=True)
class ServerProcess:
    """A server that ``belayer_server`` started: its URL, its process (leader of its own group), its log."""

    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self, sig: int = signal.SIGTERM, grace: float = 60.0) -> int:
        return stop(self.proc, sig, grace)


@contextlib.contextmanager
def belayer_server(
    args: Sequence[str], log: Path, *, port: int | None = None, timeout: float = 60.0
) -> Iterator[ServerProcess]:
    """``belayer ARGS --port PORT`` (``serve``, ``fake-engine``; a free port unless given), healthy
    within ``timeout`` seconds; stopped with its whole process group on the way out."""
    port = port or free_port()
    proc = spawn(belayer_argv(*args, "--port", str(port)), log)
    server = ServerProcess(f"http://127.0.0.1:{port}", proc, log)
    try:
        wait_healthy(f"{server.url}/health", [proc], timeout, log)
        yield server
    finally:
        server.stop()


def serve_config(*argv: str) -> GatewayConfig:
    """What ``belayer serve ARGV`` configures (the flags as `belayer.cli` gathers them)."""
    from belayer.cli import parser
    from belayer.cli.serve import SERVE_FLAGS
    from gateway.config.loader import ConfigLoader

    args = parser().parse_args(["serve", *argv])
    given = {f.path: getattr(args, f.path) for f in SERVE_FLAGS if hasattr(args, f.path)}
    return ConfigLoader(given, {f.path: f.name for f in SERVE_FLAGS}).load()


T = TypeVar("T")


def poll(read: Callable[[], T | None], what: str, timeout: float = 60.0) -> T:
    """`read()` until it gives a value, with a deadline (for another process's progress)."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if value is not None:
            return value
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.02)


@contextlib.contextmanager
def held_engine(tmp_path: Path, token_delay: float, require_exit: bool = True) -> Iterator[tuple[str, int]]:
    """One fake engine process (``tests.gateway.held_engine``, holding no request) that streams a token
    every `token_delay` seconds: its URL and pid. The pool of every gateway a test starts on it.
    ``require_exit=False`` for a test that may kill it itself."""
    port = free_port()
    argv = [sys.executable, "-m", "tests.gateway.held_engine", "--port", str(port)]
    argv += ["--hold", str(tmp_path / "no-hold"), "--token-delay", str(token_delay)]
    proc = spawn(argv, tmp_path / "engine.log")
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", [proc], 60, tmp_path / "engine.log")
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        stop(proc, require_exit=require_exit)
