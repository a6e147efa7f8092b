"""``phalanx top``: the fleet and its jobs in one screen that refreshes in place.

:func:`frame` is pure (the API's JSON in, text out); :func:`run` polls the API and
redraws. The screen stays one screen at any fleet size: nodes are counted per rack and
state, only the nodes that are not ``up`` are listed (the first :data:`MAX_NODES_LISTED`),
and the jobs shown are those not yet ended plus the last few that did.
"""

from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable
from typing import IO, Any, Final

from phalanx.cli.charts import figure

MAX_NODES_LISTED: Final = 12
MAX_RACKS_LISTED: Final = 16
ENDED_SHOWN: Final = 5
STATES: Final = ("up", "warn", "drain", "offline")
FINAL: Final = ("succeeded", "failed", "cancelled")
CLEAR: Final = "\x1b[H\x1b[2J"


def _counts(states: collections.Counter[str]) -> str:
    return " · ".join(f"{states[s]} {s}" for s in STATES if states[s]) or "none"


def _reasons(node: dict[str, Any]) -> str:
    codes = [r.get("code", "?") for r in node.get("reasons") or []]
    drain = node.get("drain")
    if drain and drain.get("reason"):
        codes.append(f"{drain.get('by', '?')}: {drain['reason']}")
    return ", ".join(codes) or "-"


def _table(rows: list[list[str]], headers: list[str]) -> list[str]:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    return [
        "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip()
        for r in [headers, *rows]
    ]


def frame(nodes: list[dict[str, Any]], jobs: list[dict[str, Any]], now: float) -> str:
    """One screen of ``phalanx top``."""
    states = collections.Counter(n["state"] for n in nodes)
    spares = sum(1 for n in nodes if n.get("spare"))
    job_states = collections.Counter(j["state"] for j in jobs)
    lines = [
        f"phalanx top  {time.strftime('%H:%M:%S', time.localtime(now))}",
        f"nodes {len(nodes)}: {_counts(states)} · spares {spares}",
        "jobs: "
        + (
            " · ".join(f"{n} {s}" for s, n in sorted(job_states.items()) if s not in FINAL)
            or "none running"
        )
        + f" · {sum(job_states[s] for s in FINAL)} ended",
        "",
    ]
    racks: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for n in nodes:
        racks[n.get("rack") or "-"][n["state"]] += 1
    rack_rows = [[rack, _counts(c)] for rack, c in sorted(racks.items())[:MAX_RACKS_LISTED]]
    lines += _table(rack_rows, ["RACK", "NODES"])
    if len(racks) > MAX_RACKS_LISTED:
        lines.append(f"... {len(racks) - MAX_RACKS_LISTED} more racks")
    sick = [n for n in nodes if n["state"] != "up"]
    if sick:
        lines.append("")
        rows = [
            [n["id"], n["state"], n.get("rack") or "-", _reasons(n)]
            for n in sick[:MAX_NODES_LISTED]
        ]
        lines += _table(rows, ["NODE", "STATE", "RACK", "REASONS"])
        if len(sick) > MAX_NODES_LISTED:
            lines.append(f"... {len(sick) - MAX_NODES_LISTED} more nodes not up")
    live = [j for j in jobs if j["state"] not in FINAL]
    ended = sorted((j for j in jobs if j["state"] in FINAL), key=lambda j: j.get("ended_at") or 0)
    shown = live + ended[-ENDED_SHOWN:]
    if shown:
        lines.append("")
        rows = []
        for j in shown:
            s = j.get("summary") or {}
            rows.append(
                [
                    j["id"],
                    j["state"],
                    str(j.get("world_size", "-")),
                    str(j.get("generation", "-")),
                    f"{j.get('restarts', 0)}/{j.get('max_restarts', '-')}",
                    figure(s.get("step")),
                    figure(s.get("loss")),
                    figure(s.get("tokens_per_s")),
                    figure(s.get("step_time_s")),
                    str(len(s.get("stragglers") or [])) if s else "-",
                ]
            )
        lines += _table(
            rows,
            ["JOB", "STATE", "RANKS", "GEN", "RESTARTS", "STEP", "LOSS", "TOK/S", "STEP S", "SLOW"],
        )
    return "\n".join(lines)


def run(
    fetch: Callable[[], tuple[list[dict[str, Any]], list[dict[str, Any]]]],
    *,
    interval_s: float,
    frames: int | None = None,
    out: IO[str] = sys.stdout,
    clear: bool = True,
) -> None:
    """Draw a frame every ``interval_s`` (``frames`` of them, or until Ctrl-C)."""
    drawn = 0
    try:
        while frames is None or drawn < frames:
            if drawn:
                time.sleep(interval_s)
            nodes, jobs = fetch()
            out.write((CLEAR if clear else "") + frame(nodes, jobs, time.time()) + "\n")
            out.flush()
            drawn += 1
    except KeyboardInterrupt:
        out.write("\n")
