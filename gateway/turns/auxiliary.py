"""Auxiliary model calls: a harness's requests for a model other than the policy (Claude Code's small
fast model for summaries and titles, a judge). ``GatewayConfig.auxiliary_models`` maps model-name
patterns (fnmatch) to one of three routes, checked before the policy's names and aliases:

- ``policy``: the policy answers, as usual, but in the session's *auxiliary side session*
  (``<session id>-aux``, metadata ``auxiliary_of``), so side calls are recorded, token for token, and
  marked, without branching the episode's own trajectory;
- ``http(s)://provider/v1#model``: the request is passed through unchanged (but for ``model``) to an
  OpenAI- or Anthropic-compatible provider, e.g. a LiteLLM proxy in front of a hosted model; streamed
  or not, its answer (errors included) goes back as it is, and an ``auxiliary_call`` event records it;
- ``reject``: a clear 400 that names the model and the configuration to change.

An external route is per session: only a session's own routes (``/s/{id}/v1/...``) forward to it, and
a plain ``/v1`` request for it is a 403 (``auxiliary_model_needs_session``) before the provider is
contacted. The provider's key (``BELAYER_AUX_API_KEY``) is the operator's; a plain route is open to
whoever reaches the port unless ``--plain-v1`` says otherwise, and must not spend it.

Example (``belayer serve``)::

    --aux-model 'claude-haiku-*=policy' --aux-model 'judge-*=http://127.0.0.1:4000/v1#gpt-4o-mini'
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from core.errors import AuxiliaryUnavailable, Forbidden, InvalidRequest
from core.events import AuxiliaryCall
from store import EventRecord, SessionRecord, TrajectoryStore

API_KEY_ENV = "BELAYER_AUX_API_KEY"

Endpoint = Literal["chat/completions", "completions", "messages", "responses"]
"""The provider endpoints a request is forwarded to."""


@dataclass(frozen=True, slots=True)
class AuxRoute:
    kind: Literal["policy", "external", "reject"]
    url: str | None = None
    model: str | None = None

    @classmethod
    def parse(cls, text: str) -> AuxRoute:
        if text in ("policy", "reject"):
            return cls(text)  # type: ignore[arg-type]
        if text.startswith(("http://", "https://")):
            url, _, model = text.partition("#")
            return cls("external", url.rstrip("/"), model or None)
        raise ValueError(
            f"an auxiliary route is 'policy', 'reject' or 'http(s)://provider/v1[#model]', not {text!r}"
        )


def refuse(model: str, pattern: str) -> InvalidRequest:
    return InvalidRequest(
        f"'{model}' is an auxiliary model, and this gateway refuses it (auxiliary route {pattern!r} = reject). "
        "Point the harness's auxiliary model at the policy's name, or route it with "
        f"--aux-model '{pattern}=policy' or --aux-model '{pattern}=https://provider/v1#model'",
        param="model",
        code="auxiliary_model_refused",
    )


def external_needs_session(model: str, endpoint: Endpoint) -> Forbidden:
    """The refusal of an external auxiliary model on a plain route (see the module docstring)."""
    return Forbidden(
        f"'{model}' is an auxiliary model served by an external provider, which a plain /v1 request "
        "cannot reach; create a session (POST /api/sessions) and send it to the session's base_url, "
        f"/s/{{session}}/v1/{endpoint}",
        param="model",
        code="auxiliary_model_needs_session",
    )


def side_session(store: TrajectoryStore, session: SessionRecord, model: str) -> SessionRecord:
    """The episode's auxiliary side session, created on first use."""
    aux_id = f"{session.id}-aux"
    existing = store.get_session(aux_id)
    if existing is not None:
        return existing
    record = SessionRecord(
        id=aux_id,
        created_at=time.time(),
        metadata={"auxiliary_of": session.id, "auxiliary_model": model},
    )
    return store.create_session(record)


async def forward(
    http: httpx.AsyncClient,
    store: TrajectoryStore,
    route: AuxRoute,
    raw: dict[str, Any],
    endpoint: Endpoint,
    request: Request,
) -> Response:
    """Pass `raw` through to the route's provider; return its answer as it is."""
    assert route.url is not None
    body = {**raw, "model": route.model or raw.get("model")}
    headers = {"content-type": "application/json"}
    for name in ("anthropic-version", "anthropic-beta"):
        if name in request.headers:
            headers[name] = request.headers[name]
    key = os.environ.get(API_KEY_ENV)
    if key:
        headers |= {"authorization": f"Bearer {key}", "x-api-key": key}
    url = f"{route.url}/{endpoint}"
    sid = request.path_params.get("session_id")
    started = time.monotonic()

    def record(status: int) -> None:
        if sid is not None:
            ms = round((time.monotonic() - started) * 1000, 1)
            event = AuxiliaryCall(raw.get("model"), body["model"], url, status, ms)
            store.front.post(sid, store.add_event, EventRecord.of(sid, None, event))

    try:
        upstream = await http.send(http.build_request("POST", url, json=body, headers=headers), stream=True)
    except httpx.TransportError as exc:
        record(502)
        raise AuxiliaryUnavailable(
            f"the auxiliary provider at {route.url} is unreachable ({exc}); check that it runs, or route "
            "this model elsewhere with --aux-model"
        ) from exc
    media = upstream.headers.get("content-type", "application/json")
    if not body.get("stream"):
        content = await upstream.aread()
        await upstream.aclose()
        record(upstream.status_code)
        return Response(content, status_code=upstream.status_code, media_type=media)

    async def relay() -> Any:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
            record(upstream.status_code)

    return StreamingResponse(relay(), status_code=upstream.status_code, media_type=media)
