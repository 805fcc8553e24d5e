"""OpenAI Responses requests → ``GenerationRequest``, and response ids → their stored conversation.

A Responses request becomes the same internal messages as a chat completion (role, text content, tool
calls with parsed arguments, ``tool`` messages), so it shares the chat template, prefix reuse, branching,
failover and trajectories with the chat and Messages routes. The mapping:

- ``instructions``: a first ``system`` message. As at OpenAI, the instructions of a previous response
  are not carried over: each request's own apply.
- ``input``: a string is one user message. A ``message`` item's text parts (``input_text``,
  ``output_text``, ``text``) are joined with ``"\\n"`` (as vLLM joins text parts), an assistant's with
  nothing in between; ``developer`` is ``system``. Parts that are not text (images, files) are a 400.
- Consecutive assistant-side items (``assistant`` messages, ``function_call``, ``reasoning``) form one
  assistant message: their text concatenated, each ``function_call`` a tool call, a reasoning item's
  ``reasoning_text`` content as ``<think>…</think>`` (the convention of the Messages route; its
  summaries are not the model's tokens and are left out). That is the exact inverse of how one turn's
  output is split into items, so a client that sends the output back unchanged meets the turn that
  produced it, and prefix reuse applies.
- ``function_call_output``: a ``tool`` message (text parts joined with ``"\\n"``).
- ``previous_response_id``: the stored conversation of that response (the inputs and outputs of its
  chain of previous responses), then this request's input. Nothing is kept in memory: every turn
  stores the request as sent and its response, so a restarted gateway resolves the chain too.

A response id names its turn and is bound to the turn's session: ``resp_`` + 24 hex digits of a keyed
hash of (session id, turn id) + the turn id in hex. Knowing a response id does not reveal the session.
Under ``/s/{id}/`` a response of another session is not found (a fork child sees the turns it shares).
A response created with ``store: false`` is recorded in the trajectory like any turn, but it cannot be
retrieved or continued (as at OpenAI).

The Responses objects that turns and stored turns give back are built in `responses_formatting`.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from pydantic import ValidationError

from core.errors import Conflict, InvalidRequest, NotFound
from gateway.api.openai.responses_protocol import (
    UNSUPPORTED,
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    FunctionTool,
    MessageItem,
    OtherChoice,
    OtherItem,
    ReasoningItem,
    ResponsesRequest,
)
from gateway.api.openai.serving import sampling
from gateway.policy.parsers import think_text
from gateway.policy.streaming import tool_choice_prefix
from gateway.turns.protocol import GenerationRequest, parse_arguments
from gateway.turns.sessions import SessionManager
from store import SessionRecord, TurnRecord
from store.base import TURN_COMPLETE, TURN_DISCARDED, TURN_RUNNING
from store.roles import TrajectoryReader

LOGPROBS_INCLUDE = "message.output_text.logprobs"
TEXT_PARTS = ("input_text", "output_text", "text")
_DIGEST_HEX = 24
_MAX_ID_HEX = 15  # a turn id below 2**60: any SQLite integer
_UNION_TAGS = frozenset(
    {"message", "function_call", "function_call_output", "reasoning", "function", "other"}
)


# --- request → internal messages --------------------------------------------------------------------


def reject_unsupported(body: dict[str, Any]) -> None:
    for key, why in UNSUPPORTED.items():
        if body.get(key) not in (None, False, [], {}, ""):
            raise InvalidRequest(why, param=key, code="unsupported_parameter")


def validate_request(raw: dict[str, Any]) -> ResponsesRequest:
    """The request as a `ResponsesRequest`, or the `InvalidRequest` that names the field as the client
    wrote it (``input[2].call_id``, not pydantic's union members)."""
    try:
        return ResponsesRequest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        parts: list[str] = []
        after_index = False
        for p in first["loc"]:
            if isinstance(p, int):
                parts.append(f"[{p}]")
            elif not (after_index and p in _UNION_TAGS):
                parts.append(f".{p}" if parts else p)
            after_index = isinstance(p, int)
        loc = "".join(parts)
        raise InvalidRequest(
            f"invalid value for '{loc}': {first['msg']} ({e.error_count()} error(s) in total)",
            param=loc or None,
            code="invalid_type" if "type" in first["type"] else "invalid_value",
        ) from e


def _text(content: list[ContentPart], where: str, sep: str) -> str:
    texts = []
    for k, part in enumerate(content):
        if part.type not in TEXT_PARTS:
            raise InvalidRequest(
                f"content part {where}.content[{k}] of type '{part.type}' is not supported by this "
                "text-only model; send input_text parts",
                param=f"{where}.content[{k}]",
                code="unsupported_content",
            )
        if part.text is None:
            raise InvalidRequest(
                f"a content part of type '{part.type}' needs its 'text'",
                param=f"{where}.content[{k}].text",
                code="missing_required_parameter",
            )
        texts.append(part.text)
    return sep.join(texts)


def _unsupported_item(kind: str, where: str) -> InvalidRequest:
    return InvalidRequest(
        f"input item {where} of type '{kind}' is not supported; this gateway takes message, "
        "function_call, function_call_output and reasoning items",
        param=f"{where}.type",
        code="unsupported_item",
    )


def _reasoning_text(item: ReasoningItem) -> str:
    thought = "".join(part.text for part in item.content or [] if part.type == "reasoning_text")
    return f"<think>{thought}</think>" if thought else ""


def input_messages(items: list[Any], where: str = "input") -> list[dict[str, Any]]:
    """The internal messages of a request's ``input`` (see the module's docstring)."""
    out: list[dict[str, Any]] = []
    reply: dict[str, Any] | None = None  # the assistant message being gathered
    for i, item in enumerate(items):
        at = f"{where}[{i}]"
        if isinstance(item, OtherItem):
            raise _unsupported_item(item.type, at)
        assistant_side = isinstance(item, FunctionCallItem | ReasoningItem) or (
            isinstance(item, MessageItem) and item.role == "assistant"
        )
        if not assistant_side:
            reply = None
            out.append(_plain_message(item, at))
            continue
        if reply is None:
            reply = {"role": "assistant", "content": ""}
            out.append(reply)
        if isinstance(item, MessageItem):
            reply["content"] += _text(item.content, at, "")
        elif isinstance(item, ReasoningItem):
            reply["content"] += _reasoning_text(item)
        else:
            fn = {"name": item.name, "arguments": parse_arguments(item.arguments)}
            reply.setdefault("tool_calls", []).append(
                {"id": item.call_id, "type": "function", "function": fn}
            )
    return out


def _plain_message(item: MessageItem | FunctionCallOutputItem, where: str) -> dict[str, Any]:
    if isinstance(item, FunctionCallOutputItem):
        return {"role": "tool", "content": _text(item.output, where, "\n"), "tool_call_id": item.call_id}
    role = "system" if item.role == "developer" else item.role
    return {"role": role, "content": _text(item.content, where, "\n")}


def _tools(req: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Function tools in the template's form: ``{"type": "function", "function": {name, description,
    parameters}}``."""
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(req.tools or []):
        if not isinstance(tool, FunctionTool):
            raise InvalidRequest(
                f"tools[{i}] is a tool of type '{tool.type}', which this gateway does not run; send "
                "function tools (type 'function', name, parameters) and run them in the client",
                param=f"tools[{i}].type",
                code="unsupported_tool",
            )
        if tool.name in seen:
            raise InvalidRequest(
                f"tools[{i}] repeats the name '{tool.name}'; give each tool its own name", f"tools[{i}].name"
            )
        seen.add(tool.name)
        params = tool.parameters
        if params is not None and params and params.get("type", "object") != "object":
            raise InvalidRequest(
                f"invalid schema for function '{tool.name}': parameters must be a JSON Schema of type "
                f"'object', got type {json.dumps(params.get('type'))}",
                param=f"tools[{i}].parameters",
                code="invalid_function_parameters",
            )
        fn: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            fn["description"] = tool.description
        if params is not None:
            fn["parameters"] = params
        out.append({"type": "function", "function": fn})
    return out or None


def _tool_choice(req: ResponsesRequest, tools: list[dict[str, Any]] | None) -> tuple[str, bool]:
    names = [t["function"]["name"] for t in tools or []]
    choice = req.tool_choice
    if isinstance(choice, OtherChoice):
        raise InvalidRequest(
            f"tool_choice of type '{choice.type}' is not supported; send 'auto', 'none', 'required' or "
            "{'type': 'function', 'name': …}",
            param="tool_choice",
            code="unsupported_tool_choice",
        )
    if isinstance(choice, FunctionChoice):
        return tool_choice_prefix(names, None, choice.name)
    return tool_choice_prefix(names, choice)


def _check_text_format(req: ResponsesRequest) -> None:
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type != "text":
        raise InvalidRequest(
            f"text.format of type '{fmt.type}' (structured output) is not supported; describe the "
            "format in the prompt",
            param="text.format",
            code="unsupported_parameter",
        )


def logprob_count(req: ResponsesRequest) -> int | None:
    """How many top logprobs each output token carries; None: no logprobs (not asked in ``include``)."""
    if LOGPROBS_INCLUDE not in (req.include or []):
        return None
    return req.top_logprobs or 0


def response_request(
    req: ResponsesRequest,
    raw: dict[str, Any],
    session: SessionRecord | str,
    sessions: SessionManager,
    store: TrajectoryReader,
) -> GenerationRequest:
    """The internal request for a Responses call (resolving ``previous_response_id`` in the store;
    `session`: as admitted, its id when the planning reads it)."""
    received = time.time()
    _check_text_format(req)
    tools = _tools(req)
    forced, parse_tools = _tool_choice(req, tools)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        if isinstance(session, str):  # the session is checked before its history is read
            session = sessions.get_open(session)
        scope = None if session.ephemeral else session.id
        previous = find_response(store, req.previous_response_id, scope, "previous_response_id")
        history = conversation(store, previous)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = system + history + input_messages(req.input)
    if not messages:
        raise InvalidRequest("the input is empty; send at least one input item", "input")
    plan, keys, session = sessions.plan(session, messages, tools)
    params = sampling(req.temperature, req.top_p, None, None, None, logprob_count(req), None, None)
    return GenerationRequest(
        session=session,
        plan=plan,
        params=params,
        request=raw,
        received_at=received,
        max_tokens=req.max_output_tokens,
        messages=messages,
        tools=tools,
        message_keys=keys,
        forced_prefix=forced,
        parse_tools=parse_tools,
        stream=bool(req.stream),
    )


# --- response ids and the stored conversation -------------------------------------------------------


def _digest(session_id: str, turn_id: int) -> str:
    key = hashlib.blake2b(f"{session_id}/{turn_id}".encode(), digest_size=_DIGEST_HEX // 2)
    return key.hexdigest()


def response_id(turn: TurnRecord) -> str:
    return response_id_of(turn.session_id, turn.id)


def response_id_of(session_id: str, turn_id: int) -> str:
    """The id of the response that turn `turn_id` of session `session_id` gave."""
    return f"resp_{_digest(session_id, turn_id)}{turn_id:x}"


def _turn_id(rid: str) -> int | None:
    core = rid.removeprefix("resp_")
    tail = core[_DIGEST_HEX:]
    if core == rid or not 0 < len(tail) <= _MAX_ID_HEX or any(c not in "0123456789abcdef" for c in core):
        return None
    return int(tail, 16)


def is_responses_request(request: dict[str, Any]) -> bool:
    """Whether a stored turn's request came through the Responses route (chat and Messages requests
    have ``messages``, completions ``prompt``)."""
    return "input" in request and "messages" not in request and "prompt" not in request


def _visible(store: TrajectoryReader, session_id: str, turn: TurnRecord) -> bool:
    """Whether `turn` is one of the session's turns (its own, or one a fork shares with it)."""
    limit: int | None = None
    record = store.get_session(session_id)
    for _ in range(1000):  # fork depth; a cycle cannot be stored, but a loop must still end
        if record is None:
            return False
        if record.id == turn.session_id:
            return limit is None or turn.index <= limit
        if record.parent_session is None or record.fork_turn is None:
            return False
        limit = record.fork_turn if limit is None else min(limit, record.fork_turn)
        record = store.get_session(record.parent_session)
    return False


