"""Trajectories in Harbor's ATIF (Agent Trajectory Interchange Format, RFC 0001; ``ATIF-v1.8``): one per
branch of each session, as the export's rows are (``store.export``).

A branch is the sequence that ends with its newest complete turn; its turns are the ones whose output
that sequence holds, in order. Each becomes an ``agent`` step: the message text, reasoning and tool
calls of the turn's response, and in ``metrics`` the exact ``prompt_token_ids``, ``completion_token_ids``
and ``logprobs`` the store has. What the harness sent before a turn becomes steps too, read from the
turn's request: the first turn's system prompt and instruction as ``system`` and ``user`` steps, and
between turns the messages that the next request added after the previous answer: tool results become
the ``observation`` of the step that called the tool (``source_call_id``: the call's id), user and
system messages steps of their own, and assistant text the gateway did not generate (a summary, an
edited answer) an ``agent`` step with ``is_copied_context``. Requests are read in the shape they came
in: OpenAI chat (``messages``), Anthropic Messages (``system``, content blocks; its tool calls keep the
``toolu_`` ids the harness saw), OpenAI Responses (``instructions``, ``input`` items; with
``previous_response_id`` the input holds only the new items) and completions (``prompt``).

Belayer's own fields go where ATIF keeps custom data, ``extra``: the loss mask, weight segments,
recomputed logprobs (``metrics.extra``), the turn's index, worker, finish reason and failovers
(``step.extra``), and the reward, status, metadata and fork of the session (the trajectory's
``extra``). The whole mapping is in ``docs/export.md``. The steps of a fork child's branch that its
parent generated are ``is_copied_context`` (the parent's own trajectories hold them for training).

Example::

    for trajectory in session_trajectories(store, "ses_1"):
        print(trajectory["trajectory_id"], len(trajectory["steps"]))
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from core.atif import ATIF_VERSION
from store.base import EventRecord, SessionRecord, TurnRecord
from store.export import Runs, branch_leaves, generated_spans, recomputed_runs
from store.roles import TrajectoryReader

TEXT_PARTS = ("text", "input_text", "output_text")
"""Content part types whose ``text`` is message text (OpenAI chat, Anthropic, Responses)."""

SWITCH_EVENTS = ("failover", "weight_switch")
"""A turn's events that say it moved to another worker mid-output (``gateway.turns.failover``)."""

Step = dict[str, Any]


@dataclass(slots=True)
class Message:
    """A request's message in one form, whatever its protocol's."""

    role: str
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """ATIF tool calls: ``tool_call_id``, ``function_name``, ``arguments`` (and ``extra``)."""
    tool_call_id: str | None = None
    reasoning: str | None = None
    is_error: bool = False


# --- requests as messages --------------------------------------------------------------------------------


