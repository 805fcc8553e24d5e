"""Who may call what, decided here, before any route runs. One sentence: **the trainer side holds a
token, the harness side holds a capability URL, and a web page holds nothing.**

- With ``api_token`` set, every ``/api/*`` and ``/metrics*`` route needs ``Authorization: Bearer
  <token>`` (the scheme in any case); ``/health`` needs none. Without it the API is open, as on a
  laptop, and the gateway says so at start-up.
- A session's routes, ``/s/{id}/…``, need no token: the session id is the capability. It carries
  128 random bits, and only the API (behind the token) lists it. The routes themselves answer 404 for
  an id that is not an open session, before anything is forwarded or written.
- Every plain route (``/v1/*`` but ``/v1/models``: each a one-request session, or a stored response)
  is ``open``, behind the token (``token``) or ``off`` (``plain_v1``): `is_plain` decides which routes
  those are, for every one of them.
- **No DNS rebinding.** A request whose ``Host`` is not an allowed host is refused (400
  ``invalid_host``). Unless ``allowed_hosts`` is set, the allowed hosts are the loopback names, the
  listening address, ``public_url``'s host, and any IP literal (a rebinding page reaches the gateway
  only under a name of its own, never an address); a request with no ``Host`` (an HTTP/1.0 health
  check; a browser always sends one) is answered too. Session base_urls come from ``public_url``, the
  Host checked against an explicit ``allowed_hosts``, or the listening address; never an unchecked Host.
- **No cross-site requests.** On every state-changing method (POST, PUT, PATCH, DELETE), a request
  that a browser marks as coming from another site (``Sec-Fetch-Site`` other than ``same-origin`` or
  ``none``, or an ``Origin`` other than the gateway's own) is refused (403 ``cross_site_request``);
  the dashboard's own requests are same-origin. A non-empty body must be declared as JSON (415
  otherwise, ``gateway.http.bodies``), so a blind ``no-cors`` form or ``text/plain`` POST gets nowhere.
- Admin routes (``POST/DELETE /api/engines``, ``POST /api/weights``, reward overrides) need the
  separate admin token, which opens the rest of the API too; in a header only: ``/api/events?token=``
  (for EventSource, which cannot send headers) takes the API token and never the admin token.
- A sandbox's own requests come through the sandbox listener (``gateway.api.sandbox_listener``), which
  checked who sent them; it sets ``SANDBOX_SCOPE_KEY`` and only the body rule applies here.

>>> bearer_matches("bearer s3cret", "s3cret"), bearer_matches("Bearer nope", "s3cret")
(True, False)
>>> is_plain("/v1/responses"), is_plain("/v1/models"), is_plain("/s/abc/v1/responses")
(True, False, False)
"""

from __future__ import annotations

import functools
import ipaddress
import secrets
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from core.errors import Forbidden, InvalidRequest, Unauthorized
from gateway.config import GatewayConfig
from gateway.http.bodies import check_json_media_type

SANDBOX_SCOPE_KEY = "belayer.sandbox_session"
"""Set in the ASGI scope by the sandbox listener: the request comes from that session's sandbox."""
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
"""Hosts every gateway answers, unless ``allowed_hosts`` says otherwise."""
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_SAME_SITE_FETCH = frozenset({"same-origin", "none"})  # none: the user typed the URL or followed a bookmark
_OPEN_PLAIN = frozenset({"/v1/models"})


def is_plain(path: str) -> bool:
    """Whether `path` is a plain route (outside any session), governed by ``plain_v1``."""
    return path.startswith("/v1/") and path not in _OPEN_PLAIN


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


class HostRule:
    """The Host values a gateway answers (see the module docstring).

    >>> rule = HostRule(GatewayConfig.model_construct(allowed_hosts=[], public_url="https://gw.example:8443",
    ...                                               host="0.0.0.0"))
    >>> [rule.allows(h) for h in ("localhost:8000", "10.1.2.3:80", "[::1]:8000", "gw.example", "evil.example", "")]
    [True, True, True, True, False, True]
    """

    def __init__(self, config: GatewayConfig) -> None:
        self.explicit = bool(config.allowed_hosts)
        names = set(config.allowed_hosts) if self.explicit else {*LOOPBACK_NAMES, config.host}
        if config.public_url and not self.explicit:
            names.add(urlsplit(config.public_url).hostname or "")
        self.names = frozenset(n.strip("[]").lower() for n in names if n)

    def allows(self, host_header: str) -> bool:
        name = host_name(host_header)
        if not name:  # no Host: an HTTP/1.0 health check (HAProxy's httpchk); a browser always sends one
            return not self.explicit
        return name in self.names or (not self.explicit and _is_ip(name))

    def describe(self) -> str:
        if self.explicit:
            return f"one of {sorted(self.names)} (--allowed-hosts)"
        return (
            f"an IP address or one of {sorted(self.names)}; to reach it by another name, give that name "
            "with --allowed-hosts or --public-url"
        )


