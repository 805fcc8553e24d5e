// Events in words: a title, detail chips and a tone, for the recovery timeline and the session page.

import { fixed, ms, num } from "./util.js";

const TONES = {
  failover: "bad", turn_failed: "bad", sandbox_failure: "bad", sandbox_restore_failed: "bad", recompute_failed: "bad",
  sandbox_checkpoint_failed: "bad", tool_call_parse_error: "warn", turns_discarded: "warn",
  shadow_promoted: "good", worker_cold_start: "info", replacement_started: "info",
  sandbox_checkpoint: "info", sandbox_restored: "warn", sandbox_checkpoint_skipped: "muted",
  sandbox_checkpoint_decision: "muted", sandbox_created: "muted", sandbox_destroyed: "muted",
  recomputed_logprobs: "info", branch: "info", prefix_reuse: "muted", fresh_prompt: "muted",
  session_moved: "info",
};

const WORKER_TONES = { dead: "bad", unhealthy: "warn", ready: "good", shadow: "info", starting: "info" };

// A label for every kind of core.events.REGISTRY (tests/gateway/test_event_kinds.py checks it).
export const LABELS = {
  failover: "Failover", worker_state: "Worker", shadow_promoted: "Promotion",
  worker_cold_start: "Cold start", replacement_started: "Replacement", sandbox_checkpoint: "Checkpoint",
  sandbox_restored: "Restore", sandbox_failure: "Sandbox failure", sandbox_restore_failed: "Restore failed", turns_discarded: "Discard",
  sandbox_created: "Sandbox", sandbox_destroyed: "Sandbox", sandbox_checkpoint_decision: "Checkpoint plan",
  sandbox_checkpoint_skipped: "Checkpoint skipped", sandbox_checkpoint_failed: "Checkpoint failed",
  recomputed_logprobs: "Recomputed", recompute_failed: "Recompute failed", turn_failed: "Turn failed",
  tool_call_parse_error: "Tool call", branch: "Branch", prefix_reuse: "Prefix reuse",
  fresh_prompt: "Fresh prompt", session_moved: "Moved", worker_weights: "Weights", weight_owner: "Weight owner",
  turn_started: "Turn", turn_finished: "Turn", weight_switch: "Weight switch", query_of_death: "Query of death",
  query_of_death_refused: "Refused", recompute_resumed: "Recompute resumed", auxiliary_call: "Auxiliary call",
  export: "Export", sample: "Sample", weights_updated: "Weights updated", weights_update_failed: "Weights failed",
  session_created: "Session", session_updated: "Session", session_deleted: "Session deleted",
  session_closed: "Closed", session_forked: "Forked", turns_interrupted: "Interrupted", feed_advanced: "Feed",
  sandbox_forked: "Sandbox fork", sandbox_adopted: "Adopted", sandbox_failed: "Sandbox failed", sandbox_standby: "Standby",
  sandbox_checkpoint_refused: "Checkpoint refused", sandbox_call: "Tool call", agent_processes_left: "Processes left",
  outside_workspace_modified: "Outside workspace", workspace_too_large: "Workspace too large",
  protected_path_modified: "Protected path",
};

const seconds = (s) => (s === null || s === undefined ? "—" : `${fixed(s, s < 10 ? 2 : 1)} s`);

