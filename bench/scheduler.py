"""Benchmark of the gang scheduler; prints one JSON object.

Two measurements on a simulated cluster (default 2,048 nodes x 8 GPUs in 64
racks, NVLink domains of 8 nodes) and a seeded job mix (80% of jobs use 1-8
GPUs on one node, 15% 16-64 GPUs, 5% 128-1,024 GPUs, whole 8-GPU nodes):

* ``pass``: the wall time of one full `schedule` call with ``--jobs``
  pending jobs, median and p99 over ``--passes`` calls, on two states:
  ``cold`` (an idle cluster: most decisions are starts) and ``busy`` (the
  cluster full of running jobs with mixed end times, checkpoints and
  priorities: mostly waits, reservations, backfill and preemption).
* ``day``: a discrete-event simulation of ``--hours`` of the same trace
  (a backlog at time 0, the rest arriving through the day; jobs run for
  their actual runtime, at most ``max_runtime``, checkpoint every 30 min,
  and preempted jobs go back to the queue losing the work since their last
  checkpoint). One scheduling pass every ``--interval`` seconds, for this
  scheduler and for a plain FIFO gang scheduler (submit order, first-fit
  by node id, the head blocks everyone, no backfill, no preemption, the same
  number of spares held back) on the same trace. Utilisation is busy GPUs
  over all GPUs (work later lost to preemption included; it is reported
  apart); fragmentation is the share of idle non-spare GPUs that sit on
  partly used nodes (so cannot take a whole-node rank), and
  ``stranded_gpu_share`` those GPUs over all GPUs; all are time averages.

    .venv/bin/python bench/scheduler.py                 # full scale
    .venv/bin/python bench/scheduler.py --nodes 256 --racks 8 --jobs 600 --passes 5 --hours 6
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from supervisor.scheduler import (
    ClusterNode,
    ClusterState,
    Decisions,
    PendingJob,
    Placement,
    RunningJob,
    TeamShare,
    schedule,
)

GPU_TYPE = "h100"
CHECKPOINT_EVERY = 1800.0
USAGE_HALF_LIFE = 6 * 3600.0
TEAMS = ("atlas", "borealis", "cirrus", "delta", "ember", "fjord", "gale", "helix")
TEAM_WEIGHTS = (2.0, 2.0, 1.0, 1.0, 1.0, 1.0, 0.5, 0.5)


@dataclass(frozen=True, slots=True)
class TraceJob:
    spec: PendingJob
    runtime: float  # what it actually runs, <= spec.max_runtime
    size: str  # "small", "medium" or "large"


def build_cluster(
    n_nodes: int, n_racks: int, gpus: int, domain_size: int
) -> tuple[ClusterNode, ...]:
    per_rack = math.ceil(n_nodes / n_racks)
    return tuple(
        ClusterNode(
            id=f"n{i:05d}",
            rack=f"r{i // per_rack:03d}",
            gpus=gpus,
            gpu_type=GPU_TYPE,
            nvlink_domain=f"nvl{(i % per_rack) // domain_size:02d}",
        )
        for i in range(n_nodes)
    )


def make_trace(
    rng: random.Random,
    count: int,
    n_nodes: int,
    gpus: int,
    backlog: float,
    span: float,
    prefix: str,
) -> list[TraceJob]:
    """``count`` jobs; a ``backlog`` share submitted at 0, the rest uniformly over ``span``."""
    jobs = []
    max_nodes = max(1, n_nodes // 2)
    for k in range(count):
        draw = rng.random()
        if draw < 0.80:
            size = "small"
            total = rng.choices((1, 2, 4, 8), weights=(3, 2, 2, 3))[0]
            runtime = _lognormal(rng, 3600.0, 300.0, 12 * 3600.0)
        elif draw < 0.95:
            size = "medium"
            total = rng.choice((16, 32, 64))
            runtime = _lognormal(rng, 2.5 * 3600.0, 900.0, 24 * 3600.0)
        else:
            size = "large"
            total = rng.choices((128, 256, 512, 1024), weights=(4, 3, 2, 1))[0]
            runtime = _lognormal(rng, 4 * 3600.0, 1800.0, 24 * 3600.0)
        if total <= gpus:
            nodes, per_node = 1, total
        else:
            nodes, per_node = min(max_nodes, math.ceil(total / gpus)), gpus
        priority = rng.choices((0, 1, 2), weights=(2, 7, 1))[0]
        placement, required = Placement.PACK, False
        if nodes > 1:
            pick = rng.random()
            if pick < 0.10:
                required = True
            elif pick < 0.20:
                placement = Placement.SPREAD
        max_runtime = math.ceil(runtime * rng.uniform(1.1, 2.0) / 60.0) * 60.0
        submit = 0.0 if rng.random() < backlog else rng.uniform(0.0, span)
        team = rng.randrange(len(TEAMS))
        jobs.append(
            TraceJob(
                PendingJob(
                    id=f"{prefix}{k:05d}",
                    team=TEAMS[team],
                    priority=priority,
                    nodes=nodes,
                    gpus_per_node=per_node,
                    max_runtime=max_runtime,
                    submit_time=submit,
                    gpu_type=GPU_TYPE,
                    placement=placement,
                    placement_required=required,
                    preemptible=priority == 0 or rng.random() < 0.3,
                ),
                runtime,
                size,
            )
        )
    return jobs


def _lognormal(rng: random.Random, median: float, low: float, high: float) -> float:
    return min(high, max(low, rng.lognormvariate(math.log(median), 0.9)))


def teams(n_gpus: int, usage: dict[str, float] | None = None) -> tuple[TeamShare, ...]:
    quota = n_gpus // 3
    return tuple(
        TeamShare(team, gpu_quota=quota, weight=weight, usage=(usage or {}).get(team, 0.0))
        for team, weight in zip(TEAMS, TEAM_WEIGHTS, strict=True)
    )


# -- one pass ---------------------------------------------------------------


def time_passes(state: ClusterState, passes: int) -> dict[str, float | int]:
    times = []
    decisions: Decisions | None = None
    for _ in range(passes):
        began = time.perf_counter()
        decisions = schedule(state)
        times.append(time.perf_counter() - began)
    assert decisions is not None
    times.sort()
    median = statistics.median(times)
    count = len(decisions.starts) + len(decisions.preemptions) + len(decisions.waits)
    reserved = sum(1 for wait in decisions.waits if wait.reserved_start is not None)
    return {
        "median_ms": round(median * 1000, 2),
        "p99_ms": round(times[min(len(times) - 1, math.ceil(0.99 * len(times)) - 1)] * 1000, 2),
        "min_ms": round(times[0] * 1000, 2),
        "decisions": count,
        "decisions_per_s": round(count / median),
        "starts": len(decisions.starts),
        "preemptions": len(decisions.preemptions),
        "waits": len(decisions.waits),
        "reservations": reserved,
        "pending": len(state.pending),
        "running": len(state.running),
    }


def busy_state(
    nodes: tuple[ClusterNode, ...], rng: random.Random, jobs: int, spares: int
) -> ClusterState:
    """A full cluster: jobs placed by the scheduler itself, ``jobs`` more pending."""
    now = 86_400.0
    n_gpus = sum(node.gpus for node in nodes)
    gpus = nodes[0].gpus
    filler = make_trace(rng, jobs, len(nodes), gpus, 1.0, 0.0, "run")
    fill = schedule(
        ClusterState(
            now=now,
            nodes=nodes,
            pending=tuple(job.spec for job in filler),
            spare_pool=spares,
            reservation_depth=0,
        )
    )
    by_id = {job.spec.id: job for job in filler}
    running = []
    for start in fill.starts:
        job = by_id[start.job_id]
        began = now - rng.uniform(0.0, job.runtime)
        checkpoints = math.floor((now - began) / CHECKPOINT_EVERY)
        running.append(
            RunningJob(
                id=job.spec.id,
                team=job.spec.team,
                priority=job.spec.priority,
                nodes=start.nodes,
                gpus_per_node=start.gpus_per_node,
                preemptible=job.spec.preemptible,
                start_time=began,
                max_runtime=job.spec.max_runtime,
                last_checkpoint_time=(
                    began + checkpoints * CHECKPOINT_EVERY if checkpoints else None
                ),
            )
        )
    pending = [job.spec for job in make_trace(rng, jobs, len(nodes), gpus, 0.0, now, "job")]
    usage = {team: rng.uniform(0.0, 1e7) for team in TEAMS}
    return ClusterState(
        now=now,
        nodes=nodes,
        running=tuple(running),
        pending=tuple(pending),
        teams=teams(n_gpus, usage),
        spare_pool=spares,
        previous_spares=frozenset(fill.spares),
    )


# -- a simulated day --------------------------------------------------------


@dataclass(slots=True)
class _Run:
    job: TraceJob
    nodes: tuple[str, ...]
    per_node: int
    started: float
    left: float  # runtime still to do when it started
    record: RunningJob


class Simulation:
    """A day of the trace under one scheduler; collects utilisation and waits."""

    def __init__(self, nodes: tuple[ClusterNode, ...], trace: list[TraceJob], spares: int) -> None:
        self.nodes = nodes
        self.trace = sorted(trace, key=lambda job: (job.spec.submit_time, job.spec.id))
        self.spares = spares
        self.n_gpus = sum(node.gpus for node in nodes)
        self.free = {node.id: node.gpus for node in nodes}
        self.running: dict[str, _Run] = {}
        self.pending: dict[str, TraceJob] = {}
        self.left: dict[str, float] = {job.spec.id: job.runtime for job in trace}
        self.first_start: dict[str, float] = {}
        self.usage = dict.fromkeys(TEAMS, 0.0)
        self.lost_gpu_s = 0.0
        self.preempted = 0
        self.done = 0
        self.busy_integral = 0.0
        self.fragment_integral = 0.0
        self.stranded_integral = 0.0
        self.sample_time = 0.0
        self.pass_times: list[float] = []
        self.held: tuple[str, ...] = ()

    def run(self, hours: float, interval: float, scheduler: str) -> dict[str, object]:
        horizon = hours * 3600.0
        arrivals = 0
        now = 0.0
        while now <= horizon:
            for run_id in [r for r, run in self.running.items() if run.started + run.left <= now]:
                self._finish(run_id)
            while arrivals < len(self.trace) and self.trace[arrivals].spec.submit_time <= now:
                job = self.trace[arrivals]
                self.pending[job.spec.id] = job
                arrivals += 1
            began = time.perf_counter()
            if scheduler == "phalanx":
                self._phalanx(now)
            else:
                self._fifo(now)
            self.pass_times.append(time.perf_counter() - began)
            self._sample(now, interval)
            self._decay(interval)
            now += interval
        waits = {
            size: [
                self.first_start[job.spec.id] - job.spec.submit_time
                for job in self.trace
                if job.size == size and job.spec.id in self.first_start
            ]
            for size in ("small", "medium", "large")
        }
        self.pass_times.sort()
        return {
            "utilisation": round(self.busy_integral / (self.sample_time * self.n_gpus), 4),
            "fragmentation": round(self.fragment_integral / self.sample_time, 4),
            "stranded_gpu_share": round(
                self.stranded_integral / (self.sample_time * self.n_gpus), 4
            ),
            "busy_gpu_hours": round(self.busy_integral / 3600.0),
            "jobs_arrived": arrivals,
            "jobs_started": len(self.first_start),
            "jobs_finished": self.done,
            "still_pending": len(self.pending),
            "preemptions": self.preempted,
            "lost_gpu_hours_to_preemption": round(self.lost_gpu_s / 3600.0, 1),
            "mean_wait_h_of_started": {
                size: round(statistics.fmean(values) / 3600.0, 2) if values else None
                for size, values in waits.items()
            },
            "started": {size: len(values) for size, values in waits.items()},
            "pass_median_ms": round(statistics.median(self.pass_times) * 1000, 2),
            "pass_p99_ms": round(
                self.pass_times[math.ceil(0.99 * len(self.pass_times)) - 1] * 1000, 2
            ),
        }

    def _finish(self, run_id: str) -> None:
        run = self.running.pop(run_id)
        for node_id in run.nodes:
            self.free[node_id] += run.per_node
        self.done += 1

    def _start(self, job: TraceJob, nodes: Sequence[str], per_node: int, now: float) -> None:
        for node_id in nodes:
            self.free[node_id] -= per_node
            assert self.free[node_id] >= 0, node_id
        spec = job.spec
        self.pending.pop(spec.id)
        self.first_start.setdefault(spec.id, now)
        record = RunningJob(
            id=spec.id,
            team=spec.team,
            priority=spec.priority,
            nodes=tuple(nodes),
            gpus_per_node=per_node,
            preemptible=spec.preemptible,
            start_time=now,
            max_runtime=spec.max_runtime,
        )
        self.running[spec.id] = _Run(job, tuple(nodes), per_node, now, self.left[spec.id], record)

    def _sample(self, now: float, interval: float) -> None:
        busy = self.n_gpus - sum(self.free.values())
        idle = 0
        stranded = 0
        held = set(self.held)
        for node in self.nodes:
            if node.id in held:
                continue
            free = self.free[node.id]
            idle += free
            if 0 < free < node.gpus:
                stranded += free
        self.busy_integral += busy * interval
        self.fragment_integral += (stranded / idle if idle else 0.0) * interval
        self.stranded_integral += stranded * interval
        self.sample_time += interval
        for run in self.running.values():
            gpus = run.per_node * len(run.nodes)
            self.usage[run.job.spec.team] += gpus * interval

    def _decay(self, interval: float) -> None:
        factor = 0.5 ** (interval / USAGE_HALF_LIFE)
        for team in self.usage:
            self.usage[team] *= factor

    def _phalanx(self, now: float) -> None:
        running = []
        for run in self.running.values():
            checkpoints = math.floor((now - run.started) / CHECKPOINT_EVERY)
            checkpoint = run.started + checkpoints * CHECKPOINT_EVERY if checkpoints else None
            if run.record.last_checkpoint_time != checkpoint:
                run.record = replace(run.record, last_checkpoint_time=checkpoint)
            running.append(run.record)
        state = ClusterState(
            now=now,
            nodes=self.nodes,
            running=tuple(running),
            pending=tuple(job.spec for job in self.pending.values()),
            teams=teams(self.n_gpus, self.usage),
            spare_pool=self.spares,
            previous_spares=frozenset(self.held),
        )
        decisions = schedule(state)
        self.held = decisions.spares
        for preempt in decisions.preemptions:
            self.preempted += 1
            run = self.running.pop(preempt.victim_id)
            for node_id in run.nodes:
                self.free[node_id] += run.per_node
            done = now - run.started
            kept = math.floor(done / CHECKPOINT_EVERY) * CHECKPOINT_EVERY
            self.lost_gpu_s += (done - kept) * run.per_node * len(run.nodes)
            self.left[preempt.victim_id] = run.left - kept
            self.pending[preempt.victim_id] = run.job
        for start in decisions.starts:
            self._start(self.pending[start.job_id], start.nodes, start.gpus_per_node, now)

    def _fifo(self, now: float) -> None:
        if not self.held:  # the same pool size, fixed: the last node of the first racks
            per_rack = math.ceil(len(self.nodes) / len({node.rack for node in self.nodes}))
            self.held = tuple(
                self.nodes[min(len(self.nodes), (k + 1) * per_rack) - 1].id
                for k in range(self.spares)
            )
        held = set(self.held)
        order = sorted(self.pending.values(), key=lambda job: (job.spec.submit_time, job.spec.id))
        for job in order:
            spec = job.spec
            chosen = []
            for node in self.nodes:
                if node.id not in held and self.free[node.id] >= spec.gpus_per_node:
                    chosen.append(node.id)
                    if len(chosen) == spec.nodes:
                        break
            if len(chosen) < spec.nodes:
                return  # strict order: the head blocks the queue
            self._start(job, chosen, spec.gpus_per_node, now)


# -- main -------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=2048, help="GPU nodes in the cluster")
    parser.add_argument("--racks", type=int, default=64, help="racks they are spread over")
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per node")
    parser.add_argument("--domain-size", type=int, default=8, help="nodes per NVLink domain")
    parser.add_argument("--jobs", type=int, default=5000, help="pending jobs in a timed pass")
    parser.add_argument("--passes", type=int, default=50, help="timed passes per state")
    parser.add_argument("--spares", type=int, default=16, help="hot spare pool size")
    parser.add_argument("--hours", type=float, default=24.0, help="simulated time; 0 skips it")
    parser.add_argument("--interval", type=float, default=60.0, help="simulated s between passes")
    parser.add_argument(
        "--sim-jobs",
        type=int,
        default=0,
        help="jobs in the simulated day's trace (default: --jobs)",
    )
    parser.add_argument("--seed", type=int, default=7, help="seed of every random draw")
    args = parser.parse_args(argv)

    nodes = build_cluster(args.nodes, args.racks, args.gpus, args.domain_size)
    n_gpus = args.nodes * args.gpus
    rng = random.Random(args.seed)
    cold_trace = make_trace(rng, args.jobs, args.nodes, args.gpus, 1.0, 0.0, "job")
    cold = ClusterState(
        now=0.0,
        nodes=nodes,
        pending=tuple(job.spec for job in cold_trace),
        teams=teams(n_gpus),
        spare_pool=args.spares,
    )
    busy = busy_state(nodes, rng, args.jobs, args.spares)
    result: dict[str, object] = {
        "cluster": {
            "nodes": args.nodes,
            "racks": args.racks,
            "gpus_per_node": args.gpus,
            "gpus": n_gpus,
            "nvlink_domain_nodes": args.domain_size,
            "spares": args.spares,
        },
        "seed": args.seed,
        "python": platform.python_version(),
        "pass": {
            "cold": time_passes(cold, args.passes),
            "busy": time_passes(busy, args.passes),
        },
    }
    if args.hours > 0:
        trace = make_trace(
            random.Random(args.seed + 1),
            args.sim_jobs or args.jobs,
            args.nodes,
            args.gpus,
            0.3,
            args.hours * 3600.0,
            "day",
        )
        offered = sum(job.runtime * job.spec.nodes * job.spec.gpus_per_node for job in trace)
        day: dict[str, object] = {
            "hours": args.hours,
            "interval_s": args.interval,
            "jobs": len(trace),
            "offered_load": round(offered / (n_gpus * args.hours * 3600.0), 3),
        }
        for name in ("phalanx", "fifo"):
            day[name] = Simulation(nodes, trace, args.spares).run(args.hours, args.interval, name)
        result["day"] = day
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
