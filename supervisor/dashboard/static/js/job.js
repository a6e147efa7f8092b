// One job: its state, generations with their failures and recovery phases, goodput,
// checkpoints per tier, live training charts, and the tail of a rank's log.

import * as api from "./api.js";
import { JobSeries, lineChart } from "./charts.js";
import {
  badge,
  codeText,
  errorBox,
  fill,
  fmtAgo,
  fmtBytes,
  fmtClock,
  fmtDuration,
  fmtNum,
  fmtPct,
  fmtTime,
  h,
  pager,
  poll,
  section,
  table,
} from "./dom.js";

const PHASES = ["detect", "plan", "stop", "prepare", "launch", "restore", "first_step"];
const MAIN_CHARTS = [
  ["loss", "loss"],
  ["grad_norm", "grad norm"],
  ["tokens_per_s", "throughput (tokens/s)"],
];
const LOG_TAIL = 64 * 1024; // bytes of a rank's log the page starts from
const LOG_LINES = 400; // lines it keeps
const CKPT_PAGE = 10;
const FINAL = ["succeeded", "failed", "cancelled"];

function kv(pairs, cls = "kv") {
  return h(
    "dl",
    { class: cls },
    pairs.filter(([, v]) => v !== null && v !== undefined && v !== "").map(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]),
  );
}

function phaseBar(phases) {
  const known = PHASES.filter((p) => typeof phases[p] === "number");
  const total = known.reduce((s, p) => s + phases[p], 0);
  const bar = h("div", { class: "phases", title: known.map((p) => `${p} ${fmtDuration(phases[p])}`).join(" · ") });
  for (const p of known) {
    const seg = h("span", { class: `phase phase-${p}` });
    seg.style.width = `${total > 0 ? Math.max(2, (100 * phases[p]) / total) : 100 / known.length}%`;
    bar.appendChild(seg);
  }
  const legend = h(
    "div",
    { class: "phase-legend" },
    PHASES.map((p) =>
      h("span", { class: "phase-key" }, h("i", { class: `phase phase-${p}` }), `${p.replace("_", " ")} ${typeof phases[p] === "number" ? fmtDuration(phases[p]) : "–"}`),
    ),
  );
  return h("div", {}, bar, legend);
}

/** The ranks a relaunch started cold (no warm interpreter became them), by reason. */
function coldNote(cold) {
  const reasons = Object.entries(cold || {});
  if (!reasons.length) return "";
  return h("div", { class: "cold-launch" }, reasons.map(([why, ranks]) => h("div", {}, `cold launch of ranks ${ranks}: ${why}`)));
}

function failures(list) {
  return (list || []).map((f) =>
    h(
      "div",
      { class: "failure" },
      h("b", {}, f.kind || "failure"),
      f.rank !== undefined && f.rank !== null ? ` rank ${f.rank}` : "",
      f.node ? ` on ${f.node}` : "",
      f.code !== undefined && f.code !== null ? ` exit ${f.code}` : "",
      f.signal ? ` signal ${f.signal}` : "",
      f.detail ? `: ${f.detail}` : "",
    ),
  );
}

function planText(plan) {
  if (!plan) return "–";
  const swaps = (plan.swaps || []).map(([a, b]) => `${a} → ${b}`).join(", ");
  // A rollback (the loss guard) skips the steps [start, stop): their data is not trained again.
  const skip = plan.skip ? `skipped steps ${plan.skip[0]}–${plan.skip[1] - 1}` : "";
  return [plan.action, plan.cause ? `(${plan.cause})` : "", swaps ? `swaps ${swaps}` : "", skip].filter(Boolean).join(" ");
}

/** One row per generation: when it ran, how it ended, and the recovery that followed. */
function generations(job) {
  const byGen = new Map((job.incidents || []).map((i) => [i.generation, i]));
  const rows = [];
  for (let g = job.generation; g >= 1; g -= 1) {
    const inc = byGen.get(g);
    const prev = byGen.get(g - 1);
    const began = g === 1 ? job.first_started_at || job.started_at : prev && prev.resumed_at;
    let ended;
    if (inc) ended = h("span", {}, `failed at step ${inc.failed_step ?? "?"}`, failures(inc.failures));
    else if (g === job.generation) ended = badge(job.state);
    else ended = "–";
    rows.push(
      h(
        "tr",
        { class: "generation", dataset: { generation: g } },
        h("td", { class: "num" }, g),
        h("td", {}, fmtTime(began)),
        h("td", {}, sizeText(inc ? inc.size : g === job.generation ? currentSize(job) : null)),
        h("td", {}, ended),
        h("td", {}, inc ? planText(inc.plan) : "–"),
        h("td", {}, inc ? `${inc.outcome}${inc.restored_step !== null && inc.restored_step !== undefined ? `, restored step ${inc.restored_step}` : ""}` : "–"),
        h("td", { class: "num" }, inc ? lostWork(inc) : "–"),
        h("td", { class: "num" }, inc ? fmtDuration(inc.downtime_s) : "–"),
        h("td", { class: "phases-cell" }, inc ? phaseBar(inc.phases || {}) : "–", inc ? coldNote(inc.cold_ranks) : ""),
      ),
    );
  }
  return table([{ num: "gen" }, "began", "size", "ended", "recovery plan", "outcome", { num: "work lost" }, { num: "downtime" }, "recovery phases"], rows, {
    id: "generations",
  });
}

