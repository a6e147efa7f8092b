// Sweeps: every sweep (#/sweeps), and one (#/sweeps/ID): its trials (a table sorted by
// any column), the objective of each trial over steps (from its job's series: a pruned
// trial's line stops where it was pruned), and each parameter against the objective.
// The charts' data is published on window.phalanx.charts: "sweep-objective" and
// "sweep-param-NAME" (x: the parameter, y: [complete trials' values, pruned trials']).

import * as api from "./api.js";
import { JobSeries, color, lineChart } from "./charts.js";
import { badge, errorBox, fill, fmtNum, fmtTime, h, poll, section, table } from "./dom.js";

function counts(s) {
  const c = s.counts || {};
  return `${c.complete || 0} complete · ${c.pruned || 0} pruned · ${c.failed || 0} failed · ${c.running || 0} running of ${s.n_trials}`;
}

function paramText(v) {
  return typeof v === "number" ? fmtNum(v) : String(v);
}

function sweepLink(s) {
  return h("a", { href: `#/sweeps/${encodeURIComponent(s.id)}`, class: "sweep-link", dataset: { sweep: s.id } }, s.id);
}

function mountList(root) {
  const body = h("div");
  fill(root, h("h1", {}, "Sweeps"), body);
  const p = poll(async () => {
    let found;
    try {
      found = await api.get("v1/sweeps");
    } catch (err) {
      fill(body, errorBox(err));
      return;
    }
    const rows = found.map((s) =>
      h(
        "tr",
        { dataset: { sweep: s.id } },
        h("td", {}, sweepLink(s)),
        h("td", {}, badge(s.state)),
        h("td", {}, s.team),
        h("td", {}, counts(s)),
        h("td", { class: "num" }, s.best ? fmtNum(s.best.value) : "–"),
        h("td", {}, fmtTime(s.created_at)),
      ),
    );
    fill(
      body,
      section(
        `${found.length} sweep${found.length === 1 ? "" : "s"}`,
        found.length
          ? table(["sweep", "state", "team", "trials", { num: "best" }, "created"], rows, { id: "sweeps" })
          : h("p", { class: "muted" }, "No sweep yet: phalanx sweep submit SPEC"),
      ),
    );
  }, 3000);
  return { unmount: () => p.stop() };
}

const STATE_ORDER = { running: 0, complete: 1, pruned: 2, failed: 3 };

/** The key a column sorts by: numbers before text, missing values last. */
function sortKey(t, column) {
  if (column === "number") return t.number;
  if (column === "state") return STATE_ORDER[t.state] ?? 9;
  if (column === "value") return typeof t.value === "number" ? t.value : Infinity;
  if (column === "pruned_at") return t.pruned_at ?? Infinity;
  if (column.startsWith("param:")) {
    const v = t.params[column.slice(6)];
    return v === undefined ? Infinity : v;
  }
  return t[column] ?? "";
}

function compare(a, b) {
  if (typeof a === "number" && typeof b === "number") return a - b;
  if (typeof a === "number") return -1;
  if (typeof b === "number") return 1;
  return String(a).localeCompare(String(b));
}

/** A scatter of one parameter against the objective: complete trials and pruned ones
 * (their last value reported) as two series of points. */
function scatter(el, name, param) {
  const box = h("div", { class: "chart-box" });
  el.appendChild(box);
  const categorical = param.type === "categorical";
  const choices = categorical ? param.choices.map(String) : [];
  const width = () => Math.max(260, Math.min(480, el.clientWidth / 2 - 24));
  const u = new uPlot(
    {
      title: `${name} vs objective`,
      width: width(),
      height: 220,
      scales: { x: { time: false, distr: param.log ? 3 : 1, ...(categorical ? { range: [-0.5, choices.length - 0.5] } : {}) } },
      series: [
        { label: name, value: (u, v) => (v === null ? "–" : categorical ? choices[v] : fmtNum(v)) },
        { label: "complete", stroke: color(0), fill: color(0), paths: () => null, points: { show: true, size: 8 } },
        { label: "pruned", stroke: color(1), fill: color(1), paths: () => null, points: { show: true, size: 8 } },
      ],
      axes: [
        categorical ? { splits: () => choices.map((_, i) => i), values: (u, splits) => splits.map((i) => choices[i] ?? "") } : {},
        { size: 60 },
      ],
    },
    [[], [], []],
    box,
  );
  return {
    set(trials) {
      const pts = trials
        .filter((t) => (t.state === "complete" || t.state === "pruned") && typeof t.value === "number" && name in t.params)
        .map((t) => [categorical ? choices.indexOf(String(t.params[name])) : t.params[name], t.value, t.state]);
      pts.sort((a, b) => a[0] - b[0]);
      const data = [pts.map((p) => p[0]), pts.map((p) => (p[2] === "complete" ? p[1] : null)), pts.map((p) => (p[2] === "pruned" ? p[1] : null))];
      u.setData(data);
      window.phalanx.charts[`sweep-param-${name}`] = { x: data[0], y: [data[1], data[2]], labels: ["complete", "pruned"] };
    },
    destroy() {
      u.destroy();
    },
  };
}

