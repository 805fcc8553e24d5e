"""The first steps every generating route takes, in one place: read the JSON body, refuse what the
protocol does not support, validate, route the model (an external auxiliary model is forwarded to its
provider here, once the session's URL has been checked like a policy call's; on a plain route it is
refused), bound the prompt cheaply
before any templating, and name the request's session: a session URL's is read where the prompt is
planned, with the turn the request extends (`SessionManager.plan`), in one look-up.

Example::

    admitted = await admit(request, partial(validate, ChatCompletionRequest), reject_unsupported,
                           "chat/completions", "messages")
    if isinstance(admitted, Response):  # forwarded to an auxiliary model's provider
        return admitted
    gen, top = await admitted.gw.prepare(request, chat_request, admitted.req, admitted.raw, ...)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from gateway.gateway import Gateway, gateway_of
from gateway.http.bodies import read_json
from gateway.turns import auxiliary
from gateway.turns.auxiliary import Endpoint
from store import SessionRecord


class _NamesAModel(Protocol):
    @property
    def model(self) -> str: ...


R = TypeVar("R", bound=_NamesAModel)


@dataclass(frozen=True, slots=True)
class Admitted(Generic[R]):
    """A request the policy will serve: its gateway, raw body, validated form and session (its id when
    the planning reads it: `SessionManager.plan`)."""

    gw: Gateway
    raw: dict[str, Any]
    req: R
    session: SessionRecord | str


async def admit(
    request: Request,
    parse: Callable[[dict[str, Any]], R],
    reject_unsupported: Callable[[dict[str, Any]], None],
    endpoint: Endpoint,
    *prompt_fields: str,
) -> Admitted[R] | Response:
    """The admitted request, or the provider's response when `request` names an external auxiliary
    model (forwarded to its ``endpoint``). `prompt_fields` are the body's fields that become the prompt
    (bounded before templating). An auxiliary model the policy serves goes to the side session."""
    gw, sid = gateway_of(request), request.path_params.get("session_id")
    raw = await read_json(request, gw.config.max_body_bytes)
    reject_unsupported(raw)
    req = parse(raw)
    route = gw.route_model(req.model)
    if route is not None and route.kind == "external":
        # the same admission as the policy's: an open session's URL, before the provider or the store
        # sees anything. Never a plain route: the provider's key is the operator's, and a plain route
        # is a door for whoever reaches the port (`auxiliary.external_needs_session`)
        if sid is None:
            raise auxiliary.external_needs_session(req.model, endpoint)
        gw.sessions.get_open(sid)
        return await auxiliary.forward(gw.aux_http_client(), gw.store, route, raw, endpoint, request)
    gw.tokenizer.bound_prompt(gw.pool.max_model_len, *(raw.get(f) for f in prompt_fields))
    if sid is None:
        return Admitted(gw, raw, req, plain_session(gw, request.url.path, req.model if route else None))
    if gw.sandboxes is not None:
        # while the session's sandbox is being restored, wait: the request must meet the truncated
        # trajectory (a harness inside the sandbox retries its call as soon as it is back)
        await gw.sandboxes.settled(sid)
    if route is None:
        return Admitted(gw, raw, req, sid)
    session = gw.sessions.get_open(sid)
    # its side session, created on first use: through the front (a write that may reach a remote store)
    side = await gw.store.front.call(sid, auxiliary.side_session, gw.store, session, req.model)
    return Admitted(gw, raw, req, side)


def plain_session(gw: Gateway, path: str, auxiliary_model: str | None) -> SessionRecord:
    """A plain ``/v1/…`` request's session: for this request only (stored with its turn)."""
    meta: dict[str, object] = {"source": path}
    if auxiliary_model is not None:
        meta["auxiliary_model"] = auxiliary_model
    return gw.sessions.create(meta, ephemeral=True)
