// Events: the fleet's event log, newest first, filtered by node and job (by the API) and
// kind (here); "show more" reaches further back.

import * as api from "./api.js";
import { errorBox, fill, fmtTime, h, hashQuery, poll, table } from "./dom.js";

const LIMIT = 200;

function detailText(d) {
  if (!d || typeof d !== "object") return "";
  return Object.entries(d)
    .filter(([k]) => k !== "job")
    .map(([k, v]) => `${k}=${typeof v === "object" ? JSON.stringify(v) : v}`)
    .join(" ");
}

export function mount(root) {
  const q = hashQuery();
  const ui = { node: q.get("node") || "", job: q.get("job") || "", limit: Number(q.get("limit") || LIMIT) };
  const node = h("input", { type: "search", id: "events-node", placeholder: "node", value: ui.node });
  const job = h("input", { type: "search", id: "events-job", placeholder: "job", value: ui.job });
  const kind = h("input", { type: "search", id: "events-kind", placeholder: "kind (-ckpt hides)", title: "events whose kind contains this; -text hides those that do" });
  const els = { error: h("div"), list: h("div"), more: h("div", { class: "controls" }) };
  let found = [];
  const apply = (ev) => {
    if (ev) ev.preventDefault();
    ui.node = node.value.trim();
    ui.job = job.value.trim();
    const p = new URLSearchParams();
    if (ui.node) p.set("node", ui.node);
    if (ui.job) p.set("job", ui.job);
    history.replaceState(null, "", `#/events${p.toString() ? `?${p}` : ""}`);
    timer.now();
  };
  fill(
    root,
    h("h1", {}, "Events"),
    h("form", { class: "controls", onsubmit: apply }, node, job, kind, h("button", { type: "submit" }, "filter")),
    els.error,
    els.list,
    els.more,
  );
  const render = () => {
    const needle = kind.value.trim().toLowerCase();
    const hide = needle.startsWith("-");
    const word = hide ? needle.slice(1) : needle;
    const rows = found
      .filter((e) => !word || e.kind.toLowerCase().includes(word) !== hide)
      .slice()
      .reverse()
      .map((e) =>
        h(
          "tr",
          { class: "event", dataset: { id: e.id, kind: e.kind } },
          h("td", { class: "num" }, e.id),
          h("td", {}, fmtTime(e.ts)),
          h("td", {}, e.kind),
          h("td", {}, e.node ? h("a", { href: `#/events?node=${encodeURIComponent(e.node)}` }, e.node) : "–"),
          h("td", {}, e.detail && e.detail.job ? h("a", { href: `#/jobs/${encodeURIComponent(e.detail.job)}` }, e.detail.job) : "–"),
          h("td", { class: "why" }, detailText(e.detail)),
        ),
      );
    fill(els.list, rows.length ? table(["id", "time", "kind", "node", "job", "detail"], rows, { id: "events" }) : h("p", { class: "muted" }, "No event."));
    fill(
      els.more,
      found.length >= ui.limit
        ? h("button", { type: "button", onclick: () => { ui.limit = Math.min(10000, ui.limit * 2); timer.now(); } }, `show more (newest ${ui.limit} shown)`)
        : null,
    );
  };
  kind.addEventListener("input", render);
  const timer = poll(async () => {
    const p = new URLSearchParams({ limit: String(ui.limit) });
    if (ui.node) p.set("node", ui.node);
    if (ui.job) p.set("job", ui.job);
    try {
      found = await api.get(`v1/events?${p}`);
      fill(els.error);
    } catch (err) {
      fill(els.error, errorBox(err));
      return;
    }
    render();
  }, 5000);
  return { unmount: () => timer.stop() };
}
