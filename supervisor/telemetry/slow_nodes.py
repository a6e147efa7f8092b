"""Nodes slow in several jobs at once: straggler flags in, slow nodes out (pure).

A job's :class:`~supervisor.telemetry.anomalies.StragglerWatch` flags ranks, and a flagged rank
names the node it runs on. One job's straggler says little about its node: the rank may
hold a heavier pipeline stage or read slower data. A node whose ranks straggle in
``min_jobs`` distinct jobs at the same time is what those jobs have in common, so the
supervisor gives it a ``warn`` reason with code :data:`STRAGGLER`
(:meth:`supervisor.fleet.registry.Registry.mark_slow`).

Only flags standing now count: a flag that cleared is gone from the watch, and a flag
of a job that ended, or of an older generation of its job (a recovery moved its ranks),
does not count, so the reason goes when the flags clear or the jobs end. Nothing here
does I/O; :meth:`supervisor.telemetry.training.TrainingMetrics.straggler_flags` gathers the flags.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from phalanx import wire

STRAGGLER = "straggler"  # the reason's code


@dataclass(frozen=True, slots=True)
class Flag:
    """A rank flagged as a straggler, standing now."""

    job: str
    generation: int
    rank: int
    node: str
    since: float  # when it was flagged (wall clock)
    ratio: float  # its step time over its gang's median


@dataclass(frozen=True, slots=True)
class SlowJob:
    """One job in which a node's ranks straggle: its slowest flagged rank there."""

    job: str
    rank: int
    ratio: float
    since: float  # its node's first standing flag in this job


@dataclass(frozen=True, slots=True)
class SlowNode:
    node: str
    jobs: tuple[SlowJob, ...]  # by job id
    since: float  # when it became slow in ``min_jobs`` jobs: that job's first flag

    @property
    def job_ids(self) -> tuple[str, ...]:
        return tuple(j.job for j in self.jobs)

    def reason(self) -> wire.Reason:
        """The ``warn`` reason the registry shows for the node."""
        each = ", ".join(
            f"{j.job} (rank {j.rank}, {_times(j.ratio)} its gang's median)" for j in self.jobs
        )
        return wire.Reason(
            code=STRAGGLER,
            severity="warn",
            detail=f"step time above the median in {len(self.jobs)} jobs: {each}",
        )


def slow_nodes(
    flags: Iterable[Flag], live: Mapping[str, int], *, min_jobs: int
) -> dict[str, SlowNode]:
    """The nodes with standing straggler flags in at least ``min_jobs`` distinct jobs.

    ``live``: the generation of each job not ended; a flag counts only when its job is
    there with the flag's generation. Several flagged ranks of one job on one node count
    as one job (the slowest of them is named)."""
    if min_jobs < 1:
        raise ValueError(f"min_jobs must be at least 1, not {min_jobs}")
    by_node: dict[str, dict[str, SlowJob]] = {}
    for f in flags:
        if live.get(f.job) != f.generation:
            continue
        jobs = by_node.setdefault(f.node, {})
        had = jobs.get(f.job)
        if had is None:
            jobs[f.job] = SlowJob(f.job, f.rank, f.ratio, f.since)
            continue
        slowest = (f.ratio, -f.rank) > (had.ratio, -had.rank)
        jobs[f.job] = SlowJob(
            f.job,
            f.rank if slowest else had.rank,
            max(f.ratio, had.ratio),
            min(f.since, had.since),
        )
    slow = {}
    for node, jobs in sorted(by_node.items()):
        if len(jobs) < min_jobs:
            continue
        since = sorted(j.since for j in jobs.values())[min_jobs - 1]
        slow[node] = SlowNode(node, tuple(jobs[j] for j in sorted(jobs)), since)
    return slow


def _times(ratio: float) -> str:
    return f"{ratio:.2f}x" if math.isfinite(ratio) else "infinitely above"
