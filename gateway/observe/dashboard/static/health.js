// Health: the gateway, every worker and shadow (with replacements starting up), and the sandboxes.

import { $, ago, badge, bytes, clock, duration, h, num, percent, plural, replace, shortId } from "./util.js";

export class HealthView {
  constructor(live) {
    this.live = live;
  }

  render(state) {
    this.renderCards(state);
    this.renderWorkers(state.workers);
    this.renderNodes(state.sandbox_nodes || []);
    this.renderSandboxes(state);
    this.tick();
  }

  renderCards(state) {
    const g = state.gateway;
    const workers = state.workers;
    const ready = workers.filter((w) => w.state === "ready").length;
    const shadows = workers.filter((w) => w.state === "shadow").length;
    const starting = workers.filter((w) => w.state === "starting").length;
    const alive = workers.filter((w) => w.state !== "dead").length;
    const outstanding = workers.reduce((sum, w) => sum + (w.outstanding || 0), 0);
    const card = (label, value, note, attrs = {}) =>
      h("div", { class: "card", ...attrs }, h("div", { class: "card-label" }, label),
        h("div", { class: "card-value" }, value), h("div", { class: "card-note" }, note || ""));
    replace(
      $("#health-cards"),
      card("Gateway", g.version ? `v${g.version}` : "—", g.sandboxes ? "sandboxes on" : "sandboxes off"),
      card("Uptime", h("span", { "data-uptime": g.uptime_s }, duration(g.uptime_s)), `since ${clock(g.started_at)}`),
      card("Ready workers", num(ready), `${alive} live${starting ? ` · ${starting} starting` : ""}`,
        { class: `card ${ready === 0 ? "card-bad" : ""}` }),
      card("Shadows", num(shadows), "standing by"),
      card("Outstanding", num(outstanding), "requests in flight"),
      card("Prefix cache", percent(state.prefix_cache_hit_rate), "hits, all workers"),
      this.deathCard(state.queries_of_death || [], card),
      card("Sessions open", num(state.totals?.sessions_open), plural(state.totals?.turns ?? 0, "turn")),
      card("Store", bytes(g.store_bytes), "trajectory store"),
    );
  }

  // Queries of death: requests convicted of crashing workers, refused at once while remembered.
  deathCard(convicted, card) {
    const refused = convicted.reduce((sum, c) => sum + (c.refused || 0), 0);
    const killed = convicted.reduce((sum, c) => sum + (c.workers?.length || 0), 0);
    const note = convicted.length
      ? `${plural(killed, "worker")} killed · ${plural(refused, "retry", "retries")} refused`
      : "none remembered";
    return card("Queries of death", num(convicted.length), note,
      { class: `card ${convicted.length ? "card-bad" : ""}`, title: convicted.map((c) => c.fingerprint).join("\n") });
  }

  renderWorkers(workers) {
    const tbody = $("#workers tbody");
    const rows = workers.map((w) => this.workerRow(w));
    if (!rows.length) rows.push(h("tr", {}, h("td", { colspan: 9, class: "empty" }, "No workers.")));
    replace(tbody, rows);
    const dead = workers.filter((w) => w.state === "dead").length;
    replace($("#workers-summary"), `${plural(workers.length, "worker")}${dead ? ` · ${dead} dead` : ""}`);
    const starting = workers.filter((w) => w.state === "starting");
    replace(
      $("#replacements"),
      starting.map((w) =>
        h("div", { class: "replacement", "data-replacement": w.name },
          h("span", { class: "replacement-name" }, w.name),
          h("span", { class: "muted" }, w.launched === false ? "connecting" : "cold start"),
          this.progress(w),
        ),
      ),
    );
  }

