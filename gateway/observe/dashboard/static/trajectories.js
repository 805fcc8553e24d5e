// Trajectories: the session list with filters and server-side paging (GET /api/sessions). The filters
// live in the address (#/trajectories?status=open&offset=50), so a filtered page can be linked to.

import { ApiError, getJson } from "./api.js";
import { $, badge, datetime, fixed, h, num, replace, shortId, throttle } from "./util.js";

const PAGE = 50;
const FIELDS = ["status", "reward_min", "reward_max", "has_reward", "meta", "created_after", "created_before", "order"];

export class TrajectoriesView {
  constructor(onAuth) {
    this.onAuth = onAuth;
    this.params = new URLSearchParams();
    this.visible = false;
    this.controller = null;
    this.form = $("#session-filters");
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      location.hash = `#/trajectories${query(this.formParams())}`;
    });
    this.form.addEventListener("reset", () => {
      setTimeout(() => {
        location.hash = "#/trajectories";
      });
    });
    $("#page-prev").addEventListener("click", () => this.page(-1));
    $("#page-next").addEventListener("click", () => this.page(1));
    this.refreshSoon = throttle(() => this.load(), 2000);
  }

  show(params) {
    this.visible = true;
    this.params = params;
    this.fillForm(params);
    this.load();
  }

  hide() {
    this.visible = false;
  }

  // New and changed sessions: refresh the first page (a later page would shift under the reader).
  onEvent(event) {
    if (!this.visible || Number(this.params.get("offset") || 0) > 0) return;
    if (["session_created", "session_updated", "turn_finished"].includes(event.kind)) this.refreshSoon();
  }

  formParams() {
    const out = new URLSearchParams();
    for (const name of FIELDS) {
      const value = this.form.elements[name].value.trim();
      if (value && !(name === "order" && value === "desc")) out.set(name, value);
    }
    return out;
  }

  fillForm(params) {
    for (const name of FIELDS) this.form.elements[name].value = params.get(name) || (name === "order" ? "desc" : "");
  }

  page(direction) {
    const params = new URLSearchParams(this.params);
    const offset = Math.max(0, Number(params.get("offset") || 0) + direction * PAGE);
    if (offset) params.set("offset", String(offset));
    else params.delete("offset");
    location.hash = `#/trajectories${query(params)}`;
  }

  apiParams() {
    const p = this.params;
    const out = { limit: PAGE, offset: Number(p.get("offset") || 0), order: p.get("order") || "desc" };
    for (const name of ["status", "reward_min", "reward_max", "has_reward"]) if (p.get(name)) out[name] = p.get(name);
    for (const name of ["created_after", "created_before"]) {
      const value = p.get(name);
      if (value) out[name] = String(Date.parse(value) / 1000);
    }
    for (const pair of (p.get("meta") || "").split(",")) {
      const [key, ...rest] = pair.split("=");
      if (key.trim() && rest.length) out[`meta.${key.trim()}`] = rest.join("=").trim();
    }
    return out;
  }

  async load() {
    this.controller?.abort();
    const controller = new AbortController();
    this.controller = controller;
    const params = this.apiParams();
    let body;
    try {
      body = await getJson("api/sessions", params, controller.signal);
    } catch (err) {
      if (err.name === "AbortError") return;
      if (err instanceof ApiError && err.status === 401) this.onAuth(err);
      replace($("#sessions tbody"), h("tr", {}, h("td", { colspan: 7, class: "empty error" }, `Could not list sessions: ${err.message}`)));
      return;
    }
    if (controller !== this.controller) return;
    this.renderRows(body.data || []);
    this.renderPager(params, body);
  }

  renderRows(sessions) {
    const rows = sessions.map((s) =>
      h("tr", { dataset: { session: s.id }, class: "clickable", onclick: (event) => {
        if (!event.target.closest("a")) location.hash = `#/session/${encodeURIComponent(s.id)}`;
      } },
      h("td", { class: "mono" }, h("a", { href: `#/session/${encodeURIComponent(s.id)}`, title: s.id }, shortId(s.id, 24))),
      h("td", {}, badge(s.status)),
      h("td", { class: "mono muted" }, datetime(s.created_at)),
      h("td", { class: "num" }, num(s.num_turns)),
      h("td", { class: "num" }, num(s.num_branches)),
      h("td", { class: "num reward" }, s.reward === null || s.reward === undefined ? h("span", { class: "muted" }, "—") : fixed(s.reward, 3)),
      h("td", { class: "meta" }, metaChips(s.metadata))),
    );
    if (!rows.length) rows.push(h("tr", {}, h("td", { colspan: 7, class: "empty" }, "No sessions match.")));
    replace($("#sessions tbody"), rows);
  }

  renderPager(params, body) {
    const count = (body.data || []).length;
    const total = typeof body.total === "number" ? body.total : null;
    const first = count ? params.offset + 1 : 0;
    const last = params.offset + count;
    const of = total === null ? "" : ` of ${num(total)}`;
    replace($("#page-info"), count ? `${num(first)}–${num(last)}${of}` : `0${of}`);
    replace($("#sessions-summary"), total === null ? "" : `${num(total)} matching`);
    $("#page-prev").disabled = params.offset === 0;
    $("#page-next").disabled = total === null ? count < PAGE : last >= total;
  }
}

export function metaChips(metadata) {
  const entries = Object.entries(metadata || {});
  const chips = entries.slice(0, 4).map(([k, v]) =>
    h("span", { class: "chip-static", title: `${k}=${typeof v === "string" ? v : JSON.stringify(v)}` },
      h("span", { class: "k" }, k), h("span", { class: "v" }, typeof v === "string" ? v : JSON.stringify(v))));
  if (entries.length > 4) chips.push(h("span", { class: "muted" }, `+${entries.length - 4}`));
  return chips;
}

function query(params) {
  const s = params.toString();
  return s ? `?${s}` : "";
}
