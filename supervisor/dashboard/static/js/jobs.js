// Jobs: the queue with why each job waits, the jobs holding nodes, the finished ones
// (a page at a time, newest submitted first, paged by the server: GET /v1/jobs?state=
// &limit=&before=). Ticked jobs open side by side on the compare page.

import * as api from "./api.js";
import { badge, errorBox, fill, fmtAgo, fmtDuration, fmtPct, h, pager, poll, section, table } from "./dom.js";

const ACTIVE = ["starting", "running", "recovering", "stopping"];
const FINISHED = ["succeeded", "failed", "cancelled"];
const PAGE = 25;

// cursors[n]: the `before` of finished page n (null: the first), from X-Phalanx-Next
const ui = { page: 0, cursors: [null], picked: new Set() };

function jobLink(j) {
  return h("a", { href: `#/jobs/${encodeURIComponent(j.id)}`, class: "job-link", dataset: { job: j.id } }, j.id);
}

function pick(j) {
  return h("input", {
    type: "checkbox",
    title: "compare",
    checked: ui.picked.has(j.id),
    onchange: (ev) => {
      if (ev.target.checked) ui.picked.add(j.id);
      else ui.picked.delete(j.id);
      renderCompare();
    },
  });
}

function size(j) {
  const s = j.spec || {};
  return `${s.nodes ?? "?"}×${s.ranks_per_node ?? "?"}`;
}

function waiting(j) {
  const w = j.waiting;
  if (!w) return "–";
  return w.detail ? `${w.reason}: ${w.detail}` : w.reason;
}

function summaryCell(j) {
  const s = j.summary; // with the training metrics (GET /v1/jobs carries them when known)
  if (!s || s.step === null || s.step === undefined) return "–";
  return `step ${s.step}${s.loss !== null && s.loss !== undefined ? ` · loss ${Number(s.loss).toPrecision(4)}` : ""}`;
}

let els = null;
let jobsCache = []; // the jobs not ended: few, all of them
let finished = { items: [], total: 0 }; // the finished page shown
let loads = 0; // the newest load's number: an older one in flight renders nothing

function renderCompare() {
  if (!els) return;
  const ids = [...ui.picked];
  fill(
    els.compare,
    ids.length
      ? h("a", { class: "button", href: `#/compare?jobs=${ids.map(encodeURIComponent).join(",")}` }, `compare ${ids.length} picked`)
      : h("span", { class: "muted" }, "tick jobs to compare them"),
  );
}

function render() {
  const now = Date.now() / 1000;
  const queue = jobsCache
    .filter((j) => j.state === "pending")
    .sort((a, b) => b.priority - a.priority || a.submitted_at - b.submitted_at);
  const active = jobsCache.filter((j) => ACTIVE.includes(j.state));
  const slice = finished.items;
  fill(
    els.body,
    section(
      `Queue (${queue.length})`,
      queue.length
        ? table(
            ["", "job", "name", "team", { num: "priority" }, "size", "waiting because", "waited"],
            queue.map((j) =>
              h(
                "tr",
                { dataset: { job: j.id } },
                h("td", {}, pick(j)),
                h("td", {}, jobLink(j)),
                h("td", {}, j.name),
                h("td", {}, j.team),
                h("td", { class: "num" }, j.priority),
                h("td", {}, size(j)),
                h("td", { class: "why" }, waiting(j)),
                h("td", {}, fmtDuration(now - j.submitted_at)),
              ),
            ),
            { id: "queue" },
          )
        : h("p", { class: "muted" }, "Nothing waits."),
    ),
    section(
      `Running (${active.length})`,
      active.length
        ? table(
            ["", "job", "name", "team", "state", "nodes", { num: "gen" }, { num: "restarts" }, "progress", { num: "ETTR" }, "running for"],
            active.map((j) =>
              h(
                "tr",
                { dataset: { job: j.id } },
                h("td", {}, pick(j)),
                h("td", {}, jobLink(j)),
                h("td", {}, j.name),
                h("td", {}, j.team),
                h("td", {}, badge(j.state)),
                h("td", {}, j.nodes.join(", ")),
                h("td", { class: "num" }, j.generation),
                h("td", { class: "num" }, `${j.restarts} / ${j.max_restarts}`),
                h("td", {}, summaryCell(j)),
                h("td", { class: "num" }, (j.goodput && j.goodput.ettr_upper_bound ? "≤ " : "") + fmtPct(j.goodput && j.goodput.ettr)),
                h("td", {}, j.started_at ? fmtDuration(now - j.started_at) : "–"),
              ),
            ),
            { id: "running" },
          )
        : h("p", { class: "muted" }, "No job holds nodes."),
    ),
    section(
      `Finished (${finished.total})`,
      finished.total
        ? table(
            ["", "job", "name", "team", "state", "reason", "ended", "took", { num: "restarts" }, { num: "ETTR" }],
            slice.map((j) =>
              h(
                "tr",
                { dataset: { job: j.id } },
                h("td", {}, pick(j)),
                h("td", {}, jobLink(j)),
                h("td", {}, j.name),
                h("td", {}, j.team),
                h("td", {}, badge(j.state)),
                h("td", { class: "why" }, j.reason || "–"),
                h("td", {}, fmtAgo(j.ended_at)),
                h("td", {}, j.started_at && j.ended_at ? fmtDuration(j.ended_at - j.started_at) : "–"),
                h("td", { class: "num" }, j.restarts),
                h("td", { class: "num" }, (j.goodput && j.goodput.ettr_upper_bound ? "≤ " : "") + fmtPct(j.goodput && j.goodput.ettr)),
              ),
            ),
            { id: "finished" },
          )
        : h("p", { class: "muted" }, "No job has ended yet."),
      pager(finished.total, PAGE, ui.page, (p) => {
        if (ui.cursors[p] === undefined) return; // no cursor for it yet: only the next page
        ui.page = p;
        load();
      }),
    ),
  );
}

async function load() {
  const mine = ++loads;
  const q = new URLSearchParams({ state: FINISHED.join(","), limit: String(PAGE) });
  if (ui.cursors[ui.page]) q.set("before", ui.cursors[ui.page]);
  let active;
  let page;
  try {
    [active, page] = await Promise.all([
      api.get(`v1/jobs?state=${["pending", ...ACTIVE].join(",")}`),
      api.getPage(`v1/jobs?${q}`),
    ]);
  } catch (err) {
    if (els && mine === loads) fill(els.error, errorBox(err));
    return;
  }
  if (!els || mine !== loads) return;
  if (!page.items.length && ui.page > 0) {
    // the page emptied (jobs gone from it): back to the first
    ui.page = 0;
    ui.cursors = [null];
    load();
    return;
  }
  fill(els.error);
  jobsCache = active;
  finished = { items: page.items, total: page.total ?? page.items.length };
  ui.cursors.length = ui.page + 1;
  if (page.next) ui.cursors.push(page.next);
  render();
}

export function mount(root) {
  els = { body: h("div"), compare: h("div", { class: "controls" }), error: h("div") };
  fill(root, h("h1", {}, "Jobs"), els.compare, els.error, els.body);
  renderCompare();
  const timer = poll(load, 5000);
  return {
    unmount() {
      timer.stop();
      els = null;
    },
  };
}