const DESCRIBE = {
  failover: (d) => ({
    title: d.to_worker ? `${d.from_worker} → ${d.to_worker}` : `${d.from_worker} lost, not resumed`,
    parts: [
      d.cause && `cause ${d.cause}`,
      d.detect_ms !== undefined && `detected in ${ms(d.detect_ms)}`,
      d.lost_ms !== undefined && `lost ${ms(d.lost_ms)}`,
      `resumed at token ${num(d.token_index)}`,
    ],
    note: d.error,
  }),
  worker_state: (d) => ({
    title: `${d.worker}: ${d.from ?? "—"} → ${d.to}`,
    parts: [d.why, d.pid && `pid ${d.pid}`],
    tone: WORKER_TONES[d.to] || "muted",
  }),
  shadow_promoted: (d) => ({ title: `${d.worker} promoted from shadow`, parts: [] }),
  worker_cold_start: (d) => ({ title: `${d.worker} ready`, parts: [`cold start ${seconds(d.seconds)}`] }),
  replacement_started: (d) => ({ title: `${d.worker} starting`, parts: ["replacement"] }),
  sandbox_checkpoint: (d) => ({
    title: `checkpoint ${d.id ?? ""}`.trim(),
    parts: [
      d.turn_index !== undefined && `turn ${d.turn_index}`,
      d.in_bubble ? "in bubble" : "outside a bubble",
      `took ${seconds(d.seconds)}`,
      d.trigger,
    ],
  }),
  sandbox_restored: (d) => ({
    title: `restored (${d.mode ?? "truncate"})`,
    parts: [
      d.checkpoint_id ? `from turn ${d.turn_index}` : "from scratch",
      `took ${seconds(d.seconds)}`,
      d.standby && "from its standby",
      d.mode === "replay" && `${num(d.replayed ?? d.replayed_calls ?? 0)} calls replayed`,
      d.diverged ? `${num(d.diverged)} diverged` : null,
      d.discarded_turns?.length ? `discarded ${d.discarded_turns.join(", ")}` : null,
    ],
    note: d.reason,
  }),
  sandbox_failure: (d) => ({ title: `sandbox ${d.sandbox_id ?? ""} failed`.trim(), parts: [d.kind], note: d.detail }),
  sandbox_restore_failed: (d) => ({ title: `restore of ${d.checkpoint_id ?? "the image"} failed`, parts: [d.reason], note: d.error }),
  turns_discarded: (d) => ({
    title: `turns ${(d.turn_indices || []).join(", ")} discarded`,
    parts: [d.after_turn !== undefined && d.after_turn !== null && `after turn ${d.after_turn}`],
    note: d.reason,
  }),
  session_moved: (d) => ({
    title: `moved ${d.from_worker} → ${d.to_worker}`,
    parts: [
      d.group !== null && d.group !== undefined && `group ${d.group}`,
      `${num(d.from_outstanding_tokens ?? 0)} against ${num(d.to_outstanding_tokens ?? 0)} tokens outstanding`,
    ],
    note: `for ${d.why ?? "load"}`,
  }),
  sandbox_checkpoint_failed: (d) => ({ title: "checkpoint failed", parts: [], note: d.error }),
  sandbox_standby: (d) => ({
    title: `standby ${d.action}`,
    parts: [`checkpoint ${d.checkpoint_id}`, d.action !== "discarded" && `took ${seconds(d.seconds)}`],
    note: d.reason,
  }),
  sandbox_checkpoint_skipped: (d) => ({ title: "checkpoint skipped", parts: [d.reason] }),
  recomputed_logprobs: (d) => ({
    title: "logprobs recomputed",
    parts: [`${num((d.runs || []).reduce((n, run) => n + (run[1]?.length || 0), 0))} tokens`],
  }),
  branch: (d) => ({ title: d.reason || "new branch", parts: [d.reused_tokens !== undefined && `${num(d.reused_tokens)} tokens reused`] }),
  prefix_reuse: (d) => ({ title: d.reason || "prefix reused", parts: [d.reused_tokens !== undefined && `${num(d.reused_tokens)} tokens reused`] }),
  fresh_prompt: (d) => ({ title: d.reason || "fresh prompt", parts: [] }),
  turn_failed: (d) => ({ title: "turn failed", parts: [], note: d.error || d.message }),
};

// An unknown kind: its scalar fields, so a new event still says something.
function scalars(d) {
  return Object.entries(d)
    .filter(([, v]) => ["string", "number", "boolean"].includes(typeof v))
    .slice(0, 4)
    .map(([k, v]) => `${k.replaceAll("_", " ")} ${v}`);
}

export function describe(event) {
  const how = DESCRIBE[event.kind];
  const d = event.data || {};
  const base = how ? how(d) : { title: "", parts: scalars(d) };
  return {
    label: LABELS[event.kind] || event.kind.replaceAll("_", " "),
    tone: base.tone || TONES[event.kind] || "muted",
    title: base.title,
    parts: (base.parts || []).filter(Boolean),
    note: base.note || null,
  };
}
