// Recovery: totals since start, charts of the once-a-second samples (uPlot), and the timeline of
// failovers, promotions, cold starts, checkpoints, restores and discards.

import { describe } from "./events.js";
import { $, clock, h, num, replace, shortId } from "./util.js";

const FILTERS = {
  all: () => true,
  failover: (e) => e.kind === "failover",
  worker: (e) => ["worker_state", "shadow_promoted", "worker_cold_start", "replacement_started"].includes(e.kind),
  sandbox: (e) => e.kind.startsWith("sandbox_") || e.kind === "turns_discarded",
};

const COLORS = {
  axis: "#8b95a7",
  grid: "rgba(139,149,167,0.12)",
  tokens: "#4ea1ff",
  requests: "#b58cff",
  ttft: "#3ecf8e",
  checkpoint: "#f5a524",
  failover: "rgba(255,93,93,0.85)",
};

export class RecoveryView {
  constructor(live) {
    this.live = live;
    this.filter = "all";
    this.timelineKey = "";
    this.charts = null;
    this.chartsDirty = true;
    for (const chip of document.querySelectorAll("#timeline-filter .chip")) {
      chip.addEventListener("click", () => {
        this.filter = chip.dataset.filter;
        for (const c of document.querySelectorAll("#timeline-filter .chip")) c.classList.toggle("active", c === chip);
        this.renderTimeline(this.live.state, true);
      });
    }
  }

  render(state, visible) {
    this.renderTotals(state.totals || {});
    this.renderTimeline(state);
    this.chartsDirty = true;
    if (visible) this.renderCharts(state);
  }

  shown(state) {
    if (state) this.render(state, true);
  }

  renderTotals(t) {
    const card = (label, value, note, key) =>
      h("div", { class: "card", dataset: { total: key } }, h("div", { class: "card-label" }, label),
        h("div", { class: "card-value" }, num(value)), h("div", { class: "card-note" }, note || ""));
    const share = t.checkpoints ? Math.round((100 * (t.checkpoints_in_bubble || 0)) / t.checkpoints) : null;
    replace(
      $("#totals"),
      card("Failovers", t.failovers, "requests resumed", "failovers"),
      card("Promotions", t.promotions, "shadows activated", "promotions"),
      card("Replacements", t.replacements, "workers relaunched", "replacements"),
      card("Cold starts", t.cold_starts, "workers started", "cold_starts"),
      card("Checkpoints", t.checkpoints, share === null ? "sandbox checkpoints" : `${share}% in bubbles`, "checkpoints"),
      card("Restores", t.restores, `${num(t.replays ?? 0)} with replay`, "restores"),
      card("Turns discarded", t.turns_discarded, "rolled back", "turns_discarded"),
      card("Tokens generated", t.tokens_generated, `in ${num(t.turns ?? 0)} turns`, "tokens_generated"),
    );
  }

  renderTimeline(state, force = false) {
    if (!state) return;
    const events = state.timeline.filter(FILTERS[this.filter]);
    const newest = events.length ? events[events.length - 1].seq : 0;
    const key = `${this.filter}:${events.length}:${newest}`;
    if (key === this.timelineKey && !force) return;
    this.timelineKey = key;
    const items = events.slice().reverse().map((e) => timelineItem(e));
    if (!items.length) items.push(h("li", { class: "empty" }, "Nothing has gone wrong yet: no failovers, promotions, restores or discards."));
    replace($("#timeline"), items);
  }

  // --- charts --------------------------------------------------------------------------------------

  renderCharts(state) {
    if (!window.uPlot || !this.chartsDirty) return;
    this.chartsDirty = false;
    if (!this.charts) this.charts = this.makeCharts();
    const series = state.series || [];
    const x = series.map((s) => s.ts);
    const col = (key) => series.map((s) => (s[key] === undefined ? null : s[key]));
    this.failoverTimes = state.timeline.filter((e) => e.kind === "failover").map((e) => e.ts);
    const perSecond = series.some((s) => s.requests_per_s !== undefined) ? "requests_per_s" : "turns_per_s";
    this.charts.throughput.setData([x, col("tokens_per_s"), col(perSecond)]);
    this.charts.ttft.setData([x, col("ttft_ms")]);
    this.charts.checkpoint.setData([x, col("checkpoint_ms")]);
    for (const el of document.querySelectorAll(".chart")) el.classList.toggle("no-data", x.length === 0);
  }