class Access:
    """ASGI middleware that enforces the rules above before any route runs; refusals are raised as
    the tree's errors, so the error table answers them in each protocol's format."""

    def __init__(self, app: ASGIApp, config: GatewayConfig) -> None:
        self.app = app
        self.config = config
        self.hosts = HostRule(config)
        self.own_origin = _origin(config.public_url) if config.public_url else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            request = Request(scope)
            if SANDBOX_SCOPE_KEY in scope:  # a sandbox's listener checked who it is
                check_body_type(request)
            else:
                self.check(request)
        await self.app(scope, receive, send)

    def check(self, request: Request) -> None:
        config, path = self.config, request.url.path
        host = request.headers.get("host", "")
        if not self.hosts.allows(host):
            raise InvalidRequest(
                f"this gateway does not answer for host {host!r}; use {self.hosts.describe()}",
                code="invalid_host",
            )
        if request.method in STATE_CHANGING:
            self._same_site(request, host)
        check_body_type(request)
        if path.startswith("/api/") or path.startswith("/metrics"):
            self._need_token(request, "the API")
        elif is_plain(path):
            if config.plain_v1 == "off":
                raise Forbidden(
                    f"plain /v1 requests are off on this gateway ({path}); create a session with "
                    "POST /api/sessions and send requests to its base_url"
                )
            if config.plain_v1 == "token":
                self._need_token(request, "plain /v1 requests")

    def _same_site(self, request: Request, host: str) -> None:
        """Refuse what a browser says another site sent (a web page the operator has open)."""
        fetch_site = request.headers.get("sec-fetch-site")
        origin = request.headers.get("origin")
        foreign = fetch_site is not None and fetch_site.lower() not in _SAME_SITE_FETCH
        if origin is not None and not foreign:
            given = _origin(origin)
            foreign = given != self.own_origin and urlsplit(given).netloc != host.strip().lower()
        if foreign:
            raise Forbidden(
                f"{request.method} {request.url.path} came from another site (Origin {origin!r}, "
                f"Sec-Fetch-Site {fetch_site!r}); a web page cannot change this gateway's state. Call it "
                "from a program (the SDKs, belayer.client, curl) or from the gateway's own dashboard",
                code="cross_site_request",
            )

    def _need_token(self, request: Request, what: str) -> None:
        token, admin = self.config.api_token, self.config.admin_token
        if token is None:
            return
        header = request.headers.get("authorization")
        if header is None and request.url.path == "/api/events" and "token" in request.query_params:
            # EventSource cannot send headers. A query string lands in proxies' and browsers' logs, so
            # only the API token is taken there, never the admin token, which could change the engines
            header, admin = f"Bearer {request.query_params['token']}", None
        if not (bearer_matches(header, token) or (admin is not None and bearer_matches(header, admin))):
            problem = "without the gateway's API token" if header is None else "with a wrong API token"
            raise Unauthorized(f"{what} answered a request {problem}: send 'Authorization: Bearer <token>'")


def check_body_type(request: Request) -> None:
    """On a state-changing method, a declared media type must be JSON, and a body must come declared
    (every body route is a JSON route; ``gateway.http.bodies``)."""
    if request.method not in STATE_CHANGING:
        return
    content_type = request.headers.get("content-type")
    if content_type is not None:
        check_json_media_type(content_type)
        return
    length = request.headers.get("content-length")
    if "transfer-encoding" in request.headers or (length is not None and length.strip() not in ("", "0")):
        check_json_media_type(None)


def require_admin(config: GatewayConfig, request: Request) -> None:
    """Admin routes need ``Authorization: Bearer <admin token>``; with no admin token they are off."""
    if config.admin_token is None:
        raise Forbidden(
            "admin endpoints are disabled; start the gateway with --admin-token (or BELAYER_ADMIN_TOKEN)"
        )
    if not bearer_matches(request.headers.get("authorization"), config.admin_token):
        raise Forbidden("this endpoint needs the gateway's admin token: send 'Authorization: Bearer <token>'")


def host_name(host_header: str) -> str:
    """The name part of a Host header, without port or IPv6 brackets, in lower case.

    >>> host_name("Example.COM:8000"), host_name("[::1]:8000"), host_name("10.0.0.1")
    ('example.com', '::1', '10.0.0.1')
    """
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


@functools.lru_cache(maxsize=256)  # a gateway sees a handful of Host values: ~6 us each, parsed once
def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _origin(url: str) -> str:
    """``scheme://host[:port]`` of a URL, in lower case (``null`` stays ``null``)."""
    parts = urlsplit(url.strip().lower())
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else url.strip().lower()
