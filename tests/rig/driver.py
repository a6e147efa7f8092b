"""One scenario on the rig: submit the job, strike at the seeded step, wait for the end,
and measure what happened. One JSON object per scenario (see :func:`run_scenario`)."""

from __future__ import annotations

import logging
import random
import statistics
import time
from typing import Any

from tests.rig import job as rigjob
from tests.rig.base import Fleet
from tests.rig.faults import FAULTS, Strike
from tests.rig.net import RigError

log = logging.getLogger(__name__)

JOB_TIMEOUT_S = 300.0  # a scenario's job must end within this, fault and recovery included
STRIKE_STEPS = (30, 120)  # the seeded step falls in this range


def undisturbed(fleet: Fleet) -> dict[str, Any]:
    """The same job with no fault, on the same rig: the digest every scenario must match."""
    spec = rigjob.spec("undisturbed", **fleet.job_runtime())
    job_id = fleet.client().post("/v1/jobs", {"spec": spec})["id"]
    job = wait_end(fleet, job_id, JOB_TIMEOUT_S)
    digest = rigjob.final_digest(fleet.rank_log(job, 0))
    if job["state"] != "succeeded" or digest is None:
        raise RigError(f"the undisturbed job ended {job['state']}: {job.get('reason')}")
    return {"digest": digest, "wall_s": job["ended_at"] - job["started_at"]}


