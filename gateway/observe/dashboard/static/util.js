// Small helpers shared by the views: building elements (text only: data never goes through innerHTML),
// and formatting numbers, durations, sizes and times.

export function h(tag, props, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key === "text") el.textContent = value;
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

export function append(el, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function replace(el, ...children) {
  el.replaceChildren();
  return append(el, children);
}

export const $ = (selector, root = document) => root.querySelector(selector);

export function debounce(fn, ms) {
  let timer = null;
  return (...args) => {
    clearTimeout(timer);
    timer = setTimeout(() => fn(...args), ms);
  };
}

// At most one call every `ms`, and always one after the last request (a trailing call).
export function throttle(fn, ms) {
  let last = 0;
  let timer = null;
  return () => {
    const wait = last + ms - Date.now();
    if (timer) return;
    timer = setTimeout(() => {
      timer = null;
      last = Date.now();
      fn();
    }, Math.max(0, wait));
  };
}

const nf = new Intl.NumberFormat("en-US");

export function num(n) {
  return n === null || n === undefined ? "—" : nf.format(n);
}

export function fixed(n, digits = 1) {
  return n === null || n === undefined || Number.isNaN(n) ? "—" : Number(n).toFixed(digits);
}

export function percent(ratio) {
  return ratio === null || ratio === undefined || Number.isNaN(ratio) ? "—" : `${(ratio * 100).toFixed(1)}%`;
}

export function ms(value) {
  if (value === null || value === undefined) return "—";
  if (value >= 10000) return `${(value / 1000).toFixed(1)} s`;
  if (value >= 100) return `${Math.round(value)} ms`;
  return `${Number(value).toFixed(1)} ms`;
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || seconds < 0) return "—";
  const s = Math.floor(seconds);
  if (s < 60) return `${s}s`;
  const m = Math.floor(s / 60);
  if (m < 60) return `${m}m ${String(s % 60).padStart(2, "0")}s`;
  const hrs = Math.floor(m / 60);
  if (hrs < 48) return `${hrs}h ${String(m % 60).padStart(2, "0")}m`;
  return `${Math.floor(hrs / 24)}d ${hrs % 24}h`;
}

export function bytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return `${v.toFixed(i === 0 ? 0 : 1)} ${units[i]}`;
}

export function clock(ts) {
  if (!ts) return "—";
  const d = new Date(ts * 1000);
  return d.toLocaleTimeString([], { hour12: false });
}

export function datetime(ts) {
  if (!ts) return "—";
  const d = new Date(ts * 1000);
  const pad = (x) => String(x).padStart(2, "0");
  return (
    `${d.getFullYear()}-${pad(d.getMonth() + 1)}-${pad(d.getDate())} ` +
    `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}`
  );
}

export function ago(ts) {
  if (!ts) return "—";
  const s = Date.now() / 1000 - ts;
  return s < 1 ? "just now" : `${duration(s)} ago`;
}

export function shortId(id, max = 14) {
  return id && id.length > max ? `${id.slice(0, max - 2)}…` : id;
}

export function badge(text, kind = text) {
  return h("span", { class: `badge badge-${kind}` }, text);
}

export function plural(n, word, many = `${word}s`) {
  return `${num(n)} ${n === 1 ? word : many}`;
}
