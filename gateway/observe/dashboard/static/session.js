// One session: its reward and metadata, the branch tree, and each turn with its messages, a token strip
// coloured by logprob (loss mask and recomputed tokens marked, failovers at their token index) and its
// events. An open session tails live: its events on the feed bring a fresh trajectory (debounced).

import { ApiError, getJson } from "./api.js";
import { describe } from "./events.js";
import { metaChips } from "./trajectories.js";
import { $, badge, clock, datetime, debounce, fixed, h, ms, num, replace, shortId } from "./util.js";

const STRIP_LIMIT = 4000; // tokens drawn per strip before "show all"
const TAIL_KINDS = new Set([
  "turn_finished", "failover", "turn_failed", "turns_discarded", "sandbox_restored", "sandbox_checkpoint",
  "sandbox_failure", "session_updated", "recomputed_logprobs", "branch",
]);
// Events drawn as a marker between turns when they belong to no turn (restores, discards, sandboxes).
const SESSION_MARKERS = new Set([
  "sandbox_restored", "turns_discarded", "sandbox_failure", "sandbox_created", "sandbox_destroyed",
  "sandbox_checkpoint",
]);

export class SessionView {
  constructor(onAuth) {
    this.onAuth = onAuth;
    this.root = $("#view-session");
    this.id = null;
    this.data = null;
    this.pending = new Map(); // turn index -> turn_started data, until the trajectory has the turn
    this.controller = null;
    this.refetch = debounce(() => this.load(false), 400);
    this.tokenMode = localStorage.getItem("belayer.tokens") === "ids" ? "ids" : "text";
  }

  setTokenMode(mode) {
    this.tokenMode = mode;
    localStorage.setItem("belayer.tokens", mode);
    this.render();
  }

  show(id, params) {
    const changed = id !== this.id;
    this.id = id;
    this.focusTurn = params.get("turn");
    if (changed) {
      this.data = null;
      this.pending.clear();
      replace(this.root, h("div", { class: "panel empty" }, "Loading trajectory…"));
    }
    this.load(true);
  }

  hide() {
    this.controller?.abort();
    this.id = null;
  }

  onEvent(event) {
    if (!this.id || event.session_id !== this.id) return;
    if (event.kind === "turn_started") {
      this.pending.set(event.data.index, event.data);
      this.renderPending();
    }
    if (TAIL_KINDS.has(event.kind)) this.refetch();
  }

  async load(scroll) {
    const id = this.id;
    if (!id) return;
    this.controller?.abort();
    const controller = new AbortController();
    this.controller = controller;
    let data;
    try {
      const params = { token_text: 1 }; // each output token's text, for the strips
      data = await getJson(`api/sessions/${encodeURIComponent(id)}/trajectory`, params, controller.signal);
    } catch (err) {
      if (err.name === "AbortError") return;
      if (err instanceof ApiError && err.status === 401) this.onAuth(err);
      replace(this.root, h("div", { class: "panel empty error" }, `Could not load session ${id}: ${err.message}`));
      return;
    }
    if (controller !== this.controller || id !== this.id) return;
    this.data = data;
    for (const t of data.turns) this.pending.delete(t.index);
    this.render();
    if (scroll && this.focusTurn) this.scrollToTurn(`[data-turn-id="${CSS.escape(this.focusTurn)}"]`);
  }

  render() {
    const open = new Set([...this.root.querySelectorAll("details[open][data-key]")].map((d) => d.dataset.key));
    const expanded = new Set([...this.root.querySelectorAll(".strip[data-all]")].map((s) => s.dataset.turnIndex));
    const { session, turns } = this.data;
    const body = h("div", { class: "session-body" },
      h("aside", { class: "panel tree-panel" }, this.tree()),
      h("div", { class: "turns" }, this.turnCards(expanded), h("div", { id: "pending-turns" })));
    replace(this.root, this.header(session, turns), body);
    for (const d of this.root.querySelectorAll("details[data-key]")) if (open.has(d.dataset.key)) d.open = true;
    this.renderPending();
  }