def wait_end(fleet: Fleet, job_id: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    last: dict[str, Any] = {}
    while time.monotonic() < deadline:
        try:
            last = fleet.client().get(f"/v1/jobs/{job_id}")
        except Exception:  # the supervisor may be restarting (a scenario)
            time.sleep(0.5)
            continue
        if last["state"] in ("succeeded", "failed", "cancelled"):
            return last
        time.sleep(0.25)
    fleet.client().post(f"/v1/jobs/{job_id}/cancel", {})
    raise RigError(f"job {job_id} did not end within {timeout:.0f} s (state {last.get('state')})")


JOB_POLL_S = 0.5  # how often wait_step asks the supervisor about the job
LOG_POLL_S = 0.02  # how often it reads rank 0's log: the strike's precision


def wait_step(fleet: Fleet, job_id: str, step: int, timeout: float) -> int:
    """Block until rank 0 reports ``step`` (or later); the step it reported. Rank 0's log
    is read every 20 ms, the job asked for every 0.5 s: asked every 20 ms, it cost ~9 %
    of a core while a scenario waits (the supervisor's 5.6 %, the driver's 3 %), twice
    that with two scenarios at once on the 2-core CI machine."""
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    asked = 0.0
    while time.monotonic() < deadline:
        if time.monotonic() - asked >= JOB_POLL_S:
            job = fleet.client().get(f"/v1/jobs/{job_id}")
            asked = time.monotonic()
            if job["state"] in ("succeeded", "failed", "cancelled"):
                raise RigError(f"job {job_id} ended ({job['state']}) before step {step}")
        if job["state"] == "running" and job["ranks"]:
            try:
                seen = rigjob.last_step(fleet.rank_log(job, 0))
            except OSError:
                seen = None
            if seen is not None and seen >= step:
                return seen
        time.sleep(LOG_POLL_S)
    raise RigError(f"job {job_id} did not reach step {step} within {timeout:.0f} s")


def run_scenario(fleet: Fleet, kind: str, seed: int, baseline: dict[str, Any]) -> dict[str, Any]:
    """Run fault ``kind`` once; the scenario's JSON object:

    fault, seed, step (the step rank 0 had reported when it struck), detected_s and
    mttr_s (strike to the first failure's detection, and to the next generation's
    first step), recovered (the job succeeded), generations, committed_lost,
    final_digest_equal, state, as_expected (and why not), and the fault's notes."""
    fault = FAULTS[kind]
    rng = random.Random(seed)
    strike_step = rng.randint(*STRIKE_STEPS)
    extra: tuple[str, ...] = ()
    if kind == "code-error":
        extra = ("--fail-at-step", str(strike_step), "--fail-rank", "1")
    spec = rigjob.spec(f"rig-{kind}", *extra, **fleet.job_runtime())
    job_id = fleet.client().post("/v1/jobs", {"spec": spec})["id"]
    strike = Strike(fleet, job_id, rng)
    # The code error strikes by itself at strike_step; the others when rank 0 reached it.
    struck_step = wait_step(fleet, job_id, 1 if kind == "code-error" else strike_step, 300)
    struck_at = time.time()
    nodes_before = list(strike.job()["nodes"])
    fault.inject(strike)
    job = wait_end(fleet, job_id, JOB_TIMEOUT_S)
    incidents = job.get("incidents") or []
    recovered_incidents = [i for i in incidents if i.get("outcome") == "recovered"]
    detected_s = None
    if incidents:
        # (the code error struck by itself: from its failure, as the supervisor timed it)
        since = incidents[0]["fault_at"] if kind == "code-error" else struck_at
        detected_s = round(incidents[0]["detected_at"] - since, 2)
    mttr_s = None
    resumed = [i["resumed_at"] for i in recovered_incidents if i.get("resumed_at")]
    if resumed and kind != "code-error":
        mttr_s = round(max(resumed) - struck_at, 2)
    digest = rigjob.final_digest(fleet.rank_log(job, 0)) if job["state"] == "succeeded" else None
    lost, checked = committed_lost(fleet, job)
    result: dict[str, Any] = {
        "fault": kind,
        "seed": seed,
        "step": strike_step if kind == "code-error" else struck_step,
        "detected_s": detected_s,
        "recovered": job["state"] == "succeeded",
        "mttr_s": mttr_s,
        "generations": job["generation"],
        "committed_lost": lost,
        "committed_checked": checked,
        "final_digest_equal": digest == baseline["digest"] if digest else False,
        "state": job["state"],
        "reason": job.get("reason"),
        "nodes": {"before": nodes_before, "after": job["nodes"]},
        "phases": [i.get("phases") for i in incidents],
        "notes": strike.notes,
        "expected": fault.what,
    }
    as_expected, unexpected = judge(fault.expect_state, fault.recovery, result)
    more = fault.check(strike, job) if fault.check is not None else None
    if more:
        as_expected, unexpected = False, "; ".join(x for x in (unexpected, more) if x)
    result["as_expected"], result["unexpected"] = as_expected, unexpected
    return result


def judge(state: str, recovery: str, r: dict[str, Any]) -> tuple[bool, str]:
    """Whether the scenario ended as its fault expects; why not, in words."""
    why = []
    if r["state"] != state:
        why.append(f"state {r['state']}, expected {state} ({r['reason']})")
    gens = r["generations"]
    swapped = set(r["nodes"]["after"]) != set(r["nodes"]["before"])
    if recovery == "none" and gens != 1:
        why.append(f"{gens} generations, expected no recovery")
    if recovery in ("in-place", "replaced") and gens < 2:
        why.append("no recovery happened")
    if recovery == "in-place" and swapped:
        why.append(f"nodes changed {r['nodes']}, expected a restart in place")
    if recovery == "replaced" and not swapped:
        why.append("the failed node was not replaced")
    if recovery == "no-spare" and swapped:
        why.append(f"a spare was used {r['nodes']}")
    if r["committed_lost"]:
        why.append(f"{r['committed_lost']} committed step(s) lost")
    if state == "succeeded" and not r["final_digest_equal"]:
        why.append("the final digest differs from the undisturbed run's")
    return (not why, "; ".join(why))


def committed_lost(fleet: Fleet, job: dict[str, Any]) -> tuple[int, int]:
    """Committed steps that no tier can restore any more and retention did not remove: a
    step the catalog still lists committed in the object tier must have every rank's shard
    in the object tier (the durable one; the others die with their node). (lost, checked)"""
    view = fleet.client().get(f"/v1/jobs/{job['id']}/checkpoints")
    world = int(view["world_size"])
    lost = checked = 0
    for entry in view["steps"]:
        if "object" not in entry["committed"]:
            continue
        checked += 1
        ranks = fleet.object_shards(job["id"], entry["step"])
        if len({r for r in ranks if r.startswith("rank-")}) < world:
            lost += 1
    return lost, checked


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """p50/p95 of detection and MTTR over trials of one scenario."""

    def pct(values: list[float], q: float) -> float | None:
        if not values:
            return None
        if len(values) == 1:
            return values[0]
        return round(statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1], 2)

    det = [r["detected_s"] for r in results if r["detected_s"] is not None]
    mttr = [r["mttr_s"] for r in results if r["mttr_s"] is not None]
    # Each recovery phase (the supervisor's: detect, plan, stop, launch, restore,
    # first_step) over every incident of every trial.
    phases: dict[str, list[float]] = {}
    for r in results:
        for incident in r["phases"]:
            for name, seconds in (incident or {}).items():
                phases.setdefault(name, []).append(float(seconds))
    return {
        "fault": results[0]["fault"],
        "trials": len(results),
        "as_expected": sum(r["as_expected"] for r in results),
        "detected_s": {"p50": pct(det, 50), "p95": pct(det, 95)},
        "mttr_s": {"p50": pct(mttr, 50), "p95": pct(mttr, 95)},
        "phases_s": {k: {"p50": pct(v, 50), "p95": pct(v, 95)} for k, v in phases.items()},
        "committed_lost": sum(r["committed_lost"] for r in results),
    }


