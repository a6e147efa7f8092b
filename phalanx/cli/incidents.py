"""How ``phalanx status JOB`` words a job's goodput and each of its recoveries."""

from __future__ import annotations

from typing import Any

PHASES = ("detect", "plan", "stop", "prepare", "launch", "restore", "first_step")


def ettr_text(goodput: dict[str, Any]) -> str | None:
    """The job's ETTR, as an upper bound where its lost work or downtime is unknown."""
    if goodput.get("ettr") is None:
        return None
    pct = f"{goodput['ettr'] * 100:.1f}%"
    lost = f"{goodput['lost_s']:.1f}s of {goodput['wall_s']:.1f}s"
    if not goodput.get("ettr_upper_bound"):
        return f"ETTR: {pct} (lost {lost})"
    why = (
        "lost work unknown: the job reports no steps"
        if goodput.get("lost_work_unknown")
        else "a recovery's downtime not yet timed"
    )
    return f"ETTR: at most {pct} (lost at least {lost}; {why})"


def incident_lines(incident: dict[str, Any]) -> list[str]:
    """One recovery: what failed, what was done, how long each phase took, what it lost."""
    failure = (incident.get("failures") or [{}])[0]
    plan = incident.get("plan") or {}
    where = (
        f"rank {failure['rank']} on {failure.get('node')}"
        if failure.get("rank") is not None
        else f"node {failure.get('node')}"
    )
    phases = incident.get("phases") or {}
    timing = "  ".join(f"{p} {phases[p]:.2f}s" for p in PHASES if phases.get(p) is not None)
    lost = incident.get("lost_steps")
    out = [
        f"generation {incident.get('generation')}: {failure.get('kind')} ({where}) -> "
        f"{plan.get('action', '-')}: {incident.get('outcome')}",
        f"    {plan.get('reason', '')}",
    ]
    if plan.get("skip"):
        start, stop = plan["skip"]
        out.append(f"    skipped steps {start}-{stop - 1} (the loss guard's rollback)")
    if timing:
        out.append(f"    phases: {timing}")
    out.extend(cold_lines(incident.get("cold_ranks")))
    acked = incident.get("acked_s")
    started = f"; ranks started {acked:.2f}s after the fault" if acked is not None else ""
    if incident.get("mttr_s") is not None:
        out.append(f"    MTTR {incident['mttr_s']:.2f}s (fault to first step){started}")
    elif incident.get("outcome") == "recovered":
        out.append(f"    MTTR unknown: no step reported by every rank yet{started}")
    if incident.get("outcome") == "recovered":
        work = incident.get("lost_work_s")
        out.append(
            f"    restored step {incident.get('restored_step')}; "
            + (
                "lost work unknown (the job reports no steps)"
                if work is None
                else f"lost {'-' if lost is None else lost} step(s), {work:.2f}s of work"
            )
        )
    return out


def cold_lines(cold: dict[str, str] | None) -> list[str]:
    """The ranks a relaunch started cold (no warm interpreter became them), by reason:
    the launch phase paid a cold start for them."""
    return [f"    cold launch of ranks {ranks}: {why}" for why, ranks in (cold or {}).items()]
