"""Thin Anthropic routes: parse, validate, hand over to serving, format.

Errors on these paths leave in Anthropic's shape: ``gateway.errors`` reshapes the one error table's
output for ``/v1/messages…`` paths, and errors raised mid-stream become an ``event: error``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.anthropic.serving import (
    MessageFormatter,
    count_tokens,
    message_request,
    prompt_tokens,
    reject_unsupported,
    sse,
)
from gateway.errors import anthropic_error, for_exception
from gateway.generation import Delta, Done, GenerationRequest
from gateway.state import Gateway, gateway_of, read_json, validate
from gateway.store import SessionRecord

SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def _session(gw: Gateway, request: Request) -> SessionRecord:
    sid = request.path_params.get("session_id")
    if sid is None:
        return gw.sessions.create({"source": request.url.path}, ephemeral=True)
    return gw.sessions.get_open(sid)


async def _respond(gw: Gateway, gen: GenerationRequest, fmt: MessageFormatter) -> Response:
    events = gw.runner.run(gen)
    headers = {"x-belayer-session": gen.session.id}
    if not gen.stream:
        async for ev in events:
            if isinstance(ev, Done):
                headers["x-belayer-turn"] = str(ev.turn.index)
                return JSONResponse(fmt.response(ev), headers=headers)
            fmt.feed(ev)
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
            async for chunk in fmt.stream(chained()):
                yield chunk
        except Exception as e:  # headers are sent: report it in the stream, as Anthropic does
            status, err = for_exception(e)
            yield sse("error", anthropic_error(status, err))
        finally:
            await events.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers | SSE_HEADERS)


async def messages(request: Request) -> Response:
    gw = gateway_of(request)
    raw = await read_json(request, gw.config.max_body_bytes)
    reject_unsupported(raw)
    req = validate(MessagesRequest, raw)
    gw.check_model(req.model)
    session = _session(gw, request)
    gen = message_request(req, raw, session, gw.sessions)
    fmt = MessageFormatter(req.model, prompt_tokens(gen.plan.prompt_ids, gen.forced_prefix, gw.tokenizer))
    return await _respond(gw, gen, fmt)


async def messages_count_tokens(request: Request) -> Response:
    gw = gateway_of(request)
    raw = await read_json(request, gw.config.max_body_bytes)
    reject_unsupported(raw)
    req = validate(CountTokensRequest, raw)
    gw.check_model(req.model)
    sid = request.path_params.get("session_id")
    if sid is not None:
        gw.sessions.get(sid)
    return JSONResponse({"input_tokens": count_tokens(req, sid, gw.sessions, gw.tokenizer)})


def routes() -> list[Route]:
    out = []
    for prefix in ("", "/s/{session_id}"):
        out += [
            Route(f"{prefix}/v1/messages", messages, methods=["POST"]),
            Route(f"{prefix}/v1/messages/count_tokens", messages_count_tokens, methods=["POST"]),
        ]
    return out
