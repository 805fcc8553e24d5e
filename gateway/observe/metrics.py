"""Prometheus metrics (``GET /metrics``), through prometheus-client, on the gateway's own registry.

Most metrics are counted from the live feed (`core.telemetry`): each event that a layer publishes
(a worker's state change, a failover, a checkpoint, a restore, a finished turn) moves its counters
and histograms, so a metric and the event it counts cannot disagree. `GatewayMetrics.on_event`
dispatches on the event's type (`core.events`), so a renamed field is a type error, not a zero. Two things are observed directly,
because they happen per token or per request and are not worth an event each: the inter-token gaps
of a turn (`observe_gaps`) and the gateway's own added time per request (`RequestClock`, set by the
request middleware and charged by the turn runner). States (workers, sandboxes, open sessions, the
store's size) are read when Prometheus scrapes; so is the prefix-cache hit rate, computed from the
workers' own counters (``gateway.api.engine_metrics.prefix_cache_hit_rate``).

Every name starts with ``belayer_``; no label holds a session id or any other unbounded value. The
catalogue is `GatewayMetrics` below; ``deploy/observability/`` holds a scrape configuration and a
Grafana dashboard built on it.

Example::

    metrics = GatewayMetrics(telemetry, pool, store, lambda: [], version="0.1.0")
    text = metrics.render()          # what GET /metrics answers
"""

from __future__ import annotations

import contextvars
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from core import events as ev
from core.telemetry import Event, Telemetry
from engine_pool.face import Engines
from engine_pool.states import DEAD, DRAINING, READY, SHADOW, STARTING, UNHEALTHY
from gateway.http.errors import is_anthropic_path
from store import SessionQuery, TrajectoryStore

WORKER_STATES = (STARTING, READY, SHADOW, UNHEALTHY, DRAINING, DEAD)
SANDBOX_STATES = ("running", "restoring", "failed")
# Latency buckets (seconds): from sub-millisecond gateway work to multi-minute agent turns.
FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
SLOW = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass(slots=True)
class RequestClock:
    """One request's time inside the engines, charged by the turn runner (see `REQUEST_CLOCK`)."""

    engine_seconds: float = 0.0
    engine_calls: int = 0

    def charge(self, seconds: float) -> None:
        self.engine_seconds += seconds
        self.engine_calls += 1


REQUEST_CLOCK: contextvars.ContextVar[RequestClock | None] = contextvars.ContextVar(
    "belayer_request_clock", default=None
)
"""Set by the request middleware for each HTTP request; the turn runner (in the same context, even
while a streamed body is produced) charges its engine time to it."""


class _States(Collector):
    """What is read at scrape time: workers, sandboxes, open sessions, the store's size."""

    def __init__(
        self,
        pool: Engines,
        store: TrajectoryStore,
        sandboxes: Callable[[], list[dict[str, Any]]],
        nodes: Callable[[], list[dict[str, Any]]] = list,
    ) -> None:
        self.pool, self.store, self.sandboxes, self.nodes = pool, store, sandboxes, nodes

    def collect(self) -> Iterator[Metric]:
        pool = self.pool.view()
        workers = GaugeMetricFamily("belayer_workers", "Engine workers by state.", labels=["state"])
        for state in WORKER_STATES:
            workers.add_metric([state], len(pool.in_state(state)))
        yield workers
        boxes = GaugeMetricFamily("belayer_sandboxes", "Session sandboxes by state.", labels=["state"])
        views = self.sandboxes()
        for state in SANDBOX_STATES:
            boxes.add_metric([state], sum(1 for v in views if v["state"] == state))
        yield boxes
        nodes = self.nodes()
        if nodes:  # sandboxes on a Ray cluster (sandbox.cluster)
            per_node = GaugeMetricFamily(
                "belayer_sandbox_node_sandboxes", "Sandboxes on each sandbox node, and the node's state.",
                labels=["node", "state"],
            )  # fmt: skip
            for node in nodes:
                per_node.add_metric([node["node"], node["state"]], node["sandboxes"])
            yield per_node
            yield GaugeMetricFamily(
                "belayer_sandbox_node_slots_free", "Free sandbox slots on the nodes alive.",
                value=sum(n["slots"] - n["sandboxes"] for n in nodes if n["state"] == "alive"),
            )  # fmt: skip
        _, open_sessions = self.store.query_sessions(SessionQuery(status="open", limit=0))
        yield GaugeMetricFamily("belayer_sessions_open", "Sessions open (not closed).", value=open_sessions)
        yield GaugeMetricFamily(
            "belayer_store_size_bytes", "The trajectory store's size on disk.", value=self.store.size_bytes()
        )
        yield CounterMetricFamily(
            "belayer_store_failures", "Store operations that failed (disk full, read-only, ...).",
            value=self.store.failures,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "belayer_affinity_sessions", "Sessions whose last worker the pool remembers.",
            value=pool.remembered_sessions,
        )  # fmt: skip
        version = GaugeMetricFamily(
            "belayer_weight_version_info", "The policy weight version the pool serves (one series: the current one).",
            labels=["version"],
        )  # fmt: skip
        version.add_metric([pool.weight_version], 1)
        yield version
        live = [m for m in pool.members if m.state not in (DEAD, DRAINING)]
        yield GaugeMetricFamily(
            "belayer_workers_stale_weights", "Live workers not on the served weight version (not routed to).",
            value=sum(1 for m in live if m.weight_version != pool.weight_version),
        )  # fmt: skip