SOAK_FAULTS = ("kill-rank", "kill-agent", "ecc-dbe", "xid-79", "link-cut")


def soak(fleet: Fleet, minutes: float, mtbf_s: float, seed: int) -> dict[str, Any]:
    """One long job while faults of random kinds strike at exponential intervals of mean
    ``mtbf_s``; each struck node is repaired (its GPUs cleared, undrained) once the job runs
    again, as an operator would, so the pool never runs dry. ETTR is the supervisor's: time
    on steps that count over wall time."""
    rng = random.Random(seed)
    spec = rigjob.spec("soak", "--steps", "1000000", **fleet.job_runtime())
    spec["restart"]["max_restarts"] = 1000  # every fault is one: the budget is not measured
    job_id = fleet.client().post("/v1/jobs", {"spec": spec})["id"]
    wait_step(fleet, job_id, 1, 300)
    kinds = [k for k in SOAK_FAULTS if fleet.cannot(k) is None]  # what this fleet can strike
    end = time.monotonic() + minutes * 60
    struck: list[dict[str, Any]] = []
    while True:
        gap = rng.expovariate(1.0 / mtbf_s)
        if time.monotonic() + gap >= end:
            time.sleep(max(0.0, end - time.monotonic()))
            break
        time.sleep(gap)
        strike = Strike(fleet, job_id, rng)
        if strike.job()["state"] != "running":
            continue  # still recovering from the last one: this fault waits for the next
        kind = rng.choice(kinds)
        FAULTS[kind].inject(strike)
        struck.append({"fault": kind, "at": time.time(), **strike.notes})
        _repair(fleet, job_id, strike)
    job = fleet.client().get(f"/v1/jobs/{job_id}")
    if job["state"] not in ("succeeded", "failed", "cancelled"):
        fleet.client().post(f"/v1/jobs/{job_id}/cancel", {})
    lost, checked = committed_lost(fleet, job)
    return {
        "soak_minutes": minutes,
        "mtbf_s": mtbf_s,
        "seed": seed,
        "faults": len(struck),
        "struck": struck,
        "ettr": job["goodput"]["ettr"],
        "goodput": job["goodput"],
        "state_at_end": job["state"],
        "reason": job.get("reason"),
        "generations": job["generation"],
        "mttr_s": [i.get("mttr_s") for i in job.get("incidents") or []],
        "committed_lost": lost,
        "committed_checked": checked,
    }


def _repair(fleet: Fleet, job_id: str, strike: Strike) -> None:
    """Once the job runs again: the struck host's GPUs healthy and the host undrained."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and strike.job()["state"] != "running":
        time.sleep(0.5)
    name = strike.notes.get("host")
    if name is None:
        return
    host = fleet.host(name)
    if fleet.cannot("ecc-dbe") is None:  # sim GPUs to clear
        for gpu in range(2):
            fleet.inject_gpu(host, gpu, "clear")
    time.sleep(31)  # the agents hold an XID for xid_hold_s (30 s) after it was seen
    try:
        fleet.client().post(f"/v1/nodes/{name}/undrain", {"force": True})
    except Exception as exc:  # offline a moment longer (a link cut): it comes back by itself
        log.info("undrain of %s: %s", name, exc)