/** A generation's size: nodes, ranks and, for an elastic job, its accumulation steps. */
function sizeText(size) {
  if (!size) return "–";
  const accumulation = size.accumulation ? `, accumulation ${size.accumulation}` : "";
  return `${size.nodes} nodes, ${size.world_size} ranks${accumulation}`;
}

function currentSize(job) {
  const e = job.elastic;
  return { nodes: job.nodes.length || (e ? e.nodes : 0), world_size: job.world_size, accumulation: e ? e.accumulation : null };
}

/** The work a recovery lost; unknown (never 0) for a job that reports no steps. */
function lostWork(inc) {
  if (inc.lost_work_s === null || inc.lost_work_s === undefined) return "unknown";
  return `${inc.lost_steps ?? "–"} steps, ${fmtDuration(inc.lost_work_s)}`;
}

function goodput(job) {
  const g = job.goodput || {};
  const bound = g.ettr_upper_bound ? "≤ " : "";
  const unknown = g.lost_work_unknown ? ` + unknown (${g.lost_work_unknown} recover${g.lost_work_unknown === 1 ? "y" : "ies"}: the job reports no steps)` : "";
  return h(
    "div",
    { class: "goodput", id: "goodput" },
    h("div", { class: "big" }, g.ettr === null || g.ettr === undefined ? "–" : bound + fmtPct(g.ettr)),
    h(
      "div",
      { class: "muted" },
      g.ettr_upper_bound
        ? "ETTR, an upper bound: some lost work or downtime is not known"
        : "ETTR (time on steps that count / wall time)",
    ),
    kv([
      ["wall", fmtDuration(g.wall_s)],
      ["lost", (bound ? "≥ " : "") + fmtDuration(g.lost_s)],
      ["downtime", fmtDuration(g.downtime_s)],
      ["work redone", fmtDuration(g.lost_work_s) + unknown],
    ]),
  );
}

function checkpoints(cat, ui, rerender) {
  if (!cat) return h("p", { class: "muted" }, "loading…");
  const steps = [...cat.steps].reverse();
  if (!steps.length) return h("p", { class: "muted" }, "No checkpoint yet.");
  const tiers = [...cat.tiers, ...new Set(steps.flatMap((s) => Object.keys(s.committed)).filter((t) => !cat.tiers.includes(t)))];
  const newest = tiers.map((t) => {
    const s = steps.find((x) => t in x.committed);
    return h("span", { class: "chip" }, `${t}: ${s ? `step ${s.step}` : "none"}`);
  });
  const withLoss = steps.some((s) => "loss" in s); // the supervisor knows each step's loss
  const slice = steps.slice(ui.ckptPage * CKPT_PAGE, (ui.ckptPage + 1) * CKPT_PAGE);
  const rows = slice.map((s) =>
    h(
      "tr",
      { class: "ckpt", dataset: { step: s.step } },
      h("td", { class: "num" }, s.step),
      tiers.map((t) => {
        if (t in s.committed) return h("td", { class: "ok", title: `committed ${fmtTime(s.committed[t])}` }, `✓ ${fmtClock(s.committed[t])}`);
        if (t in s.partial) return h("td", { class: "warn" }, `${s.partial[t]}/${cat.world_size} ranks`);
        return h("td", { class: "muted" }, "–");
      }),
      withLoss ? h("td", { class: "num" }, fmtNum(s.loss)) : null,
      h("td", { class: "num" }, fmtBytes(Math.max(0, ...Object.values(s.bytes || {})))),
    ),
  );
  return h(
    "div",
    {},
    h("p", {}, "Newest committed: ", newest),
    table([{ num: "step" }, ...tiers, withLoss ? { num: "loss" } : null, { num: "size" }].filter(Boolean), rows, { id: "checkpoints" }),
    pager(steps.length, CKPT_PAGE, ui.ckptPage, (p) => {
      ui.ckptPage = p;
      rerender();
    }),
  );
}

