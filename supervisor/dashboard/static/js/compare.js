// Compare: a reported scalar of several jobs overlaid by step, their specs side by side.
//   #/compare?jobs=A,B,C&metric=loss

import * as api from "./api.js";
import { JobSeries, color, lineChart } from "./charts.js";
import { badge, codeText, errorBox, fill, fmtNum, fmtTime, h, hashQuery, poll, section } from "./dom.js";

function setQuery(ids, metric) {
  const q = new URLSearchParams();
  if (ids.length) q.set("jobs", ids.join(","));
  if (metric) q.set("metric", metric);
  history.replaceState(null, "", `#/compare?${q}`);
}

/** A row of the lineage table: the label, each job's cell; a row of what made the runs
 * (`made`) is marked where the jobs differ. */
function row(label, jobs, get, made = false) {
  const texts = jobs.map((j) => (j.view ? get(j.view) : null));
  const shown = texts.filter((t) => t !== null).map((t) => (typeof t === "string" ? t : t.textContent));
  const differ = made && new Set(shown).size > 1;
  return h(
    "tr",
    { class: differ ? "differs" : "" },
    h("th", {}, label),
    jobs.map((j, i) => h("td", {}, j.view ? texts[i] : j.error ? errorBox(j.error) : "…")),
  );
}

function lineageTable(jobs) {
  const spec = (v) => v.spec || {};
  const hyper = [...new Set(jobs.flatMap((j) => Object.keys((j.view && spec(j.view).hyperparams) || {})))].sort();
  return h(
    "table",
    { id: "lineage", class: "lineage" },
    h("thead", {}, h("tr", {}, h("th", {}, ""), jobs.map((j, i) => h("th", {}, h("i", { class: "swatch", dataset: { i } }), h("a", { href: `#/jobs/${encodeURIComponent(j.id)}` }, j.id))))),
    h(
      "tbody",
      {},
      row("name", jobs, (v) => v.name),
      row("state", jobs, (v) => badge(v.state)),
      row("team", jobs, (v) => v.team),
      row("submitted", jobs, (v) => fmtTime(v.submitted_at)),
      row("code", jobs, (v) => codeText(spec(v).code_ref), true),
      row("data", jobs, (v) => spec(v).data_snapshot || "–", true),
      hyper.map((k) => row(`hyperparam ${k}`, jobs, (v) => (k in (spec(v).hyperparams || {}) ? String(spec(v).hyperparams[k]) : "–"), true)),
      row("command", jobs, (v) => h("code", {}, (spec(v).command || []).join(" ")), true),
      row("workdir", jobs, (v) => spec(v).workdir || "–"),
      row("env keys", jobs, (v) => Object.keys(spec(v).env || {}).join(", ") || "–", true),
      row("size", jobs, (v) => `${spec(v).nodes}×${spec(v).ranks_per_node}`, true),
      row("checkpoint", jobs, (v) => (spec(v).checkpoint ? (spec(v).checkpoint.tiers || []).join(" → ") : "–")),
      row("restarts", jobs, (v) => String(v.restarts)),
      row("latest", jobs, (v) => (v.summary && v.summary.step !== null && v.summary.step !== undefined ? `step ${v.summary.step}, loss ${fmtNum(v.summary.loss)}` : "–")),
    ),
  );
}

export function mount(root) {
  const q = hashQuery();
  let ids = (q.get("jobs") || "").split(",").map((s) => s.trim()).filter(Boolean);
  let metric = q.get("metric") || "loss";
  const input = h("input", { type: "text", id: "compare-jobs", size: 60, value: ids.join(", "), placeholder: "job ids, comma-separated" });
  const select = h("select", { id: "compare-metric" });
  const els = { error: h("div"), chart: h("div", { class: "chart", id: "compare-chart" }), note: h("p", { class: "muted", id: "compare-note" }), lineage: h("div") };
  fill(
    root,
    h("h1", {}, "Compare"),
    h(
      "form",
      {
        class: "controls",
        onsubmit: (ev) => {
          ev.preventDefault();
          ids = input.value.split(/[\s,]+/).filter(Boolean);
          setQuery(ids, metric);
          start();
        },
      },
      input,
      " by step: ",
      select,
      h("button", { type: "submit" }, "compare"),
    ),
    els.error,
    section("Series", els.note, els.chart),
    section("Lineage", els.lineage),
  );
  select.addEventListener("change", () => {
    metric = select.value;
    setQuery(ids, metric);
    draw();
  });

  let jobs = []; // {id, view, error, series}
  let chart = null;

  const draw = () => {
    const names = [...new Set(["loss", ...jobs.flatMap((j) => Object.keys(j.series.points))])].sort();
    if ([...select.options].map((o) => o.value).join() !== names.join()) {
      fill(select, names.map((n) => h("option", { value: n, selected: n === metric }, n)));
    }
    const tables = jobs.map((j) => j.series.byStep(metric));
    const data = uPlot.join(tables.map(([xs, ys]) => [xs, ys]));
    if (chart) chart.destroy();
    fill(els.chart);
    chart = lineChart(els.chart, {
      name: "compare",
      title: `${metric} by step`,
      labels: jobs.map((j) => `${j.id}${j.view ? ` (${j.view.name})` : ""}`),
      spanGaps: true,
      height: 320,
    });
    chart.set(tables.length ? data : [[]]);
    const none = jobs.filter((j) => j.series.available === false).map((j) => j.id);
    const empty = jobs.filter((j) => j.series.available !== false && !(j.series.points[metric] || []).length).map((j) => j.id);
    fill(
      els.note,
      none.length ? `No metrics yet from ${none.join(", ")}. ` : "",
      empty.length ? `No ${metric} from ${empty.join(", ")}.` : "",
    );
    els.chart.hidden = jobs.length > 0 && none.length === jobs.length;
    fill(els.lineage, jobs.length ? lineageTable(jobs) : h("p", { class: "muted" }, "Name jobs above, or tick them on the jobs page."));
    for (const sw of els.lineage.querySelectorAll(".swatch")) sw.style.background = color(Number(sw.dataset.i));
  };

  let timer = null;
  const start = () => {
    if (timer) timer.stop();
    jobs = ids.map((id) => ({ id, view: null, error: null, series: new JobSeries(api.get, id) }));
    timer = poll(async () => {
      fill(els.error);
      await Promise.all(
        jobs.map(async (j) => {
          try {
            j.view = await api.get(`v1/jobs/${encodeURIComponent(j.id)}`);
            j.error = null;
            await j.series.refresh();
          } catch (err) {
            j.error = err;
          }
        }),
      );
      draw();
    }, 10000);
  };
  start();
  return {
    unmount() {
      if (timer) timer.stop();
      if (chart) chart.destroy();
    },
  };
}
