"""Thin Anthropic routes: parse, validate, hand over to serving, format.

Errors on these paths leave in Anthropic's shape: ``gateway.http.errors`` reshapes the one error table's
output for ``/v1/messages…`` paths, and errors raised mid-stream become an ``event: error``.
"""

from __future__ import annotations

from functools import partial

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api.admission import admit
from gateway.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.api.anthropic.serving import (
    MessageFormatter,
    count_tokens,
    message_request,
    prompt_tokens,
    reject_unsupported,
)
from gateway.api.responding import respond
from gateway.gateway import gateway_of
from gateway.http.bodies import read_json, validate
from gateway.policy.parsers import forced_call_prefix


async def messages(request: Request) -> Response:
    a = await admit(
        request, partial(validate, MessagesRequest), reject_unsupported, "messages", "system", "messages"
    )
    if isinstance(a, Response):
        return a
    gw, req = a.gw, a.req
    gen = await gw.prepare(request, message_request, req, a.raw, a.session, gw.sessions)
    gen.forced_prefix = forced_call_prefix(gw.config.tool_call_parser, gen.forced_prefix)  # counted below
    fmt = MessageFormatter(req.model, prompt_tokens(gen.plan.prompt_ids, gen.forced_prefix, gw.tokenizer))
    return await respond(gw, gen, fmt)


async def messages_count_tokens(request: Request) -> Response:
    gw = gateway_of(request)
    raw = await read_json(request, gw.config.max_body_bytes)
    reject_unsupported(raw)
    req = validate(CountTokensRequest, raw)
    gw.route_model(req.model)  # a refused auxiliary model is refused here too
    sid = request.path_params.get("session_id")
    session = gw.sessions.get(sid) if sid is not None else None
    gw.tokenizer.bound_prompt(gw.pool.max_model_len, raw.get("system"), raw.get("messages"))
    tokens = await gw.offload(count_tokens, req, session, gw.sessions, gw.tokenizer)
    return JSONResponse({"input_tokens": tokens})


def routes() -> list[Route]:
    out = []
    for prefix in ("", "/s/{session_id}"):
        out += [
            Route(f"{prefix}/v1/messages", messages, methods=["POST"]),
            Route(f"{prefix}/v1/messages/count_tokens", messages_count_tokens, methods=["POST"]),
        ]
    return out
