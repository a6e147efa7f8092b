// Fleet: racks -> nodes, coloured by state. At thousands of nodes the racks start
// collapsed (one coloured tile per node); an open rack lists its nodes a page at a time.

import * as api from "./api.js";
import { badge, errorBox, fill, fmtAgo, fmtBytes, fmtNum, h, hashQuery, pager, plural, poll, table } from "./dom.js";

const STATES = ["up", "warn", "drain", "offline"];
const RACK_PAGE = 64; // node rows an open rack shows at once
const OPEN_ALL_UP_TO = 64; // a fleet (or filter) this small shows every rack open

// Kept while the dashboard is open, so a refresh or a visit elsewhere keeps the view.
const ui = { filter: "", state: "", toggled: new Map(), pages: new Map(), open: new Set() };
const details = new Map(); // node -> its full view (GET /v1/nodes/ID), for the open ones

function why(n) {
  const out = [];
  if (n.drain) out.push(`drained by ${n.drain.by}: ${n.drain.reason}`);
  for (const r of n.reasons || []) {
    if (n.drain && n.drain.reason.includes(r.code)) continue; // the drain already says it
    out.push(`${r.code}${r.gpu !== null && r.gpu !== undefined ? ` (GPU ${r.gpu})` : ""}${r.detail ? `: ${r.detail}` : ""}`);
  }
  if (n.offline_cause) out.push(n.offline_cause);
  return out.join("; ");
}

function matches(n, needle) {
  if (ui.state && n.state !== ui.state) return false;
  if (!needle) return true;
  const hay = [n.id, n.hostname, n.rack, n.state, ...(n.jobs || []), why(n), n.spare ? "spare" : ""];
  return hay.some((x) => x && String(x).toLowerCase().includes(needle));
}

function counts(nodes) {
  const c = Object.fromEntries(STATES.map((s) => [s, 0]));
  for (const n of nodes) c[n.state] = (c[n.state] || 0) + 1;
  return c;
}

function chips(c) {
  return STATES.filter((s) => c[s]).map((s) => h("span", { class: `chip state-${s}` }, `${c[s].toLocaleString()} ${s}`));
}

function tileTitle(n) {
  const g = n.gauges || {};
  const parts = [n.id, n.state, `${n.gpu_count} GPUs`];
  if (g.temperature_max_c !== null && g.temperature_max_c !== undefined) parts.push(`${g.temperature_max_c} °C`);
  if (n.spare) parts.push("spare");
  if (n.jobs && n.jobs.length) parts.push(`jobs: ${n.jobs.join(", ")}`);
  const w = why(n);
  if (w) parts.push(w);
  return parts.join(" · ");
}

function gpuTable(view) {
  const rows = (view.gpu_gauges || []).map((g) =>
    h(
      "tr",
      {},
      h("td", {}, g.index),
      h("td", {}, (view.gpus || []).find((d) => d.index === g.index)?.model || "–"),
      h("td", { class: "num" }, fmtNum(g.temperature_c, 3)),
      h("td", { class: "num" }, fmtNum(g.power_w, 4)),
      h("td", { class: "num" }, fmtNum(g.util_pct, 3)),
      h("td", { class: "num" }, g.mem_used_bytes === null ? "–" : `${fmtBytes(g.mem_used_bytes)} / ${fmtBytes(g.mem_total_bytes)}`),
      h("td", { class: "num" }, fmtNum(g.ecc_sbe_volatile)),
      h("td", { class: `num ${g.ecc_dbe_volatile ? "bad" : ""}` }, fmtNum(g.ecc_dbe_volatile)),
      h("td", { class: "num" }, fmtNum(g.retired_pages)),
      h("td", {}, (g.throttle || []).join(", ") || "–"),
    ),
  );
  const n = (label) => ({ num: label });
  return table(["GPU", "model", n("°C"), n("W"), n("util %"), n("memory"), n("ECC SBE"), n("ECC DBE"), n("retired"), "throttle"], rows, {
    class: "inner",
  });
}

