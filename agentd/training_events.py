"""The rank events a rank's training reports become: a loss guard's trip and a parameter
digest (``phalanx.progress``'s ``guard`` and ``digest`` kinds), as the agent's progress
monitor (:mod:`agentd.progress`) forwards them to the supervisor. Pure."""

from __future__ import annotations

import math

from phalanx import wire
from phalanx.progress import StepReport


def guard_event(node: str, report: StepReport) -> wire.RankEvent:
    """The ``guard`` event of a rank's trip report (an onset past the trip, or not a
    step, is the trip's own step; a value or baseline that is not finite is left out)."""
    scalars = report.scalars
    onset = scalars.get("onset", float(report.step))
    onset = int(onset) if math.isfinite(onset) and 0 <= onset <= report.step else report.step
    value, baseline = scalars.get("value"), scalars.get("baseline")
    return wire.RankEvent(
        node=node,
        job=report.job,
        generation=report.generation,
        rank=report.rank,
        event="guard",
        pid=report.pid,
        step=report.step,
        guard="nan" if scalars.get("nan", 0.0) else "loss_spike",
        onset=onset,
        value=value if value is not None and math.isfinite(value) else None,
        baseline=baseline if baseline is not None and math.isfinite(baseline) else None,
        at=report.at,
    )


def digest_event(node: str, report: StepReport) -> wire.RankEvent | None:
    """The ``digest`` event of a rank's digest report (its two 32-bit halves joined);
    None when they are not two 32-bit integers."""
    hi, lo = report.scalars.get("hi", -1.0), report.scalars.get("lo", -1.0)
    if not (0 <= hi < 2**32 and 0 <= lo < 2**32 and hi.is_integer() and lo.is_integer()):
        return None
    return wire.RankEvent(
        node=node,
        job=report.job,
        generation=report.generation,
        rank=report.rank,
        event="digest",
        pid=report.pid,
        step=report.step,
        digest=(int(hi) << 32) | int(lo),
        at=report.at,
    )
