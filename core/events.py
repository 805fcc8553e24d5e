"""The vocabulary of events: one typed definition per kind, and the registry of them all.

Every event the gateway publishes on its live feed (`core.telemetry`) or writes to a session's
trajectory (the store's ``events`` rows, read back by ``GET /api/sessions/{id}``, exports and trainers)
is one of the classes below: a frozen dataclass whose class attribute `Payload.kind` is the kind on the
wire and whose fields are the keys of its ``data``. A publisher builds one (``mypy --strict`` then
catches a missing or misspelt field) and hands it to `Telemetry.publish` or to the store
(`store.EventRecord.of`); a reader of stored rows gets one back with `decode`. `REGISTRY` maps every
kind to its class: ``docs/reference/events.md`` is generated from it, the dashboard's labels are
checked against it, and publishing a kind it does not hold fails.

The wire format is the dict `Payload.data` returns: the fields in their declared order, each under its
name (or under ``metadata["key"]`` where the name is a Python keyword, as ``from``), and a field left
`ABSENT` not written at all (the keys some events carry only sometimes).

>>> e = WorkerColdStart(worker="worker-0", seconds=4.2)
>>> e.kind, e.data()
('worker_cold_start', {'worker': 'worker-0', 'seconds': 4.2})
>>> decode("prefix_reuse", {"reason": "extends turn 0", "reused_tokens": 12}) == PrefixReuse(
...     reason="extends turn 0", reused_tokens=12)
True
>>> WorkerState("w0", "ready", "dead", "exited", "http://x", 12, True).data()["from"]
'ready'
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from core.errors import UnknownEvent


class Absent(enum.Enum):
    """The type of `ABSENT`."""

    ABSENT = "absent"


ABSENT = Absent.ABSENT
"""A field's value when its key is left out of the event's data."""


def _key(name: str) -> Any:
    """A field stored under another key than its name (a Python keyword, as ``from``)."""
    return field(metadata={"key": name})


_LAYOUTS: dict[type[Payload], tuple[tuple[str, str], ...]] = {}


def _layout(cls: type[Payload]) -> tuple[tuple[str, str], ...]:
    """(attribute, key) of each field of `cls`, in order; worked out once per class."""
    layout = _LAYOUTS.get(cls)
    if layout is None:
        layout = _LAYOUTS[cls] = tuple((f.name, f.metadata.get("key", f.name)) for f in fields(cls))
    return layout


@dataclass(frozen=True, slots=True)
class Payload:
    """The base of every event: its `kind` and the `data` it is written as."""

    kind: ClassVar[str] = ""
    topic: ClassVar[str] = ""
    """Who publishes it (a heading of the reference page)."""

    def data(self) -> dict[str, Any]:
        """The event's data as written: the fields in order, `ABSENT` ones left out."""
        out: dict[str, Any] = {}
        for attr, key in _layout(type(self)):
            value = getattr(self, attr)
            if value is not ABSENT:
                out[key] = value
        return out


def decode(kind: str, data: dict[str, Any]) -> Payload:
    """The typed event of a kind and its data (a stored row, a feed event's JSON); raises
    `core.errors.UnknownEvent` for a kind `REGISTRY` does not hold or data that does not fit its fields."""
    cls = REGISTRY.get(kind)
    if cls is None:
        raise UnknownEvent(f"no event kind {kind!r} in core.events.REGISTRY")
    layout = _layout(cls)
    attrs = {key: attr for attr, key in layout}
    unknown = [k for k in data if k not in attrs]
    if unknown:
        raise UnknownEvent(f"a {kind} event has no field {', '.join(map(repr, unknown))}")
    try:
        return cls(**{attrs[k]: v for k, v in data.items()})
    except TypeError as e:
        raise UnknownEvent(f"a {kind} event's data does not fit its fields: {e}") from e


