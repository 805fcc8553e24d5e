"""One table of error handlers: the exception tree (``core.errors``) → OpenAI or Anthropic error JSON.

``TABLE`` maps each class to its HTTP status, error type and code; an exception takes the entry of the
first class in its MRO that the table has, so a subclass without an entry answers as its parent. No
status lives on an instance. A `RequestError` may refine the code and name the offending ``param``.

Every error body is ``{"error": {"message", "type", "param", "code"}}`` and the message says what to
change. Anything unexpected is logged with its traceback and answered with a 500 that says so.
Under the Anthropic routes (``/v1/messages…``) the same status and message go out in Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}`` (``anthropic_error``); `for_route` is the one place
that chooses the shape by path, for this table's handlers, the server's own refusals and the sandbox
listener's.

>>> for_exception(NoCheckpoint("session s has no checkpoint to restore"))
(409, {'error': {'message': 'session s has no checkpoint to restore', 'type': 'invalid_request_error', 'param': 'checkpoint_id', 'code': 'no_checkpoint'}})
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.errors import (
    AuxiliaryUnavailable,
    BelayerError,
    CheckpointError,
    CheckpointTampered,
    CheckpointUnreadable,
    Conflict,
    ContextLengthExceeded,
    EngineError,
    EngineProtocolError,
    EngineRejected,
    EngineRequestFailed,
    EngineServerError,
    EngineTimeout,
    EngineUnavailable,
    Forbidden,
    ImageNotFound,
    InvalidRequest,
    NoCheckpoint,
    NodeLost,
    NoSandbox,
    NoSandboxSlot,
    NotFound,
    PathEscapeError,
    QueryOfDeath,
    RequestError,
    RequestTimeout,
    RequestTooLarge,
    SandboxArgumentError,
    SandboxCallFailed,
    SandboxError,
    SandboxesDisabled,
    SandboxExists,
    SandboxFailed,
    SandboxFileNotFound,
    SandboxFileTooLarge,
    SandboxJournalFull,
    SandboxNotFound,
    SandboxPathRefused,
    SandboxRestored,
    SandboxTimeout,
    SandboxUnavailable,
    StoreError,
    Unauthorized,
    UnknownEvent,
    UnsupportedMediaType,
)

log = logging.getLogger("belayer.gateway")


def _timeout_message(exc: BaseException) -> str:
    tail = exc.stdout[-2000:] if isinstance(exc, SandboxTimeout) else ""
    return f"{exc}; the command was killed and the sandbox is unharmed. Output before the kill: {tail!r}"


@dataclass(frozen=True, slots=True)
class HttpError:
    """How one class of errors is answered."""

    status: int
    code: str | None = None
    param: str | None = None
    type: str | None = None
    """OpenAI error type; by default invalid_request_error below 500 and server_error from 500 up."""
    prefix: str = ""
    hint: str = ""
    """Appended to the message: what to do next."""
    message: Callable[[BaseException], str] | None = None
    headers: tuple[tuple[str, str], ...] = ()
    """Sent with the answer: ``x-should-retry: false`` tells the official SDKs not to retry a 5xx."""

    @property
    def error_type(self) -> str:
        return self.type or ("invalid_request_error" if self.status < 500 else "server_error")


NO_RETRY = (("x-should-retry", "false"),)
"""The official SDKs retry a 5xx unless told not to: a request that crashes engines must not be."""

TABLE: dict[type[BaseException], HttpError] = {
    # the client's request
    InvalidRequest: HttpError(400),
    RequestTooLarge: HttpError(413, "request_too_large"),
    RequestTimeout: HttpError(408, "request_timeout"),
    UnsupportedMediaType: HttpError(415, "unsupported_media_type"),
    NotFound: HttpError(404, "not_found"),
    ContextLengthExceeded: HttpError(400, "context_length_exceeded"),
    Conflict: HttpError(409, "conflict"),
    Unauthorized: HttpError(401, "invalid_api_token", type="authentication_error"),
    Forbidden: HttpError(403, "forbidden", type="permission_error"),
    SandboxesDisabled: HttpError(404, "sandboxes_disabled"),
    RequestError: HttpError(400),
    # a client that hung up while sending its body: its own doing, not an unexpected error (no one reads it)
    ClientDisconnect: HttpError(
        400, "client_disconnected", prefix="the client closed the connection before it sent the whole body"
    ),
    # engines
    EngineRejected: HttpError(400, "engine_rejected", prefix="the engine rejected the request: "),
    EngineTimeout: HttpError(504, "engine_timeout", hint="; retry the request"),
    EngineUnavailable: HttpError(
        503, "engine_unavailable", type="service_unavailable", hint="; retry the request shortly"
    ),
    EngineProtocolError: HttpError(
        502, "engine_protocol_error", hint="; the worker is misbehaving, check its log (retry may succeed)"
    ),
    EngineError: HttpError(502, "engine_error"),
    EngineServerError: HttpError(502, "engine_error", hint="; check the worker's log"),
    EngineRequestFailed: HttpError(
        500,
        "engine_request_failed",
        hint="; the request itself makes the engine fail: change it, do not retry it unchanged",
        headers=NO_RETRY,
    ),
    QueryOfDeath: HttpError(500, "request_killed_workers", headers=NO_RETRY),
    AuxiliaryUnavailable: HttpError(502, "auxiliary_provider_unavailable", param="model"),
    StoreError: HttpError(500, hint="; the trajectory store failed, check the gateway's disk"),
    UnknownEvent: HttpError(500, hint="; an event fits no kind of core.events (a bug of the gateway's)"),
    # sandboxes
    NoSandbox: HttpError(404, "sandbox_not_found", "session_id"),
    SandboxExists: HttpError(409, "sandbox_exists"),
    NoCheckpoint: HttpError(409, "no_checkpoint", "checkpoint_id"),
    SandboxCallFailed: HttpError(422, "command_broke_sandbox", "command", "sandbox_error"),
    SandboxRestored: HttpError(409, "sandbox_restored", type="sandbox_error"),
    SandboxFailed: HttpError(503, "sandbox_failed", type="sandbox_error"),
    SandboxTimeout: HttpError(408, "command_timeout", "timeout_s", message=_timeout_message),
    PathEscapeError: HttpError(400, "path_outside_sandbox", "path"),
    SandboxPathRefused: HttpError(400, "path_refused", "path"),
    SandboxFileTooLarge: HttpError(413, "file_too_large", "path"),
    SandboxJournalFull: HttpError(
        429, "sandbox_journal_full", type="sandbox_error", headers=(("retry-after", "5"),)
    ),
    SandboxArgumentError: HttpError(400, "invalid_value"),
    SandboxFileNotFound: HttpError(404, "file_not_found", "path", prefix="no such file in the sandbox: "),
    NoSandboxSlot: HttpError(503, "no_sandbox_slot", hint="; retry once a session closes, or add nodes"),
    SandboxUnavailable: HttpError(503, "sandbox_engine_unavailable", hint="; retry shortly"),
    NodeLost: HttpError(
        503, "sandbox_node_lost", hint="; it is being restored on another node, retry shortly"
    ),
    ImageNotFound: HttpError(400, "image_not_found", "image"),
    SandboxNotFound: HttpError(404, "sandbox_not_found"),
    CheckpointTampered: HttpError(
        503, "checkpoint_tampered", prefix="the sandbox could not be restored: ", type="sandbox_error"
    ),
    CheckpointUnreadable: HttpError(
        503, "checkpoint_unreadable", prefix="the sandbox could not be restored: ", type="sandbox_error"
    ),
    CheckpointError: HttpError(500, "checkpoint_failed", prefix="checkpoint or restore failed: "),
    SandboxError: HttpError(400, "sandbox_error"),
}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def entry_for(exc: BaseException) -> HttpError | None:
    """The table's entry for `exc`: that of the first class in its MRO that has one."""
    return next((TABLE[cls] for cls in type(exc).__mro__ if cls in TABLE), None)


