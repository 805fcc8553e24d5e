"""The key a launched engine worker asks of every caller, and the ASGI guard that asks it.

A launched worker (vLLM, or the fake engine) listens on a node's address, and with vLLM's development
endpoints on (``/pause``, ``/collective_rpc``, ``/update_weight_version``: a weight update needs them),
whoever reaches that address could stop it or run methods in it. vLLM's own ``--api-key`` guards only
``/v1`` (and ``/v2``, ``/inference``...), so every worker the gateway launches also runs `RequireApiKey`
(``vllm ... --middleware core.worker_auth.RequireApiKey``), which guards every path but ``GET /health``
and ``GET /metrics`` (probes and scrapes that change nothing). The key comes from the environment
(`KEY_ENV`, which vLLM reads as its ``--api-key`` too), never the command line, which every local user
sees in ``ps``; the gateway holds it and sends it (``engine_pool.engine.client.EngineClient``'s ``api_key``).

>>> import asyncio
>>> async def call(app, method, path, auth=None):
...     sent = []
...     headers = [(b"authorization", auth.encode())] if auth else []
...     scope = {"type": "http", "method": method, "path": path, "headers": headers}
...     async def send(message): sent.append(message)
...     await app(scope, None, send)
...     return sent[0]["status"] if sent else 200
>>> async def inner(scope, receive, send): pass
>>> guard = RequireApiKey(inner, key="k3y")
>>> [asyncio.run(call(guard, *c)) for c in [("POST", "/pause"), ("POST", "/pause", "Bearer k3y"),
...  ("GET", "/health"), ("POST", "/collective_rpc", "Bearer nope")]]
[401, 200, 200, 401]
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

KEY_ENV = "VLLM_API_KEY"
"""The variable a launched worker reads its key from (vLLM's own name for it)."""
OPEN = frozenset({("GET", "/health"), ("GET", "/metrics")})
"""What a worker answers without the key: its health probe and its metrics scrape."""

Scope = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Any, Any], Awaitable[None]]


class RequireApiKey:
    """ASGI middleware: a request without ``Authorization: Bearer <key>`` gets a 401, but for `OPEN`.
    With no key (none given, `KEY_ENV` unset) it lets everything through, as vLLM does without one."""

    def __init__(self, app: ASGIApp, key: str | None = None) -> None:
        self.app = app
        key = key if key is not None else os.environ.get(KEY_ENV)
        self._digest = hashlib.sha256(key.encode()).digest() if key else None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if self._digest is None or scope["type"] != "http" or (scope["method"], scope["path"]) in OPEN:
            await self.app(scope, receive, send)
            return
        if not self._allowed(scope):
            body = json.dumps({"error": {"message": "this worker needs its API key", "code": 401}}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 401, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        assert self._digest is not None
        header = next((v for k, v in scope.get("headers") or () if k.lower() == b"authorization"), b"")
        scheme, _, given = header.decode("latin-1").partition(" ")
        digest = hashlib.sha256(given.strip().encode()).digest()  # equal lengths for compare_digest
        return scheme.lower() == "bearer" and secrets.compare_digest(digest, self._digest)


def new_worker_key() -> str:
    """A fresh key for the workers one gateway launches (256 random bits)."""
    return secrets.token_urlsafe(32)
