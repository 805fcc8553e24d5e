"""The sandbox API of a session: create it, run tool calls and file operations, checkpoint, restore.

The trainer's routes, under ``/api/`` (behind the API token, `gateway.http.access`)::

    POST   /api/sessions/{id}/sandbox               {"image": ..., "workdir"?, "memory_mb"?, ...} -> 201
                                                    (or POST /api/sessions {"sandbox": {...}})
    GET    /api/sessions/{id}/sandbox               state, checkpoints, last restore
    DELETE /api/sessions/{id}/sandbox
    POST   /api/sessions/{id}/sandbox/exec          {"command": ..., "timeout_s"?, "cwd"?, "env"?}
    GET    /api/sessions/{id}/sandbox/files?path=P  {"content", "encoding": "utf-8" | "base64"}; a file over
                                                    sandbox.max_read_bytes: 413 file_too_large (told by its
                                                    size, none of it read); more than one symbolic link on
                                                    the way, a loop or a directory: 400 path_refused
    PUT    /api/sessions/{id}/sandbox/files         {"path", "content", "encoding"?, "mode"?}
    GET    /api/sessions/{id}/sandbox/checkpoints
    POST   /api/sessions/{id}/sandbox/checkpoints   checkpoint now
    POST   /api/sessions/{id}/sandbox/restore       {"checkpoint_id"?}: newest when absent
    POST   /api/sessions/{id}/sandbox/verify        {"files": [{"path", "content" (base64), "mode"?}], ...}:
                                                    the verify stage (`sandbox.sessions.verify`); "format":
                                                    belayer | harbor (reward files), "mode": clean |
                                                    shared; answers the verdict, "reward" and "rewards"

The harness's routes, under the session's capability URL (no token: the session id is the capability,
as for ``/s/{id}/v1/*``), for a harness beside its sandbox that runs its tool calls there: the same
handlers, for that session's sandbox only::

    GET    /s/{id}/sandbox                          state (after a 409 sandbox_restored, `last_restore`:
                                                    where to go on); no checkpoints, no parent session
    POST   /s/{id}/sandbox/exec
    GET    /s/{id}/sandbox/files?path=P
    PUT    /s/{id}/sandbox/files

Nothing there creates, deletes, checkpoints, restores or verifies: a harness cannot judge itself,
rewind its own trajectory (a restore truncates it) or end its episode. An unknown or closed session
answers 404 (``session_not_found``, ``session_closed``) and reaches no sandbox. A request from
inside a sandbox (the sandbox listener, `gateway.api.sandbox_listener`) is refused with a 403: a harness
inside runs its commands itself, and its sandbox's own processes stay off the tool-call journal.

Sandbox errors become OpenAI- or Anthropic-style error JSON in the gateway's one table (`gateway.http.errors`). A tool call during
which the sandbox failed is, by default (`"recovery": "replay"`), run again on the restored sandbox
after the calls since its checkpoint were replayed: it just answers. With `"recovery": "truncate"` it
answers 409 `sandbox_restored`: the trajectory was truncated, and `GET .../sandbox` says after which turn
(`last_restore.keep_through`) to continue. A call that breaks the sandbox twice answers 422
`command_broke_sandbox`. The journal of calls since the last checkpoint is capped
(``sandbox.max_journal_bytes``): a call that would pass the cap checkpoints the sandbox first, or, where
no checkpoint can be taken, answers 429 `sandbox_journal_full` (`sandbox.sessions.recovery`).

Example (a harness's tool call, with only its session id)::

    httpx.post(f"{gateway}/s/{session_id}/sandbox/exec", json={"command": "pytest -q", "timeout_s": 120})
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import logging
import posixpath
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from core.errors import Forbidden, InvalidRequest, NotFound, SandboxError, SandboxesDisabled
from engine_pool.face import Engines
from engine_pool.states import READY
from gateway.gateway import Gateway, gateway_of
from gateway.http.access import SANDBOX_SCOPE_KEY
from gateway.http.bodies import read_json, validate
from sandbox.backend import SandboxBackend, SandboxSpec, check_env_name
from sandbox.config import SandboxConfig
from sandbox.sessions.manager import SandboxManager
from sandbox.sessions.verify import VerifyPlan
from store import SessionRecord, TrajectoryStore

log = logging.getLogger("belayer.sandbox")
CAPABILITY_ROOT = "/s/{session_id}/sandbox"
"""The session's sandbox under its capability URL: no token, that session's sandbox only."""
HARNESS_STATE = frozenset(
    {"session_id", "status", "failure", "image", "network", "harness_inside", "recovery", "journaled_calls",
     "last_restore"}
)  # fmt: skip
"""What ``GET /s/{id}/sandbox`` shows of `SandboxManager.describe`: never ``forked_from`` (a fork
child's harness would hold its parent's capability) nor the checkpoints (ids, host paths)."""


@contextlib.asynccontextmanager
async def open_sandboxes(
    config: SandboxConfig,
    store: TrajectoryStore,
    pool: Engines,
    backend: SandboxBackend | None = None,
    gateway_id: str | None = None,
) -> AsyncIterator[SandboxManager | None]:
    """The app's sandbox manager (None when disabled), over `backend` or the local Docker engine;
    `gateway_id` labels its sandboxes, among replicas on `store` (`sandbox.sessions.adoption`)."""
    if not config.enabled:
        yield None
        return
    owned = backend is None
    if backend is None:
        from sandbox.backends import sandbox_backend

        backend = await asyncio.to_thread(sandbox_backend, config)

    def engine_load() -> float:  # requests sharing a worker with a new one
        members = pool.view().members
        return 1.0 + sum(m.outstanding for m in members) / max(1, sum(m.state == READY for m in members))

    manager = SandboxManager(backend, store, config, engine_load, gateway_id=gateway_id)
    try:
        try:  # the sandboxes a gateway before this one left (killed, or shut down)
            await manager.adopt()
        except SandboxError as exc:
            log.error("could not take back the sandboxes of the open sessions at start-up: %s", exc)
        yield manager
    finally:
        if config.keep_on_shutdown:
            await manager.detach()  # the next gateway on this store adopts them
        else:
            await manager.close()
        if owned:
            backend.close()


# --------------------------------------------------------------------------- wire models
class CreateSandbox(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: str = Field(min_length=1)
    workdir: str = "/workspace"
    shell: str = "/bin/sh"
    env: dict[str, str] = Field(default_factory=dict)
    memory_mb: int = Field(default=512, ge=16, le=65536)
    pids_limit: int = Field(default=256, ge=8, le=32768)
    cpus: float = Field(default=1.0, gt=0, le=64)
    network: Literal["none", "gateway", "full"] = "none"
    """none: loopback only; gateway: only this gateway's sandbox listener (for a harness inside)."""
    harness_inside: bool = False
    """The harness runs in this sandbox: a restore discards the turn it was waiting for (it retries it)."""
    recovery: Literal["replay", "truncate"] = "replay"
    """After a failure, replay: restore + re-run the tool calls since the checkpoint (the harness never
    notices); truncate: restore, discard the later turns, answer 409 sandbox_restored."""


class ExecRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    command: str = Field(min_length=1)
    timeout_s: float = Field(default=30.0, gt=0, le=3600)
    cwd: str | None = None
    env: dict[str, str] | None = None
    shell_session: str = "main"
    max_output_bytes: int = Field(default=1 << 20, ge=1, le=16 << 20)


class WriteFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    content: str
    encoding: Literal["utf-8", "base64"] = "utf-8"
    mode: int = Field(default=0o644, ge=0, le=0o7777)


class RestoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checkpoint_id: str | None = None


class TaskFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1)
    content: str = Field(description="base64")
    mode: int = Field(default=0o644, ge=0, le=0o7777)


class VerifyRequest(BaseModel):
    """The verify stage. ``format="belayer"``: `files` go to /belayer-verify (``verify.sh`` required: the
    verifier, its exit code the verdict; e.g. ``tests/...``: hidden tests); ``format="harbor"``: `files`
    go to /tests (``test.sh`` required), and the reward is read from /logs/verifier/reward.json or
    reward.txt. `originals` are the task's own versions of the protected files. ``mode="clean"`` judges a
    copy of the working directory in a new sandbox from the clean image; ``"shared"`` runs the verifier in
    the agent's own sandbox (Harbor's way; no protected paths). `env`: the verifier's variables."""

    model_config = ConfigDict(extra="forbid")
    files: list[TaskFile] = Field(min_length=1)
    originals: list[TaskFile] = Field(default_factory=list)
    protected_paths: list[str] = Field(default_factory=list)
    on_tamper: Literal["reset", "fail"] = "reset"
    timeout_s: float = Field(default=300.0, gt=0, le=3600)
    image: str | None = None
    keep_sandbox: bool = False
    format: Literal["belayer", "harbor"] = "belayer"
    mode: Literal["clean", "shared"] = "clean"
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _env(cls, value: dict[str, str]) -> dict[str, str]:
        for name, text in value.items():
            check_env_name(name)
            if "\0" in text:
                raise ValueError(f"the value of {name} holds a NUL byte")
        return value


