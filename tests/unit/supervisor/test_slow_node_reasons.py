"""A node whose ranks straggle in several jobs is ``warn`` with a ``straggler`` reason: the
real training metrics, registry and store, with the agents' batches and heartbeats written
by hand."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx import wire
from phalanx.cli.commands import _reasons
from phalanx.jobspec import validate_spec
from supervisor.config import SupervisorSettings
from supervisor.control.cluster import cluster_state
from supervisor.fleet.registry import NodeState, Registry
from supervisor.jobs import Job, JobState, RankPlace
from supervisor.store import Store
from supervisor.telemetry.training import TrainingMetrics

# Two jobs of 2 nodes x 2 ranks share node n2 (4 GPUs): job a on n1 and n2, b on n2 and n3.
PLACES = {"a": ("n1", "n2"), "b": ("n2", "n3")}
SLOW = {"a": 3, "b": 0}  # each job's rank on n2 that is slow


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """The real parts, wired as the daemon wires them."""

    def __init__(self, store: Store, *, node_jobs: int = 2) -> None:
        self.clock = Clock()
        self.registry = Registry(store, offline_after_s=15.0)
        self.jobs = {job_id: make_job(job_id, nodes) for job_id, nodes in PLACES.items()}
        self.metrics = TrainingMetrics(
            store,
            self.jobs.get,
            interval_s=5.0,
            straggler_margin=0.2,
            straggler_windows=2,
            straggler_node_jobs=node_jobs,
            on_slow_nodes=self.registry.mark_slow,
            clock=self.clock,
        )
        self.step = 0
        for node in ("n1", "n2", "n3"):
            self.registry.on_birth(birth(node))

    def windows(self, slow: dict[str, int], n: int = 3) -> None:
        """``n`` metrics windows of every job whose rank ``slow[job]`` (if any) takes 5x
        the others' step time, each followed by a flush."""
        for _ in range(n):
            self.step += 10
            for job_id, job in self.jobs.items():
                if job.state.final:
                    continue
                by_node: dict[str, list[wire.RankWindow]] = {}
                for place in job.ranks:
                    st = 0.5 if slow.get(job_id) == place.rank else 0.1
                    by_node.setdefault(place.node, []).append(self.window(place.rank, st))
                for node, ranks in by_node.items():
                    self.metrics.on_batch(
                        wire.MetricsBatch(
                            node=node,
                            job=job_id,
                            generation=job.generation,
                            window_s=5.0,
                            sent_at=1.0,
                            ranks=ranks,
                        )
                    )
            self.metrics.flush()
            self.clock.now += 5

    def window(self, rank: int, st: float) -> wire.RankWindow:
        return wire.RankWindow(
            rank=rank,
            step_first=self.step - 9,
            step_last=self.step,
            at=self.clock.now,
            reports=10,
            step_time_s=st,
            tokens_per_s=100.0,
        )