# --- the engine pool --------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerState(Payload):
    """A worker changed state (``engine_pool.states``)."""

    kind: ClassVar[str] = "worker_state"
    topic: ClassVar[str] = "engine pool"
    worker: str
    """The worker's name."""
    from_: str = _key("from")
    """The state it left (key ``from``)."""
    to: str = _key("to")
    """The state it entered."""
    why: str = _key("why")
    """Why, in words."""
    url: str = _key("url")
    """Its engine's base URL."""
    pid: int | None = _key("pid")
    """Its process id (None: not launched by this gateway)."""
    launched: bool = _key("launched")
    """Whether this gateway launched its process."""


@dataclass(frozen=True, slots=True)
class WorkerColdStart(Payload):
    """A launched worker answered its first healthy probe."""

    kind: ClassVar[str] = "worker_cold_start"
    topic: ClassVar[str] = "engine pool"
    worker: str
    """The worker's name."""
    seconds: float
    """From its launch to its first healthy probe."""


@dataclass(frozen=True, slots=True)
class ShadowPromoted(Payload):
    """A warm shadow worker was promoted to active in place of a lost one."""

    kind: ClassVar[str] = "shadow_promoted"
    topic: ClassVar[str] = "engine pool"
    worker: str
    """The promoted worker."""


@dataclass(frozen=True, slots=True)
class ReplacementStarted(Payload):
    """A replacement worker was launched after a failure."""

    kind: ClassVar[str] = "replacement_started"
    topic: ClassVar[str] = "engine pool"
    worker: str
    """The new worker's name."""


@dataclass(frozen=True, slots=True)
class WorkerWeights(Payload):
    """A worker now holds a weight version."""

    kind: ClassVar[str] = "worker_weights"
    topic: ClassVar[str] = "engine pool"
    worker: str
    """The worker's name."""
    version: str
    """The weight version it holds."""
    source: str
    """Where it loaded them from: ``disk``, ``owner`` (the shared weight owner) or ``restored``."""


@dataclass(frozen=True, slots=True)
class SessionMoved(Payload):
    """A session left its worker for load (the ``group`` routing policy's spill); names its session."""

    kind: ClassVar[str] = "session_moved"
    topic: ClassVar[str] = "engine pool"
    from_worker: str
    """The worker it left."""
    to_worker: str
    """The worker it goes to."""
    group: str | None
    """Its routing group (None: none)."""
    from_outstanding_tokens: int
    """Tokens outstanding on the worker it left."""
    to_outstanding_tokens: int
    """Tokens outstanding on the worker it goes to."""
    from_outstanding: int
    """Requests outstanding on the worker it left."""
    to_outstanding: int
    """Requests outstanding on the worker it goes to."""
    why: str
    """Why it moved: ``load``."""


@dataclass(frozen=True, slots=True)
class WeightOwner(Payload):
    """The shared weight owner process changed (``engine_pool.weights.keeper``)."""

    kind: ClassVar[str] = "weight_owner"
    topic: ClassVar[str] = "engine pool"
    state: str
    """``ready``, ``down``, ``restarted``, ``updated``, ``update_failed`` or ``remapped``."""
    seconds: float | Absent | None = ABSENT
    """Its start or load time (ready, restarted, updated)."""
    version: str | Absent | None = ABSENT
    """The weight version it holds or was loading (all but down)."""
    why: str | Absent = ABSENT
    """What went wrong (down, update_failed)."""
    workers: int | Absent = ABSENT
    """Workers mapped onto it again (remapped)."""
    failed: list[str] | Absent = ABSENT
    """Workers that could not be mapped again (remapped)."""


# --- turns ------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TurnStarted(Payload):
    """A turn (one LLM call) began; live feed only."""

    kind: ClassVar[str] = "turn_started"
    topic: ClassVar[str] = "turns"
    index: int
    """The turn's index in its session."""
    branch: int
    """Its branch."""
    prompt_tokens: int
    """Its prompt's length in tokens."""
    reused_tokens: int
    """Prompt tokens reused from an earlier turn."""


