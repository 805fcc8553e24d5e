"""The private parts of uvicorn, httpx and httpcore that Belayer's HTTP plumbing builds on still exist,
with the shape the code uses.

``pyproject.toml`` bounds uvicorn, httpx and httpcore from above to the series this was written against
(README, "Supported versions"). Within them a patch release may still change a private name; outside them
(a bound raised, or a forced install) this test is the first thing to run. Each check names the private
API and the file that uses it (found by searching the source tree, so it follows a module that moves),
and `test_every_private_import_is_checked` fails when code starts importing another internal module.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest
import uvicorn
from httpcore._async import connection_pool as httpcore_pool
from uvicorn.protocols.http import httptools_impl
from uvicorn.server import ServerState

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ["gateway", "engine_pool", "sandbox", "store", "core", "belayer", "harness_adapters"]
WRITTEN_AGAINST = "uvicorn 0.54.0, httpx 0.28.1, httpcore 1.0.9"

# engine_pool.engine.transport._LinearPool is a copy of this method with one line changed; a release that
# changes the method (code, not comments or docstring) must be copied again. The digest is of its AST.
ASSIGN_REQUESTS_DIGEST = "fa6bc19bf34f62f0da526b7463d8d5d77555081111ef4dba75f59302fb830b57"


@dataclass(frozen=True, slots=True)
class PrivateApi:
    name: str
    used_by: str  # a regular expression that finds, in the source tree, the code that uses it
    check: Callable[[], None]


def _app(scope: Any, receive: Any, send: Any) -> None:  # never called: a Config needs an app
    raise AssertionError


def _loaded_config() -> uvicorn.Config:
    config = uvicorn.Config(_app, log_config=None)
    config.load()
    return config


def _has_params(function: Callable[..., Any], *names: str) -> None:
    params = inspect.signature(function).parameters
    missing = [n for n in names if n not in params]
    assert not missing, f"{function.__qualname__}{inspect.signature(function)} has no {missing}"


def _assigns(function: Callable[..., Any], *attributes: str) -> None:
    """`function`'s body sets ``self.<attribute>`` for each attribute (instance state set outside
    ``__init__``, or per request, which a bare instance does not show)."""
    source = inspect.getsource(function)
    missing = [a for a in attributes if not re.search(rf"self\.{a}\b[^=\n]*=[^=]", source)]
    assert not missing, f"{function.__qualname__} no longer sets self.{missing}"


def _has_attributes(obj: object, *attributes: str) -> None:
    missing = [a for a in attributes if not hasattr(obj, a)]
    assert not missing, f"{type(obj).__qualname__} has no {missing}"


def _protocol_shape() -> None:
    """``LimitedHttpProtocol`` / ``SandboxProtocol`` subclass it: the constructor's arguments, the
    per-connection state they read (the sandbox listener: ``client`` for the sandbox's address, ``scope``
    for its identity) and the parser callbacks they extend."""
    protocol = httptools_impl.HttpToolsProtocol
    assert list(inspect.signature(protocol.__init__).parameters) == [
        "self", "config", "server_state", "app_state", "_loop",
    ], f"HttpToolsProtocol.__init__{inspect.signature(protocol.__init__)}"  # fmt: skip
    for method in (
        "connection_made", "connection_lost", "data_received", "shutdown", "on_message_begin", "on_url",
        "on_header", "on_headers_complete", "on_body", "on_message_complete",
    ):  # fmt: skip
        assert callable(getattr(protocol, method, None)), f"HttpToolsProtocol.{method} is gone"
    instance = protocol(_loaded_config(), ServerState(), {}, _loop=object())  # type: ignore[arg-type]
    _has_attributes(
        instance, "loop", "server_state", "connections", "cycle", "timeout_keep_alive_task", "access_log"
    )
    assert instance.connections is instance.server_state.connections, "connections is not server_state's"
    _assigns(protocol.connection_made, "transport", "client")
    _assigns(protocol.on_message_begin, "url", "scope")


def _cycle_shape() -> None:
    """The protocol reads ``cycle.response_complete`` and clears ``cycle.keep_alive`` to close after it."""
    _assigns(httptools_impl.RequestResponseCycle.__init__, "response_complete", "keep_alive")


def _server_state_shape() -> None:
    _has_attributes(ServerState(), "connections", "tasks", "default_headers")


def _server_shape() -> None:
    """``GatewayServer.shutdown`` closes ``servers``, walks ``server_state`` and honours ``force_exit``
    before calling uvicorn's own shutdown."""
    _has_attributes(uvicorn.Server(_loaded_config()), "server_state", "force_exit", "should_exit")
    _assigns(uvicorn.Server.startup, "servers")
    _has_params(uvicorn.Server.shutdown, "sockets")


def _loaded_app_shape() -> None:
    """The sandbox listener replaces ``loaded_app`` after ``load()`` (no message logger, no proxy
    headers): the protocol must read the app from there."""
    assert _loaded_config().loaded_app is not None
    assert "config.loaded_app" in inspect.getsource(httptools_impl.HttpToolsProtocol.__init__)


def _error_logger_shape() -> None:
    """``GatewayServer`` filters cancelled requests' tracebacks out of the ``uvicorn.error`` logger."""
    source = inspect.getsource(httptools_impl)
    assert 'getLogger("uvicorn.error")' in source, "the protocol logs elsewhere than uvicorn.error"
    assert "Exception in ASGI application" in source


