"""Nodes that go offline together (a broker restart's wills, a network cut) are not that
many failures (issue 22: at 2,048 nodes a broker restart quarantined 1,908 nodes of a
job). Such a node is confirmed offline only after a whole heartbeat timeout, and a
recovery plan moves off nodes gone by their wills together without quarantining them.
A lone node's will is confirmed and quarantined as before.

The supervisor, its registry, store, controller and recovery executor are real; the
broker link is not started (its state is set), the registry's clock is the test's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx import wire
from phalanx.jobspec import validate_spec
from supervisor.config import SupervisorSettings
from supervisor.daemon import OFFLINE_CONFIRM_S, Supervisor
from supervisor.fleet.registry import NodeState
from supervisor.jobs import Job, JobState, RankPlace
from supervisor.records import Recovery
from supervisor.recovery.planner import Action, Cause, Failure, FailureKind, Plan
from tests.unit.supervisor.fake_fleet import birth
from tests.unit.supervisor.test_metrics import Clock

FLEET = 20


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[tuple[Supervisor, Clock]]:
    sup = Supervisor(SupervisorSettings(state_dir=tmp_path, offline_after_s=15.0), "t" * 24)
    clock = Clock()
    sup.registry.clock = clock
    for i in range(FLEET):
        sup.registry.on_birth(birth(f"n{i:02d}", gpus=2))
    sup.link.links[0]._connected.set()  # the link is up (not started: nothing is sent)
    sup.link_since = clock.now - 100.0
    try:
        yield sup, clock
    finally:
        sup.store.close()


def die(sup: Supervisor, node: str) -> float:
    sup.registry.on_death(wire.NodeDeath(node=node, seq=1, cause="lost"))
    found = sup.registry.nodes[node]
    assert found.state is NodeState.OFFLINE
    return found.offline_at


def test_a_lone_will_is_confirmed_after_the_short_wait(sup: tuple[Supervisor, Clock]) -> None:
    s, clock = sup
    at = die(s, "n00")
    assert not s.offline_confirmed(at)
    clock.now += OFFLINE_CONFIRM_S
    assert s.offline_confirmed(at)


def test_wills_together_are_confirmed_after_a_heartbeat_timeout(
    sup: tuple[Supervisor, Clock],
) -> None:
    s, clock = sup
    times = []
    for i in range(5):  # 5 of 20 nodes within a second: a broker or network event
        times.append(die(s, f"n{i:02d}"))
        clock.now += 0.2
    assert s.registry.offline_together(times[0], 10.0) == 5
    clock.now = times[0] + OFFLINE_CONFIRM_S + 1
    assert not any(s.offline_confirmed(t) for t in times)

    # The first to come back leave the others in the same event: the last to reconnect
    # still get their whole heartbeat timeout.
    for i in range(3):
        s.registry.on_birth(birth(f"n{i:02d}", gpus=2))
    assert s.registry.offline_together(times[0], 10.0) == 5
    assert s.registry.mass_offline(s.registry.nodes["n04"])
    assert not s.registry.mass_offline(s.registry.nodes["n00"])  # back online
    clock.now = times[0] + 14.0
    assert not any(s.offline_confirmed(t) for t in times[3:])
    clock.now = times[-1] + 15.0
    assert all(s.offline_confirmed(t) for t in times[3:])


def test_offline_together_counts_only_those_within_the_window(
    sup: tuple[Supervisor, Clock],
) -> None:
    s, clock = sup
    first = die(s, "n00")
    clock.now += 30.0
    later = [die(s, "n01"), die(s, "n02")]
    assert s.registry.offline_together(first, 10.0) == 1
    assert s.registry.offline_together(later[0], 10.0) == 2
    assert s.registry.offline_together(first + 15.0, 10.0) == 0
    assert s.registry.offline_together(first + 15.0, 15.0) == 3


def test_a_plan_does_not_quarantine_nodes_gone_together_by_their_wills(
    sup: tuple[Supervisor, Clock],
) -> None:
    s, clock = sup
    ctl = s.jobs
    spec = validate_spec(
        {
            "name": "big",
            "team": "t",
            "command": ["true"],
            "workdir": "/tmp",
            "nodes": 16,
            "ranks_per_node": 2,
        }
    )
    job = Job(Job.new_id("big"), spec, state=JobState.RECOVERING)
    job.nodes = [f"n{i:02d}" for i in range(16)]
    job.ranks = [RankPlace(rank=r, node=job.nodes[r // 2], local_rank=r % 2) for r in range(32)]
    job.recovery = Recovery(0, [], 0.0, 0.0)
    ctl.jobs[job.id] = job
    gone = [f"n{i:02d}" for i in range(6)]
    for node in gone:
        die(s, node)
    failures = [Failure(FailureKind.NODE_OFFLINE, "n00", detail="last will")]
    plan = Plan(Action.REPLACE, "nodes lost", Cause.HARDWARE, quarantine=tuple(gone))
    ctl.recoveries._quarantine(job, plan, failures)
    assert all(s.registry.nodes[n].drain is None for n in gone)  # none drained
    assert [e.kind for e in s.store.events()][-1] == "quarantine_skipped"

    # Later, nodes lost one at a time, a minute apart, within one recovery: each is its
    # own failure, quarantined as before.
    for node in gone:
        s.registry.on_birth(birth(node, gpus=2))
    job.recovery = Recovery(0, [], 0.0, 0.0)
    lost = ["n07", "n08", "n09", "n10", "n11"]
    for i, node in enumerate(lost):
        clock.now += 60.0
        die(s, node)
        plan = Plan(Action.REPLACE, "node lost", Cause.HARDWARE, quarantine=tuple(lost[: i + 1]))
        ctl.recoveries._quarantine(job, plan, [Failure(FailureKind.NODE_OFFLINE, node)])
    for node in lost:
        drained = s.registry.nodes[node].drain
        assert drained is not None and drained.by == "supervisor", node