  header(s, turns) {
    const failovers = this.data.events.filter((e) => e.kind === "failover").length;
    const tokens = turns.reduce((n, t) => n + t.output_ids.length, 0);
    const field = (label, value) => h("div", { class: "field" }, h("div", { class: "card-label" }, label), h("div", { class: "field-value" }, value));
    return h("div", { class: "panel session-head", dataset: { session: s.id } },
      h("div", { class: "session-title" },
        h("a", { href: "#/trajectories", class: "back" }, "← Sessions"),
        h("h1", { class: "mono", title: s.id }, s.id),
        badge(s.status),
        s.status === "open" ? h("span", { class: "tailing" }, h("span", { class: "dot" }), "tailing live") : null,
        h("span", { class: "spacer" }),
        h("button", { class: "btn", type: "button", onclick: () => this.download() }, "Download JSON")),
      h("div", { class: "session-fields" },
        h("div", { class: "field reward-field" }, h("div", { class: "card-label" }, "Reward"),
          s.reward === null || s.reward === undefined
            ? h("div", { class: "reward-value none", id: "session-reward" }, "not yet")
            : h("div", { class: "reward-value", id: "session-reward" }, fixed(s.reward, 3))),
        field("Created", datetime(s.created_at)),
        field("Closed", s.closed_at ? datetime(s.closed_at) : "—"),
        field("Turns", num(turns.length)),
        field("Branches", num(s.num_branches)),
        field("Tokens generated", num(tokens)),
        field("Failovers", num(failovers)),
        field("Metadata", Object.keys(s.metadata || {}).length ? metaChips(s.metadata) : h("span", { class: "muted" }, "none"))),
      s.reward_info ? h("details", { class: "reward-info", dataset: { key: "reward-info" } },
        h("summary", {}, "Reward info"), h("pre", { class: "content" }, JSON.stringify(s.reward_info, null, 2))) : null);
  }

  // --- branch tree ---------------------------------------------------------------------------------

  tree() {
    const { turns, branches, events } = this.data;
    const children = new Map();
    const roots = [];
    for (const t of turns) {
      if (t.parent_index === null || t.parent_index === undefined) roots.push(t);
      else children.set(t.parent_index, [...(children.get(t.parent_index) || []), t]);
    }
    const failed = new Set(events.filter((e) => e.kind === "failover").map((e) => e.turn_index));
    const node = (t) => h("button", {
      class: `node status-${t.status}`, type: "button", dataset: { turnIndex: t.index },
      title: `turn ${t.index}: ${t.status}, branch ${t.branch}, ${t.output_ids.length} tokens`,
      onclick: () => this.scrollToTurn(`.turn[data-turn-index="${t.index}"]`),
    },
    h("span", { class: "node-index" }, `#${t.index}`),
    h("span", { class: "node-branch" }, `b${t.branch}`),
    h("span", { class: "node-tokens" }, `${num(t.output_ids.length)} tok`),
    failed.has(t.index) ? h("span", { class: "node-flag failover", title: "failover in this turn" }, "⚡") : null,
    t.status !== "complete" ? h("span", { class: `node-flag status-${t.status}` }, t.status) : null);
    // A chain of single children stays at one level; a fork indents one list per child.
    const chain = (start) => {
      const items = [];
      for (let t = start; t;) {
        const kids = children.get(t.index) || [];
        const li = h("li", {}, node(t));
        items.push(li);
        if (kids.length > 1) {
          li.append(h("div", { class: "forks" }, kids.map((k) => h("ul", { class: "tree fork" }, chain(k)))));
          break;
        }
        t = kids[0];
      }
      return items;
    };
    return [
      h("div", { class: "panel-head" }, h("h2", {}, "Branch tree"), h("span", { class: "muted" }, `${num(branches.length)} branches`)),
      !turns.length
        ? h("div", { class: "empty" }, "No turns yet.")
        : roots.length === 1
          ? h("ul", { class: "tree", id: "branch-tree" }, chain(roots[0]))
          : h("div", { class: "roots", id: "branch-tree" }, roots.map((r) => h("ul", { class: "tree" }, chain(r)))),
      branches.length ? h("div", { class: "branch-list" }, branches.map((b) =>
        h("div", { class: "branch-row" }, h("span", { class: "node-branch" }, `b${b.branch}`),
          `${num(b.turn_indices.length)} turns, leaf #${b.leaf_index}`))) : null,
      this.legend(),
    ];
  }

  legend() {
    const swatch = (cls, label) => h("span", { class: "legend-item" }, h("span", { class: `tok ${cls}` }, " "), label);
    return h("div", { class: "legend" },
      h("div", { class: "card-label" }, "Token colour: probability"),
      h("div", { class: "legend-row" }, swatch("p0", "≥ .9"), swatch("p1", "≥ .7"), swatch("p2", "≥ .5"), swatch("p3", "≥ .3")),
      h("div", { class: "legend-row" }, swatch("p4", "≥ .1"), swatch("p5", "≥ .01"), swatch("p6", "< .01"), swatch("pn", "none")),
      h("div", { class: "legend-row" }, swatch("p1 nomask", "loss mask 0"), swatch("p1 recomputed", "recomputed")),
      h("div", { class: "legend-row" }, h("span", { class: "legend-item" }, h("span", { class: "failover-marker legend-marker" }, "⚡"), "failover (resumed here)")));
  }

