"""The gateway's sessions API as a Harbor trial calls it: one httpx client with the API token, and a
refused call as a `BelayerError` that carries the gateway's own message (an OpenAI-style error's).

Example::

    api = GatewayClient("http://127.0.0.1:8000", token)
    session = await api.call("POST", "/api/sessions", {"sandbox": {"image": "..."}})
    await api.aclose()
"""

from __future__ import annotations

from typing import Any

import httpx


class BelayerError(RuntimeError):
    """The gateway refused a call; the message is its own (an OpenAI-style error's)."""


class GatewayClient:
    """Calls to the gateway at `gateway` (its root URL) with `token` as the bearer, if any."""

    def __init__(self, gateway: str, token: str | None) -> None:
        self.gateway = gateway
        self._http = httpx.AsyncClient(
            base_url=gateway,
            headers={"Authorization": f"Bearer {token}"} if token else {},
            timeout=httpx.Timeout(120.0, connect=10.0),
        )

    async def call(
        self,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The JSON answer of `method` `path`; a `BelayerError` when the call fails or is refused."""
        limit = httpx.Timeout(timeout, connect=10.0) if timeout else httpx.USE_CLIENT_DEFAULT
        try:
            r = await self._http.request(method, path, json=body, params=params, timeout=limit)
        except httpx.HTTPError as exc:
            raise BelayerError(f"{method} {self.gateway}{path}: {exc!r}") from exc
        if r.status_code >= 400:
            try:
                error = r.json().get("error", {})
                detail = f"{error.get('code') or error.get('type')}: {error.get('message')}"
            except ValueError:
                detail = r.text[:2000]
            raise BelayerError(f"{method} {path} answered {r.status_code} ({detail})")
        answer: dict[str, Any] = r.json()
        return answer

    async def aclose(self) -> None:
        await self._http.aclose()
