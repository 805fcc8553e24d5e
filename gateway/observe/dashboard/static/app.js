// The dashboard's entry point: hash routes (#/health, #/recovery, #/trajectories?..., #/session/<id>),
// one live feed for every view, and the API token dialog.

import { ApiError, setToken, takeTokenFromHash } from "./api.js";
import { HealthView } from "./health.js";
import { Live, TIMELINE_KINDS } from "./live.js";
import { RecoveryView } from "./recovery.js";
import { SessionView } from "./session.js";
import { TrajectoriesView } from "./trajectories.js";
import { $, duration, replace } from "./util.js";

let current = null;

let renderTimer = null;

// Under load the feed brings many events a second: draw the health and recovery views at most 5 times.
function renderSoon() {
  if (renderTimer) return;
  renderTimer = setTimeout(() => {
    renderTimer = null;
    if (!live.state) return;
    health.render(live.state);
    recovery.render(live.state, current === "recovery");
    renderSummary(live.state);
  }, 200);
}

const live = new Live({
  onState: () => renderSoon(),
  onEvent: (event) => {
    if (event.kind === "sample" || TIMELINE_KINDS.has(event.kind)) renderSoon();
    trajectories.onEvent(event);
    session.onEvent(event);
  },
  onStatus: (status) => {
    const el = $("#live");
    el.dataset.state = status;
    replace(el.querySelector(".label"), status);
  },
  onAuth: () => askToken(),
});

const health = new HealthView(live);
const recovery = new RecoveryView(live);
const trajectories = new TrajectoriesView(() => askToken());
const session = new SessionView(() => askToken());

function route() {
  const raw = location.hash.replace(/^#\/?/, "");
  const [path, query = ""] = raw.split("?");
  const params = new URLSearchParams(query);
  const [name, ...rest] = path.split("/");
  const view = ["health", "recovery", "trajectories", "session"].includes(name) ? name : "health";
  current = view;
  for (const section of document.querySelectorAll("main > .view")) section.hidden = section.dataset.view !== view;
  const tab = view === "session" ? "trajectories" : view;
  for (const a of document.querySelectorAll(".tabs a")) a.classList.toggle("active", a.dataset.view === tab);
  if (view === "trajectories") trajectories.show(params);
  else trajectories.hide();
  if (view === "session") session.show(decodeURIComponent(rest.join("/")), params);
  else session.hide();
  if (view === "recovery") recovery.shown(live.state);
  document.title = `Belayer · ${view === "session" ? `session ${rest.join("/").slice(0, 12)}` : view}`;
  if (view !== "session") window.scrollTo(0, 0);
}

function renderSummary(state) {
  const g = state.gateway;
  const uptime = duration((g.uptime_s || 0) + live.sinceSnapshot());
  replace($("#gateway-summary"), `${g.version ? `v${g.version} · ` : ""}up ${uptime}`);
}

let asking = null;

function askToken() {
  if (asking) return asking;
  const dialog = $("#token-dialog");
  asking = new Promise((resolve) => {
    dialog.addEventListener("close", () => {
      const value = dialog.querySelector("input").value.trim();
      asking = null;
      if (value) setToken(value);
      resolve();
      location.reload(); // start again with the token: the feed, the snapshot and the view
    }, { once: true });
    if (!dialog.open) dialog.showModal();
  });
  return asking;
}

function banner(message) {
  const el = $("#banner");
  el.hidden = !message;
  replace(el, message || "");
}

async function start() {
  try {
    await live.start();
    banner(null);
  } catch (err) {
    if (!(err instanceof ApiError && err.status === 401)) {
      banner(`Could not reach the gateway's dashboard API: ${err.message}. Retrying…`);
      setTimeout(start, 3000);
    }
  }
}

function main() {
  takeTokenFromHash();
  window.addEventListener("hashchange", () => {
    takeTokenFromHash(); // a link with a token, pasted into this tab's address bar
    route();
  });
  route();
  start();
  setInterval(() => {
    if (!live.state) return;
    health.tick();
    renderSummary(live.state);
  }, 1000);
}

main();