@dataclass(frozen=True, slots=True)
class TurnFinished(Payload):
    """A turn ended, however it ended; live feed only (the metrics count turns and tokens from it)."""

    kind: ClassVar[str] = "turn_finished"
    topic: ClassVar[str] = "turns"
    index: int
    """The turn's index in its session."""
    status: str
    """How it ended: ``complete``, ``error``, ``aborted``..."""
    prompt_tokens: int
    """Its prompt's length in tokens."""
    reused_tokens: int
    """Prompt tokens reused from an earlier turn."""
    output_tokens: int
    """Tokens generated."""
    worker: str | None
    """The worker that finished it."""
    ttft_ms: float | None
    """Time to its first token (None: it had none)."""
    total_ms: float | None
    """Its duration, end to end."""
    finish_reason: str | None
    """The engine's finish reason."""
    failovers: int
    """Failovers during the turn."""


@dataclass(frozen=True, slots=True)
class TurnFailed(Payload):
    """A turn ended without its output complete."""

    kind: ClassVar[str] = "turn_failed"
    topic: ClassVar[str] = "turns"
    status: str
    """The turn's status."""
    error: str
    """Why, in words."""


@dataclass(frozen=True, slots=True)
class PromptPlan(Payload):
    """How a turn's prompt was built (the base of the three kinds below)."""

    reason: str
    """The prompt planner's reason, in words."""
    reused_tokens: int
    """Prompt tokens reused from the parent turn."""
    parent_turn: int | Absent = ABSENT
    """The index of the turn it extends (absent: none)."""


@dataclass(frozen=True, slots=True)
class PrefixReuse(PromptPlan):
    """A turn's prompt extends an earlier turn of its branch (its first event, in the turn's write)."""

    kind: ClassVar[str] = "prefix_reuse"
    topic: ClassVar[str] = "turns"


@dataclass(frozen=True, slots=True)
class FreshPrompt(PromptPlan):
    """A turn's prompt reuses no earlier turn."""

    kind: ClassVar[str] = "fresh_prompt"
    topic: ClassVar[str] = "turns"


@dataclass(frozen=True, slots=True)
class Branch(PromptPlan):
    """A turn opened a new branch (its history was rewritten)."""

    kind: ClassVar[str] = "branch"
    topic: ClassVar[str] = "turns"


@dataclass(frozen=True, slots=True)
class Resumed(Payload):
    """A turn lost its worker mid-stream (the base of the two kinds below; ``gateway.turns.failover``)."""

    token_index: int
    """Tokens the turn had when it was lost (kept and resubmitted)."""
    from_worker: str
    """The worker lost."""
    error: str
    """What the loss looked like."""
    cause: str
    """``dead``, ``stall``, ``error`` or ``weights``."""
    to_worker: str | None
    """The worker it resumed on (None: not resumed)."""
    detect_ms: float
    """From its last token to noticing the loss."""
    lost_ms: float
    """From its last token to the next worker's first."""
    sampling: str
    """What the continuation is: ``greedy``, ``keyed`` or ``sampled``."""
    noticed_at: float
    """When the loss was noticed (``CLOCK_MONOTONIC``)."""
    resubmitted_at: float | None
    """When the resubmission was sent (``CLOCK_MONOTONIC``)."""
    resumed_at: float | None
    """When the new worker's first token arrived (``CLOCK_MONOTONIC``; None: not resumed)."""
    from_version: str | None
    """The weight version of the tokens before the loss."""
    to_version: str | None
    """The weight version it resumed on."""


@dataclass(frozen=True, slots=True)
class Failover(Resumed):
    """A turn's worker was lost mid-stream and the turn resumed on another (or could not)."""

    kind: ClassVar[str] = "failover"
    topic: ClassVar[str] = "turns"


@dataclass(frozen=True, slots=True)
class WeightSwitch(Resumed):
    """A weight update cut a turn, which resumed on the new weights."""

    kind: ClassVar[str] = "weight_switch"
    topic: ClassVar[str] = "turns"


@dataclass(frozen=True, slots=True)
class QueryOfDeath(Payload):
    """A request was convicted of crashing the workers it ran on (``gateway.turns.quarantine``)."""

    kind: ClassVar[str] = "query_of_death"
    topic: ClassVar[str] = "turns"
    fingerprint: str
    """The request's fingerprint (prompt and sampling)."""
    prompt_hash: str
    """A hash of its prompt ids."""
    prompt_tokens: int
    """Its prompt's length."""
    sampling: dict[str, Any]
    """Its sampling parameters."""
    session: str | None
    """Its session."""
    workers_killed: list[str]
    """The workers it crashed."""
    deaths: int
    """Worker deaths it was in flight at."""


