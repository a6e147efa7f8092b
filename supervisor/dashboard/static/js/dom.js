// Building the page: elements from data, text only (no HTML is ever parsed from data),
// and the formatters every page shares.

/**
 * h("a", {href: "#/jobs", class: "x", onclick: fn, dataset: {job: id}}, "text", child)
 * Children: strings (text nodes), nodes, arrays of them, null/false (skipped).
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key.startsWith("on")) el.addEventListener(key.slice(2), value);
    else if (key in el && typeof value !== "string") el[key] = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else if (child instanceof Node) el.appendChild(child);
    else el.appendChild(document.createTextNode(String(child)));
  }
}

/** Replace el's children. */
export function fill(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

/** A table; a header given as {num: "label"} heads a column of numbers (right-aligned). */
export function table(headers, rows, attrs = {}) {
  const th = (x) => (x && typeof x === "object" && "num" in x ? h("th", { class: "num" }, x.num) : h("th", {}, x));
  return h("table", attrs, h("thead", {}, h("tr", {}, headers.map(th))), h("tbody", {}, rows));
}

export function plural(n, word) {
  return `${n.toLocaleString()} ${word}${n === 1 ? "" : "s"}`;
}

export function badge(state) {
  return h("span", { class: `badge state-${state}` }, state);
}

export function section(title, ...children) {
  return h("section", { class: "card" }, h("h2", {}, title), ...children);
}

/** A pager: page numbers of `count` items, `size` a page; onPage(n) when one is picked. */
export function pager(count, size, page, onPage) {
  const pages = Math.max(1, Math.ceil(count / size));
  if (pages <= 1) return null;
  const go = (n) => () => onPage(Math.min(pages - 1, Math.max(0, n)));
  return h(
    "div",
    { class: "pager" },
    h("button", { type: "button", disabled: page === 0, onclick: go(page - 1) }, "‹ prev"),
    ` page ${page + 1} of ${pages} (${count}) `,
    h("button", { type: "button", disabled: page >= pages - 1, onclick: go(page + 1) }, "next ›"),
  );
}

export function fmtTime(ts) {
  if (ts === null || ts === undefined) return "–";
  const d = new Date(ts * 1000);
  return d.toLocaleString(undefined, { hour12: false });
}

export function fmtClock(ts) {
  if (ts === null || ts === undefined) return "–";
  return new Date(ts * 1000).toLocaleTimeString(undefined, { hour12: false });
}

export function fmtDuration(s) {
  if (s === null || s === undefined || Number.isNaN(s)) return "–";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 60) return `${s.toFixed(1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.round(s % 60)} s`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.round((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d ${Math.round((s % 86400) / 3600)} h`;
}

export function fmtAgo(ts) {
  if (!ts) return "–";
  return `${fmtDuration(Math.max(0, Date.now() / 1000 - ts))} ago`;
}

export function fmtNum(v, digits = 4) {
  if (v === null || v === undefined) return "–";
  if (typeof v === "string") return v; // "NaN", "Infinity" as the API sends them
  if (Number.isInteger(v)) return v.toLocaleString();
  if (Math.abs(v) >= 1000) return v.toLocaleString(undefined, { maximumFractionDigits: 1 });
  return Number(v.toPrecision(digits)).toString();
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = n;
  let i = 0;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i += 1;
  }
  return i === 0 ? `${v} B` : `${v.toFixed(1)} ${units[i]}`;
}

export function fmtPct(v) {
  return v === null || v === undefined ? "–" : `${(v * 100).toFixed(1)} %`;
}

/** Run fn now and every `ms` after it finishes, until stop(); skips while the tab is hidden. */
export function poll(fn, ms) {
  let timer = null;
  let stopped = false;
  const tick = async () => {
    if (stopped) return;
    if (!document.hidden) {
      try {
        await fn();
      } catch (err) {
        if (!stopped) console.debug("poll", err);
      }
    }
    if (!stopped) timer = setTimeout(tick, ms);
  };
  tick();
  return {
    stop() {
      stopped = true;
      clearTimeout(timer);
    },
    now() {
      clearTimeout(timer);
      tick();
    },
  };
}

/** The query of a hash route: "#/events?node=n01" -> URLSearchParams("node=n01"). */
export function hashQuery() {
  const i = location.hash.indexOf("?");
  return new URLSearchParams(i < 0 ? "" : location.hash.slice(i + 1));
}

export function errorBox(err) {
  return h("p", { class: "error" }, err && err.message ? err.message : String(err));
}

/** The code a spec's code_ref names: "abc1234 (dirty) from URL". */
export function codeText(ref) {
  if (!ref) return "–";
  return `${ref.commit}${ref.dirty ? " (dirty)" : ""}${ref.source ? ` from ${ref.source}` : ""}`;
}