def _transport_pool_shape() -> None:
    """``httpx_transport`` replaces ``AsyncHTTPTransport._pool`` (it keeps httpx's own if that is gone:
    then the engine leg runs on anyio, slower but correct)."""
    transport = httpx.AsyncHTTPTransport(limits=httpx.Limits())
    assert isinstance(getattr(transport, "_pool", None), httpcore.AsyncConnectionPool)
    _has_params(
        httpcore.AsyncConnectionPool.__init__,
        "ssl_context", "max_connections", "max_keepalive_connections", "keepalive_expiry", "network_backend",
    )  # fmt: skip


def _assign_requests_shape() -> None:
    """``_LinearPool`` overrides it with a copy of httpcore 1.0's body (one count hoisted), reading the
    pool's private state and its pool requests'."""
    pool = httpcore.AsyncConnectionPool()
    _has_attributes(pool, "_connections", "_requests", "_max_connections", "_max_keepalive_connections")
    assert callable(getattr(pool, "create_connection", None))
    _has_attributes(httpcore_pool.AsyncPoolRequest, "is_queued", "assign_to_connection")
    _assigns(httpcore_pool.AsyncPoolRequest.__init__, "request")
    method = httpcore.AsyncConnectionPool._assign_requests_to_connections
    assert list(inspect.signature(method).parameters) == ["self"], str(inspect.signature(method))
    if httpcore.__version__.startswith("1.0."):  # the only series _LinearPool is applied to
        digest = _body_digest(method)
        assert digest == ASSIGN_REQUESTS_DIGEST, (
            f"httpcore {httpcore.__version__} changed the method's body (digest {digest}): copy it into "
            "_LinearPool again with the one change, then update ASSIGN_REQUESTS_DIGEST"
        )


def _body_digest(function: Callable[..., Any]) -> str:
    """A digest of a function's code that ignores its comments and docstring."""
    node = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    assert isinstance(node, ast.FunctionDef)
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return hashlib.sha256("\n".join(ast.dump(statement) for statement in body).encode()).hexdigest()


PRIVATE_APIS = [
    PrivateApi("uvicorn.protocols.http.httptools_impl.HttpToolsProtocol", r"\(HttpToolsProtocol\)", _protocol_shape),
    PrivateApi("uvicorn.protocols.http.httptools_impl.RequestResponseCycle", r"self\.cycle\.", _cycle_shape),
    PrivateApi("uvicorn.server.ServerState", r"\bServerState\b", _server_state_shape),
    PrivateApi("uvicorn.Server.servers/server_state/force_exit", r"self\.server_state\.tasks", _server_shape),
    PrivateApi("uvicorn.Config.loaded_app", r"\.loaded_app = ", _loaded_app_shape),
    PrivateApi('the "uvicorn.error" logger\'s tracebacks', r'getLogger\("uvicorn\.error"\)', _error_logger_shape),
    PrivateApi("httpx.AsyncHTTPTransport._pool", r"transport\._pool\b", _transport_pool_shape),
    PrivateApi(
        "httpcore.AsyncConnectionPool._assign_requests_to_connections",
        r"def _assign_requests_to_connections",
        _assign_requests_shape,
    ),
]  # fmt: skip


def _sources() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((REPO / package).rglob("*.py"))]


def _users(pattern: str) -> list[str]:
    return [str(p.relative_to(REPO)) for p in _sources() if re.search(pattern, p.read_text())]


def _installed() -> str:
    return ", ".join(f"{name} {version(name)}" for name in ("uvicorn", "httpx", "httpcore"))


@pytest.mark.parametrize("api", PRIVATE_APIS, ids=lambda api: api.name)
def test_private_api_has_the_shape_the_code_uses(api: PrivateApi) -> None:
    users = _users(api.used_by) or ["(no file: see test_every_checked_private_api_is_still_used)"]
    try:
        api.check()
    except (AssertionError, AttributeError, TypeError, ValueError, OSError) as exc:
        pytest.fail(
            f"{api.name}, used by {', '.join(users)}, no longer has the shape the code uses: {exc}\n"
            f"installed: {_installed()}; written against {WRITTEN_AGAINST}",
            pytrace=False,
        )


@pytest.mark.parametrize("api", PRIVATE_APIS, ids=lambda api: api.name)
def test_every_checked_private_api_is_still_used(api: PrivateApi) -> None:
    """A check whose user is gone is stale: delete it (or fix ``used_by`` if the code changed shape)."""
    assert _users(api.used_by), f"no file under {PACKAGES} matches {api.used_by!r} for {api.name}"


IMPORTED = re.compile(r"^\s*(?:from|import)\s+((?:uvicorn|httpx|httpcore|starlette|h11)\.[\w.]+)", re.M)
CHECKED_MODULES = {"uvicorn.protocols.http.httptools_impl", "uvicorn.server"}


def _internal(module: str) -> bool:
    """A private module (a ``_`` name: httpx, httpcore, starlette), or any of uvicorn's submodules (its
    documented API is ``uvicorn.run``, ``uvicorn.Config`` and ``uvicorn.Server``)."""
    return module.startswith("uvicorn.") or any(part.startswith("_") for part in module.split("."))


def test_every_private_import_is_checked() -> None:
    """Importing a library's internal module is relying on its internals: such an import needs a check
    above, and its module a place in ``CHECKED_MODULES``."""
    unchecked = sorted(
        f"{p.relative_to(REPO)}: {module}"
        for p in _sources()
        for module in IMPORTED.findall(p.read_text())
        if _internal(module) and module not in CHECKED_MODULES
    )
    assert not unchecked, f"imports of internal modules with no check in {Path(__file__).name}: {unchecked}"