function specBox(spec) {
  if (!spec) return null;
  const env = Object.keys(spec.env || {});
  return kv([
    ["command", (spec.command || []).join(" ")],
    ["workdir", spec.workdir],
    ["env", env.length ? env.join(", ") : "–"],
    ["size", `${spec.nodes} nodes × ${spec.ranks_per_node} ranks`],
    ["checkpoint", spec.checkpoint ? `${(spec.checkpoint.tiers || []).join(" → ")}` : "–"],
    ["code", spec.code_ref ? codeText(spec.code_ref) : null],
    ["data", spec.data_snapshot],
    ["hyperparams", Object.entries(spec.hyperparams || {}).map(([k, v]) => `${k}=${v}`).join(" ") || null],
  ]);
}

/** The tail of one rank's log, then what it appends. */
class LogTail {
  constructor(jobId, pre) {
    this.jobId = jobId;
    this.pre = pre;
    this.rank = 0;
    this.reset();
  }

  reset() {
    this.quiet = false;
    this.offset = null;
    this.node = null;
    this.lines = [];
    this.partial = "";
  }

  async refresh() {
    const base = `v1/jobs/${encodeURIComponent(this.jobId)}/logs?rank=${this.rank}`;
    if (this.offset === null) {
      const probe = await api.getText(`${base}&offset=0&limit=1`);
      const size = Number(probe.headers.get("X-Phalanx-Size") || 0);
      this.offset = Math.max(0, size - LOG_TAIL);
      this.node = probe.headers.get("X-Phalanx-Node");
    }
    const { text, headers } = await api.getText(`${base}&offset=${this.offset}&limit=${LOG_TAIL}`);
    const node = headers.get("X-Phalanx-Node");
    const size = Number(headers.get("X-Phalanx-Size") || 0);
    if (node !== this.node || size < this.offset) {
      this.reset(); // a new generation, or the rank moved: start over from its new log
      return this.refresh();
    }
    this.offset = Number(headers.get("X-Phalanx-Offset") || this.offset + text.length);
    this.quiet = !text;
    if (text) {
      const parts = (this.partial + text).split("\n");
      this.partial = parts.pop();
      this.lines.push(...parts);
      if (this.lines.length > LOG_LINES) this.lines.splice(0, this.lines.length - LOG_LINES);
      const stick = this.pre.scrollTop + this.pre.clientHeight >= this.pre.scrollHeight - 4;
      fill(this.pre, [...this.lines, this.partial].join("\n"));
      if (stick) this.pre.scrollTop = this.pre.scrollHeight;
    }
  }
}

