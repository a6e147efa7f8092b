"""Text charts for the terminal: ``phalanx metrics`` and the training line of ``phalanx status``.

Pure functions from the API's JSON (``GET /v1/jobs/{id}/metrics``, the job's
``summary``) to text; the CLI prints them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Final

BLOCKS: Final = "▁▂▃▄▅▆▇█"
NOT_FINITE: Final = "!"  # a NaN or an infinity in the chart
FIRST: Final = ("loss", "tokens_per_s", "step_time_s")  # shown first, in this order


def number(value: Any) -> float:
    """A value of the API's JSON as a float (``"NaN"``, ``"Infinity"`` included)."""
    if isinstance(value, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(value, math.nan)
    return math.nan if value is None else float(value)


def sparkline(values: Sequence[float], width: int = 40) -> str:
    """``values`` as at most ``width`` unicode blocks, the last value of each bucket
    (``!`` where it is not finite)."""
    if not values or width < 1:
        return ""
    if len(values) > width:
        values = [values[(i + 1) * len(values) // width - 1] for i in range(width)]
    finite = [v for v in values if math.isfinite(v)]
    low, high = (min(finite), max(finite)) if finite else (0.0, 0.0)
    span = high - low
    out = []
    for v in values:
        if not math.isfinite(v):
            out.append(NOT_FINITE)
        elif span <= 0:
            out.append(BLOCKS[len(BLOCKS) // 2])
        else:
            out.append(BLOCKS[min(len(BLOCKS) - 1, int((v - low) / span * len(BLOCKS)))])
    return "".join(out)


def figure(value: Any) -> str:
    """A metric's value, short: 4 significant digits, thousands grouped when large."""
    v = number(value)
    if value is None:
        return "-"
    if not math.isfinite(v):
        return str(value)
    if abs(v) >= 10_000:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def metrics_table(data: dict[str, Any], width: int = 40) -> str:
    """``phalanx metrics``: per series its latest value (at which step), its range and a
    sparkline; then the stragglers."""
    columns = data.get("columns") or ["step", "ts", "value", "min", "max", "n"]
    at = {c: i for i, c in enumerate(columns)}
    series: dict[str, list[list[Any]]] = data.get("series") or {}
    names = [n for n in FIRST if n in series] + sorted(set(series) - set(FIRST))
    summary = data.get("summary") or {}
    lines = [
        f"job {data.get('job')}  generation {data.get('generation')}  "
        f"step {summary.get('step') if summary.get('step') is not None else '-'}"
    ]
    rows = []
    for name in names:
        points = series[name]
        if not points:
            rows.append([name, "-", "-", "-", ""])
            continue
        values = [number(p[at["value"]]) for p in points]
        finite = [v for v in values if math.isfinite(v)]
        last = points[-1]
        rows.append(
            [
                name,
                figure(last[at["value"]]),
                str(last[at["step"]]),
                f"{figure(min(finite))}..{figure(max(finite))}" if finite else "-",
                sparkline(values, width),
            ]
        )
    if rows:
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        head = ["SERIES", "LAST", "STEP", "RANGE"]
        widths = [max(w, len(h)) for w, h in zip(widths, head, strict=True)]
        lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + "  CHART")
        for r in rows:
            cells = [c.ljust(w) for c, w in zip(r[:4], widths, strict=True)]
            lines.append("  ".join([*cells, r[4]]).rstrip())
    else:
        lines.append("no metrics yet (ranks report them with phalanx.rank.step)")
    lines.extend(straggler_lines(summary))
    return "\n".join(lines)


def straggler_lines(summary: dict[str, Any]) -> list[str]:
    return [
        f"straggler: rank {s['rank']} on {s.get('node') or '?'}: {s['step_time_s']:.4g}s a "
        f"step, {_ratio(s.get('ratio'))} the gang's median {s['median_s']:.4g}s"
        for s in summary.get("stragglers") or []
    ]


def _ratio(ratio: float | None) -> str:
    """A straggler's ratio to the median: JSON has no infinity (a median of 0 gives
    one), which the API writes as null."""
    if ratio is None or ratio != ratio or ratio == float("inf"):
        return "inf x"
    return f"{ratio:.2f}x"


def summary_line(summary: dict[str, Any] | None) -> str | None:
    """The job's latest training figures on one line (None: nothing reported yet)."""
    if not summary or summary.get("step") is None:
        return None
    parts = [f"step {summary['step']}"]
    for key, label in (("loss", "loss"), ("tokens_per_s", "tokens/s"), ("step_time_s", "s/step")):
        if summary.get(key) is not None:
            parts.append(f"{label} {figure(summary[key])}")
    if summary.get("mfu") is not None:
        parts.append(f"MFU {100 * float(summary['mfu']):.3g}%")
    if summary.get("stragglers"):
        parts.append(f"{len(summary['stragglers'])} straggler(s)")
    return "   ".join(parts)


def lineage_lines(lineage: dict[str, Any]) -> list[str]:
    """A job's lineage (``JobSpec.lineage``) as the lines above its checkpoints."""
    code = lineage.get("code_ref") or {}
    lines = []
    if code:
        dirty = " (dirty tree)" if code.get("dirty") else ""
        source = f" from {code['source']}" if code.get("source") else ""
        lines.append(f"code: {code.get('commit')}{dirty}{source}")
    if lineage.get("data_snapshot"):
        lines.append(f"data: {lineage['data_snapshot']}")
    params = lineage.get("hyperparams") or {}
    if params:
        lines.append("hyperparams: " + ", ".join(f"{k}={v}" for k, v in sorted(params.items())))
    return lines