function detailBody(n) {
  const view = details.get(n.id);
  if (!view) return h("p", { class: "muted" }, "loading…");
  const host = view.host;
  return h(
    "div",
    { class: "node-detail" },
    h(
      "p",
      {},
      `${view.hostname || "?"} · ${view.address || "?"}:${view.http_port ?? "?"} · ${view.gpu_backend || "?"} · agent ${view.version || "?"} · last seen ${fmtAgo(view.last_seen)}`,
      host ? ` · disk ${fmtBytes(host.disk_free_bytes)} free of ${fmtBytes(host.disk_total_bytes)} · load ${fmtNum(host.load1, 3)}` : null,
      " · ",
      h("a", { href: `#/events?node=${encodeURIComponent(n.id)}` }, "events"),
    ),
    view.drain ? h("p", {}, `Drained by ${view.drain.by} ${fmtAgo(view.drain.since)}: ${view.drain.reason}${view.drain.codes.length ? ` (${view.drain.codes.join(", ")})` : ""}`) : null,
    gpuTable(view),
  );
}

function nodeRows(n) {
  const g = n.gauges || {};
  const open = ui.open.has(n.id);
  const ecc = g.ecc_sbe_volatile === null || g.ecc_sbe_volatile === undefined ? "–" : `${g.ecc_sbe_volatile} / ${g.ecc_dbe_volatile ?? "–"}`;
  const row = h(
    "tr",
    { class: `node state-${n.state}`, dataset: { node: n.id } },
    h(
      "td",
      {},
      h(
        "button",
        {
          type: "button",
          class: "link",
          title: "GPU details",
          onclick: () => {
            if (ui.open.has(n.id)) ui.open.delete(n.id);
            else ui.open.add(n.id);
            render();
            refreshDetails();
          },
        },
        `${open ? "▾" : "▸"} ${n.id}`,
      ),
    ),
    h("td", {}, badge(n.state)),
    h("td", { class: "num" }, n.gpu_count),
    h("td", { class: `num ${g.temperature_max_c >= 85 ? "bad" : ""}` }, fmtNum(g.temperature_max_c, 3)),
    h("td", { class: `num ${g.ecc_dbe_volatile ? "bad" : ""}` }, ecc),
    h("td", {}, (n.jobs || []).map((j, i) => [i ? ", " : "", h("a", { href: `#/jobs/${encodeURIComponent(j)}` }, j)])),
    h("td", {}, n.spare ? h("span", { class: "chip spare" }, "spare") : ""),
    h("td", { class: "why" }, why(n)),
  );
  if (!open) return [row];
  return [row, h("tr", { class: "detail" }, h("td", { colspan: 8 }, detailBody(n)))];
}

function rackSection(rack, nodes, visible, open) {
  const page = ui.pages.get(rack) || 0;
  const toggle = () => {
    ui.toggled.set(rack, !open);
    render();
  };
  const tiles = h(
    "div",
    { class: "tiles" },
    nodes.map((n) =>
      h("a", {
        class: `tile state-${n.state}${visible.has(n.id) ? "" : " dim"}${n.spare ? " spare" : ""}`,
        href: `#/fleet`,
        title: tileTitle(n),
        "aria-label": tileTitle(n),
        dataset: { node: n.id },
        onclick: (ev) => {
          ev.preventDefault();
          ui.toggled.set(rack, true);
          ui.open.add(n.id);
          const idx = nodes.filter((m) => visible.has(m.id)).findIndex((m) => m.id === n.id);
          if (idx >= 0) ui.pages.set(rack, Math.floor(idx / RACK_PAGE));
          render();
          refreshDetails();
          document.querySelector(`tr.node[data-node="${CSS.escape(n.id)}"]`)?.scrollIntoView({ block: "center" });
        },
      }),
    ),
  );
  const shown = nodes.filter((n) => visible.has(n.id));
  let body = null;
  if (open) {
    const slice = shown.slice(page * RACK_PAGE, (page + 1) * RACK_PAGE);
    body = h(
      "div",
      { class: "rack-body" },
      table(["node", "state", { num: "GPUs" }, { num: "hottest °C" }, { num: "ECC SBE / DBE" }, "jobs", "role", "why"], slice.flatMap(nodeRows), {
        class: "nodes",
      }),
      pager(shown.length, RACK_PAGE, page, (p) => {
        ui.pages.set(rack, p);
        render();
      }),
    );
  }
  return h(
    "section",
    { class: `rack card${open ? " open" : ""}`, dataset: { rack } },
    h(
      "div",
      { class: "rack-head" },
      h("button", { type: "button", class: "link rack-toggle", onclick: toggle }, `${open ? "▾" : "▸"} ${rack}`),
      h("span", { class: "muted" }, plural(nodes.length, "node")),
      h("span", { class: "chips" }, chips(counts(nodes))),
      tiles,
    ),
    body,
  );
}

