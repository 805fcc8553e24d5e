// The page's picture of the gateway: a snapshot of /api/dashboard/state, kept current by the live feed
// (/api/events?since=<snapshot seq>, so nothing falls between the two) and refreshed now and then for
// the counters that events do not carry (outstanding requests, served requests, uptimes, totals).
//
// A snapshot replaces the picture; the events seen after it (seq > snapshot.seq) are applied again on
// top, so a snapshot that was taken before an event arrived cannot undo it.

import { ApiError, eventsUrl, getJson } from "./api.js";

export const KINDS = [
  "prefix_reuse", "fresh_prompt", "branch", "failover", "turn_failed", "tool_call_parse_error",
  "recomputed_logprobs", "recompute_failed", "turns_discarded", "sandbox_created", "sandbox_destroyed",
  "sandbox_checkpoint", "sandbox_checkpoint_decision", "sandbox_checkpoint_skipped",
  "sandbox_checkpoint_failed", "sandbox_restored", "sandbox_failure", "sandbox_restore_failed", "turn_started",
  "turn_finished",
  "session_created", "session_updated", "worker_state", "worker_cold_start", "shadow_promoted",
  "replacement_started", "session_moved", "sample", "lagged",
];

export const TIMELINE_KINDS = new Set([
  "failover", "worker_state", "shadow_promoted", "worker_cold_start", "replacement_started",
  "sandbox_checkpoint", "sandbox_restored", "sandbox_failure", "sandbox_restore_failed", "turns_discarded",
  "session_moved",
]);

// Events after which the snapshot's counters are worth fetching again soon.
const REFRESH_ON = new Set([
  "worker_state", "shadow_promoted", "replacement_started", "worker_cold_start", "failover",
  "sandbox_created", "sandbox_destroyed", "sandbox_checkpoint", "sandbox_restored", "sandbox_failure",
  "session_created", "session_updated", "turn_finished",
]);

const SERIES_SECONDS = 600;
const TIMELINE_MAX = 300;
const POLL_MS = 3000;

export class Live {
  constructor({ onState, onEvent, onStatus, onAuth }) {
    this.onState = onState;
    this.onEvent = onEvent;
    this.onStatus = onStatus;
    this.onAuth = onAuth;
    this.state = null;
    this.fetchedAt = 0; // performance.now() of the snapshot, for ticking uptimes
    this.recent = []; // events seen, newest last (re-applied over a snapshot)
    this.lastSeq = 0;
    this.source = null;
    this.refreshTimer = null;
    this.inflight = null;
    this.retry = 1000;
  }

  async start() {
    await this.refresh();
    this.connect();
    setInterval(() => {
      if (document.visibilityState === "visible") this.refresh().catch(() => {});
    }, POLL_MS);
  }

  async refresh() {
    if (this.inflight) return this.inflight;
    this.inflight = (async () => {
      try {
        const state = await getJson("api/dashboard/state");
        this.apply(state);
      } catch (err) {
        if (err instanceof ApiError && err.status === 401) this.onAuth(err);
        throw err;
      } finally {
        this.inflight = null;
      }
    })();
    return this.inflight;
  }

  // Fetch the snapshot again shortly: several events in a row cost one request.
  refreshSoon() {
    if (this.refreshTimer) return;
    this.refreshTimer = setTimeout(() => {
      this.refreshTimer = null;
      this.refresh().catch(() => {});
    }, 400);
  }

  apply(state) {
    const restarted = this.state && state.gateway.started_at !== this.state.gateway.started_at;
    if (restarted) {
      this.recent = [];
      this.lastSeq = 0;
    }
    this.state = state;
    this.fetchedAt = performance.now();
    for (const event of this.recent) if (event.seq > state.seq) this.fold(event);
    this.onState(this.state);
    if (restarted) this.reconnect(0);
  }

  connect() {
    const since = this.lastSeq || this.state?.seq || 0;
    const source = new EventSource(eventsUrl(since));
    this.source = source;
    source.onopen = () => {
      this.retry = 1000;
      this.onStatus("live");
    };
    source.onerror = () => {
      // Reconnect ourselves (EventSource would replay from the first `since`), from the last event seen.
      if (this.source !== source) return;
      this.onStatus("reconnecting");
      this.reconnect(this.retry);
      this.retry = Math.min(this.retry * 2, 15000);
    };
    for (const kind of KINDS) source.addEventListener(kind, (message) => this.receive(message));
    source.onmessage = (message) => this.receive(message); // events without an `event:` line
  }

  reconnect(delay) {
    this.source?.close();
    this.source = null;
    setTimeout(async () => {
      try {
        await this.refresh();
      } catch {
        // the gateway is away: try the feed anyway, its error brings us back here
      }
      if (!this.source) this.connect();
    }, delay);
  }

  receive(message) {
    let event;
    try {
      event = JSON.parse(message.data);
    } catch {
      return;
    }
    if (event.kind === "lagged") {
      // This page fell behind and the gateway dropped events for it: start over from a snapshot.
      this.lastSeq = 0;
      this.reconnect(0);
      return;
    }
    if (typeof event.seq !== "number" || event.seq <= this.lastSeq) return;
    this.lastSeq = event.seq;
    this.recent.push(event);
    if (this.recent.length > 1000) this.recent.splice(0, this.recent.length - 500);
    if (this.state) this.fold(event);
    if (REFRESH_ON.has(event.kind)) this.refreshSoon();
    this.onEvent(event);
  }

  // What an event changes in the snapshot, before the next snapshot confirms it.
  fold(event) {
    const state = this.state;
    const data = event.data || {};
    if (TIMELINE_KINDS.has(event.kind) && !state.timeline.some((e) => e.seq === event.seq)) {
      state.timeline.push(event);
      if (state.timeline.length > TIMELINE_MAX) state.timeline.splice(0, state.timeline.length - TIMELINE_MAX);
    }
    if (event.kind === "sample" && !state.series.some((s) => s.ts === event.ts)) {
      state.series.push({ ...data, ts: event.ts });
      const cutoff = event.ts - SERIES_SECONDS;
      while (state.series.length && state.series[0].ts < cutoff) state.series.shift();
    }
    if (event.kind === "worker_state") this.foldWorker(event, data);
  }

  foldWorker(event, data) {
    let worker = this.state.workers.find((w) => w.name === data.worker);
    if (!worker) {
      worker = {
        name: data.worker, state: data.to, launched: data.launched, pid: data.pid, url: data.url,
        outstanding: 0, served: 0, started_at: event.ts, uptime_s: 0, last_transition: null,
        starting_elapsed_s: null, start_timeout_s: null,
      };
      this.state.workers.push(worker);
    }
    worker.state = data.to;
    if (data.pid !== undefined && data.pid !== null) worker.pid = data.pid;
    if (data.url) worker.url = data.url;
    worker.last_transition = { at: event.ts, from: data.from, to: data.to, why: data.why };
    if (data.to === "starting" && worker.starting_elapsed_s === null) worker.starting_elapsed_s = 0;
    if (data.to !== "starting") worker.starting_elapsed_s = null;
  }

  // Seconds since the snapshot was taken: views add it to the snapshot's uptimes and elapsed times.
  sinceSnapshot() {
    return (performance.now() - this.fetchedAt) / 1000;
  }
}
