"""The supervisor's Prometheus metrics, read from its state at scrape time (``GET /metrics``).

Labels are bounded: node and job states (a handful), and the job id for jobs that hold
nodes now (starting, running, recovering, stopping: bounded by the fleet's size). There
is never a per-rank or per-node label here: a 16k-GPU job is a few series, not 16k;
per-node figures are the agents' own ``/metrics``.

=======================================  =======  ======================================
metric                                   type     labels
=======================================  =======  ======================================
``phalanx_nodes``                        gauge    ``state`` (up, warn, drain, offline)
``phalanx_spares``                       gauge
``phalanx_jobs``                         gauge    ``state``
``phalanx_recoveries_total``             counter  (in-place restarts of every job)
``phalanx_job_step``                     gauge    ``job``
``phalanx_job_loss``                     gauge    ``job``
``phalanx_job_step_time_seconds``        gauge    ``job`` (median over ranks)
``phalanx_job_tokens_per_second``        gauge    ``job`` (sum over ranks)
``phalanx_job_stragglers``               gauge    ``job``
``phalanx_metrics_batches_total``        counter  (agents' metrics batches taken)
``phalanx_metrics_dropped_total``        counter  (batches dropped: unknown job, ...)
``phalanx_bad_messages_total``           counter  (MQTT messages that broke the contract)
``phalanx_store_ok``                     gauge    (0 once damage was met in state.db)
``phalanx_store_backup_timestamp_seconds``  gauge  (the newest sound backup; none: no backups)
``phalanx_store_backup_failures_total``  counter  (backups that failed since the start)
``phalanx_supervisor_loop_stall_seconds``  histogram  (event loop stalls of 0.1 s or more)
``phalanx_supervisor_gc_pause_seconds``  histogram  ``generation`` (the collector's passes)
=======================================  =======  ======================================
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from phalanx.loopwatch import LoopWatch
from supervisor import gcpolicy
from supervisor.backup import StoreBackups
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.control.controller import JobController
from supervisor.fleet.registry import NodeState, Registry
from supervisor.jobs import JobState
from supervisor.store import Store
from supervisor.telemetry.training import TrainingMetrics


class Source(Protocol):
    """What the collector reads of the supervisor (``supervisor.daemon.Supervisor``)."""

    registry: Registry
    jobs: JobController
    metrics: TrainingMetrics
    catalog: CheckpointCatalog
    store: Store
    backups: StoreBackups | None
    bad_messages: int
    loopwatch: LoopWatch


class SupervisorCollector(Collector):
    def __init__(self, sup: Source) -> None:
        self.sup = sup

    def collect(self) -> Iterator[Metric]:
        sup = self.sup
        nodes = GaugeMetricFamily("phalanx_nodes", "Nodes by state", labels=["state"])
        by_state = Counter(n.state.value for n in sup.registry.nodes.values())
        for state in NodeState:
            nodes.add_metric([state.value], by_state.get(state.value, 0))
        yield nodes
        spares = GaugeMetricFamily("phalanx_spares", "Hot spares held back")
        spares.add_metric([], len(sup.jobs.spares))
        yield spares
        jobs = list(sup.jobs.jobs.values())
        family = GaugeMetricFamily("phalanx_jobs", "Jobs by state", labels=["state"])
        job_states = Counter(j.state.value for j in jobs)
        for job_state in JobState:
            family.add_metric([job_state.value], job_states.get(job_state.value, 0))
        yield family
        recoveries = CounterMetricFamily(
            "phalanx_recoveries", "In-place restarts of every job (recoveries)"
        )
        recoveries.add_metric([], sum(j.restarts for j in jobs))
        yield recoveries
        now = time.time()
        waited = GaugeMetricFamily(
            "phalanx_queue_wait_seconds", "How long the oldest pending job has waited"
        )
        pending = [now - j.submitted_at for j in jobs if j.state is JobState.PENDING]
        waited.add_metric([], max(pending, default=0.0))
        yield waited
        # Tiering falling behind: per running job and tier (bounded: jobs x 4 tiers).
        commit_age = GaugeMetricFamily(
            "phalanx_ckpt_commit_age_seconds",
            "Seconds since the job's newest checkpoint was committed at the tier",
            labels=["job", "tier"],
        )
        for job in sorted(jobs, key=lambda j: j.id):
            if not job.state.holds_nodes:
                continue
            newest: dict[str, float] = {}
            for _step, tier, at in sup.catalog.rows.commits(job.id):
                newest[tier] = max(newest.get(tier, 0.0), at)
            for tier, at in sorted(newest.items()):
                commit_age.add_metric([job.id, tier], max(0.0, now - at))
        yield commit_age
        gauges = {
            "step": GaugeMetricFamily("phalanx_job_step", "Latest step", labels=["job"]),
            "loss": GaugeMetricFamily("phalanx_job_loss", "Latest loss", labels=["job"]),
            "step_time_s": GaugeMetricFamily(
                "phalanx_job_step_time_seconds", "Median step time over ranks", labels=["job"]
            ),
            "tokens_per_s": GaugeMetricFamily(
                "phalanx_job_tokens_per_second", "Tokens/s, summed over ranks", labels=["job"]
            ),
        }
        stragglers = GaugeMetricFamily(
            "phalanx_job_stragglers", "Ranks flagged as stragglers", labels=["job"]
        )
        for job in sorted(jobs, key=lambda j: j.id):
            if not job.state.holds_nodes:
                continue
            summary = sup.metrics.summary(job.id)
            for key, gauge in gauges.items():
                value = summary.get(key)
                if value is not None:  # "NaN", "Infinity": float() reads them too
                    gauge.add_metric([job.id], float(value))
            stragglers.add_metric([job.id], len(summary.get("stragglers") or []))
        yield from gauges.values()
        yield stragglers
        for name, doc, value in (
            ("phalanx_metrics_batches", "Agents' metrics batches taken", sup.metrics.batches),
            ("phalanx_metrics_dropped", "Metrics batches dropped", sup.metrics.dropped),
            ("phalanx_bad_messages", "MQTT messages that broke the contract", sup.bad_messages),
        ):
            counter = CounterMetricFamily(name, doc)
            counter.add_metric([], value)
            yield counter
        yield from self._store()
        yield self._stalls()
        yield self._gc_pauses()

    def _gc_pauses(self) -> Metric:
        """The cyclic collector's passes, each a pause of the event loop (``gcpolicy``)."""
        family = HistogramMetricFamily(
            "phalanx_supervisor_gc_pause_seconds",
            "Passes of the supervisor's cyclic garbage collector, by generation: each "
            "stops its event loop (GET /v1/stats, gc)",
            labels=["generation"],
        )
        pauses = gcpolicy.PAUSES
        for generation in range(3):
            family.add_metric(
                [str(generation)],
                pauses.cumulative(generation),
                sum_value=pauses.total_s[generation],
            )
        return family

    def _stalls(self) -> Metric:
        """The event loop's stalls (``phalanx.loopwatch``)."""
        watch = self.sup.loopwatch
        family = HistogramMetricFamily(
            "phalanx_supervisor_loop_stall_seconds",
            "Stretches of at least "
            f"{watch.threshold_s:g} s the supervisor's event loop ran without a yield "
            "(messages, heartbeats and the API waited); where: GET /v1/stats, loop",
        )
        family.add_metric([], watch.cumulative(), sum_value=watch.total_s)
        return family

    def _store(self) -> Iterator[Metric]:
        """The state database's health and its backups (``supervisor.backup``)."""
        ok = GaugeMetricFamily(
            "phalanx_store_ok",
            "1 while no damage was met in the state database; 0 once some was (restore it "
            "from a backup: docs/operations.md)",
        )
        ok.add_metric([], 0.0 if self.sup.store.corrupt is not None else 1.0)
        yield ok
        backups = self.sup.backups
        if backups is None:
            return
        if backups.last_at is not None:
            newest = GaugeMetricFamily(
                "phalanx_store_backup_timestamp_seconds",
                "Unix time of the newest sound backup of the state database",
            )
            newest.add_metric([], backups.last_at)
            yield newest
        failures = CounterMetricFamily(
            "phalanx_store_backup_failures", "Backups of the state database that failed"
        )
        failures.add_metric([], backups.failures)
        yield failures
        if backups.remote is None:
            return
        if backups.uploaded_at is not None:
            uploaded = GaugeMetricFamily(
                "phalanx_store_backup_uploaded_timestamp_seconds",
                "Unix time of the newest backup uploaded to store.backup_url",
            )
            uploaded.add_metric([], backups.uploaded_at)
            yield uploaded
        upload_failures = CounterMetricFamily(
            "phalanx_store_backup_upload_failures",
            "Backups that could not be uploaded to store.backup_url",
        )
        upload_failures.add_metric([], backups.upload_failures)
        yield upload_failures


def registry_of(sup: Source) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SupervisorCollector(sup))
    return registry