  // --- turns ---------------------------------------------------------------------------------------

  turnCards(expanded) {
    const { turns, events } = this.data;
    const loose = events.filter((e) => (e.turn_index === null || e.turn_index === undefined) && SESSION_MARKERS.has(e.kind));
    const discarded = new Map();
    for (const e of events) {
      const indices = e.kind === "turns_discarded" ? e.data.turn_indices : e.kind === "sandbox_restored" ? e.data.discarded_turns : null;
      for (const i of indices || []) discarded.set(i, e);
    }
    const out = [];
    let next = 0;
    const ordered = loose.slice().sort((a, b) => a.ts - b.ts);
    for (const t of turns) {
      while (next < ordered.length && ordered[next].ts < (t.received_at || 0)) out.push(divider(ordered[next++]));
      out.push(this.turnCard(t, discarded.get(t.index), expanded.has(String(t.index))));
    }
    while (next < ordered.length) out.push(divider(ordered[next++]));
    if (!turns.length) out.push(h("div", { class: "panel empty" }, "This session has no turns yet."));
    return out;
  }

  turnCard(t, discardedBy, showAll) {
    const own = this.data.events.filter((e) => e.turn_index === t.index);
    const timings = t.timings || {};
    const meta = [
      t.worker && h("span", { class: "mono" }, t.worker),
      t.finish_reason && `finish ${t.finish_reason}`,
      `${num(t.output_ids.length)} tokens`,
      timings.ttft_ms !== undefined && `TTFT ${ms(timings.ttft_ms)}`,
      timings.total_ms !== undefined && `total ${ms(timings.total_ms)}`,
      t.received_at && clock(t.received_at),
    ].filter(Boolean);
    return h("article", {
      class: `panel turn status-${t.status}${discardedBy ? " discarded" : ""}`,
      id: `turn-${t.index}`, dataset: { turnIndex: t.index, turnId: t.id, branch: t.branch },
    },
    h("header", { class: "turn-head" },
      h("span", { class: "turn-title" }, `Turn ${t.index}`),
      h("span", { class: "chip-static" }, `branch ${t.branch}`),
      t.parent_index !== null && t.parent_index !== undefined ? h("span", { class: "chip-static" }, `after #${t.parent_index}`) : null,
      badge(t.status),
      discardedBy ? h("span", { class: "badge badge-discarded", title: describe(discardedBy).title }, "discarded") : null,
      h("span", { class: "spacer" }),
      h("span", { class: "turn-meta muted" }, meta.map((m, i) => [i ? " · " : "", m]))),
    own.length ? h("div", { class: "turn-events" }, own.map((e) => eventChip(e))) : null,
    t.error ? h("div", { class: "turn-error" }, t.error) : null,
    h("div", { class: "turn-body" }, this.messages(t), this.strips(t, own, showAll)));
  }

  messages(t) {
    const request = t.request || {};
    const all = requestMessages(request);
    const firstNew = t.parent_index === null || t.parent_index === undefined ? 0 : lastAssistant(all) + 1;
    const fresh = all.slice(firstNew);
    const reply = responseMessage(t.response);
    return h("div", { class: "messages" },
      firstNew > 0 ? h("details", { class: "history", dataset: { key: `history-${t.index}` } },
        h("summary", {}, `${num(firstNew)} earlier messages`),
        all.slice(0, firstNew).map((m) => messageBox(m))) : null,
      fresh.map((m) => messageBox(m)),
      reply ? messageBox(reply, "response") : t.status === "running" ? h("div", { class: "muted" }, "generating…") : null);
  }