@dataclass(frozen=True, slots=True)
class QueryOfDeathRefused(Payload):
    """A request was refused at once: the same one was convicted as a query of death."""

    kind: ClassVar[str] = "query_of_death_refused"
    topic: ClassVar[str] = "turns"
    fingerprint: str
    """The request's fingerprint."""
    error: str
    """The refusal."""


@dataclass(frozen=True, slots=True)
class ToolCallParseError(Payload):
    """The model's output held a tool call the parser could not read."""

    kind: ClassVar[str] = "tool_call_parse_error"
    topic: ClassVar[str] = "turns"
    raw: str
    """The text it could not parse."""
    reason: str
    """Why."""


@dataclass(frozen=True, slots=True)
class RecomputeResumed(Payload):
    """A logprob recomputation left pending by a previous gateway was scheduled again."""

    kind: ClassVar[str] = "recompute_resumed"
    topic: ClassVar[str] = "turns"
    spans: list[tuple[int, int]]
    """The prompt spans (start, end) to recompute."""


@dataclass(frozen=True, slots=True)
class RecomputeFailed(Payload):
    """A logprob recomputation failed."""

    kind: ClassVar[str] = "recompute_failed"
    topic: ClassVar[str] = "turns"
    spans: list[tuple[int, int]]
    """The prompt spans (start, end) it was for."""
    error: str
    """Why."""


@dataclass(frozen=True, slots=True)
class RecomputedLogprobs(Payload):
    """Prompt logprobs recomputed for tokens whose own were lost (a failover's resubmission)."""

    kind: ClassVar[str] = "recomputed_logprobs"
    topic: ClassVar[str] = "turns"
    runs: list[list[Any]]
    """``[start, [logprob, ...]]`` per span."""
    worker: str
    """The worker that computed them."""
    tokens: int
    """Tokens recomputed."""


@dataclass(frozen=True, slots=True)
class AuxiliaryCall(Payload):
    """A harness's side call passed through to a provider (``gateway.turns.auxiliary``)."""

    kind: ClassVar[str] = "auxiliary_call"
    topic: ClassVar[str] = "turns"
    model: str | None
    """The model the harness asked for."""
    provider_model: str | None
    """The model sent to the provider."""
    url: str
    """The provider's URL."""
    status: int
    """Its HTTP status."""
    ms: float
    """Its duration."""


# --- the gateway ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Export(Payload):
    """Trajectories were exported (``GET``/``POST /api/export``)."""

    kind: ClassVar[str] = "export"
    topic: ClassVar[str] = "gateway"
    format: str
    """The export format."""
    rows: int
    """Rows written."""
    sessions_matched: int
    """Sessions the query matched."""
    marked: bool
    """Whether the sessions were marked exported (``POST``)."""


@dataclass(frozen=True, slots=True)
class Sample(Payload):
    """The dashboard recorder's figures over its last interval (``gateway.observe.recorder``)."""

    kind: ClassVar[str] = "sample"
    topic: ClassVar[str] = "gateway"
    tokens_per_s: float
    """Tokens generated per second."""
    turns_per_s: float
    """Turns finished per second."""
    ttft_ms: float | None
    """Mean time to first token (None: no turn)."""
    checkpoint_ms: float
    """Time spent checkpointing."""