def make_job(job_id: str, nodes: tuple[str, str]) -> Job:
    spec = validate_spec(
        {
            "name": job_id,
            "team": "research",
            "command": ["python", "t.py"],
            "workdir": "/srv/t",
            "nodes": 2,
            "ranks_per_node": 2,
        }
    )
    ranks = [RankPlace(r, nodes[r // 2], r % 2) for r in range(4)]
    return Job(
        id=job_id, spec=spec, state=JobState.RUNNING, generation=1, nodes=list(nodes), ranks=ranks
    )


def birth(node: str, health: wire.Health | None = None) -> wire.NodeBirth:
    return wire.NodeBirth(
        node=node,
        seq=1,
        hostname=f"{node}.example",
        address="10.0.0.1",
        http_port=9400,
        gpus=[
            wire.GpuDescriptor(
                index=i, uuid=f"GPU-{node}-{i}", model="H100", memory_bytes=80 * 2**30
            )
            for i in range(4)
        ],
        gpu_backend="sim",
        topology=wire.Topology(rack="r1"),
        version="0.1.0",
        started_at=1700000000.0,
        health=health or wire.Health(status=wire.HealthStatus.OK),
    )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "state.db")
    yield s
    s.close()


@pytest.fixture
def fleet(store: Store) -> Fleet:
    return Fleet(store)


def kinds(store: Store, node: str, *wanted: str) -> list[str]:
    return [e.kind for e in store.events(node=node) if e.kind in wanted]


def test_a_node_slow_in_two_jobs_is_warn_with_a_straggler_reason(
    fleet: Fleet, store: Store
) -> None:
    fleet.windows(SLOW)
    view = fleet.registry.get("n2").view()
    assert (view["state"], view["health"]) == ("warn", "ok")
    [reason] = view["reasons"]
    assert (reason["code"], reason["severity"]) == ("straggler", "warn")
    assert reason["detail"] == (
        "step time above the median in 2 jobs: a (rank 3, 5.00x its gang's median), "
        "b (rank 0, 5.00x its gang's median)"
    )
    [slow] = [e for e in store.events(node="n2") if e.kind == "node_slow"]
    assert slow.detail == {"jobs": ["a", "b"], "reason": reason["detail"]}
    change = [e for e in store.events(node="n2") if e.kind == "state_changed"][-1]
    assert (change.detail["previous"], change.detail["state"]) == ("up", "warn")
    assert fleet.registry.get("n1").state is NodeState.UP


def test_a_node_slow_in_one_job_only_stays_up(fleet: Fleet, store: Store) -> None:
    fleet.windows({"a": 3})
    assert kinds(store, "n2", "straggler", "node_slow") == ["straggler"]
    assert fleet.registry.get("n2").view()["reasons"] == []
    assert fleet.registry.get("n2").state is NodeState.UP


def test_a_node_slow_in_one_job_is_warn_when_one_job_is_enough(store: Store) -> None:
    fleet = Fleet(store, node_jobs=1)
    fleet.windows({"a": 3})
    assert fleet.registry.get("n2").state is NodeState.WARN
    assert kinds(store, "n2", "node_slow") == ["node_slow"]


def test_node_slow_is_recorded_once_while_its_jobs_stay_the_same(
    fleet: Fleet, store: Store
) -> None:
    fleet.windows(SLOW, n=6)
    assert kinds(store, "n2", "node_slow", "node_slow_cleared") == ["node_slow"]


def test_the_straggler_reason_goes_when_the_flags_clear(fleet: Fleet, store: Store) -> None:
    fleet.windows(SLOW)
    fleet.windows({"a": 3}, n=1)  # b's rank 0 caught up
    node = fleet.registry.get("n2")
    assert node.state is NodeState.UP and node.view()["reasons"] == []
    assert kinds(store, "n2", "straggler_cleared", "node_slow", "node_slow_cleared") == [
        "node_slow",
        "straggler_cleared",
        "node_slow_cleared",
    ]
    [cleared] = [e for e in store.events(node="n2") if e.kind == "node_slow_cleared"]
    assert cleared.detail == {"jobs": ["a", "b"]}


def test_the_straggler_reason_goes_when_the_jobs_end(fleet: Fleet, store: Store) -> None:
    fleet.windows(SLOW)
    fleet.jobs["b"].state = JobState.SUCCEEDED
    fleet.metrics.flush()
    assert fleet.registry.get("n2").state is NodeState.UP
    assert kinds(store, "n2", "node_slow", "node_slow_cleared") == [
        "node_slow",
        "node_slow_cleared",
    ]


def test_the_straggler_reason_goes_when_a_recovery_starts_a_new_generation(
    fleet: Fleet,
) -> None:
    fleet.windows(SLOW)
    fleet.jobs["b"].generation = 2
    fleet.metrics.flush()
    assert fleet.registry.get("n2").state is NodeState.UP


def test_the_straggler_reason_comes_after_the_agents_own_reasons(fleet: Fleet) -> None:
    agent = wire.Reason(code="load_high", severity="warn")
    fleet.registry.on_birth(
        birth("n2", wire.Health(status=wire.HealthStatus.WARN, reasons=[agent])).model_copy(
            update={"seq": 2}
        )
    )
    fleet.windows(SLOW)
    view = fleet.registry.get("n2").view()
    assert [r["code"] for r in view["reasons"]] == ["load_high", "straggler"]
    assert _reasons(view) == "load_high, straggler"

    fleet.windows({}, n=1)  # the flags clear: the agent's warn stays
    assert fleet.registry.get("n2").state is NodeState.WARN
    assert [r["code"] for r in fleet.registry.get("n2").view()["reasons"]] == ["load_high"]


def test_a_drained_node_slow_in_two_jobs_stays_drained(fleet: Fleet) -> None:
    fleet.registry.drain("n2", "maintenance window")
    fleet.windows(SLOW)
    node = fleet.registry.get("n2")
    assert node.state is NodeState.DRAIN
    assert [r["code"] for r in node.view()["reasons"]] == ["straggler"]


def test_a_node_slow_in_two_jobs_takes_no_new_work(fleet: Fleet) -> None:
    fleet.windows(SLOW)
    state = cluster_state(
        fleet.registry.nodes.values(),
        list(fleet.jobs.values()),
        SupervisorSettings(),
        needs_burn_in=lambda _node: False,
        previous_spares=(),
        now=fleet.clock.now,
    )
    assert {n.id: n.schedulable for n in state.nodes} == {"n1": True, "n2": False, "n3": True}
    # Its jobs keep it: both still run on it.
    assert [r.nodes for r in state.running] == [("n1", "n2"), ("n2", "n3")]