let nodesCache = null;
let els = null;

function render() {
  if (!els || !nodesCache) return;
  const nodes = nodesCache;
  const needle = ui.filter.trim().toLowerCase();
  const visible = new Set(nodes.filter((n) => matches(n, needle)).map((n) => n.id));
  const c = counts(nodes);
  const gpus = nodes.reduce((s, n) => s + (n.gpu_count || 0), 0);
  const spares = nodes.filter((n) => n.spare).length;
  const busy = nodes.filter((n) => n.jobs && n.jobs.length).length;
  fill(
    els.summary,
    h("span", { class: "big" }, plural(nodes.length, "node")),
    ` · ${plural(gpus, "GPU")} · ${plural(spares, "spare")} · ${plural(busy, "node")} running jobs `,
    chips(c),
    needle || ui.state ? h("span", { class: "muted" }, ` · ${visible.size} match`) : null,
  );
  const racks = new Map();
  for (const n of nodes) {
    const rack = n.rack || "(no rack)";
    if (!racks.has(rack)) racks.set(rack, []);
    racks.get(rack).push(n);
  }
  const openByDefault = visible.size <= OPEN_ALL_UP_TO;
  const sections = [];
  for (const rack of [...racks.keys()].sort()) {
    const members = racks.get(rack);
    if ((needle || ui.state) && !members.some((n) => visible.has(n.id))) continue;
    const open = ui.toggled.has(rack) ? ui.toggled.get(rack) : openByDefault;
    sections.push(rackSection(rack, members, visible, open));
  }
  fill(els.racks, sections.length ? sections : h("p", { class: "muted" }, nodes.length ? "No node matches." : "No node has announced itself yet."));
}

async function refreshDetails() {
  const known = new Set((nodesCache || []).map((n) => n.id));
  for (const id of [...ui.open]) {
    if (!known.has(id)) continue;
    try {
      details.set(id, await api.get(`v1/nodes/${encodeURIComponent(id)}`));
    } catch (err) {
      details.delete(id);
    }
  }
  render();
}

export function mount(root) {
  const q = hashQuery();
  if (q.has("filter")) ui.filter = q.get("filter");
  if (q.has("state")) ui.state = q.get("state");
  const filter = h("input", {
    type: "search",
    id: "fleet-filter",
    placeholder: "filter: node, rack, job, reason…",
    value: ui.filter,
    oninput: (ev) => {
      ui.filter = ev.target.value;
      ui.pages.clear();
      render();
    },
  });
  const select = h(
    "select",
    {
      id: "fleet-state",
      onchange: (ev) => {
        ui.state = ev.target.value;
        ui.pages.clear();
        render();
      },
    },
    h("option", { value: "" }, "every state"),
    STATES.map((s) => h("option", { value: s, selected: ui.state === s }, s)),
  );
  const all = (open) => () => {
    for (const n of nodesCache || []) ui.toggled.set(n.rack || "(no rack)", open);
    render();
  };
  els = {
    summary: h("div", { class: "summary", id: "fleet-summary" }),
    racks: h("div", { id: "racks" }),
    error: h("div"),
  };
  fill(
    root,
    h("h1", {}, "Fleet"),
    els.summary,
    h(
      "div",
      { class: "controls" },
      filter,
      select,
      h("button", { type: "button", onclick: all(true) }, "open all racks"),
      h("button", { type: "button", onclick: all(false) }, "close all"),
    ),
    els.error,
    els.racks,
  );
  render();
  const timer = poll(async () => {
    try {
      nodesCache = await api.get("v1/nodes");
      fill(els.error);
    } catch (err) {
      fill(els.error, errorBox(err));
      return;
    }
    render();
    if (ui.open.size) await refreshDetails();
  }, 5000);
  return {
    unmount() {
      timer.stop();
      els = null;
    },
  };
}