@dataclass(frozen=True, slots=True)
class WeightsUpdated(Payload):
    """A weight update (``POST /api/weights``) went through; in the weight log (``__belayer_weights``).
    It is also what the pool's ``WeightUpdater.update`` returns."""

    kind: ClassVar[str] = "weights_updated"
    topic: ClassVar[str] = "gateway"
    version: str
    """The new version."""
    previous: str
    """The version served before."""
    path: str
    """Where the weights were loaded from."""
    updated: list[str]
    """Workers that loaded them (now on `version`)."""
    stale: list[str]
    """Workers that missed them (unreachable, starting, or a failed load): brought up to date later."""
    preempted: int
    """Requests cut when the drain time ran out (resubmitted on the new version)."""
    drain_s: float
    """How long it waited for the requests in flight to finish (at most the drain it was given; to 1 ms)."""
    seconds: float
    """Its duration (to 1 ms)."""
    owner: str | None
    """The weight owner: ``following`` (an owner for these weights is being started in the background,
    made current once ready: ``weight_owner`` events say how it went) or ``in_place`` (a GPU weight
    cache: its mappers wrote the update into its memory); None: the pool has none."""


@dataclass(frozen=True, slots=True)
class WeightsUpdateFailed(Payload):
    """A weight update failed; in the weight log (``__belayer_weights``)."""

    kind: ClassVar[str] = "weights_update_failed"
    topic: ClassVar[str] = "gateway"
    version: str
    """The version asked for."""
    path: str
    """Where its weights were."""
    previous: str
    """The version still served."""
    error: str
    """Why."""


# --- the trajectory store ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SessionChanged(Payload):
    """A session's state (the base of the two kinds below; live feed only)."""

    status: str
    """``open`` or ``closed``."""
    reward: float | None
    """Its reward."""
    metadata: dict[str, Any]
    """Its metadata."""


@dataclass(frozen=True, slots=True)
class SessionCreated(SessionChanged):
    """A session was created (or a fork child)."""

    kind: ClassVar[str] = "session_created"
    topic: ClassVar[str] = "store"


@dataclass(frozen=True, slots=True)
class SessionUpdated(SessionChanged):
    """A session's metadata, status or reward changed."""

    kind: ClassVar[str] = "session_updated"
    topic: ClassVar[str] = "store"


@dataclass(frozen=True, slots=True)
class SessionDeleted(Payload):
    """A session was deleted; live feed only."""

    kind: ClassVar[str] = "session_deleted"
    topic: ClassVar[str] = "store"
    turns: int
    """Turns deleted with it."""
    events: int
    """Events deleted with it."""


@dataclass(frozen=True, slots=True)
class SessionClosed(Payload):
    """A session was closed."""

    kind: ClassVar[str] = "session_closed"
    topic: ClassVar[str] = "store"
    reward: float | None
    """Its reward."""
    closed_at: float | None
    """When (unix time)."""


@dataclass(frozen=True, slots=True)
class SessionForked(Payload):
    """A session was forked from another (the child's first event)."""

    kind: ClassVar[str] = "session_forked"
    topic: ClassVar[str] = "store"
    parent_session: str
    """The session it was forked from."""
    fork_turn: int
    """The parent's turn index it was forked at."""
    fork_turn_id: int
    """That turn's id."""


@dataclass(frozen=True, slots=True)
class TurnsDiscarded(Payload):
    """Turns were rolled back (an environment restore)."""

    kind: ClassVar[str] = "turns_discarded"
    topic: ClassVar[str] = "store"
    after_turn: int | None
    """The turn kept last (None: the turns were named)."""
    turn_indices: list[int]
    """The turns discarded."""
    reason: str
    """Why."""


@dataclass(frozen=True, slots=True)
class TurnsInterrupted(Payload):
    """Running turns of a gone gateway (a dead replica) were marked interrupted."""

    kind: ClassVar[str] = "turns_interrupted"
    topic: ClassVar[str] = "store"
    turn_indices: list[int]
    """The turns interrupted."""
    output_tokens: list[int]
    """The tokens each had."""
    reason: str
    """Why: ``gateway_gone``."""


@dataclass(frozen=True, slots=True)
class FeedAdvanced(Payload):
    """Another replica wrote to the shared store (PostgreSQL): readers look again; live feed only."""

    kind: ClassVar[str] = "feed_advanced"
    topic: ClassVar[str] = "store"
    by: str
    """Who: ``replica``."""