def _decoded(files: list[TaskFile], param: str) -> dict[str, tuple[bytes, int]]:
    try:
        return {f.path: (base64.b64decode(f.content, validate=True), f.mode) for f in files}
    except binascii.Error as e:
        raise InvalidRequest(f"'{param}': a content is not valid base64: {e}", param, "invalid_value") from e


def _manager(request: Request) -> tuple[SandboxManager, str]:
    """The sandbox manager and the session the path names: any stored one under ``/api/`` (behind the
    token), under the capability URL only an open one, and not from inside a sandbox."""
    gw = gateway_of(request)
    manager = manager_of(gw)
    session = gw.sessions.get(request.path_params["session_id"])
    if _is_capability(request):
        _check_capability(request, session)
    return manager, session.id


def _is_capability(request: Request) -> bool:
    return request.url.path.startswith("/s/")


def _check_capability(request: Request, session: SessionRecord) -> None:
    if SANDBOX_SCOPE_KEY in request.scope:
        raise Forbidden(
            "a sandbox cannot call its session's sandbox API; run the command in the sandbox itself"
        )
    if session.status != "open":
        raise NotFound(
            f"session '{session.id}' is {session.status}: its sandbox is gone; a new episode needs a new "
            "session",
            "session_id",
            "session_closed",
        )


def manager_of(gw: Gateway) -> SandboxManager:
    if gw.sandboxes is None:
        raise SandboxesDisabled(
            "sandboxes are not enabled on this gateway; start it with `belayer serve --sandboxes` (as root, "
            "with Docker and CRIU: deploy/host/setup_sandbox_host.sh install)"
        )
    return gw.sandboxes


async def _body(request: Request) -> dict[str, Any]:
    gw = gateway_of(request)
    return await read_json(request, gw.config.max_body_bytes, optional=True)


# --------------------------------------------------------------------------- routes
async def create_sandbox(request: Request) -> Response:
    manager, sid = _manager(request)
    gateway_of(request).sessions.get_open(sid)
    return JSONResponse(await create_for(manager, sid, await _body(request)), status_code=201)


async def create_for(manager: SandboxManager, sid: str, body: dict[str, Any]) -> dict[str, Any]:
    """Create session `sid`'s sandbox from a `CreateSandbox` body; return its description."""
    req = validate(CreateSandbox, body)
    try:
        spec = SandboxSpec(
            image=req.image, workdir=req.workdir, shell=req.shell, env=req.env,
            memory_bytes=req.memory_mb << 20, pids_limit=req.pids_limit, cpus=req.cpus,
            network=req.network,
        )  # fmt: skip
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"invalid value for '{param}': {first['msg']}", param, "invalid_value") from e
    await manager.create(sid, spec, harness_inside=req.harness_inside, recovery=req.recovery)
    return manager.describe(sid)


async def get_sandbox(request: Request) -> Response:
    manager, sid = _manager(request)
    state = manager.describe(sid)
    if _is_capability(request):  # not the sessions it forked from, nor where its checkpoints lie
        state = {k: v for k, v in state.items() if k in HARNESS_STATE}
    return JSONResponse(state)


async def delete_sandbox(request: Request) -> Response:
    manager, sid = _manager(request)
    await manager.destroy(sid)
    return JSONResponse({"session_id": sid, "deleted": True})


async def exec_command(request: Request) -> Response:
    manager, sid = _manager(request)
    req = validate(ExecRequest, await _body(request))
    r = await manager.exec(
        sid, req.command, timeout_s=req.timeout_s, cwd=req.cwd, env=req.env,
        shell_session=req.shell_session, max_output_bytes=req.max_output_bytes,
    )  # fmt: skip
    return JSONResponse(
        {
            "exit_code": r.exit_code,
            "stdout": r.stdout,
            "stderr": r.stderr,
            "duration_s": round(r.duration_s, 4),
            "stdout_truncated": r.stdout_truncated,
            "stderr_truncated": r.stderr_truncated,
            # Output that was not UTF-8 was decoded with replacement characters; read files instead.
            "output_not_utf8": "\ufffd" in r.stdout or "\ufffd" in r.stderr,
        }
    )


