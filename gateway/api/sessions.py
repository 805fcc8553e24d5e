"""The trainer's sessions API: create (optionally with a sandbox), read, fork, reward, close, delete.

Closing a session destroys its sandbox and the sandbox's checkpoints; the trajectory stays. Deleting
one (retention) removes its trajectory and events too; a session with fork children is refused (409
``session_has_forks``): they share its turns, so delete the children first.

Forking (tree rollouts)::

    POST /api/sessions/{id}/fork  {"at_turn": k, "n": N, "metadata": {...}}  -> 201 {"data": [N children]}

Each child reads the parent's turns 0..k as its own first turns (shared in the store, not copied) and
continues from turn k + 1 with its own ``base_url``: a request that extends the conversation through
turn k reuses the parent's exact token ids. Its metadata is the parent's, updated with the request's.
When the parent has a sandbox, each child gets its own, restored from the parent's checkpoint at turn
k (`SandboxManager.fork`). All or nothing: a fork that fails leaves no child and no sandbox behind.

Routing groups: a session may name a ``group`` (1 to 200 characters) when it is created; the ``group``
routing policy (``belayer serve --routing group``, ``engine_pool.router``) places a group's sessions on
the worker that served the group first, whose prefix cache holds their shared prompt. A fork child is in
its parent's group, or, when the parent named none, in the group named after the parent's id.

Seeds: a session may carry a ``seed`` (0 to 2^63 - 1); its turns' keyed sampling (``core.keyed``; a request's
``"sampling": "keyed"``, or ``belayer serve --sampling keyed``) derives each turn's key from it and the
turn's index, so re-running the episode with the same seed, harness and environment reproduces it token
for token. A fork child's seed derives from its parent's, the fork turn and its place among its siblings.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core.errors import Conflict, InvalidRequest
from core.keyed import KEY_BITS, child_seed
from core.logs import session_tag
from gateway.api import sandbox as sandbox_api
from gateway.api.observe import encode_cursor, session_query
from gateway.gateway import Gateway, gateway_of
from gateway.http.access import base_root, require_admin
from gateway.http.bodies import read_json, validate
from store import SessionRecord, TurnRecord
from store.base import RESERVED_KEYS
from store.export import Runs, aligned_logprobs, branch_leaves, recomputed_mask, recomputed_runs


def _own_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """Metadata without the key the store keeps a session's group under."""
    if reserved := [k for k in RESERVED_KEYS if k in metadata]:
        raise ValueError(
            f"the metadata key {reserved[0]!r} is reserved (name a routing group with 'group', a seed with 'seed')"
        )
    return metadata


class CreateSession(BaseModel):
    model_config = ConfigDict(extra="forbid")
    metadata: dict[str, Any] = Field(default_factory=dict)
    sandbox: dict[str, Any] | None = None
    """A sandbox spec (the body of POST /api/sessions/{id}/sandbox) to create with the session."""
    group: str | None = Field(default=None, min_length=1, max_length=200, strict=True)
    """A routing group (module docstring)."""
    seed: int | None = Field(default=None, ge=0, lt=1 << KEY_BITS, strict=True)
    """The seed its turns' keyed sampling derives from (``core.keyed``): re-running the episode with the
    same seed, harness and environment draws the same tokens."""

    _metadata = field_validator("metadata")(_own_metadata)


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    at_turn: int = Field(ge=0)
    n: int = Field(default=1, ge=1)
    metadata: dict[str, Any] = Field(default_factory=dict)
    """Merged over the parent's metadata for every child."""

    _metadata = field_validator("metadata")(_own_metadata)