# --- sandboxes --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SandboxCreated(Payload):
    """A session's sandbox started."""

    kind: ClassVar[str] = "sandbox_created"
    topic: ClassVar[str] = "sandbox"
    sandbox_id: str | None
    """The sandbox."""
    image: str
    """Its image."""
    network: str
    """Its network mode."""
    address: str | None
    """Its address, where it has one (a cluster node's)."""
    spec: dict[str, Any]
    """Its `SandboxSpec` (a restarted gateway rebuilds the slot from it)."""
    harness_inside: bool
    """Whether the harness runs inside it."""
    recovery: str
    """Its recovery mode."""


@dataclass(frozen=True, slots=True)
class SandboxForked(Payload):
    """A fork child's sandbox started, from its parent's checkpoint (or image) and replayed calls."""

    kind: ClassVar[str] = "sandbox_forked"
    topic: ClassVar[str] = "sandbox"
    sandbox_id: str | None
    """The child's sandbox."""
    parent_session: str
    """The parent session."""
    fork_turn: int
    """The turn it was forked at."""
    checkpoint_id: str | None
    """The checkpoint restored (None: the image)."""
    replayed: int
    """Journaled calls replayed on top."""
    address: str | None
    """Its address."""
    lineage: list[str]
    """Its ancestors' sessions."""
    spec: dict[str, Any]
    """Its `SandboxSpec`."""
    harness_inside: bool
    """Whether the harness runs inside it."""
    recovery: str
    """Its recovery mode."""


@dataclass(frozen=True, slots=True)
class SandboxDestroyed(Payload):
    """A session's sandbox was removed."""

    kind: ClassVar[str] = "sandbox_destroyed"
    topic: ClassVar[str] = "sandbox"
    sandbox_id: str | None
    """The sandbox."""
    stage: str | Absent = ABSENT
    """``verify`` (after the verify stage) or ``start-up`` (a leaked one); absent: a plain delete."""
    reason: str | Absent = ABSENT
    """Why (a leaked one)."""


@dataclass(frozen=True, slots=True)
class SandboxAdopted(Payload):
    """A restarted gateway took over a sandbox that was still running."""

    kind: ClassVar[str] = "sandbox_adopted"
    topic: ClassVar[str] = "sandbox"
    sandbox_id: str
    """The sandbox."""
    address: str | None
    """Its address."""
    checkpoints: int
    """Checkpoints it had."""
    journaled_calls: int
    """Journaled calls since the newest."""
    seconds: float
    """Time to check and adopt it."""


@dataclass(frozen=True, slots=True)
class SandboxFailed(Payload):
    """A sandbox found failed at a restart could not be recovered."""

    kind: ClassVar[str] = "sandbox_failed"
    topic: ClassVar[str] = "sandbox"
    reason: str | None
    """Why."""


@dataclass(frozen=True, slots=True)
class SandboxCheckpointDecision(Payload):
    """Whether to checkpoint in a turn's inference bubble (``sandbox.sessions.bubbles``)."""

    kind: ClassVar[str] = "sandbox_checkpoint_decision"
    topic: ClassVar[str] = "sandbox"
    action: str
    """``checkpoint``, ``defer``, ``busy``..."""
    predicted_bubble_s: float
    """The predicted length of the turn's bubble."""
    predicted_cost_s: float
    """The predicted cost of a checkpoint."""
    turns_since_checkpoint: int
    """Turns since the last one."""
    reason: str
    """Why, in words."""


@dataclass(frozen=True, slots=True)
class SandboxCheckpoint(Payload):
    """A sandbox checkpoint was taken (its whole record: a restarted gateway reads it back)."""

    kind: ClassVar[str] = "sandbox_checkpoint"
    topic: ClassVar[str] = "sandbox"
    id: str
    """The checkpoint."""
    session_id: str
    """Its session."""
    turn_index: int
    """The turn it was taken at."""
    in_bubble: bool
    """Whether it was taken inside an inference bubble."""
    keep_through: int
    """The last turn it is consistent with."""
    trigger: str
    """What asked for it."""
    seconds: float
    """Its duration."""
    fs_seconds: float
    """Of which the filesystem."""
    process_seconds: float
    """Of which the processes."""
    dump_bytes: int
    """Its process dump's size."""
    created_at: float
    """When (unix time)."""
    location: str
    """Where it is stored."""
    record: dict[str, Any]
    """The checkpoint store's record of it."""