def find_response(
    store: TrajectoryReader, rid: str, session_id: str | None, param: str = "response_id"
) -> TurnRecord:
    """The turn of response `rid` (in session `session_id`, when given); `NotFound` otherwise, as for
    a response stored with ``store: false``."""
    where = f" in session '{session_id}'" if session_id is not None else ""
    missing = NotFound(f"no response with id '{rid}'{where}", param=param, code="response_not_found")
    tid = _turn_id(rid)
    turn = store.get_turn(tid) if tid is not None else None
    if turn is None or rid[5 : 5 + _DIGEST_HEX] != _digest(turn.session_id, turn.id):
        raise missing
    if not is_responses_request(turn.request):
        raise missing
    if session_id is not None and not _visible(store, session_id, turn):
        raise missing
    if turn.request.get("store") is False:
        raise NotFound(
            f"response '{rid}' was created with store: false, so it cannot be retrieved or continued; "
            "send the whole conversation as input instead",
            param=param,
            code="response_not_stored",
        )
    return turn


def output_message(turn: TurnRecord, rid: str) -> dict[str, Any]:
    """The internal assistant message of a finished turn (what its response's output items map to)."""
    if turn.response is None or turn.status not in (TURN_COMPLETE, TURN_DISCARDED):
        state = "still in progress" if turn.status == TURN_RUNNING else f"{turn.status}, not completed"
        raise Conflict(
            f"response '{rid}' is {state}; only a completed response can be continued",
            param="previous_response_id",
            code="response_not_completed",
        )
    message = turn.response["message"]
    out: dict[str, Any] = {"role": "assistant", "content": message.get("content") or ""}
    if message.get("reasoning_content"):  # as a reasoning item sent back renders
        out["content"] = think_text(message["reasoning_content"], out["content"])
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {
                    "name": c["function"]["name"],
                    "arguments": parse_arguments(c["function"]["arguments"]),
                },
            }
            for c in calls
        ]
    return out


def conversation(store: TrajectoryReader, turn: TurnRecord) -> list[dict[str, Any]]:
    """The internal messages of `turn`'s conversation through its output: the inputs and outputs of
    its chain of previous responses (each request's own instructions left out)."""
    chain = [turn]
    known: dict[int, TurnRecord] | None = None
    while True:
        prev = chain[-1].request.get("previous_response_id")
        if not isinstance(prev, str):
            break
        tid = _turn_id(prev)
        if known is None:  # one read of the session for the whole chain (a fork's shared turns too)
            known = {t.id: t for t in store.get_turns(turn.session_id)}
        found = known.get(tid) if tid is not None else None
        if found is None and tid is not None:
            found = store.get_turn(tid)  # another session's (a plain /v1 chain: one session each)
        if found is None or any(t.id == found.id for t in chain) or found.id >= chain[-1].id:
            raise NotFound(
                f"response '{response_id(chain[-1])}' continues '{prev}', which is no longer stored",
                param="previous_response_id",
                code="response_not_found",
            )
        chain.append(found)
    out: list[dict[str, Any]] = []
    for t in reversed(chain):
        rid = response_id(t)
        stored = validate_request(t.request)
        out += input_messages(stored.input)
        out.append(output_message(t, rid))
    return out