class Reward(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reward: float = Field(allow_inf_nan=False)
    info: dict[str, Any] | None = None
    override: bool = False
    """Change the reward of a closed session (admin token only)."""


def _root(gw: Gateway, request: Request) -> str:
    return base_root(gw.config, request)


def _summary(
    gw: Gateway, request: Request, s: SessionRecord, counts: dict[str, tuple[int, int]] | None = None
) -> dict[str, Any]:
    """A session as the API shows it; `counts` (from ``turn_counts``) when listing many."""
    turns, branches = (counts if counts is not None else gw.store.turn_counts(s.id)).get(s.id, (0, 0))
    return {
        "id": s.id,
        "base_url": f"{_root(gw, request)}/s/{s.id}/v1",
        "anthropic_base_url": f"{_root(gw, request)}/s/{s.id}",  # the Anthropic SDK adds /v1 itself
        "status": s.status,
        "metadata": s.metadata,
        "created_at": s.created_at,
        "closed_at": s.closed_at,
        "reward": s.reward,
        "reward_info": s.reward_info,
        "num_turns": turns,
        "num_branches": branches,
        "parent_session": s.parent_session,
        "fork_turn": s.fork_turn,
        "group": s.group,
        "seed": s.seed,
        "log_tag": session_tag(s.id),  # what the gateway's log lines show of this session
    }


def _turn_json(
    t: TurnRecord,
    by_id: dict[int, TurnRecord],
    events: list[dict[str, Any]],
    recomputed: dict[int, Runs],
    token_text: Callable[[int], str] | None = None,
) -> dict[str, Any]:
    """A turn as ``/trajectory`` shows it; with `token_text` (``?token_text=1``), each output token's
    text too (``output_text``: a byte-level token may hold part of a character, shown as U+FFFD)."""
    parent = by_id.get(t.parent_id) if t.parent_id is not None else None
    extra = {"output_text": [token_text(i) for i in t.output_ids]} if token_text is not None else {}
    return {
        "index": t.index,
        "id": t.id,
        "branch": t.branch,
        "parent_index": parent.index if parent else None,
        "status": t.status,
        "prompt_ids": t.prompt_ids,
        "output_ids": t.output_ids,
        "output_logprobs": t.output_logprobs,
        "loss_mask": t.loss_mask(),
        "logprobs": aligned_logprobs(t, by_id, recomputed.get(t.id)),
        "recomputed_mask": recomputed_mask(t, recomputed.get(t.id, [])),
        "request": t.request,
        "response": t.response,
        "finish_reason": t.finish_reason,
        "worker": t.worker,
        "timings": t.timings,
        "received_at": t.received_at,
        "error": t.error,
        # named and shaped as in the export: segments in the turn's output positions, and their versions
        "weight_segments": [{"start": a, "end": b, "version": v} for a, b, v in t.weight_segments],
        "weight_versions": [v for _, _, v in t.weight_segments],
        "events": [e for e in events if e["turn_index"] == t.index],
        **extra,
    }


async def create_session(request: Request) -> Response:
    gw = gateway_of(request)
    body = await read_json(request, gw.config.max_body_bytes, optional=True)
    req = validate(CreateSession, body)
    if req.sandbox is not None:
        manager = sandbox_api.manager_of(gw)
    session = gw.sessions.new_record(req.metadata, group=req.group, seed=req.seed)
    await gw.store.front.call(session.id, gw.store.create_session, session)
    summary = _summary(gw, request, session)
    if req.sandbox is not None:
        try:
            summary["sandbox"] = await sandbox_api.create_for(manager, session.id, req.sandbox)
        except Exception:  # no session without the sandbox it was asked with
            await _close(gw, session)
            raise
    return JSONResponse(summary, status_code=201)


async def fork_session(request: Request) -> Response:
    """Fork the session at a complete turn into N children (see the module docstring)."""
    gw = gateway_of(request)
    parent = gw.sessions.get_open(request.path_params["session_id"])
    req = validate(ForkRequest, await read_json(request, gw.config.max_body_bytes))
    if req.n > gw.config.max_fork_siblings:
        raise InvalidRequest(
            f"n={req.n} is over this gateway's limit of {gw.config.max_fork_siblings} siblings per fork "
            "(max_fork_siblings)",
            "n",
            "too_many_siblings",
        )
    group = parent.group or parent.id  # the children share the parent's prompt, hence its worker's cache
    seeds = [None if parent.seed is None else child_seed(parent.seed, req.at_turn, i) for i in range(req.n)]
    children = [
        gw.sessions.new_record({**parent.metadata, **req.metadata}, group=group, seed=seed) for seed in seeds
    ]
    await gw.offload(gw.store.fork, parent.id, req.at_turn, children)
    sandboxes: dict[str, dict[str, Any]] = {}
    try:
        if gw.sandboxes is not None and gw.sandboxes.has_sandbox(parent.id):
            await gw.sandboxes.fork(parent.id, [c.id for c in children], req.at_turn)
            sandboxes = {c.id: gw.sandboxes.describe(c.id) for c in children}
    except BaseException:  # all or nothing: no child without the sandbox it was forked with
        for child in children:
            await gw.offload(gw.store.delete_session, child.id)
        raise
    data = [_summary(gw, request, c) | ({"sandbox": sandboxes[c.id]} if sandboxes else {}) for c in children]
    return JSONResponse(
        {"data": data, "parent_session": parent.id, "fork_turn": req.at_turn}, status_code=201
    )


async def list_sessions(request: Request) -> Response:
    gw = gateway_of(request)
    return await gw.offload(_session_list, gw, request)


def _session_list(gw: Gateway, request: Request) -> Response:
    """One page of the sessions that match the query's filters (`observe_api.session_query`)."""
    query = session_query(request)
    sessions, total = gw.store.query_sessions(query)
    counts = gw.store.turn_counts([s.id for s in sessions])
    full = query.limit > 0 and len(sessions) == query.limit
    return JSONResponse(
        {
            "data": [_summary(gw, request, s, counts) for s in sessions],
            "total": total,
            "limit": query.limit,
            "offset": query.offset,
            "next_cursor": encode_cursor(sessions[-1].created_at, sessions[-1].id) if full else None,
        }
    )


async def get_session(request: Request) -> Response:
    gw = gateway_of(request)
    return JSONResponse(_summary(gw, request, gw.sessions.get(request.path_params["session_id"])))


async def trajectory(request: Request) -> Response:
    gw = gateway_of(request)
    session = gw.sessions.get(request.path_params["session_id"])
    return await gw.offload(_trajectory, gw, request, session)


def _trajectory(gw: Gateway, request: Request, session: SessionRecord) -> Response:
    """The whole trajectory (built and rendered in a worker thread: it may be megabytes)."""
    turns = gw.store.get_turns(session.id)
    by_id = {t.id: t for t in turns}
    branches = [
        {
            "branch": leaf.branch,
            "leaf_index": leaf.index,
            "turn_indices": [t.index for t in turns if t.branch == leaf.branch],
        }
        for leaf in branch_leaves(turns)
    ]
    raw_events = gw.store.get_events(session.id)
    for sid in {t.session_id for t in turns} - {session.id}:  # a fork child: the shared turns' events
        raw_events += [e for e in gw.store.get_events(sid) if e.turn_id in by_id]
    raw_events.sort(key=lambda e: e.ts)
    recomputed = recomputed_runs(raw_events)
    text = gw.tokenizer.token_text if request.query_params.get("token_text") in ("1", "true") else None
    events = [
        {
            "turn_index": by_id[e.turn_id].index if e.turn_id in by_id else None,
            "ts": e.ts,
            "kind": e.kind,
            "data": e.data,
        }
        for e in raw_events
    ]
    return JSONResponse(
        {
            "session": _summary(
                gw, request, session, {session.id: (len(turns), len({t.branch for t in turns}))}
            ),
            "turns": [_turn_json(t, by_id, events, recomputed, text) for t in turns],
            "branches": branches,
            "events": events,
        }
    )


async def set_reward(request: Request) -> Response:
    gw = gateway_of(request)
    session = gw.sessions.get(request.path_params["session_id"])
    req = validate(Reward, await read_json(request, gw.config.max_body_bytes))
    if session.status != "open":
        if not req.override:
            raise Conflict(
                f"session '{session.id}' is {session.status}: its reward is final. An admin can change it "
                'with "override": true and the admin token',
                "session_id",
                "reward_final",
            )
        require_admin(gw.config, request)
    session.reward, session.reward_info = req.reward, req.info
    await gw.store.front.call(session.id, gw.store.update_session, session)
    return JSONResponse(_summary(gw, request, session))


async def close_session(request: Request) -> Response:
    gw = gateway_of(request)
    session = gw.sessions.get(request.path_params["session_id"])
    await _close(gw, session)
    gw.pool.forget(session.id)
    if gw.sandboxes is not None and gw.sandboxes.has_sandbox(session.id):
        await gw.sandboxes.destroy(session.id)
    return JSONResponse(_summary(gw, request, session))


async def delete_session(request: Request) -> Response:
    """Delete the session: its turns, events and sandbox. Refused (409) while one of its turns runs."""
    gw = gateway_of(request)
    session = gw.sessions.get(request.path_params["session_id"])
    counts = await gw.offload(gw.store.delete_session, session.id)
    if counts is None:
        then = (
            f"close it first (POST /api/sessions/{session.id}/close), then "
            if session.status == "open"
            else ""
        )
        raise Conflict(
            f"session '{session.id}' has a running turn; {then}delete it once the turn has ended",
            "session_id",
            "session_busy",
        )
    gw.pool.forget(session.id)
    sandbox = gw.sandboxes is not None and gw.sandboxes.has_sandbox(session.id)
    if gw.sandboxes is not None and sandbox:
        await gw.sandboxes.destroy(session.id)
    body = {"id": session.id, "deleted": True, "turns": counts[0], "events": counts[1], "sandbox": sandbox}
    return JSONResponse(body)


async def _close(gw: Gateway, session: SessionRecord) -> None:
    """Close the session once: the store records it on the finished feed (``GET /api/finished``)."""
    if session.status == "open":
        session.status, session.closed_at = "closed", time.time()
        await gw.store.front.call(session.id, gw.store.mark_closed, session)


def routes() -> list[Route]:
    return [
        Route("/api/sessions", create_session, methods=["POST"]),
        Route("/api/sessions", list_sessions, methods=["GET"]),
        Route("/api/sessions/{session_id}", get_session, methods=["GET"]),
        Route("/api/sessions/{session_id}", delete_session, methods=["DELETE"]),
        Route("/api/sessions/{session_id}/trajectory", trajectory, methods=["GET"]),
        Route("/api/sessions/{session_id}/reward", set_reward, methods=["POST"]),
        Route("/api/sessions/{session_id}/close", close_session, methods=["POST"]),
        Route("/api/sessions/{session_id}/fork", fork_session, methods=["POST"]),
    ]
