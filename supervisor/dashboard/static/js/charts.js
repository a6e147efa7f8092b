// Line charts on uPlot (vendored, global `uPlot`), and the training series they plot.
// What each chart plots is published on window.phalanx.charts[name] ({x, y} arrays, the
// chart's own data), so a test or an operator's console can read it.

const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777"];

export function color(i) {
  return PALETTE[i % PALETTE.length];
}

/** A series value as a number for the chart: "NaN"/"Infinity" (JSON strings) are gaps. */
export function num(v) {
  return typeof v === "number" && Number.isFinite(v) ? v : null;
}

/** A short label of an axis value: 1.2e-3, 3.5, 1,050, 250k, 1.2M, 3.4G. */
function tick(v) {
  if (v === null || v === undefined) return "";
  const a = Math.abs(v);
  if (v !== 0 && a < 0.01) return v.toExponential(1);
  for (const [from, size, unit] of [[1e12, 1e12, "T"], [1e9, 1e9, "G"], [1e6, 1e6, "M"], [1e4, 1e3, "k"]]) {
    if (a >= from) return `${Number((v / size).toPrecision(3))}${unit}`;
  }
  return Number(v.toPrecision(4)).toLocaleString();
}

/** Shade spans of x ([from, to] pairs, `bands()`) under the lines: a job's recoveries. */
function shade(bands) {
  return (u) => {
    const { left, top, width, height } = u.bbox;
    const ctx = u.ctx;
    ctx.save();
    ctx.fillStyle = "rgba(220, 38, 38, 0.12)";
    for (const [from, to] of bands()) {
      const x0 = Math.max(left, u.valToPos(from, "x", true));
      const x1 = Math.min(left + width, u.valToPos(to, "x", true));
      if (x1 > x0) ctx.fillRect(x0, top, Math.max(2, x1 - x0), height);
    }
    ctx.restore();
  };
}

/**
 * A chart in `el`. opts: {name, title, time: x is seconds since the epoch (else steps),
 * labels: series labels, legendValue(u, v, seriesIdx, idx)?, bands: () => [[x0, x1]]
 * spans to shade}. Returns {set(data), destroy()}, data in uPlot's form: [xs, ys1, ...].
 */
export function lineChart(el, opts) {
  const labels = opts.labels || [opts.title];
  const series = [
    { label: opts.time ? "time" : "step" },
    ...labels.map((label, i) => ({
      label,
      stroke: color(i),
      width: 1.5,
      spanGaps: !!opts.spanGaps,
      points: { show: false },
      value: opts.legendValue,
    })),
  ];
  const box = document.createElement("div");
  box.className = "chart-box";
  el.appendChild(box);
  const width = () => Math.max(300, el.clientWidth - 16);
  const u = new uPlot(
    {
      title: opts.title,
      width: width(),
      height: opts.height || 220,
      scales: { x: { time: !!opts.time } },
      series,
      axes: [{}, { size: 60, values: (u, splits) => splits.map(tick) }],
      legend: { live: true },
      hooks: opts.bands ? { drawClear: [shade(opts.bands)] } : {},
    },
    [[], ...labels.map(() => [])],
    box,
  );
  const resize = new ResizeObserver(() => u.setSize({ width: width(), height: opts.height || 220 }));
  resize.observe(el);
  const publish = (data) => {
    if (opts.name) window.phalanx.charts[opts.name] = { x: Array.from(data[0]), y: data.slice(1).map((s) => Array.from(s)), labels };
  };
  publish([[], ...labels.map(() => [])]);
  return {
    set(data) {
      u.setData(data);
      publish(data);
    },
    destroy() {
      resize.disconnect();
      u.destroy();
    },
  };
}

/**
 * A job's series, kept in step with GET /v1/jobs/ID/metrics: the first call fetches every
 * series and the answer's cursor, later ones only the points inserted since (after=cursor:
 * late windows of older times included), merged in by (time, step); a full fetch every
 * `fullEvery` calls picks up the server's downsampling. Points are [step, ts, value, min,
 * max, n].
 */
export class JobSeries {
  constructor(get, jobId, { names = null, fullEvery = 20 } = {}) {
    this.get = get;
    this.jobId = jobId;
    this.names = names;
    this.fullEvery = fullEvery;
    this.calls = 0;
    this.cursor = null; // the server's high-water mark of what this holds
    this.points = {}; // name -> points, oldest first
    this.columns = { step: 0, ts: 1, value: 2 };
    this.available = null; // false: the endpoint answered 404 (not there, or no such job)
  }

  async refresh() {
    this.calls += 1;
    // Without the endpoint (an older supervisor), ask again only now and then.
    if (this.available === false && this.calls % 10 !== 0) return false;
    const full = (this.calls - 1) % this.fullEvery === 0 || this.cursor === null;
    const q = new URLSearchParams();
    if (this.names) q.set("names", this.names.join(","));
    if (!full) q.set("after", String(this.cursor));
    let body;
    try {
      body = await this.get(`v1/jobs/${encodeURIComponent(this.jobId)}/metrics?${q}`);
    } catch (err) {
      if (err.status === 404) {
        this.available = false;
        return false;
      }
      throw err;
    }
    this.available = true;
    if (Array.isArray(body.columns)) {
      for (const c of ["step", "ts", "value"]) {
        const i = body.columns.indexOf(c);
        if (i >= 0) this.columns[c] = i;
      }
    }
    const { ts, step } = this.columns;
    const key = (p) => `${p[ts]}|${p[step]}`;
    for (const [name, pts] of Object.entries(body.series || {})) {
      if (full || !this.points[name]) {
        this.points[name] = pts.slice();
        continue;
      }
      const have = this.points[name];
      const from = Math.min(...pts.map((p) => p[ts]));
      const known = new Set();
      for (let i = have.length - 1; i >= 0 && have[i][ts] >= from; i -= 1) known.add(key(have[i]));
      let unordered = false;
      for (const p of pts) {
        if (known.has(key(p))) continue;
        if (have.length && p[ts] < have[have.length - 1][ts]) unordered = true;
        have.push(p);
      }
      if (unordered) have.sort((a, b) => a[ts] - b[ts]); // stable: the server's order
    }
    // A cursor below the one sent: the supervisor's store is not the one it was; the
    // next call fetches everything again.
    const cursor = Number.isInteger(body.cursor) ? body.cursor : null;
    this.cursor = !full && cursor !== null && cursor < this.cursor ? null : cursor;
    this.summary = body.summary || null;
    return true;
  }

  /** [xs, ys] of a series by time. */
  byTime(name) {
    const pts = this.points[name] || [];
    return [pts.map((p) => p[this.columns.ts]), pts.map((p) => num(p[this.columns.value]))];
  }

  /** [steps, ys] of a series by step: a step trained again after a restore keeps its
   * newest value (the run that counts), steps in order. */
  byStep(name) {
    const pts = this.points[name] || [];
    const at = new Map();
    for (const p of pts) at.set(p[this.columns.step], num(p[this.columns.value]));
    const steps = [...at.keys()].sort((a, b) => a - b);
    return [steps, steps.map((s) => at.get(s))];
  }

  stepAt(name, idx) {
    const p = (this.points[name] || [])[idx];
    return p ? p[this.columns.step] : null;
  }
}