def for_exception(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """Status and body for any exception (also used for errors inside an SSE stream)."""
    entry = entry_for(exc)
    if entry is not None:
        message = entry.message(exc) if entry.message else f"{entry.prefix}{exc}{entry.hint}"
        param, code = entry.param, entry.code
        if isinstance(exc, RequestError):
            param, code = exc.param or param, exc.code or code
        if entry.status >= 500:  # the gateway's or a backend's failure: the operator needs to see it
            log.error("answered %d (%s): %s", entry.status, code or type(exc).__name__, message)
        return entry.status, error_body(message, entry.error_type, param, code)
    if isinstance(exc, HTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return exc.status_code, error_body(str(exc.detail), kind)
    log.exception("unexpected error", exc_info=exc)
    return 500, error_body(f"internal error ({type(exc).__name__}); see the gateway log", "server_error")


# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors); other statuses
# are invalid_request_error below 500 and api_error from 500 up.
ANTHROPIC_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
_ANTHROPIC_PATH = re.compile(r"/v1/messages(/|$)")


def is_anthropic_path(target: str) -> bool:
    """Whether a request target (a path, maybe with its query) is one of the Anthropic routes, under any
    prefix (``/v1/messages``, ``/s/<session>/v1/messages/count_tokens``)."""
    return _ANTHROPIC_PATH.search(re.split(r"[?#]", target, maxsplit=1)[0]) is not None


def anthropic_error(status: int, body: dict[str, Any]) -> dict[str, Any]:
    """A ``for_exception`` body in Anthropic's shape (for the Messages routes and their SSE streams)."""
    kind = ANTHROPIC_ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}


def for_route(target: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """An error `body` (OpenAI's shape) as the route of `target` answers it: in Anthropic's shape under
    the Anthropic routes, unchanged elsewhere.

    >>> for_route("/v1/messages?beta=true", 404, error_body("no such session", "not_found_error"))
    {'type': 'error', 'error': {'type': 'not_found_error', 'message': 'no such session'}}
    >>> for_route("/v1/chat/completions", 404, error_body("no such session", "not_found_error"))["error"]["type"]
    'not_found_error'
    """
    return anthropic_error(status, body) if is_anthropic_path(target) else body


async def _handle(request: Request, exc: Exception) -> Response:
    status, body = for_exception(exc)
    entry = entry_for(exc)
    headers = dict(entry.headers) if entry is not None else None
    return JSONResponse(for_route(request.url.path, status, body), status_code=status, headers=headers)


def handlers() -> dict[Any, Callable[[Request, Exception], Coroutine[Any, Any, Response]]]:
    return {cls: _handle for cls in (BelayerError, HTTPException)}


class UnexpectedErrors:
    """Answers an unexpected exception (a bug) with the table's 500 and *keeps the connection*.

    Starlette's own last-resort handler re-raises after answering, so the server closes the
    keep-alive connection without ``Connection: close`` and the client's next request on it is
    reset: one bug would become two failures. This middleware sits inside that handler and
    swallows the exception once it is logged and answered. A response already under way (a
    stream) cannot be answered again: then the exception goes on, and the server ends the stream.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            response = await _handle(Request(scope), exc)
            await response(scope, receive, send)