@dataclass(frozen=True, slots=True)
class SandboxCheckpointSkipped(Payload):
    """A scheduled checkpoint was not taken."""

    kind: ClassVar[str] = "sandbox_checkpoint_skipped"
    topic: ClassVar[str] = "sandbox"
    reason: str
    """Why."""


@dataclass(frozen=True, slots=True)
class SandboxCheckpointFailed(Payload):
    """A checkpoint failed."""

    kind: ClassVar[str] = "sandbox_checkpoint_failed"
    topic: ClassVar[str] = "sandbox"
    error: str
    """Why."""


@dataclass(frozen=True, slots=True)
class SandboxCheckpointRefused(Payload):
    """A checkpoint was refused: the sandbox writes more than its disk quota."""

    kind: ClassVar[str] = "sandbox_checkpoint_refused"
    topic: ClassVar[str] = "sandbox"
    reason: str
    """``disk_quota``."""
    writable_bytes: int
    """What its writable layer holds."""
    disk_quota_bytes: int
    """The quota."""
    sandbox_id: str
    """The sandbox."""


@dataclass(frozen=True, slots=True)
class SandboxCall(Payload):
    """A journaled tool call (a restarted gateway rebuilds the journal from these)."""

    kind: ClassVar[str] = "sandbox_call"
    topic: ClassVar[str] = "sandbox"
    op: str
    """The operation."""
    args: dict[str, Any]
    """Its arguments."""
    turn: int
    """The turn it ran in."""
    exit_code: int | Absent = ABSENT
    """A command's exit code."""
    digest: str | Absent = ABSENT
    """A digest of a command's output."""


@dataclass(frozen=True, slots=True)
class SandboxFailure(Payload):
    """A sandbox failed (``sandbox.sessions.recovery``)."""

    kind: ClassVar[str] = "sandbox_failure"
    topic: ClassVar[str] = "sandbox"
    kind_: str = _key("kind")
    """What failed (key ``kind``)."""
    detail: str = _key("detail")
    """In words."""
    sandbox_id: str | None = _key("sandbox_id")
    """The sandbox."""
    after_replay: bool | Absent = ABSENT
    """Present (true): it failed again after a replay."""


@dataclass(frozen=True, slots=True)
class SandboxRestored(Payload):
    """A failed sandbox was brought back: restored and truncated, or replayed. It is also the sandbox
    manager's record of the restore (``SandboxManager.restore`` returns it, ``core.errors.SandboxRestored``
    carries it, ``GET .../sandbox`` shows it as ``last_restore``)."""

    kind: ClassVar[str] = "sandbox_restored"
    topic: ClassVar[str] = "sandbox"
    checkpoint_id: str
    """The checkpoint restored (empty: the image)."""
    turn_index: int
    """The checkpoint's turn (-1: the image)."""
    keep_through: int
    """The last turn kept: the harness resumes after it."""
    discarded_turns: list[int]
    """The turns discarded."""
    sandbox_id: str
    """The new sandbox."""
    seconds: float
    """The restore's duration (to 0.1 ms)."""
    reason: str
    """Why it was restored."""
    mode: str = "truncate"
    """``truncate`` or ``replay``."""
    replayed: int = 0
    """Journaled tool calls run again after the restore (replay mode)."""
    diverged: int = 0
    """Of those, how many gave another exit code or output than the first time."""
    standby: bool | Absent = ABSENT
    """Present (true): the checkpoint came from the session's standby sandbox, unfrozen, not from storage
    (``sandbox.sessions.standby``)."""