  strips(t, own, showAll) {
    const p = t.prompt_ids.length;
    const logprobs = t.logprobs && t.logprobs.length === p + t.output_ids.length ? t.logprobs : null;
    const out = {
      ids: t.output_ids,
      logprobs: logprobs ? logprobs.slice(p) : t.output_logprobs || [],
      loss: (t.loss_mask || []).slice(p),
      recomputed: (t.recomputed_mask || []).slice(p),
      pieces: this.tokenMode === "text" ? t.output_text || null : null,
    };
    const markers = new Map();
    for (const e of own) {
      if (e.kind !== "failover") continue;
      const at = Number(e.data.token_index ?? 0);
      markers.set(at, [...(markers.get(at) || []), e]);
    }
    const latest = Math.max(-1, ...markers.keys());
    const limit = showAll ? Infinity : Math.max(STRIP_LIMIT, latest + 50);
    const promptRecomputed = (t.recomputed_mask || []).slice(0, p).reduce((n, x) => n + x, 0);
    const promptGenerated = (t.loss_mask || []).slice(0, p).reduce((n, x) => n + x, 0);
    const prompt = h("details", { class: "prompt-strip", dataset: { key: `prompt-${t.index}` } },
      h("summary", {}, `Prompt · ${num(p)} tokens · ${num(promptGenerated)} generated by the policy`,
        promptRecomputed ? h("span", { class: "recomputed-count" }, ` · ${num(promptRecomputed)} recomputed`) : null));
    const drawPrompt = () => {
      if (prompt.querySelector(".strip")) return;
      prompt.append(strip(t.index, "prompt", {
        ids: t.prompt_ids,
        logprobs: logprobs ? logprobs.slice(0, p) : [],
        loss: (t.loss_mask || []).slice(0, p),
        recomputed: (t.recomputed_mask || []).slice(0, p),
        pieces: t.prompt_text || null,
      }, new Map(), Infinity));
    };
    prompt.addEventListener("toggle", () => prompt.open && drawPrompt());
    const outStrip = strip(t.index, "output", out, markers, limit);
    if (limit !== Infinity && out.ids.length > limit) {
      outStrip.append(h("button", { class: "btn small", type: "button", onclick: () => {
        outStrip.dataset.all = "";
        this.render();
      } }, `show all ${num(out.ids.length)} tokens`));
    }
    if (showAll) outStrip.dataset.all = "";
    return h("div", { class: "strips" },
      h("div", { class: "strip-head" }, h("span", { class: "card-label" }, `Output tokens · ${num(out.ids.length)}`),
        markers.size ? h("span", { class: "muted" }, ` · ${num([...markers.values()].flat().length)} failover`) : null,
        h("span", { class: "spacer" }),
        t.output_text ? this.modeSwitch() : null),
      outStrip, prompt);
  }

  modeSwitch() {
    return h("span", { class: "token-mode", title: "show each token as its text or its id" },
      ["text", "ids"].map((mode) => h("button", {
        type: "button", class: `chip${this.tokenMode === mode ? " active" : ""}`, dataset: { mode },
        onclick: () => this.setTokenMode(mode),
      }, mode)));
  }

  renderPending() {
    const box = $("#pending-turns", this.root);
    if (!box) return;
    const known = new Set((this.data?.turns || []).map((t) => t.index));
    replace(box, [...this.pending.entries()].filter(([i]) => !known.has(i)).map(([i, d]) =>
      h("article", { class: "panel turn pending", dataset: { turnIndex: i } },
        h("header", { class: "turn-head" }, h("span", { class: "turn-title" }, `Turn ${i}`),
          h("span", { class: "chip-static" }, `branch ${d.branch ?? "—"}`), badge("running"),
          h("span", { class: "spacer" }),
          h("span", { class: "muted" }, `prompt ${num(d.prompt_tokens)} tokens (${num(d.reused_tokens)} reused) · generating…`)))));
  }

  scrollToTurn(selector) {
    const el = this.root.querySelector(selector);
    if (!el) return;
    el.scrollIntoView({ block: "start" });
    el.classList.remove("flash");
    void el.offsetWidth; // restart the highlight animation
    el.classList.add("flash");
  }

  async download() {
    const blob = new Blob([JSON.stringify(this.data, null, 2)], { type: "application/json" });
    const a = h("a", { href: URL.createObjectURL(blob), download: `trajectory-${this.id}.json` });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }
}

// --- pieces ------------------------------------------------------------------------------------------

const BUCKETS = [0.9, 0.7, 0.5, 0.3, 0.1, 0.01];

function bucket(logprob) {
  if (logprob === null || logprob === undefined || Number.isNaN(logprob)) return "pn";
  const p = Math.exp(logprob);
  const i = BUCKETS.findIndex((b) => p >= b);
  return `p${i === -1 ? 6 : i}`;
}