function mountSweep(root, id) {
  const els = {
    head: h("div"),
    summary: h("div"),
    trials: h("div", { id: "sweep-trials" }),
    objective: h("div", { class: "chart", id: "sweep-objective" }),
    params: h("div", { class: "chart params", id: "sweep-params" }),
  };
  fill(
    root,
    els.head,
    els.summary,
    section("Objective by step", h("p", { class: "muted" }, "Each trial's objective over its steps, from its job's series: a pruned trial's line stops at the rung that pruned it."), els.objective),
    section("Parameters against the objective", els.params),
    section("Trials", els.trials),
  );
  const ui = { sort: "number", desc: false };
  const series = new Map(); // job -> JobSeries
  const fetched = new Set(); // jobs of ended trials, fetched once after they ended
  let chart = null;
  let chartKey = "";
  let scatters = null;
  let last = null;

  function renderTable(s) {
    const names = Object.keys(s.space);
    const trials = s.trials.slice().sort((a, b) => compare(sortKey(a, ui.sort), sortKey(b, ui.sort)) * (ui.desc ? -1 : 1));
    const head = (label, column, num = false) =>
      h(
        "th",
        {
          class: `sortable${num ? " num" : ""}${ui.sort === column ? (ui.desc ? " sorted-desc" : " sorted-asc") : ""}`,
          dataset: { sort: column },
          onclick: () => {
            ui.desc = ui.sort === column ? !ui.desc : false;
            ui.sort = column;
            renderTable(last);
          },
        },
        label,
      );
    const best = s.best ? s.best.number : null;
    const rows = trials.map((t) =>
      h(
        "tr",
        { class: `trial${t.number === best ? " best" : ""}`, dataset: { trial: t.number, state: t.state } },
        h("td", { class: "num" }, String(t.number)),
        h("td", {}, badge(t.state)),
        h("td", { class: "num" }, fmtNum(t.value)),
        names.map((n) => h("td", { class: "num" }, n in t.params ? paramText(t.params[n]) : "–")),
        h("td", { class: "num" }, t.pruned_at ?? "–"),
        h("td", {}, t.job ? h("a", { href: `#/jobs/${encodeURIComponent(t.job)}`, class: "job-link", dataset: { job: t.job } }, t.job) : "–"),
        h("td", { class: "why" }, t.reason || (t.retry_of !== null && t.retry_of !== undefined ? `retry of trial ${t.retry_of}` : "")),
      ),
    );
    fill(
      els.trials,
      h(
        "table",
        { id: "trials" },
        h("thead", {}, h("tr", {}, head("#", "number", true), head("state", "state"), head("value", "value", true), names.map((n) => head(n, `param:${n}`, true)), head("pruned at", "pruned_at", true), head("job", "job"), h("th", {}, "reason"))),
        h("tbody", {}, rows),
      ),
    );
  }

  async function renderObjective(s) {
    const metric = s.objective.metric;
    const trials = s.trials.filter((t) => t.job);
    for (const t of trials) {
      if (!series.has(t.job)) series.set(t.job, new JobSeries(api.get, t.job, { names: [metric], fullEvery: 1 }));
      if (t.state === "running" || !fetched.has(t.job)) {
        await series.get(t.job).refresh();
        if (t.state !== "running") fetched.add(t.job);
      }
    }
    const key = trials.map((t) => t.number).join(",");
    if (!chart || key !== chartKey) {
      if (chart) chart.destroy();
      fill(els.objective);
      chart = lineChart(els.objective, { name: "sweep-objective", title: `${metric} by step`, labels: trials.map((t) => `trial ${t.number}`), spanGaps: true });
      chartKey = key;
    }
    const byTrial = trials.map((t) => {
      const [steps, ys] = series.get(t.job).byStep(metric);
      return new Map(steps.map((x, i) => [x, ys[i]]));
    });
    const xs = [...new Set(byTrial.flatMap((m) => [...m.keys()]))].sort((a, b) => a - b);
    chart.set([xs, ...byTrial.map((m) => xs.map((x) => (m.has(x) ? m.get(x) : null)))]);
  }

  function renderParams(s) {
    if (!scatters) {
      fill(els.params);
      scatters = Object.entries(s.space).map(([name, param]) => scatter(els.params, name, param));
    }
    for (const sc of scatters) sc.set(s.trials);
  }

  const p = poll(async () => {
    let s;
    try {
      s = await api.get(`v1/sweeps/${encodeURIComponent(id)}`);
    } catch (err) {
      fill(els.head, h("h1", {}, "Sweep ", id), errorBox(err));
      return;
    }
    last = s;
    window.phalanx.sweep = s;
    const obj = s.objective;
    fill(els.head, h("h1", {}, "Sweep ", h("span", { id: "sweep-id" }, s.id), badge(s.state)));
    fill(
      els.summary,
      h(
        "section",
        { class: "card", id: "sweep-summary" },
        h("p", {}, `${obj.direction} ${obj.metric} (${obj.at}) · sampler ${s.sampler.type} · pruner ${s.pruner.type} · ${s.parallelism} at once · priority ${s.priority} · team ${s.team}`),
        h("p", {}, counts(s), s.reason ? ` — ${s.reason}` : ""),
        h(
          "p",
          { id: "sweep-best" },
          s.best ? `best: trial ${s.best.number}, ${fmtNum(s.best.value)} (${Object.entries(s.best.params).map(([k, v]) => `${k}=${paramText(v)}`).join(", ")})` : "best: –",
        ),
        s.importance
          ? h("p", { id: "sweep-importance" }, "what matters (fANOVA): ", Object.entries(s.importance).map(([k, v]) => `${k} ${fmtNum(v, 2)}`).join(" · "))
          : null,
      ),
    );
    renderTable(s);
    renderParams(s);
    await renderObjective(s);
  }, 3000);
  return {
    unmount() {
      p.stop();
      if (chart) chart.destroy();
      for (const sc of scatters || []) sc.destroy();
    },
  };
}

export function mount(root, id) {
  return id ? mountSweep(root, id) : mountList(root);
}
