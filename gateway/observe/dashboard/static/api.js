// The gateway's JSON APIs, with the API token when the gateway has one. The token comes from the page's
// address (#token=...) or the token dialog and is kept in this tab's sessionStorage only. URLs are
// relative to the page (/dashboard), so a gateway served under a path prefix works too.

const TOKEN_KEY = "belayer.token";

export class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

// `#token=abc` (or `#/recovery&token=abc`): keep the token and take it out of the address bar.
export function takeTokenFromHash() {
  const match = location.hash.match(/(?:^#|&)token=([^&]*)/);
  if (!match) return;
  sessionStorage.setItem(TOKEN_KEY, decodeURIComponent(match[1]));
  // the token and its separator: `#/session/x&token=abc` is `#/session/x`, not `#/session/x&`
  const rest = location.hash.replace(/^#token=[^&]*&?/, "#").replace(/&token=[^&]*/, "");
  history.replaceState(null, "", rest && rest !== "#" ? rest : "#/health");
}

export function token() {
  return sessionStorage.getItem(TOKEN_KEY);
}

export function setToken(value) {
  sessionStorage.setItem(TOKEN_KEY, value);
}

export function url(path, params) {
  const u = new URL(path, document.baseURI);
  for (const [key, value] of Object.entries(params || {})) {
    if (value !== null && value !== undefined && value !== "") u.searchParams.set(key, value);
  }
  return u;
}

export async function getJson(path, params, signal) {
  const headers = { Accept: "application/json" };
  const t = token();
  if (t) headers.Authorization = `Bearer ${t}`;
  const response = await fetch(url(path, params), { headers, signal, cache: "no-store" });
  if (!response.ok) {
    let message = `${response.status} ${response.statusText}`;
    try {
      const body = await response.json();
      message = body?.error?.message || body?.detail || message;
    } catch {
      // not JSON: keep the status line
    }
    throw new ApiError(response.status, message);
  }
  return response.json();
}

// EventSource cannot send headers: the token goes in the query (the gateway accepts it on this route).
export function eventsUrl(since) {
  return url("api/events", { since, token: token() }).toString();
}

export function trajectoryUrl(sessionId) {
  return url(`api/sessions/${encodeURIComponent(sessionId)}/trajectory`).toString();
}