  makeCharts() {
    const uPlot = window.uPlot;
    const hhmmss = (u, splits) => splits.map((v) => clock(v));
    const axis = (extra = {}) => ({
      stroke: COLORS.axis,
      grid: { stroke: COLORS.grid, width: 1 },
      ticks: { stroke: COLORS.grid, width: 1 },
      font: "11px system-ui, sans-serif",
      ...extra,
    });
    const value = (digits) => (u, v) => (v === null || v === undefined ? "—" : v.toFixed(digits));
    const failoverLines = {
      hooks: {
        draw: [
          (u) => {
            const ctx = u.ctx;
            const [min, max] = [u.scales.x.min, u.scales.x.max];
            ctx.save();
            ctx.strokeStyle = COLORS.failover;
            ctx.setLineDash([4, 4]);
            ctx.lineWidth = 1.5 * devicePixelRatio;
            for (const ts of this.failoverTimes || []) {
              if (ts < min || ts > max) continue;
              const px = Math.round(u.valToPos(ts, "x", true));
              ctx.beginPath();
              ctx.moveTo(px, u.bbox.top);
              ctx.lineTo(px, u.bbox.top + u.bbox.height);
              ctx.stroke();
            }
            ctx.restore();
          },
        ],
      },
    };
    const make = (id, series, axes, extra = {}) => {
      const el = document.getElementById(id);
      const opts = {
        width: Math.max(200, el.clientWidth),
        height: 190,
        cursor: { drag: { x: false, y: false } },
        scales: { x: { time: true } },
        legend: { live: true },
        axes,
        series: [{ value: (u, v) => (v === null || v === undefined ? "—" : clock(v)) }, ...series],
        plugins: [failoverLines],
        ...extra,
      };
      const chart = new uPlot(opts, [[], ...series.map(() => [])], el);
      new ResizeObserver(() => {
        if (el.clientWidth > 0) chart.setSize({ width: el.clientWidth, height: 190 });
      }).observe(el);
      return chart;
    };
    const bars = uPlot.paths?.bars ? uPlot.paths.bars({ size: [0.8, 12] }) : undefined;
    return {
      throughput: make(
        "chart-throughput",
        [
          { label: "tokens/s", stroke: COLORS.tokens, fill: "rgba(78,161,255,0.12)", width: 1.5, value: value(0) },
          { label: "turns/s", stroke: COLORS.requests, width: 1.25, scale: "rps", value: value(1) },
        ],
        [axis({ values: hhmmss }), axis({ size: 48 }), axis({ side: 1, scale: "rps", grid: { show: false }, size: 40 })],
      ),
      ttft: make(
        "chart-ttft",
        [{ label: "TTFT ms", stroke: COLORS.ttft, width: 1.5, spanGaps: false, points: { size: 4 }, value: value(1) }],
        [axis({ values: hhmmss }), axis({ size: 48 })],
      ),
      checkpoint: make(
        "chart-checkpoint",
        [{ label: "checkpoint ms", stroke: COLORS.checkpoint, fill: "rgba(245,165,36,0.35)", width: 1, paths: bars, value: value(1) }],
        [axis({ values: hhmmss }), axis({ size: 48 })],
        { scales: { x: { time: true }, y: { range: (u, min, max) => [0, Math.max(10, max || 0)] } } },
      ),
    };
  }
}

function timelineItem(e) {
  const d = describe(e);
  const session = e.session_id
    ? h("a", {
      class: "session-link mono",
      href: `#/session/${encodeURIComponent(e.session_id)}${e.turn_id ? `?turn=${e.turn_id}` : ""}`,
      title: e.session_id,
    }, `session ${shortId(e.session_id)}`)
    : null;
  return h(
    "li",
    { class: `event ${e.kind} tone-${d.tone}`, dataset: { seq: e.seq, kind: e.kind } },
    h("time", { class: "mono", title: new Date(e.ts * 1000).toISOString() }, clock(e.ts)),
    h("span", { class: `kind tone-${d.tone}` }, d.label),
    h("div", { class: "body" },
      h("div", { class: "title" }, d.title),
      d.parts.length ? h("div", { class: "parts" }, d.parts.map((p) => h("span", { class: "part" }, p))) : null,
      d.note ? h("div", { class: "note", title: d.note }, d.note) : null),
    session,
  );
}