def text_of(content: Any, sep: str = "") -> str:
    """A message's (or tool result's) text: a string as it is, the text parts of a list joined with
    `sep` (as the gateway joins them: ``""`` for OpenAI's parts, newlines for Anthropic's blocks)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return sep.join(
            p["text"] for p in content if isinstance(p, dict) and p.get("type") in TEXT_PARTS and "text" in p
        )
    return ""


def tool_call(call_id: Any, name: Any, arguments: Any) -> dict[str, Any]:
    """An ATIF tool call; arguments that are not a JSON object keep their text in ``extra``."""
    args = arguments
    if isinstance(arguments, str):
        try:
            args = json.loads(arguments)
        except ValueError:
            args = None
    call: dict[str, Any] = {"tool_call_id": str(call_id), "function_name": str(name)}
    call["arguments"] = args if isinstance(args, dict) else {}
    if not isinstance(args, dict):
        call["extra"] = {"arguments": arguments}
    return call


def _chat_message(m: dict[str, Any], sep: str = "") -> list[Message]:
    """An OpenAI chat or Anthropic message (`sep`: a newline, as the gateway joins a user message's
    blocks; an assistant's are joined as they are): Anthropic's ``tool_result`` blocks become tool
    messages of their own (in block order), its ``tool_use`` blocks tool calls, its ``thinking`` blocks
    reasoning."""
    role = "system" if m.get("role") == "developer" else str(m.get("role"))
    sep = "" if role == "assistant" else sep
    content = m.get("content")
    blocks = content if isinstance(content, list) else []
    out: list[Message] = []
    msg = Message(role, text_of(content, sep), tool_call_id=m.get("tool_call_id"))
    msg.reasoning = m.get("reasoning_content") or m.get("reasoning") or None
    for c in m.get("tool_calls") or []:
        fn = c.get("function") or {}
        msg.tool_calls.append(tool_call(c.get("id"), fn.get("name"), fn.get("arguments")))
    texts: list[str] = []
    for b in blocks:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "tool_use":
            msg.tool_calls.append(tool_call(b.get("id"), b.get("name"), b.get("input")))
        elif kind == "thinking":
            msg.reasoning = (msg.reasoning or "") + str(b.get("thinking", ""))
        elif kind == "tool_result":
            if texts:
                out.append(Message(role, sep.join(texts)))
                texts = []
            tool = Message("tool", text_of(b.get("content"), sep), tool_call_id=b.get("tool_use_id"))
            tool.is_error = bool(b.get("is_error"))
            out.append(tool)
        elif kind in TEXT_PARTS:
            texts.append(str(b.get("text", "")))
    if not out:
        return [msg]
    if texts:
        out.append(Message(role, sep.join(texts)))
    return out


def _input_items(items: list[Any]) -> list[Message]:
    """Responses input items: messages, and assistant-side items (``function_call``, ``reasoning``,
    assistant messages) gathered into one assistant message, as the gateway renders them."""
    out: list[Message] = []
    reply: Message | None = None
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        assistant_side = kind in ("function_call", "reasoning") or (
            kind == "message" and item.get("role") == "assistant"
        )
        if not assistant_side:
            reply = None
            if kind == "function_call_output":
                output = text_of(item.get("output"), "\n")
                out.append(Message("tool", output, tool_call_id=item.get("call_id")))
            elif kind == "message":
                out += _chat_message(item, "\n")
            continue
        if reply is None:
            reply = Message("assistant")
            out.append(reply)
        if kind == "message":
            reply.content += text_of(item.get("content"))
        elif kind == "reasoning":
            thought = "".join(p.get("text", "") for p in item.get("content") or [] if isinstance(p, dict))
            reply.reasoning = (reply.reasoning or "") + thought
        else:
            reply.tool_calls.append(tool_call(item.get("call_id"), item.get("name"), item.get("arguments")))
    return out


def request_messages(request: dict[str, Any]) -> tuple[list[Message], bool]:
    """The request's messages, and whether they continue a stored conversation (a Responses request with
    ``previous_response_id``: its input holds only the new items, and its ``instructions`` are the
    configuration it repeats, not a message)."""
    if "input" in request:
        continued = request.get("previous_response_id") is not None
        items = request["input"]
        msgs = [Message("user", items)] if isinstance(items, str) else _input_items(list(items or []))
        if request.get("instructions") and not continued:
            msgs.insert(0, Message("system", str(request["instructions"])))
        return msgs, continued
    if "prompt" in request:  # a completion: its prompt as text (token ids are the step's prompt_token_ids)
        prompt = request["prompt"]
        text = (
            prompt if isinstance(prompt, str) else prompt[0] if prompt and isinstance(prompt[0], str) else ""
        )
        return [Message("user", text)], False
    sep = "\n" if is_anthropic(request) else ""
    msgs = [] if not request.get("system") else [Message("system", text_of(request["system"]))]
    for m in request.get("messages") or []:
        if isinstance(m, dict):
            msgs += _chat_message(m, sep)
    return msgs, False


ANTHROPIC_BLOCKS = frozenset({"tool_use", "tool_result", "thinking", "redacted_thinking"})


def anthropic_tools(request: dict[str, Any]) -> bool:
    """Whether the request's tools are Anthropic's (an ``input_schema``): a turn stores its tool calls
    with OpenAI's ``call_`` ids, and the Anthropic route shows them as ``toolu_``; a call needs a tool,
    so the tools' shape says which ids the harness saw."""
    return any(isinstance(t, dict) and "input_schema" in t for t in request.get("tools") or [])


def is_anthropic(request: dict[str, Any]) -> bool:
    """Whether the request came in Anthropic's shape: Anthropic's tools, a top-level ``system``, or
    content blocks only Anthropic has (a request with none of these reads the same either way)."""
    if anthropic_tools(request) or "system" in request:
        return True
    return any(
        isinstance(b, dict) and b.get("type") in ANTHROPIC_BLOCKS
        for m in request.get("messages") or []
        if isinstance(m, dict) and isinstance(m.get("content"), list)
        for b in m["content"]
    )