class GatewayMetrics:
    """The gateway's metrics (module docstring); `render` is the exposition."""

    def __init__(
        self,
        telemetry: Telemetry,
        pool: Engines,
        store: TrajectoryStore,
        sandboxes: Callable[[], list[dict[str, Any]]],
        version: str,
        nodes: Callable[[], list[dict[str, Any]]] = list,
    ) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "belayer_http_requests", "HTTP requests by protocol, route template, method and status.",
            ["protocol", "route", "method", "status"], registry=r,
        )  # fmt: skip
        self.request_seconds = Histogram(
            "belayer_http_request_duration_seconds", "HTTP request duration, to the last byte.",
            ["protocol", "route"], buckets=SLOW, registry=r,
        )  # fmt: skip
        self.added = Histogram(
            "belayer_gateway_added_seconds",
            "The gateway's own time per model request: its duration minus the time inside engines.",
            ["protocol"], buckets=FAST, registry=r,
        )  # fmt: skip
        self.ttft = Histogram(
            "belayer_time_to_first_token_seconds", "Time to a turn's first token.", buckets=SLOW, registry=r
        )
        self.itl = Histogram(
            "belayer_inter_token_latency_seconds", "Time between a turn's tokens.", buckets=TOKEN, registry=r
        )
        self.turn_seconds = Histogram(
            "belayer_turn_duration_seconds", "A turn's duration, end to end.", buckets=SLOW, registry=r
        )
        self.tokens = Counter(
            "belayer_tokens", "Tokens by kind: prompt (all), reused (prefix reused from the session), generated.",
            ["kind"], registry=r,
        )  # fmt: skip
        self.turns = Counter("belayer_turns", "Turns by outcome.", ["outcome"], registry=r)
        self.loop_lag = Histogram(
            "belayer_event_loop_lag_seconds",
            "How late the event loop woke a sampler that sleeps 0.1 s (`gateway.observe.loop_lag`): every "
            "stream of this process waits that long too.",
            buckets=FAST, registry=r,
        )  # fmt: skip
        self.store_write = Histogram(
            "belayer_store_write_seconds",
            "A turn's write, from its request to its commit (a worker thread's queue included): begin "
            "(before the engine is called) and finish (before the client is answered).",
            ["op"], buckets=FAST, registry=r,
        )  # fmt: skip
        self.prompts = Counter(
            "belayer_prompts", "Turn prompts by how they were built: prefix_reuse, fresh_prompt, branch.",
            ["kind"], registry=r,
        )  # fmt: skip
        self.transitions = Counter(
            "belayer_worker_transitions", "Worker state changes.", ["from_state", "to_state"], registry=r
        )
        self.failovers = Counter(
            "belayer_failovers", "Mid-stream failovers by cause: dead, stall, error.", ["cause"], registry=r
        )
        self.failover_detect = Histogram(
            "belayer_failover_detection_seconds", "From a lost worker's last token to noticing the loss.",
            ["cause"], buckets=SLOW, registry=r,
        )  # fmt: skip
        self.failover_lost = Histogram(
            "belayer_failover_lost_seconds", "From a lost worker's last token to the next worker's first.",
            ["cause"], buckets=SLOW, registry=r,
        )  # fmt: skip
        self.failover_tokens = Counter(
            "belayer_failover_resumed_tokens", "Tokens kept and resubmitted by failovers.", registry=r
        )
        self.promotions = Counter("belayer_shadow_promotions", "Shadows promoted to active.", registry=r)
        self.replacements = Counter(
            "belayer_worker_replacements", "Replacement workers launched after a failure.", registry=r
        )
        self.cold_start = Histogram(
            "belayer_worker_cold_start_seconds", "A launched worker's start, to its first healthy probe.",
            buckets=SLOW, registry=r,
        )  # fmt: skip
        self.checkpoints = Counter(
            "belayer_checkpoints", "Sandbox checkpoints by result: taken, deferred, skipped, failed.",
            ["result"], registry=r,
        )  # fmt: skip
        self.in_bubble = Counter(
            "belayer_checkpoints_in_bubble", "Checkpoints taken inside an inference bubble.", registry=r
        )
        self.checkpoint_seconds = Histogram(
            "belayer_checkpoint_duration_seconds", "A checkpoint's duration (filesystem and processes).",
            buckets=SLOW, registry=r,
        )  # fmt: skip
        self.restores = Counter("belayer_restores", "Sandbox restores by mode.", ["mode"], registry=r)
        self.node_loss_restores = Counter(
            "belayer_node_loss_restores", "Sandbox restores after their cluster node was lost.", registry=r
        )
        self.restore_seconds = Histogram(
            "belayer_restore_duration_seconds", "A restore's duration.", ["mode"], buckets=SLOW, registry=r
        )
        self.replayed = Counter(
            "belayer_tool_calls_replayed", "Tool calls run again after a replay restore.", registry=r
        )
        self.discarded = Counter("belayer_turns_discarded", "Turns discarded by restores.", registry=r)
        self.interrupted = Counter(
            "belayer_turns_interrupted",
            "Running turns of a gone gateway (a dead replica) marked interrupted by this one.",
            registry=r,
        )
        self.recomputations = Counter(
            "belayer_logprob_recomputations", "Logprob recomputations by result.", ["result"], registry=r
        )
        self.exports = Counter("belayer_exports", "Trajectory exports by format.", ["format"], registry=r)
        self.weight_updates = Counter(
            "belayer_weight_updates", "Weight updates (POST /api/weights) by result: ok, failed.", ["result"],
            registry=r,
        )  # fmt: skip
        self.sessions_moved = Counter(
            "belayer_sessions_moved",
            "Sessions moved off their worker for its load (the group routing policy's spill).",
            registry=r,
        )
        self.weight_switches = Counter(
            "belayer_weight_switches",
            "Turns cut by a weight update and resumed on the new weights.",
            registry=r,
        )
        self.queries_of_death = Counter(
            "belayer_queries_of_death",
            "Requests convicted of crashing the workers they ran on (gateway.turns.quarantine): not retried.",
            registry=r,
        )
        self.query_of_death_refusals = Counter(
            "belayer_query_of_death_refusals",
            "Requests refused at once because the same request was convicted as a query of death.",
            registry=r,
        )
        self.queries_of_death_remembered = Gauge(
            "belayer_queries_of_death_remembered",
            "Convicted request fingerprints refused at once now (`--quarantine-remember`).",
            registry=r,
        )
        Gauge("belayer_build_info", "The gateway's version.", ["version"], registry=r).labels(version).set(1)
        Gauge("belayer_start_time_seconds", "When the gateway started (unix time).", registry=r).set(
            telemetry.started_at
        )
        r.register(_States(pool, store, sandboxes, nodes))
        telemetry.listen(self.on_event)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def on_event(self, event: Event) -> None:
        """Count one event of the feed, by its type (`core.events`); the kinds not counted pass."""
        match event.typed:
            case ev.TurnFinished() as e:
                self._turn_finished(e)
            case ev.PromptPlan() as e:
                self.prompts.labels(e.kind).inc()
            case ev.Failover() as e:
                self._failover(e)
            case ev.WorkerState() as e:
                self.transitions.labels(e.from_, e.to).inc()
            case ev.ShadowPromoted():
                self.promotions.inc()
            case ev.ReplacementStarted():
                self.replacements.inc()
            case ev.WorkerColdStart() as e:
                self.cold_start.observe(e.seconds)
            case ev.SandboxCheckpoint() as e:
                self._checkpoint(e)
            case ev.SandboxCheckpointDecision() as e:
                if e.action in ("defer", "busy"):
                    self.checkpoints.labels("deferred").inc()
            case ev.SandboxCheckpointSkipped():
                self.checkpoints.labels("skipped").inc()
            case ev.SandboxCheckpointFailed():
                self.checkpoints.labels("failed").inc()
            case ev.SandboxRestored() as e:
                self._restored(e)
            case ev.TurnsDiscarded() as e:
                self.discarded.inc(len(e.turn_indices))
            case ev.TurnsInterrupted() as e:
                self.interrupted.inc(len(e.turn_indices))
            case ev.RecomputedLogprobs():
                self.recomputations.labels("ok").inc()
            case ev.RecomputeFailed():
                self.recomputations.labels("failed").inc()
            case ev.Export() as e:
                self.exports.labels(e.format).inc()
            case ev.WeightsUpdated():
                self.weight_updates.labels("ok").inc()
            case ev.WeightsUpdateFailed():
                self.weight_updates.labels("failed").inc()
            case ev.WeightSwitch():
                self.weight_switches.inc()
            case ev.SessionMoved():
                self.sessions_moved.inc()
            case ev.QueryOfDeath():
                self.queries_of_death.inc()
            case ev.QueryOfDeathRefused():
                self.query_of_death_refusals.inc()

    def observe_gaps(self, gaps: list[float]) -> None:
        """A turn's inter-token gaps (a chunk of n tokens after t seconds counts n gaps of t/n)."""
        for gap in gaps:
            self.itl.observe(gap)

    def observe_request(
        self, protocol: str, route: str, method: str, status: int, seconds: float, clock: RequestClock
    ) -> None:
        self.requests.labels(protocol, route, method, str(status)).inc()
        self.request_seconds.labels(protocol, route).observe(seconds)
        if clock.engine_calls:
            self.added.labels(protocol).observe(max(0.0, seconds - clock.engine_seconds))

    # -- events ---------------------------------------------------------------------------------

    def _turn_finished(self, e: ev.TurnFinished) -> None:
        self.turns.labels(e.status).inc()
        self.tokens.labels("prompt").inc(e.prompt_tokens)
        self.tokens.labels("reused").inc(e.reused_tokens)
        self.tokens.labels("generated").inc(e.output_tokens)
        if e.ttft_ms is not None:
            self.ttft.observe(e.ttft_ms / 1000)
        if e.total_ms is not None:
            self.turn_seconds.observe(e.total_ms / 1000)

    def _failover(self, e: ev.Failover) -> None:
        self.failovers.labels(e.cause).inc()
        self.failover_detect.labels(e.cause).observe(e.detect_ms / 1000)
        self.failover_lost.labels(e.cause).observe(e.lost_ms / 1000)
        self.failover_tokens.inc(e.token_index)

    def _checkpoint(self, e: ev.SandboxCheckpoint) -> None:
        self.checkpoints.labels("taken").inc()
        self.checkpoint_seconds.observe(e.seconds)
        if e.in_bubble:
            self.in_bubble.inc()

    def _restored(self, e: ev.SandboxRestored) -> None:
        self.restores.labels(e.mode).inc()
        self.restore_seconds.labels(e.mode).observe(e.seconds)
        self.replayed.inc(e.replayed)
        if e.reason.startswith("node_lost"):
            self.node_loss_restores.inc()


_SANDBOX_PATH = re.compile(r"/s/[^/]+/sandbox(/|$)")


def protocol_of(path: str) -> str:
    """The protocol label of a request path.

    >>> [protocol_of(p) for p in ("/s/x/v1/messages", "/v1/chat/completions", "/api/sessions", "/metrics")]
    ['anthropic', 'openai', 'api', 'metrics']
    >>> protocol_of("/s/x/sandbox/exec"), protocol_of("/s/x/v1/models")
    ('sandbox', 'openai')
    """
    if is_anthropic_path(path):
        return "anthropic"
    if _SANDBOX_PATH.match(path):  # a harness's tool calls, not model requests
        return "sandbox"
    if path.startswith(("/v1/", "/s/")):
        return "openai"
    if path.startswith("/api/"):
        return "api"
    if path.startswith("/metrics"):
        return "metrics"
    if path.startswith("/dashboard"):
        return "dashboard"
    return "other"
