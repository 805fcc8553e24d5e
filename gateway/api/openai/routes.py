"""Thin OpenAI routes: parse, validate, hand over to serving, format."""

from __future__ import annotations

from functools import partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway.api.admission import admit
from gateway.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.api.openai.serving import (
    ChatFormatter,
    CompletionFormatter,
    chat_request,
    completion_request,
    reject_unsupported,
)
from gateway.api.responding import respond
from gateway.gateway import gateway_of
from gateway.http.bodies import validate


async def chat_completions(request: Request) -> Response:
    a = await admit(
        request, partial(validate, ChatCompletionRequest), reject_unsupported, "chat/completions", "messages"
    )
    if isinstance(a, Response):
        return a
    gw, req = a.gw, a.req
    gen, top = await gw.prepare(request, chat_request, req, a.raw, a.session, gw.sessions)
    gen.stream = bool(req.stream)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return await respond(gw, gen, ChatFormatter(req.model, gw.tokenizer, top, usage))


async def completions(request: Request) -> Response:
    a = await admit(
        request, partial(validate, CompletionRequest), reject_unsupported, "completions", "prompt"
    )
    if isinstance(a, Response):
        return a
    gw, req = a.gw, a.req
    gen = await gw.prepare(request, completion_request, req, a.raw, a.session, gw.sessions, gw.tokenizer)
    gen.stream = bool(req.stream)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return await respond(gw, gen, CompletionFormatter(req.model, gw.tokenizer, req.logprobs, usage))


async def models(request: Request) -> Response:
    gw = gateway_of(request)
    if "session_id" in request.path_params:
        gw.sessions.get(request.path_params["session_id"])
    data: list[dict[str, Any]] = [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "belayer",
            "max_model_len": gw.pool.max_model_len,
        }
        for name in gw.config.served_model_names
    ]
    return JSONResponse({"object": "list", "data": data})


def routes() -> list[Route]:
    out = []
    for prefix in ("", "/s/{session_id}"):
        out += [
            Route(f"{prefix}/v1/chat/completions", chat_completions, methods=["POST"]),
            Route(f"{prefix}/v1/completions", completions, methods=["POST"]),
            Route(f"{prefix}/v1/models", models, methods=["GET"]),
        ]
    return out