function strip(turnIndex, part, s, markers, limit) {
  const text = Array.isArray(s.pieces) && s.pieces.length === s.ids.length;
  const el = h("div", { class: `strip strip-${part}${text ? " strip-text" : ""}`, dataset: { turnIndex, part } });
  const n = Math.min(s.ids.length, limit);
  const frag = document.createDocumentFragment();
  for (let i = 0; i < n; i++) {
    for (const e of markers.get(i) || []) frag.append(failoverMarker(e));
    const lp = s.logprobs[i];
    const loss = s.loss[i] ?? 1;
    const rec = s.recomputed[i] === 1;
    const span = document.createElement("span");
    span.className = `tok ${bucket(lp)}${loss ? "" : " nomask"}${rec ? " recomputed" : ""}`;
    span.dataset.i = i;
    span.textContent = text ? visible(s.pieces[i]) : String(s.ids[i]);
    span.title = `${part} token ${i} · id ${s.ids[i]}${text ? ` · ${JSON.stringify(s.pieces[i])}` : ""}` +
      (lp === null || lp === undefined ? "" : ` · logprob ${lp.toFixed(4)} (p ${Math.exp(lp).toFixed(3)})`) +
      (loss ? "" : " · loss mask 0") + (rec ? " · recomputed" : "");
    frag.append(span);
  }
  for (const [at, events] of markers) if (at >= n) for (const e of events) frag.append(failoverMarker(e));
  if (!s.ids.length) frag.append(h("span", { class: "muted" }, "no tokens"));
  el.append(frag);
  return el;
}

function failoverMarker(e) {
  const d = e.data || {};
  const title = `failover at token ${d.token_index}: ${d.from_worker} → ${d.to_worker ?? "none"}` +
    (d.cause ? ` (${d.cause})` : "") + (d.lost_ms !== undefined ? `, ${ms(d.lost_ms)} lost` : "") +
    (d.error ? ` — ${d.error}` : "");
  return h("span", { class: "failover-marker", dataset: { tokenIndex: d.token_index }, title }, "⚡");
}

// Whitespace that would vanish is drawn; a newline also breaks the line, as in the text.
function visible(piece) {
  return piece.replace(/\t/g, "⇥").replace(/\n/g, "↵\n") || "∅";
}

function eventChip(e) {
  const d = describe(e);
  const text = [d.label, d.title, ...d.parts].filter(Boolean).join(" · ");
  return h("span", { class: `event-chip ${e.kind} tone-${d.tone}`, title: d.note || text, dataset: { kind: e.kind } }, text);
}

function divider(e) {
  const d = describe(e);
  return h("div", { class: `divider-marker ${e.kind} tone-${d.tone}`, dataset: { kind: e.kind }, title: d.note || "" },
    h("span", { class: "kind" }, d.label),
    h("span", {}, [d.title, ...d.parts].join(" · ")),
    h("span", { class: "muted mono" }, clock(e.ts)));
}

function requestMessages(request) {
  const out = [];
  if (request.system) out.push({ role: "system", content: request.system });
  if (Array.isArray(request.messages)) out.push(...request.messages);
  else if (request.prompt !== undefined) out.push({ role: "prompt", content: request.prompt });
  return out;
}

function lastAssistant(messages) {
  for (let i = messages.length - 1; i >= 0; i--) if (messages[i].role === "assistant") return i;
  return -1;
}

function responseMessage(response) {
  if (!response) return null;
  if (response.message) return response.message;
  const choice = response.choices?.[0];
  if (choice?.message) return choice.message;
  if (choice && choice.text !== undefined) return { role: "completion", content: choice.text };
  if (Array.isArray(response.content)) return { role: response.role || "assistant", content: response.content };
  return null;
}

function messageBox(m, extra = "") {
  const calls = (m.tool_calls || []).map((c) =>
    h("div", { class: "tool-call mono" }, `→ ${c.function?.name ?? c.name}(${c.function?.arguments ?? JSON.stringify(c.input ?? {})})`));
  const text = contentText(m.content);
  return h("div", { class: `message role-${m.role} ${extra}` },
    h("div", { class: "role" }, m.role, m.name ? ` · ${m.name}` : "", m.tool_call_id ? ` · ${shortId(m.tool_call_id)}` : ""),
    text ? h("pre", { class: "content" }, text) : null,
    m.reasoning_content ? h("pre", { class: "content reasoning" }, m.reasoning_content) : null,
    calls);
}

function contentText(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (!Array.isArray(content)) return JSON.stringify(content, null, 2);
  return content.map((part) => {
    if (typeof part === "string") return part;
    if (part.type === "text") return part.text;
    if (part.type === "tool_use") return `→ ${part.name}(${JSON.stringify(part.input)})`;
    if (part.type === "tool_result") return `← ${contentText(part.content)}`;
    if (part.type === "thinking") return part.thinking;
    if (part.type === "image" || part.type === "image_url") return "[image]";
    return JSON.stringify(part);
  }).join("\n");
}