def tool_definitions(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's tools in OpenAI's function-calling form (ATIF's ``agent.tool_definitions``)."""
    out = []
    for t in request.get("tools") or []:
        if not isinstance(t, dict):
            continue
        if isinstance(t.get("function"), dict):
            out.append(t)
            continue
        fn = {k: t[k] for k in ("name", "description") if k in t}
        params = t.get("input_schema", t.get("parameters"))
        if params is not None:
            fn["parameters"] = params
        out.append({"type": "function", "function": fn})
    return out


# --- a branch as steps -----------------------------------------------------------------------------------


def _timestamp(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat()


def _observe(steps: list[Step], m: Message) -> None:
    """A tool result, as a result of the newest agent step's observation (its ``source_call_id`` is
    the call it answers, or null with the id in ``extra`` when that step made no such call)."""
    agent = next((s for s in reversed(steps) if s["source"] == "agent"), None)
    if agent is None:  # no step called a tool: the result stands alone, on a system step
        agent = {"step_id": len(steps) + 1, "source": "system", "message": ""}
        steps.append(agent)
    ids = {c["tool_call_id"] for c in agent.get("tool_calls", [])}
    result: dict[str, Any] = {"content": m.content}
    if m.tool_call_id is not None and m.tool_call_id in ids:
        result["source_call_id"] = m.tool_call_id
    elif m.tool_call_id is not None:
        result["extra"] = {"tool_call_id": m.tool_call_id}
    if m.is_error:
        result["extra"] = {**result.get("extra", {}), "is_error": True}
    agent.setdefault("observation", {"results": []})["results"].append(result)


def context_steps(steps: list[Step], messages: list[Message], ts: float) -> None:
    """Steps for messages the harness sent (not generated by the turns of this branch)."""
    for m in messages:
        if m.role == "tool":
            _observe(steps, m)
            continue
        step: Step = {"step_id": len(steps) + 1, "timestamp": _timestamp(ts)}
        if m.role == "assistant":
            step |= {"source": "agent", "message": m.content, "is_copied_context": True}
            if m.reasoning:
                step["reasoning_content"] = m.reasoning
            if m.tool_calls:
                step["tool_calls"] = m.tool_calls
        else:
            step |= {"source": "system" if m.role == "system" else "user", "message": m.content}
        steps.append(step)


def new_messages(messages: list[Message], continued: bool, known: int) -> list[Message]:
    """The messages a request adds after the conversation so far (`known` messages, the previous answer
    last; 0: the branch's first turn, whose messages are all new): those after it when the request
    repeats it there, else those after its last assistant message (a harness that rewrote its history)."""
    if continued or known == 0:
        return messages
    if 0 < known <= len(messages) and messages[known - 1].role == "assistant":
        return messages[known:]
    last = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
    return messages[last + 1 :]


def agent_step(
    turn: TurnRecord, step_id: int, session: SessionRecord, events: list[EventRecord], runs: Runs
) -> Step:
    """A generated turn as an agent step: its response, its exact tokens and Belayer's own fields."""
    message = (turn.response or {}).get("message") or {}
    anthropic = anthropic_tools(turn.request)
    calls = []
    for c in message.get("tool_calls") or []:
        call_id = str(c.get("id"))
        if anthropic:
            call_id = "toolu_" + call_id.removeprefix("call_")
        fn = c.get("function") or {}
        calls.append(tool_call(call_id, fn.get("name"), fn.get("arguments")))
    step: Step = {
        "step_id": step_id,
        "timestamp": _timestamp(turn.received_at),
        "source": "agent",
        "message": message.get("content") or "",
    }
    if message.get("reasoning_content"):
        step["reasoning_content"] = message["reasoning_content"]
    if calls:
        step["tool_calls"] = calls
    if turn.session_id != session.id:  # a fork child's turn that its parent generated
        step["is_copied_context"] = True
    step["metrics"] = metrics(turn, runs)
    step["llm_call_count"] = 1
    step["extra"] = step_extra(turn, events)
    return step


def metrics(turn: TurnRecord, runs: Runs) -> dict[str, Any]:
    """The turn's exact tokens; in ``extra`` its loss mask (over prompt and completion), weight
    segments (completion positions) and the recomputed logprobs of rewritten prompt spans."""
    extra: dict[str, Any] = {
        "loss_mask": turn.loss_mask(),
        "weight_segments": [{"start": a, "end": b, "version": v} for a, b, v in turn.weight_segments],
        "weight_versions": [v for _, _, v in turn.weight_segments],
    }
    if runs:
        extra["recomputed_logprobs"] = [{"start": start, "logprobs": values} for start, values in runs]
    return {
        "prompt_tokens": len(turn.prompt_ids),
        "completion_tokens": len(turn.output_ids),
        "prompt_token_ids": list(turn.prompt_ids),
        "completion_token_ids": list(turn.output_ids),
        "logprobs": list(turn.output_logprobs),
        "extra": extra,
    }


def step_extra(turn: TurnRecord, events: list[EventRecord]) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "session_id": turn.session_id,
        "turn_index": turn.index,
        "branch": turn.branch,
        "worker": turn.worker,
        "finish_reason": turn.finish_reason,
        "timings": dict(turn.timings),
        "failovers": [{"kind": e.kind, **e.data} for e in events if e.kind in SWITCH_EVENTS],
    }
    sampling = (turn.response or {}).get("sampling")
    if sampling is not None:
        extra["sampling"] = sampling
    return extra


@dataclass(frozen=True, slots=True)
class SessionView:
    """What a session's trajectories are built from, read once."""

    session: SessionRecord
    turns: list[TurnRecord]
    by_id: dict[int, TurnRecord]
    events: dict[int, list[EventRecord]]
    """Each turn's events, by turn id."""
    recomputed: dict[int, Runs]


def branch_turns(view: SessionView, leaf: TurnRecord) -> list[TurnRecord]:
    """The turns whose output the branch that ends with `leaf` holds, in order (a turn no longer
    stored has no step: its tokens are still in the next steps' prompts)."""
    return [t for _, _, t in generated_spans(leaf, view.by_id) if t is not None] + [leaf]


def branch_steps(view: SessionView, turns: list[TurnRecord]) -> list[Step]:
    """A branch's turns as ATIF steps, with the messages sent before each."""
    steps: list[Step] = []
    known = 0
    for turn in turns:
        messages, continued = request_messages(turn.request)
        context_steps(steps, new_messages(messages, continued, known), turn.received_at)
        known = (known if continued else 0) + len(messages) + 1
        events = view.events.get(turn.id, [])
        steps.append(agent_step(turn, len(steps) + 1, view.session, events, view.recomputed.get(turn.id, [])))
    return steps


def agent_info(session: SessionRecord, first: TurnRecord) -> dict[str, Any]:
    """ATIF's ``agent``: name and version from the session's metadata (``agent`` or ``harness``,
    ``agent_version`` or ``harness_version``; ``unknown`` when it has none), the model from its
    ``model`` or the first turn's request, and the tools that request offered."""
    meta = session.metadata

    def text(*keys: str) -> str | None:
        value = next((meta[k] for k in keys if meta.get(k) not in (None, "")), None)
        return None if value is None else str(value)

    agent: dict[str, Any] = {
        "name": text("agent", "harness") or "unknown",
        "version": text("agent_version", "harness_version") or "unknown",
    }
    model = text("model") or first.request.get("model")
    if model is not None:
        agent["model_name"] = str(model)
    tools = tool_definitions(first.request)
    if tools:
        agent["tool_definitions"] = tools
    return agent


def branch_trajectory(view: SessionView, leaf: TurnRecord) -> dict[str, Any]:
    """One branch as an ATIF trajectory (a JSON object that ``harbor.models.trajectories.Trajectory``
    validates)."""
    session = view.session
    turns = branch_turns(view, leaf)
    steps = branch_steps(view, turns)
    measured = [s["metrics"] for s in steps if "metrics" in s]
    return {
        "schema_version": ATIF_VERSION,
        "session_id": session.id,
        "trajectory_id": f"{session.id}-branch-{leaf.branch}",
        "agent": agent_info(session, turns[0]),
        "steps": steps,
        "final_metrics": {
            "total_prompt_tokens": sum(m["prompt_tokens"] for m in measured),
            "total_completion_tokens": sum(m["completion_tokens"] for m in measured),
            "total_steps": len(steps),
        },
        "extra": {
            "branch": leaf.branch,
            "reward": session.reward,
            "reward_info": session.reward_info,
            "status": session.status,
            "created_at": session.created_at,
            "metadata": session.metadata,
            "parent_session": session.parent_session,
            "fork_turn": session.fork_turn,
        },
    }


def session_view(store: TrajectoryReader, session: SessionRecord) -> SessionView:
    turns = store.get_turns(session.id)
    events: dict[int, list[EventRecord]] = {}
    everything = [e for sid in {t.session_id for t in turns} | {session.id} for e in store.get_events(sid)]
    for e in everything:
        if e.turn_id is not None:
            events.setdefault(e.turn_id, []).append(e)
    return SessionView(session, turns, {t.id: t for t in turns}, events, recomputed_runs(everything))


def session_trajectories(store: TrajectoryReader, session_id: str) -> list[dict[str, Any]]:
    """The session's ATIF trajectories, one per branch with a complete turn (``[]`` for an unknown
    session); a fork child's are its own branches, as with the export's rows."""
    session = store.get_session(session_id)
    if session is None:
        return []
    view = session_view(store, session)
    leaves = [t for t in branch_leaves(view.turns) if t.session_id == session_id]
    return [branch_trajectory(view, leaf) for leaf in leaves]


def encode_trajectories(trajectories: list[dict[str, Any]]) -> bytes:
    """Trajectories as JSON Lines: one trajectory per line (the HTTP export's body). ASCII, as the rows'
    JSON Lines are: a message's U+2028, U+0085... would end a line for readers that split on every
    Unicode line break (Python's ``str.splitlines``)."""
    return "".join(json.dumps(t, allow_nan=False) + "\n" for t in trajectories).encode()