@dataclass(frozen=True, slots=True)
class SandboxStandby(Payload):
    """A standby sandbox (a checkpoint restored ahead of time and frozen: ``sandbox.sessions.standby``)
    was made, used by a recovery, or discarded."""

    kind: ClassVar[str] = "sandbox_standby"
    topic: ClassVar[str] = "sandbox"
    action: str
    """``made``, ``used``, ``discarded`` or ``failed`` (it could not be made)."""
    checkpoint_id: str
    """The checkpoint it holds."""
    sandbox_id: str | None
    """The standby sandbox (None: none was made)."""
    seconds: float
    """How long making it (made, failed) or unfreezing it (used) took; 0 for discarded."""
    reason: str | Absent = ABSENT
    """Why it was discarded, or why it failed."""


@dataclass(frozen=True, slots=True)
class SandboxRestoreFailed(Payload):
    """A restore failed."""

    kind: ClassVar[str] = "sandbox_restore_failed"
    topic: ClassVar[str] = "sandbox"
    checkpoint_id: str | None
    """The checkpoint it tried (None: the image)."""
    reason: str
    """Why it restored."""
    error: str
    """Why it failed."""


@dataclass(frozen=True, slots=True)
class AgentProcessesLeft(Payload):
    """The agent left processes running at the verify stage's copy."""

    kind: ClassVar[str] = "agent_processes_left"
    topic: ClassVar[str] = "sandbox"
    count: int
    """How many."""
    commands: list[str]
    """Their commands (the first 20)."""


@dataclass(frozen=True, slots=True)
class OutsideWorkspaceModified(Payload):
    """The agent changed files outside its working directory (the verify stage does not see them)."""

    kind: ClassVar[str] = "outside_workspace_modified"
    topic: ClassVar[str] = "sandbox"
    count: int
    """How many."""
    paths: list[str]
    """``<change> <path>`` (the first 50)."""


@dataclass(frozen=True, slots=True)
class WorkspaceTooLarge(Payload):
    """The working directory was over the copy limit: the verify stage fails it."""

    kind: ClassVar[str] = "workspace_too_large"
    topic: ClassVar[str] = "sandbox"
    workspace_bytes: int
    """Its size (so far)."""
    max_workspace_bytes: int
    """The limit."""
    workdir: str
    """The directory."""


@dataclass(frozen=True, slots=True)
class ProtectedPathModified(Payload):
    """The agent changed a path the task protects."""

    kind: ClassVar[str] = "protected_path_modified"
    topic: ClassVar[str] = "sandbox"
    path: str
    """The path."""
    change: str
    """``modified``, ``added`` or ``deleted``."""
    diff_lines: int
    """Lines added plus removed (-1: not counted)."""
    bytes_before: int
    """Its size before."""
    bytes_after: int
    """Its size after."""
    action: str
    """What the verify stage does: ``none``, ``reset`` or ``fail``."""


EVENTS: tuple[type[Payload], ...] = (
    WorkerState, WorkerColdStart, ShadowPromoted, ReplacementStarted, WorkerWeights, SessionMoved,
    WeightOwner,
    TurnStarted, TurnFinished, TurnFailed, PrefixReuse, FreshPrompt, Branch, Failover, WeightSwitch,
    QueryOfDeath, QueryOfDeathRefused, ToolCallParseError, RecomputeResumed, RecomputeFailed,
    RecomputedLogprobs, AuxiliaryCall,
    Export, Sample, WeightsUpdated, WeightsUpdateFailed,
    SessionCreated, SessionUpdated, SessionDeleted, SessionClosed, SessionForked, TurnsDiscarded,
    TurnsInterrupted, FeedAdvanced,
    SandboxCreated, SandboxForked, SandboxDestroyed, SandboxAdopted, SandboxFailed,
    SandboxCheckpointDecision, SandboxCheckpoint, SandboxCheckpointSkipped, SandboxCheckpointFailed,
    SandboxCheckpointRefused, SandboxCall, SandboxFailure, SandboxRestored, SandboxStandby, SandboxRestoreFailed,
    AgentProcessesLeft, OutsideWorkspaceModified, WorkspaceTooLarge, ProtectedPathModified,
)  # fmt: skip
"""Every kind, in the reference page's order."""

REGISTRY: dict[str, type[Payload]] = {cls.kind: cls for cls in EVENTS}
"""Kind -> its class."""
