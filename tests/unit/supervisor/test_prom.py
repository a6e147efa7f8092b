"""The supervisor's Prometheus metrics: fleet and job figures, never a per-rank label."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import generate_latest

from phalanx import wire
from phalanx.jobspec import validate_spec
from phalanx.loopwatch import LoopWatch
from supervisor.api.prom import registry_of
from supervisor.backup import StoreBackups, take_backup
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.checkpoints.rows import CkptRows
from supervisor.fleet.registry import NodeState
from supervisor.jobs import Job, JobState
from supervisor.store import Store
from supervisor.telemetry.training import TrainingMetrics


@dataclass
class FakeNode:
    state: NodeState


@dataclass
class FakeRegistry:
    nodes: dict[str, FakeNode]


@dataclass
class FakeJobs:
    jobs: dict[str, Job]
    spares: tuple[str, ...] = ()


@dataclass
class FakeSupervisor:
    registry: FakeRegistry
    jobs: FakeJobs
    metrics: TrainingMetrics
    store: Store
    bad_messages: int = 0
    backups: StoreBackups | None = None
    loopwatch: LoopWatch = field(default_factory=LoopWatch)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def catalog(self) -> CheckpointCatalog:
        return CheckpointCatalog(self.store)


def job(job_id: str, state: JobState, restarts: int = 0) -> Job:
    spec = validate_spec(
        {
            "name": "tinylm",
            "team": "research",
            "command": ["python", "t.py"],
            "workdir": "/srv/t",
            "nodes": 64,
            "ranks_per_node": 8,
        }
    )
    return Job(id=job_id, spec=spec, state=state, generation=1, restarts=restarts)


def test_prometheus_shows_the_fleet_and_each_running_jobs_figures_by_job_only(
    tmp_path: Path,
) -> None:
    store = Store(tmp_path / "state.db")
    jobs = {
        "big-1": job("big-1", JobState.RUNNING, restarts=2),
        "old-1": job("old-1", JobState.SUCCEEDED, restarts=1),
        "wait-1": job("wait-1", JobState.PENDING),
    }
    jobs["wait-1"].submitted_at = time.time() - 600  # queued for 10 minutes
    CkptRows.of(store).add_commit("big-1", 90, "ram", time.time() - 5)
    CkptRows.of(store).add_commit("big-1", 60, "object", time.time() - 300)  # the object tier lags
    metrics = TrainingMetrics(store, jobs.get)
    metrics.on_batch(
        wire.MetricsBatch(
            node="n1",
            job="big-1",
            generation=1,
            window_s=5.0,
            sent_at=1.0,
            ranks=[
                wire.RankWindow(
                    rank=r,
                    step_first=0,
                    step_last=99,
                    at=1.0,
                    reports=100,
                    step_time_s=0.5,
                    tokens_per_s=1000.0,
                    scalars={"loss": (2.5, 2.0, 3.0, 2.5)},
                )
                for r in range(wire.MAX_METRIC_RANKS)
            ],
        )
    )
    metrics.flush()
    sup = FakeSupervisor(
        FakeRegistry({"n1": FakeNode(NodeState.UP), "n2": FakeNode(NodeState.DRAIN)}),
        FakeJobs(jobs, spares=("n3",)),
        metrics,
        store,
        bad_messages=3,
    )
    text = generate_latest(registry_of(sup)).decode()  # type: ignore[arg-type]
    lines = {line for line in text.splitlines() if not line.startswith("#")}
    assert 'phalanx_nodes{state="up"} 1.0' in lines
    assert 'phalanx_nodes{state="drain"} 1.0' in lines
    assert "phalanx_spares 1.0" in lines
    assert 'phalanx_jobs{state="running"} 1.0' in lines
    assert "phalanx_recoveries_total 3.0" in lines
    assert 'phalanx_job_step{job="big-1"} 99.0' in lines
    assert 'phalanx_job_loss{job="big-1"} 2.5' in lines
    assert 'phalanx_job_step_time_seconds{job="big-1"} 0.5' in lines
    assert 'phalanx_job_tokens_per_second{job="big-1"} 64000.0' in lines
    assert "phalanx_bad_messages_total 3.0" in lines
    assert 'phalanx_supervisor_loop_stall_seconds_bucket{le="+Inf"} 0.0' in lines
    names = {line.rsplit(" ", 1)[0] for line in lines}
    for generation in range(3):  # every pass of the collector, by generation
        bucket = f'generation="{generation}",le="+Inf"'
        assert f"phalanx_supervisor_gc_pause_seconds_bucket{{{bucket}}}" in names
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line}
    assert 600 <= values["phalanx_queue_wait_seconds"] < 660
    assert 5 <= values['phalanx_ckpt_commit_age_seconds{job="big-1",tier="ram"}'] < 60
    assert 300 <= values['phalanx_ckpt_commit_age_seconds{job="big-1",tier="object"}'] < 360
    assert "old-1" not in text  # an ended job has no series
    assert "rank" not in text.replace("ranks", "")  # no per-rank label, ever
    store.close()


def test_prometheus_shows_the_stores_health_and_its_newest_backup(tmp_path: Path) -> None:
    store = Store(tmp_path / "state.db")
    made = take_backup(store.path, tmp_path / "backup", keep=2)
    backups = StoreBackups(store.path, tmp_path / "backup", interval_s=300.0, keep=2)
    sup = FakeSupervisor(
        FakeRegistry({}), FakeJobs({}), TrainingMetrics(store, {}.get), store, backups=backups
    )

    text = generate_latest(registry_of(sup)).decode()  # type: ignore[arg-type]

    lines = {line for line in text.splitlines() if not line.startswith("#")}
    assert "phalanx_store_ok 1.0" in lines
    assert "phalanx_store_backup_failures_total 0.0" in lines
    newest = next(line for line in lines if line.startswith("phalanx_store_backup_timestamp"))
    assert float(newest.split()[1]) == made.path.stat().st_mtime
    store.close()