async def read_file(request: Request) -> Response:
    manager, sid = _manager(request)
    path = request.query_params.get("path")
    if path is None:
        raise InvalidRequest("the query parameter 'path' is required", "path", "missing_required_parameter")
    data = await manager.read_file(sid, path)
    try:
        content, encoding = data.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        content, encoding = base64.b64encode(data).decode(), "base64"
    return JSONResponse({"path": path, "size": len(data), "encoding": encoding, "content": content})


async def write_file(request: Request) -> Response:
    manager, sid = _manager(request)
    req = validate(WriteFile, await _body(request))
    try:
        data = (
            base64.b64decode(req.content, validate=True) if req.encoding == "base64" else req.content.encode()
        )
    except binascii.Error as e:
        raise InvalidRequest(f"'content' is not valid base64: {e}", "content", "invalid_value") from e
    await manager.write_file(sid, req.path, data, mode=req.mode)
    return JSONResponse({"path": req.path, "size": len(data)})


async def list_checkpoints(request: Request) -> Response:
    manager, sid = _manager(request)
    return JSONResponse({"data": [c.as_json() for c in manager.checkpoints(sid)]})


async def create_checkpoint(request: Request) -> Response:
    manager, sid = _manager(request)
    info = await manager.checkpoint(sid)
    return JSONResponse(info.as_json(), status_code=201)


async def restore(request: Request) -> Response:
    manager, sid = _manager(request)
    req = validate(RestoreRequest, await _body(request))
    restored = await manager.restore(sid, req.checkpoint_id)
    return JSONResponse(restored.data())


async def verify(request: Request) -> Response:
    manager, sid = _manager(request)
    gateway_of(request).sessions.get_open(sid)
    req = validate(VerifyRequest, await _body(request))
    files = _decoded(req.files, "files")
    script = "verify.sh" if req.format == "belayer" else "test.sh"
    outside = [p for p in files if posixpath.normpath(p).startswith(("/", ".."))]
    if outside:  # refused before the agent's sandbox is touched
        raise InvalidRequest(
            f"'files': {outside[0]!r} is not a relative path inside the task", "files", "invalid_value"
        )
    if script not in files:
        raise InvalidRequest(f"'files' must hold {script} (format {req.format})", "files", "invalid_value")
    if req.mode == "shared" and (req.originals or req.protected_paths or req.image):
        raise InvalidRequest(
            "mode 'shared' runs the verifier in the agent's own sandbox: no originals, protected_paths or "
            "image there (use mode 'clean')",
            "mode",
            "invalid_value",
        )
    plan = VerifyPlan(
        files=files, originals=_decoded(req.originals, "originals"), protected=tuple(req.protected_paths),
        on_tamper=req.on_tamper, timeout_s=req.timeout_s, image=req.image, keep_agent_sandbox=req.keep_sandbox,
        format=req.format, mode=req.mode, env=req.env,
    )  # fmt: skip
    outcome = await manager.verify(sid, plan)
    body = {**outcome.summary(), "output": outcome.output, "changes": [c.as_json() for c in outcome.changes]}
    return JSONResponse({**body, "agent_sandbox_kept": outcome.agent_sandbox_kept})


def routes() -> list[Route]:
    base = "/api/sessions/{session_id}/sandbox"
    return [
        Route(base, create_sandbox, methods=["POST"]),
        Route(base, get_sandbox, methods=["GET"]),
        Route(base, delete_sandbox, methods=["DELETE"]),
        Route(f"{base}/exec", exec_command, methods=["POST"]),
        Route(f"{base}/files", read_file, methods=["GET"]),
        Route(f"{base}/files", write_file, methods=["PUT"]),
        Route(f"{base}/checkpoints", list_checkpoints, methods=["GET"]),
        Route(f"{base}/checkpoints", create_checkpoint, methods=["POST"]),
        Route(f"{base}/restore", restore, methods=["POST"]),
        Route(f"{base}/verify", verify, methods=["POST"]),
        *capability_routes(),
    ]


def capability_routes() -> list[Route]:
    """The harness's routes under the session's capability URL (the module docstring)."""
    base = CAPABILITY_ROOT
    return [
        Route(base, get_sandbox, methods=["GET"]),
        Route(f"{base}/exec", exec_command, methods=["POST"]),
        Route(f"{base}/files", read_file, methods=["GET"]),
        Route(f"{base}/files", write_file, methods=["PUT"]),
    ]
