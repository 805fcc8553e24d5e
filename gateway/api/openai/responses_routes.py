"""Thin OpenAI Responses routes: parse, validate, hand over to serving, format.

``POST /v1/responses`` and ``POST /s/{id}/v1/responses`` create a response (streamed or not);
``GET /v1/responses/{response_id}`` (and under ``/s/{id}/``) reads a stored one back, from the store,
so after a restart too. Errors leave in OpenAI's shape (the one error table).
"""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core.errors import InvalidRequest
from gateway.api.admission import admit
from gateway.api.openai.responses import (
    find_response,
    logprob_count,
    reject_unsupported,
    response_request,
    validate_request,
)
from gateway.api.openai.responses_formatting import ResponseFormatter, stored_response
from gateway.api.responding import respond
from gateway.gateway import gateway_of


async def create_response(request: Request) -> Response:
    a = await admit(request, validate_request, reject_unsupported, "responses", "instructions", "input")
    if isinstance(a, Response):
        return a
    gw, req = a.gw, a.req
    gen = await gw.prepare(request, response_request, req, a.raw, a.session, gw.sessions, gw.store)
    return await respond(gw, gen, ResponseFormatter(gen, a.raw, gw.tokenizer, logprob_count(req)))


async def get_response(request: Request) -> Response:
    gw = gateway_of(request)
    sid = request.path_params.get("session_id")
    if sid is not None:
        gw.sessions.get(sid)
    if request.query_params.get("stream", "false").lower() not in ("false", "0", ""):
        raise InvalidRequest(
            "streaming a stored response again is not supported; GET it without 'stream'",
            "stream",
            "unsupported_parameter",
        )
    turn = await gw.offload(find_response, gw.store, request.path_params["response_id"], sid)
    return JSONResponse(stored_response(turn))


def routes() -> list[Route]:
    out = []
    for prefix in ("", "/s/{session_id}"):
        out += [
            Route(f"{prefix}/v1/responses", create_response, methods=["POST"]),
            Route(f"{prefix}/v1/responses/{{response_id}}", get_response, methods=["GET"]),
        ]
    return out
