"""Who may call what. One sentence: **the trainer side holds a token, the harness side holds a
capability URL.**

- With ``api_token`` set, every ``/api/*`` route needs ``Authorization: Bearer <token>`` (the scheme
  in any case); ``/health`` needs none. Without it the API is open, as on a laptop, and the gateway
  says so at start-up.
- A session's routes, ``/s/{id}/v1/*``, need no token: the session id is the capability. It carries
  128 random bits, and only the API (behind the token) lists it.
- Plain ``/v1/*`` requests, each a one-request session, are ``open``, behind the token (``token``),
  or ``off`` (``plain_v1``). ``/v1/models`` stays open.
- With ``allowed_hosts`` set, a request whose ``Host`` is not one of them is refused (a DNS
  rebinding page cannot reach the API by a name of its own), and session base_urls are built from the
  checked Host; otherwise from ``public_url`` or the listening address, never an unchecked Host.
- JSON routes refuse bodies declared as anything but JSON (``gateway.bodies``), so a web page cannot
  send a cross-site text/plain or form POST without a CORS preflight the gateway never grants.
- Admin routes (``POST/DELETE /api/engines``, reward overrides) need the separate admin token, which
  opens the rest of the API too.

>>> bearer_matches("bearer s3cret", "s3cret"), bearer_matches("Bearer nope", "s3cret")
(True, False)
"""

from __future__ import annotations

import re
import secrets

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from core.errors import Forbidden, InvalidRequest, Unauthorized
from gateway.bodies import check_json_media_type
from gateway.config import GatewayConfig

SANDBOX_SCOPE_KEY = "belayer.sandbox_session"
"""Set in the ASGI scope by the sandbox listener: the request comes from that session's sandbox."""
_PLAIN_GENERATION = re.compile(r"/v1/(chat/completions|completions|messages)$")


def bearer_matches(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header carries `token` as a bearer token (scheme in any case)."""
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and secrets.compare_digest(given.strip().encode(), token.encode())


def base_root(config: GatewayConfig, request: Request) -> str:
    """The gateway's root URL for a session's base_url (see the module docstring)."""
    if config.public_url:
        return config.public_url.rstrip("/")
    if config.allowed_hosts:  # the Host was checked against them
        return f"{request.url.scheme}://{request.headers.get('host')}"
    host = f"[{config.host}]" if ":" in config.host else config.host
    return f"http://{host}:{config.port}"


class Access:
    """ASGI middleware that enforces the rules above before any route runs; refusals are raised as
    the tree's errors, so the error table answers them in each protocol's format."""

    def __init__(self, app: ASGIApp, config: GatewayConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            if request.method in ("POST", "PUT", "PATCH"):  # every such route is a JSON route, body or not
                check_json_media_type(request.headers.get("content-type"))
            if SANDBOX_SCOPE_KEY not in scope:  # a sandbox's listener checked who it is
                self.check(request)
        await self.app(scope, receive, send)

    def check(self, request: Request) -> None:
        config, path = self.config, request.url.path
        if config.allowed_hosts and _host(request) not in config.allowed_hosts:
            raise InvalidRequest(
                f"this gateway does not answer for host {request.headers.get('host')!r}; "
                f"use one of {config.allowed_hosts} (--allowed-hosts)",
                code="invalid_host",
            )
        if path.startswith("/api/") or path.startswith("/metrics"):
            self._need_token(request, "the API")
        elif _PLAIN_GENERATION.fullmatch(path):
            if config.plain_v1 == "off":
                raise Forbidden(
                    "plain /v1 requests are off on this gateway; create a session with POST /api/sessions "
                    "and send requests to its base_url"
                )
            if config.plain_v1 == "token":
                self._need_token(request, "plain /v1 requests")

    def _need_token(self, request: Request, what: str) -> None:
        token, admin = self.config.api_token, self.config.admin_token
        if token is None:
            return
        header = request.headers.get("authorization")
        if header is None and request.url.path == "/api/events" and "token" in request.query_params:
            header = f"Bearer {request.query_params['token']}"  # EventSource cannot send headers
        if not (bearer_matches(header, token) or (admin is not None and bearer_matches(header, admin))):
            problem = "without the gateway's API token" if header is None else "with a wrong API token"
            raise Unauthorized(f"{what} answered a request {problem}: send 'Authorization: Bearer <token>'")


def require_admin(config: GatewayConfig, request: Request) -> None:
    """Admin routes need ``Authorization: Bearer <admin token>``; with no admin token they are off."""
    if config.admin_token is None:
        raise Forbidden(
            "admin endpoints are disabled; start the gateway with --admin-token (or BELAYER_ADMIN_TOKEN)"
        )
    if not bearer_matches(request.headers.get("authorization"), config.admin_token):
        raise Forbidden("this endpoint needs the gateway's admin token: send 'Authorization: Bearer <token>'")


def _host(request: Request) -> str:
    host = request.headers.get("host", "")
    return host.rsplit(":", 1)[0] if not host.endswith("]") else host