export function mount(root, jobId) {
  const ui = { ckptPage: 0 };
  let job = null;
  let cat = null;
  const els = {
    head: h("div"),
    error: h("div"),
    goodput: h("div", { class: "card" }),
    spec: h("div"),
    gens: h("div"),
    charts: h("div", { class: "charts", id: "charts" }),
    chartNote: h("p", { class: "muted", id: "chart-note" }, "loading metrics…"),
    ckpts: h("div"),
    logRank: h("input", { type: "number", id: "log-rank", min: "0", value: "0", class: "rank" }),
    log: h("pre", { class: "log", id: "log" }),
    logNote: h("p", { class: "muted" }),
  };
  fill(
    root,
    els.head,
    els.error,
    h("div", { class: "row" }, els.goodput, section("Spec", els.spec)),
    section("Training", els.chartNote, els.charts),
    section("Generations and recoveries", els.gens),
    section("Checkpoints", els.ckpts),
    section("Log", h("div", { class: "controls" }, h("label", {}, "rank ", els.logRank)), els.logNote, els.log),
  );

  const renderHead = () => {
    const active = ["pending", "starting", "running", "recovering"].includes(job.state);
    fill(
      els.head,
      h(
        "h1",
        {},
        job.name,
        " ",
        h("span", { class: "muted" }, job.id),
        " ",
        badge(job.state),
        active
          ? h(
              "button",
              {
                type: "button",
                class: "danger",
                id: "cancel",
                onclick: async () => {
                  if (!confirm(`Cancel job ${job.id} (${job.name})?`)) return;
                  try {
                    job = await api.post(`v1/jobs/${encodeURIComponent(job.id)}/cancel`);
                    renderHead();
                  } catch (err) {
                    fill(els.error, errorBox(err));
                  }
                },
              },
              "cancel",
            )
          : null,
      ),
      kv([
        ["team", job.team],
        ["priority", job.priority],
        ["nodes", job.nodes.length ? job.nodes.map((n, i) => [i ? ", " : "", h("a", { href: `#/fleet?filter=${encodeURIComponent(n)}` }, n)]) : "–"],
        ["generation", job.generation],
        ["restarts", `${job.restarts} of ${job.max_restarts}`],
        ["submitted", fmtTime(job.submitted_at)],
        ["started", fmtTime(job.started_at)],
        ["ended", job.ended_at ? fmtTime(job.ended_at) : null],
        ["waiting", job.waiting ? `${job.waiting.reason}${job.waiting.detail ? `: ${job.waiting.detail}` : ""}` : null],
        ["reason", job.reason],
        ["recovering", job.recovery ? `since ${fmtAgo(job.recovery.detected_at)}` : null],
        ["events", h("a", { href: `#/events?job=${encodeURIComponent(job.id)}` }, "this job's events")],
      ], "kv wide"),
    );
    fill(els.goodput, h("h2", {}, "Goodput"), goodput(job));
    fill(els.spec, specBox(job.spec));
    fill(els.gens, generations(job));
    els.logRank.max = String(Math.max(0, job.world_size - 1)); // a number, not 16k options
  };
  const renderCkpts = () => fill(els.ckpts, checkpoints(cat, ui, renderCkpts));

  const tail = new LogTail(jobId, els.log);
  els.logRank.addEventListener("change", () => {
    const rank = Number(els.logRank.value);
    if (!Number.isInteger(rank) || rank < 0 || (job && rank >= job.world_size)) return;
    tail.rank = rank;
    tail.reset();
    fill(els.log);
    logTimer.now();
  });

  // Charts: the three that matter always; every other series the job reports after them.
  const series = new JobSeries(api.get, jobId);
  const charts = new Map();
  const chartFor = (name, title) => {
    if (!charts.has(name)) {
      const box = h("div", { class: "chart", dataset: { series: name } });
      els.charts.appendChild(box);
      charts.set(name, lineChart(box, {
        name,
        title,
        time: true,
        bands: recoveries,
        legendValue: (u, v, si, idx) => (v === null || v === undefined ? "–" : `${fmtNum(v)}${idx !== null && idx !== undefined ? ` @ step ${series.stepAt(name, idx)}` : ""}`),
      }));
    }
    return charts.get(name);
  };
  // The job's recoveries, shaded on the charts: from the fault to the resumed run.
  const recoveries = () => {
    if (!job) return [];
    const spans = (job.incidents || []).map((i) => [i.fault_at, i.resumed_at || i.fault_at]);
    if (job.recovery && job.recovery.fault_at) spans.push([job.recovery.fault_at, Date.now() / 1000]);
    return spans;
  };
  const titleOf = (name) => name.replace(/_s$/, " (s)").replaceAll("_", " ");
  for (const [name, title] of MAIN_CHARTS) chartFor(name, title);
  const renderCharts = () => {
    window.phalanx.metrics = series.points;
    for (const name of Object.keys(series.points).sort()) chartFor(name, titleOf(name));
    for (const [name, chart] of charts) chart.set(series.byTime(name));
    const missing = MAIN_CHARTS.filter(([n]) => !(series.points[n] || []).length).map(([n]) => n);
    const s = series.summary;
    fill(
      els.chartNote,
      s && s.step !== null && s.step !== undefined ? `step ${s.step} · loss ${fmtNum(s.loss)} · ${fmtNum(s.tokens_per_s)} tokens/s · ${fmtDuration(s.step_time_s)} a step` : "",
      (job && job.incidents && job.incidents.length) || (job && job.recovery) ? " · shaded: recoveries" : "",
      s && s.stragglers && s.stragglers.length ? ` · stragglers: ${s.stragglers.map((x) => `rank ${x.rank} (${x.ratio}×)`).join(", ")}` : "",
      missing.length ? ` · not reported (yet): ${missing.join(", ")}` : "",
    );
  };

  const jobTimer = poll(async () => {
    try {
      job = await api.get(`v1/jobs/${encodeURIComponent(jobId)}`);
      fill(els.error);
    } catch (err) {
      fill(els.error, errorBox(err));
      return;
    }
    renderHead();
  }, 3000);
  const ckptTimer = poll(async () => {
    cat = await api.get(`v1/jobs/${encodeURIComponent(jobId)}/checkpoints`);
    renderCkpts();
  }, 5000);
  const metricsTimer = poll(async () => {
    try {
      if (!(await series.refresh())) {
        fill(els.chartNote, "No metrics yet (the supervisor has none for this job).");
        els.charts.hidden = true;
        return;
      }
      els.charts.hidden = false;
    } catch (err) {
      fill(els.chartNote, errorBox(err));
      return;
    }
    renderCharts();
  }, 3000);
  const logTimer = poll(async () => {
    if (!job || !job.ranks.length) {
      fill(els.logNote, "No rank placed yet.");
      return;
    }
    if (FINAL.includes(job.state) && tail.quiet) return; // the job ended and its log with it
    try {
      await tail.refresh();
      fill(els.logNote, `rank ${tail.rank} on ${tail.node || "?"}`);
    } catch (err) {
      fill(els.logNote, errorBox(err));
    }
  }, 3000);
  return {
    unmount() {
      for (const t of [jobTimer, ckptTimer, metricsTimer, logTimer]) t.stop();
      for (const c of charts.values()) c.destroy();
    },
  };
}