  workerRow(w) {
    const t = w.last_transition;
    return h(
      "tr",
      { dataset: { worker: w.name }, class: `worker-row state-${w.state}` },
      h("td", { class: "name" }, w.name, w.launched === false ? h("span", { class: "tag" }, "remote") : null,
        w.node ? h("span", { class: "tag ray-node", title: `Ray node ${w.node}` }, `node ${w.node.slice(0, 8)}`) : null),
      h("td", { class: "state", "data-state": w.state },
        badge(w.state), w.state === "starting" ? this.progress(w) : null),
      h("td", { class: "mono pid" }, w.pid ?? "—"),
      h("td", { class: "mono url" }, w.url ? h("span", { title: w.url }, w.url.replace(/^https?:\/\//, "")) : "—"),
      h("td", { class: "num outstanding" }, num(w.outstanding)),
      h("td", { class: "num served" }, num(w.served)),
      h("td", { class: "num cache-hits" }, percent(w.prefix_cache_hit_rate)),
      h("td", { class: "num uptime" },
        w.state === "dead" || w.uptime_s === null || w.uptime_s === undefined
          ? "—"
          : h("span", { "data-uptime": w.uptime_s }, duration(w.uptime_s))),
      h("td", {},
        t
          ? h("div", { class: "transition" },
            h("span", { class: "from-to" }, `${t.from ?? "—"} → ${t.to}`),
            t.why ? h("span", { class: "why", title: t.why }, t.why) : null,
            h("span", { class: "muted when", "data-ago": t.at }, ago(t.at)))
          : h("span", { class: "muted" }, "—")),
    );
  }

  progress(w) {
    const timeout = w.start_timeout_s || 0;
    return h("span", { class: "progress", "data-elapsed": w.starting_elapsed_s ?? 0, "data-timeout": timeout },
      h("span", { class: "progress-bar" }), h("span", { class: "progress-text" }));
  }

  // Sandboxes across a Ray cluster: each node that offers them, alive, lost or refused (and why).
  renderNodes(nodes) {
    $("#sandbox-nodes-panel").hidden = nodes.length === 0;
    replace($("#sandbox-nodes tbody"), nodes.map((n) =>
      h("tr", { dataset: { node: n.node }, class: `node-row state-${n.state}` },
        h("td", { class: "mono" }, n.node),
        h("td", { class: "state", "data-state": n.state }, badge(n.state)),
        h("td", { class: "num" }, num(n.sandboxes), n.lost_sandboxes ? h("span", { class: "muted" }, ` +${n.lost_sandboxes} lost`) : null),
        h("td", { class: "num" }, num(n.slots)),
        h("td", { class: "mono" }, n.docker ? `${n.docker} · ${n.criu}` : "—"),
        h("td", { class: "why" }, n.reason ? h("span", { title: n.reason }, n.reason) : h("span", { class: "muted" }, "—")),
      )));
    const alive = nodes.filter((n) => n.state === "alive");
    const free = alive.reduce((sum, n) => sum + n.slots - n.sandboxes, 0);
    replace($("#sandbox-nodes-summary"), `${alive.length} of ${plural(nodes.length, "node")} alive · ${plural(free, "free slot")}`);
  }

  renderSandboxes(state) {
    const tbody = $("#sandboxes tbody");
    const boxes = state.sandboxes || [];
    const rows = boxes.map((s) =>
      h("tr", { dataset: { sandbox: s.sandbox_id } },
        h("td", { class: "mono" }, h("a", { href: `#/session/${s.session_id}`, title: s.session_id }, shortId(s.session_id, 24))),
        h("td", { class: "mono" }, shortId(s.sandbox_id, 24)),
        h("td", { class: "mono sandbox-node" }, s.node || "—"),
        h("td", { class: "state", "data-state": s.state }, badge(s.state)),
        h("td", { class: "num" }, num(s.checkpoints)),
        h("td", { class: "num" }, num(s.restores)),
      ),
    );
    if (!rows.length) {
      const why = state.gateway.sandboxes ? "No sandboxes running." : "Sandboxes are off on this gateway (--sandboxes).";
      rows.push(h("tr", {}, h("td", { colspan: 6, class: "empty" }, why)));
    }
    replace(tbody, rows);
    const counts = {};
    for (const s of boxes) counts[s.state] = (counts[s.state] || 0) + 1;
    replace($("#sandboxes-summary"), Object.entries(counts).map(([k, v]) => `${v} ${k}`).join(" · "));
  }

  // Once a second: uptimes, "ago" times and start-up progress move without a new snapshot.
  tick() {
    const since = this.live.sinceSnapshot();
    for (const el of document.querySelectorAll("#view-health [data-uptime]")) {
      el.textContent = duration(Number(el.dataset.uptime) + since);
    }
    for (const el of document.querySelectorAll("#view-health [data-ago]")) {
      el.textContent = ago(Number(el.dataset.ago));
    }
    for (const el of document.querySelectorAll("#view-health .progress")) {
      const elapsed = Number(el.dataset.elapsed) + since;
      const timeout = Number(el.dataset.timeout);
      const share = timeout > 0 ? Math.min(1, elapsed / timeout) : 0;
      el.querySelector(".progress-bar").style.width = `${(share * 100).toFixed(1)}%`;
      el.querySelector(".progress-text").textContent = timeout > 0
        ? `${duration(elapsed)} / ${duration(timeout)}`
        : duration(elapsed);
      el.classList.toggle("late", share >= 0.8);
    }
  }
}
