"""Thin OpenAI routes: parse, validate, hand over to serving, format."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from belayer.errors import BelayerError
from gateway.errors import for_exception
from gateway.generation import Delta, Done, GenerationRequest
from gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.openai.serving import (
    ChatFormatter,
    CompletionFormatter,
    chat_request,
    completion_request,
    reject_unsupported,
)
from gateway.state import Gateway, gateway_of, read_json, validate
from gateway.store import SessionRecord

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _session(gw: Gateway, request: Request) -> SessionRecord:
    sid = request.path_params.get("session_id")
    if sid is None:
        return gw.sessions.create({"source": request.url.path}, ephemeral=True)
    return gw.sessions.get_open(sid)


async def _respond(
    gw: Gateway,
    gen: GenerationRequest,
    fmt: ChatFormatter | CompletionFormatter,
    stream: bool,
    include_usage: bool,
) -> Response:
    events = gw.runner.run(gen)
    headers = {"x-belayer-session": gen.session.id}
    if not stream:
        tops: list[list[tuple[int, float]]] = []
        async for ev in events:
            if isinstance(ev, Done):
                headers["x-belayer-turn"] = str(ev.turn.index)
                return JSONResponse(fmt.response(ev, tops), headers=headers)
            tops += ev.top_logprobs
        raise AssertionError("generation ended without Done")
    # Pull the first event before sending headers, so that errors raised before any token (no engine,
    # context length, engine rejection) still get their proper HTTP status.
    first = await events.__anext__()

    async def body() -> AsyncIterator[str]:
        async def chained() -> AsyncIterator[Delta | Done]:
            yield first
            async for ev in events:
                yield ev

        try:
            async for line in fmt.stream(chained(), include_usage):
                yield line
        except BelayerError as e:
            import json

            _, err = for_exception(e)
            yield f"data: {json.dumps(err)}\n\n"
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers | SSE_HEADERS)


async def chat_completions(request: Request) -> Response:
    gw = gateway_of(request)
    raw = await read_json(request, gw.config.max_body_bytes)
    reject_unsupported(raw)
    req = validate(ChatCompletionRequest, raw)
    gw.check_model(req.model)
    session = _session(gw, request)
    gen, top = chat_request(req, raw, session, gw.sessions)
    gen.stream = bool(req.stream)
    fmt = ChatFormatter(req.model, gw.tokenizer, top)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return await _respond(gw, gen, fmt, bool(req.stream), usage)


async def completions(request: Request) -> Response:
    gw = gateway_of(request)
    raw = await read_json(request, gw.config.max_body_bytes)
    reject_unsupported(raw)
    req = validate(CompletionRequest, raw)
    gw.check_model(req.model)
    session = _session(gw, request)
    gen = completion_request(req, raw, session, gw.tokenizer)
    gen.stream = bool(req.stream)
    fmt = CompletionFormatter(req.model, gw.tokenizer, req.logprobs)
    usage = bool(req.stream_options and req.stream_options.include_usage)
    return await _respond(gw, gen, fmt, bool(req.stream), usage)


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
