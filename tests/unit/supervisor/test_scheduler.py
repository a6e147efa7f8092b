"""The gang scheduler: one rule per test, then properties over random clusters and queues."""

from __future__ import annotations

import dataclasses
import math
import random
from collections import Counter
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from supervisor.scheduler import (
    ClusterNode,
    ClusterState,
    Decisions,
    InvalidInput,
    PendingJob,
    Placement,
    RunningJob,
    Start,
    TeamShare,
    Wait,
    WaitReason,
    schedule,
)

_T = TypeVar("_T")

# -- helpers ------------------------------------------------------------------


def node(
    node_id: str,
    rack: str = "r0",
    gpus: int = 8,
    gpu_type: str = "h100",
    domain: str | None = None,
    schedulable: bool = True,
) -> ClusterNode:
    return ClusterNode(node_id, rack, gpus, gpu_type, domain, schedulable)


def racks(count: int, per_rack: int, gpus: int = 8) -> tuple[ClusterNode, ...]:
    """Nodes r0n0, r0n1, ... r1n0, ... in racks r0, r1, ..."""
    return tuple(node(f"r{r}n{i}", f"r{r}", gpus) for r in range(count) for i in range(per_rack))


def job(
    job_id: str,
    nodes: int = 1,
    gpus: int = 8,
    *,
    priority: int = 0,
    team: str = "t",
    submit: float = 0.0,
    max_runtime: float = 3600.0,
    gpu_type: str | None = None,
    placement: Placement = Placement.PACK,
    required: bool = False,
) -> PendingJob:
    return PendingJob(
        job_id, team, priority, nodes, gpus, max_runtime, submit, gpu_type, placement, required
    )


def running(
    job_id: str,
    nodes: tuple[str, ...],
    gpus: int = 8,
    *,
    priority: int = 0,
    team: str = "t",
    preemptible: bool = False,
    start: float = 0.0,
    max_runtime: float = 3600.0,
    checkpoint: float | None = None,
) -> RunningJob:
    return RunningJob(
        job_id, team, priority, nodes, gpus, preemptible, start, max_runtime, checkpoint
    )


def run(
    nodes: tuple[ClusterNode, ...],
    pending: tuple[PendingJob, ...] = (),
    running_jobs: tuple[RunningJob, ...] = (),
    *,
    now: float = 0.0,
    **kwargs: Any,
) -> Decisions:
    state = ClusterState(now, nodes, running_jobs, pending)
    return schedule(dataclasses.replace(state, **kwargs))


def starts(decisions: Decisions) -> dict[str, Start]:
    return {start.job_id: start for start in decisions.starts}


def waits(decisions: Decisions) -> dict[str, Wait]:
    return {wait.job_id: wait for wait in decisions.waits}


# -- gangs and capacity -------------------------------------------------------


def test_job_starts_on_as_many_nodes_as_it_needs() -> None:
    decisions = run(racks(1, 4), (job("a", nodes=3),))
    assert len(starts(decisions)["a"].nodes) == 3


def test_job_never_starts_on_part_of_its_nodes() -> None:
    decisions = run(
        racks(1, 3), (job("a", nodes=3),), (running("busy", ("r0n2",), gpus=1),), now=0.0
    )
    assert decisions.starts == ()
    assert waits(decisions)["a"].reason is WaitReason.RESOURCES


def test_node_without_enough_free_gpus_is_not_used() -> None:
    busy = (running("busy", ("r0n0",), gpus=4),)
    decisions = run(racks(1, 2), (job("a", gpus=6),), busy)
    assert starts(decisions)["a"].nodes == ("r0n1",)


def test_nodes_are_shared_by_jobs_whose_gpus_fit() -> None:
    decisions = run(racks(1, 1), (job("a", gpus=3), job("b", gpus=5), job("c", gpus=1)), now=0.0)
    assert set(starts(decisions)) == {"a", "b"}
    assert waits(decisions)["c"].reason is WaitReason.PRIORITY


def test_job_only_uses_nodes_of_its_gpu_type() -> None:
    nodes = (node("a0", gpu_type="a100"), node("h0", gpu_type="h100"))
    decisions = run(nodes, (job("a", gpu_type="h100"),), now=0.0)
    assert starts(decisions)["a"].nodes == ("h0",)


def test_job_without_gpu_type_uses_nodes_of_one_type() -> None:
    nodes = (node("a0", gpu_type="a100"), node("h0", gpu_type="h100"), node("h1", gpu_type="h100"))
    decisions = run(nodes, (job("a", nodes=2),), now=0.0)
    assert starts(decisions)["a"].nodes == ("h0", "h1")


def test_unschedulable_nodes_are_never_used() -> None:
    nodes = (node("n0", schedulable=False), node("n1"))
    decisions = run(nodes, (job("a", nodes=2), job("b")), now=0.0)
    assert starts(decisions)["b"].nodes == ("n1",)
    assert waits(decisions)["a"].reason is WaitReason.RESOURCES


def test_job_larger_than_cluster_waits_for_resources_without_reservation() -> None:
    decisions = run(racks(1, 2), (job("a", nodes=3),), now=0.0)
    wait = waits(decisions)["a"]
    assert (wait.reason, wait.reserved_start) == (WaitReason.RESOURCES, None)
    assert "can never start" in wait.detail


def test_a_job_that_fits_once_a_drained_node_returns_cannot_start_yet_but_not_never() -> None:
    nodes = (node("n0"), node("n1", schedulable=False))  # n1: drained, sick or offline

    wait = waits(run(nodes, (job("a", nodes=2),), now=0.0))["a"]

    assert (wait.reason, wait.reserved_start) == (WaitReason.RESOURCES, None)
    assert wait.detail == (
        "cannot start yet: needs 2 nodes with 8 free GPUs each, the cluster has 1 such nodes "
        "in service, 1 drained, sick or offline (they can return: `phalanx undrain`)"
    )


def test_a_job_that_fits_only_with_the_spare_says_so_and_cannot_start_yet() -> None:
    wait = waits(run(racks(1, 2), (job("a", nodes=2),), now=0.0, spare_pool=1))["a"]

    assert wait.detail == (
        "cannot start yet: needs 2 nodes with 8 free GPUs each, the cluster has 1 such nodes "
        "in service, 1 held as a hot spare"
    )


def test_a_job_too_big_even_with_every_known_node_can_never_start() -> None:
    nodes = (node("n0"), node("n1", schedulable=False), node("small", gpus=4))

    wait = waits(run(nodes, (job("a", nodes=3),), now=0.0))["a"]

    assert wait.detail == (
        "can never start: needs 3 nodes with 8 free GPUs each, the cluster has 2 such nodes "
        "in all (1 in service, 1 drained, sick or offline (they can return: `phalanx undrain`))"
    )


def test_a_spread_that_fits_once_a_drained_rack_returns_cannot_start_yet() -> None:
    nodes = (node("a", rack="r0"), node("b", rack="r1", schedulable=False), node("c", rack="r0"))
    spread = job("s", nodes=2, placement=Placement.SPREAD, required=True)

    wait = waits(run(nodes, (spread,), now=0.0))["s"]

    assert wait.reason is WaitReason.TOPOLOGY
    assert wait.detail.startswith(
        "cannot start yet: spread required over 2 racks, but only 1 racks have nodes with "
        "8 GPUs in service; 2 racks have such nodes in all (1 drained"
    )


def test_job_of_unknown_gpu_type_waits_for_resources() -> None:
    decisions = run(racks(1, 1), (job("a", gpu_type="b200"),), now=0.0)
    assert waits(decisions)["a"].reason is WaitReason.RESOURCES
    assert "b200" in waits(decisions)["a"].detail


# -- spares -------------------------------------------------------------------


def test_spare_nodes_are_never_used_for_normal_placement() -> None:
    decisions = run(racks(1, 3), (job("a", nodes=3), job("b", nodes=2)), now=0.0, spare_pool=1)
    (spare,) = decisions.spares
    assert spare not in starts(decisions)["b"].nodes
    assert waits(decisions)["a"].reason is WaitReason.RESOURCES


def test_spares_are_idle_schedulable_nodes() -> None:
    nodes = (node("n0", schedulable=False), node("n1"), node("n2"))
    decisions = run(nodes, (), (running("busy", ("n1",), gpus=1),), now=0.0, spare_pool=1)
    assert decisions.spares == ("n2",)


def test_spares_spread_over_racks() -> None:
    decisions = run(racks(3, 3), now=0.0, spare_pool=3)
    assert decisions.spares == ("r0n0", "r1n0", "r2n0")


def test_previous_spares_stay_spares() -> None:
    decisions = run(racks(2, 3), now=0.0, spare_pool=2, previous_spares=frozenset({"r1n2", "r0n1"}))
    assert decisions.spares == ("r0n1", "r1n2")


def test_spare_pool_is_short_when_too_few_nodes_are_idle() -> None:
    decisions = run(racks(1, 2), (), (running("busy", ("r0n0",), gpus=1),), now=0.0, spare_pool=2)
    assert decisions.spares == ("r0n1",)


# -- topology -----------------------------------------------------------------


def test_pack_places_job_in_fewest_racks() -> None:
    busy = (running("busy", ("r0n2", "r0n3")),)
    decisions = run(racks(2, 4), (job("a", nodes=3),), busy, now=0.0)
    assert starts(decisions)["a"].nodes == ("r1n0", "r1n1", "r1n2")


def test_pack_prefers_fewest_nvlink_domains() -> None:
    nodes = tuple(node(f"n{i}", domain=f"d{i // 4}") for i in range(8))
    decisions = run(nodes, (job("a", nodes=4),), (running("busy", ("n0",)),), now=0.0)
    assert starts(decisions)["a"].nodes == ("n4", "n5", "n6", "n7")


def test_pack_prefers_the_rack_it_fills_best() -> None:
    busy = (running("busy", ("r1n0", "r1n1")),)
    decisions = run(racks(2, 4), (job("a", nodes=2),), busy, now=0.0)
    assert starts(decisions)["a"].nodes == ("r1n2", "r1n3")


def test_placement_ties_break_by_node_id() -> None:
    decisions = run(racks(2, 4), (job("a", nodes=2),), now=0.0)
    assert starts(decisions)["a"].nodes == ("r0n0", "r0n1")


def test_single_node_job_goes_to_node_with_fewest_free_gpus() -> None:
    busy = (running("busy", ("r0n1",), gpus=4),)
    decisions = run(racks(1, 3), (job("a", gpus=4),), busy, now=0.0)
    assert starts(decisions)["a"].nodes == ("r0n1",)


def test_required_pack_waits_for_topology_when_free_nodes_are_scattered() -> None:
    busy = (running("busy", ("r0n0", "r1n0")),)
    decisions = run(racks(2, 2), (job("a", nodes=2, required=True),), busy, now=0.0)
    assert waits(decisions)["a"].reason is WaitReason.TOPOLOGY


def test_preferred_pack_spans_racks_when_it_must() -> None:
    busy = (running("busy", ("r0n0", "r1n0")),)
    decisions = run(racks(2, 2), (job("a", nodes=2),), busy, now=0.0)
    assert starts(decisions)["a"].nodes == ("r0n1", "r1n1")


def test_required_spread_puts_each_node_in_its_own_rack() -> None:
    decisions = run(
        racks(3, 2), (job("a", nodes=3, placement=Placement.SPREAD, required=True),), now=0.0
    )
    assert starts(decisions)["a"].nodes == ("r0n0", "r1n0", "r2n0")


def test_preferred_spread_reuses_racks_when_there_are_too_few() -> None:
    decisions = run(racks(2, 2), (job("a", nodes=3, placement=Placement.SPREAD),), now=0.0)
    assert Counter(n[:2] for n in starts(decisions)["a"].nodes) == {"r0": 2, "r1": 1}


def test_required_spread_waits_for_topology_when_too_few_racks_are_free() -> None:
    busy = (running("busy", ("r2n0", "r2n1")),)
    decisions = run(
        racks(3, 2), (job("a", nodes=3, placement=Placement.SPREAD, required=True),), busy, now=0.0
    )
    assert waits(decisions)["a"].reason is WaitReason.TOPOLOGY


def test_required_spread_over_more_racks_than_exist_can_never_start() -> None:
    decisions = run(
        racks(2, 2), (job("a", nodes=3, placement=Placement.SPREAD, required=True),), now=0.0
    )
    wait = waits(decisions)["a"]
    assert (wait.reason, wait.reserved_start) == (WaitReason.TOPOLOGY, None)


def test_started_nodes_are_in_rack_then_domain_order() -> None:
    nodes = (
        node("a", rack="r1", domain="x"),
        node("b", rack="r0", domain="y"),
        node("c", rack="r0", domain="x"),
        node("d", rack="r1", domain="x"),
    )
    decisions = run(nodes, (job("j", nodes=4),), now=0.0)
    assert starts(decisions)["j"].nodes == ("c", "b", "a", "d")


# -- queue order --------------------------------------------------------------


def test_higher_priority_job_starts_first() -> None:
    pending = (job("low", submit=0.0), job("high", priority=1, submit=5.0))
    decisions = run(racks(1, 1), pending, now=10.0)
    assert set(starts(decisions)) == {"high"}


def test_team_with_lower_usage_per_weight_starts_first() -> None:
    teams = (TeamShare("a", usage=10.0, weight=1.0), TeamShare("b", usage=10.0, weight=4.0))
    pending = (job("of-a", team="a", submit=0.0), job("of-b", team="b", submit=5.0))
    decisions = run(racks(1, 1), pending, now=10.0, teams=teams)
    assert set(starts(decisions)) == {"of-b"}


def test_earlier_submission_starts_first_among_equals() -> None:
    pending = (job("late", submit=5.0), job("early", submit=1.0))
    decisions = run(racks(1, 1), pending, now=10.0)
    assert set(starts(decisions)) == {"early"}


def test_waits_are_listed_in_queue_order() -> None:
    pending = (job("c", submit=3.0), job("b", submit=2.0), job("a", priority=1, submit=9.0))
    decisions = run(racks(1, 1), pending, (running("busy", ("r0n0",)),), now=10.0)
    assert [wait.job_id for wait in decisions.waits] == ["a", "b", "c"]


# -- quotas -------------------------------------------------------------------


def test_pending_job_reports_quota_reason() -> None:
    teams = (TeamShare("t", gpu_quota=8),)
    decisions = run(racks(1, 2), (job("a", nodes=2),), now=0.0, teams=teams)
    wait = waits(decisions)["a"]
    assert wait.reason is WaitReason.QUOTA
    assert "quota" in wait.detail


def test_quota_counts_gpus_of_running_jobs() -> None:
    teams = (TeamShare("t", gpu_quota=12),)
    decisions = run(
        racks(1, 2),
        (job("a", gpus=8),),
        (running("mine", ("r0n0",), gpus=8),),
        now=0.0,
        teams=teams,
    )
    assert waits(decisions)["a"].reason is WaitReason.QUOTA


def test_quota_counts_jobs_started_in_the_same_pass() -> None:
    teams = (TeamShare("t", gpu_quota=8),)
    decisions = run(racks(1, 2), (job("a", submit=0.0), job("b", submit=1.0)), now=0.0, teams=teams)
    assert set(starts(decisions)) == {"a"}
    assert waits(decisions)["b"].reason is WaitReason.QUOTA


def test_quota_blocked_job_does_not_hold_back_others() -> None:
    teams = (TeamShare("capped", gpu_quota=0),)
    pending = (job("capped", team="capped", priority=9), job("other", team="free"))
    decisions = run(racks(1, 1), pending, now=0.0, teams=teams)
    assert set(starts(decisions)) == {"other"}
    assert waits(decisions)["capped"].reserved_start is None


# -- reservations and backfill -------------------------------------------------

# One node busy until t=1000 and one free; "big" needs both.
_BUSY_UNTIL_1000 = (running("busy", ("r0n0",), start=0.0, max_runtime=1000.0),)


def test_blocked_job_reserves_start_when_running_jobs_reach_max_runtime() -> None:
    decisions = run(racks(1, 2), (job("big", nodes=2, priority=1),), _BUSY_UNTIL_1000, now=100.0)
    wait = waits(decisions)["big"]
    assert (wait.reason, wait.reserved_start) == (WaitReason.RESOURCES, 1000.0)
    assert wait.reserved_nodes == ("r0n0", "r0n1")


def test_backfill_starts_short_job_that_ends_before_reserved_start() -> None:
    pending = (job("big", nodes=2, priority=1), job("short", max_runtime=900.0))
    decisions = run(racks(1, 2), pending, _BUSY_UNTIL_1000, now=100.0)
    assert starts(decisions)["short"].nodes == ("r0n1",)
    assert waits(decisions)["big"].reserved_start == 1000.0


def test_backfill_does_not_delay_reserved_job() -> None:
    pending = (job("big", nodes=2, priority=1), job("long", max_runtime=901.0))
    decisions = run(racks(1, 2), pending, _BUSY_UNTIL_1000, now=100.0)
    assert "long" not in starts(decisions)
    assert waits(decisions)["big"].reserved_start == 1000.0


def test_pending_job_reports_reservation_reason() -> None:
    pending = (job("big", nodes=2, priority=1), job("long", max_runtime=5000.0))
    decisions = run(racks(1, 2), pending, _BUSY_UNTIL_1000, now=100.0)
    wait = waits(decisions)["long"]
    assert wait.reason is WaitReason.RESERVATION
    assert "big" in wait.detail


def test_backfill_uses_nodes_the_reservation_does_not_need() -> None:
    busy = (running("busy", ("r0n0", "r0n1"), max_runtime=1000.0),)
    pending = (job("big", nodes=3, priority=1), job("long", max_runtime=5000.0))
    decisions = run(racks(1, 4), pending, busy, now=100.0)
    reserved = set(waits(decisions)["big"].reserved_nodes)
    assert len(reserved) == 3
    assert set(starts(decisions)["long"].nodes).isdisjoint(reserved)


def test_backfill_may_use_gpus_a_reserved_node_has_to_spare() -> None:
    # At t=1000 the node has 8 free GPUs and "big" needs 6: 2 may run past it.
    busy = (running("busy", ("r0n0",), gpus=4, max_runtime=1000.0),)
    pending = (
        job("big", gpus=6, priority=1),
        job("long", gpus=2, max_runtime=5000.0),
        job("longer", gpus=2, max_runtime=5000.0),
    )
    decisions = run(racks(1, 1), pending, busy, now=100.0)
    assert waits(decisions)["big"].reserved_start == 1000.0
    assert "long" in starts(decisions)
    assert waits(decisions)["longer"].reason is WaitReason.RESERVATION


def test_backfill_respects_the_earliest_of_several_reservations() -> None:
    busy = (
        running("soon", ("r0n0",), max_runtime=1000.0),
        running("later", ("r0n1", "r0n2"), max_runtime=2000.0),
    )
    pending = (
        job("first", nodes=2, priority=9),
        job("second", nodes=2, priority=8),
        job("between", max_runtime=1500.0),
    )
    decisions = run(racks(1, 4), pending, busy)
    assert waits(decisions)["first"].reserved_start == 1000.0
    assert waits(decisions)["second"].reserved_start == 2000.0
    assert waits(decisions)["between"].reason is WaitReason.RESERVATION


def test_overrunning_running_job_counts_as_ending_now() -> None:
    busy = (running("late", ("r0n0",), start=0.0, max_runtime=100.0),)
    decisions = run(racks(1, 1), (job("next"),), busy, now=500.0)
    assert waits(decisions)["next"].reserved_start == 500.0


def test_reservation_depth_limits_reserved_jobs() -> None:
    pending = (job("first", nodes=2, priority=2), job("second", nodes=2, priority=1))
    decisions = run(racks(1, 2), pending, _BUSY_UNTIL_1000, now=100.0, reservation_depth=1)
    assert waits(decisions)["first"].reserved_start == 1000.0
    assert waits(decisions)["second"].reserved_start is None


def test_pending_job_reports_priority_reason() -> None:
    decisions = run(racks(1, 1), (job("first", submit=0.0), job("second", submit=1.0)), now=0.0)
    wait = waits(decisions)["second"]
    assert wait.reason is WaitReason.PRIORITY
    assert "higher-ordered" in wait.detail


def test_pending_job_reports_resources_reason() -> None:
    decisions = run(racks(1, 1), (job("a"),), (running("busy", ("r0n0",), gpus=1),), now=0.0)
    assert waits(decisions)["a"].reason is WaitReason.RESOURCES


# -- preemption ---------------------------------------------------------------


def test_higher_priority_job_preempts_lower_priority_preemptible_job() -> None:
    victim = running("victim", ("r0n0",), preemptible=True, start=0.0, checkpoint=50.0)
    decisions = run(racks(1, 1), (job("urgent", priority=1),), (victim,), now=100.0)
    ((preempt),) = decisions.preemptions
    assert (preempt.victim_id, preempt.for_job_id, preempt.lost_work) == ("victim", "urgent", 400.0)
    assert starts(decisions)["urgent"] == Start("urgent", ("r0n0",), 8, ("victim",))


def test_preemption_picks_victim_with_least_lost_work() -> None:
    costly = running("costly", ("r0n0",), preemptible=True, checkpoint=10.0)
    cheap = running("cheap", ("r0n1",), preemptible=True, checkpoint=90.0)
    decisions = run(racks(1, 2), (job("urgent", priority=1),), (costly, cheap), now=100.0)
    assert [p.victim_id for p in decisions.preemptions] == ["cheap"]
    assert starts(decisions)["urgent"].nodes == ("r0n1",)


def test_lost_work_counts_from_start_when_job_never_checkpointed() -> None:
    fresh = running("fresh", ("r0n0",), preemptible=True, start=-100.0)
    saved = running("saved", ("r0n1",), preemptible=True, start=-1000.0, checkpoint=-200.0)
    decisions = run(racks(1, 2), (job("urgent", priority=1),), (fresh, saved), now=0.0)
    ((preempt),) = decisions.preemptions
    assert (preempt.victim_id, preempt.lost_work) == ("fresh", 800.0)


def test_preemption_evicts_no_more_victims_than_needed() -> None:
    small = (
        running("a", ("r0n0",), gpus=4, preemptible=True, checkpoint=0.0),
        running("b", ("r0n0",), gpus=4, preemptible=True, checkpoint=50.0),
    )
    decisions = run(racks(1, 1), (job("urgent", gpus=4, priority=1),), small, now=100.0)
    assert [p.victim_id for p in decisions.preemptions] == ["b"]


def test_victims_gpus_go_only_to_the_job_that_preempts_them() -> None:
    victim = running("victim", ("r0n0",), preemptible=True)
    pending = (job("urgent", gpus=4, priority=1), job("bystander", gpus=4, submit=1.0))
    decisions = run(racks(1, 1), pending, (victim,), now=100.0)
    assert set(starts(decisions)) == {"urgent"}
    assert waits(decisions)["bystander"].reason is WaitReason.RESOURCES


def test_non_preemptible_job_is_never_preempted() -> None:
    pinned = running("pinned", ("r0n0",), preemptible=False)
    decisions = run(racks(1, 1), (job("urgent", priority=1),), (pinned,), now=100.0)
    assert decisions.preemptions == ()
    assert "urgent" in waits(decisions)


def test_equal_priority_job_is_never_preempted() -> None:
    peer = running("peer", ("r0n0",), priority=1, preemptible=True)
    decisions = run(racks(1, 1), (job("urgent", priority=1),), (peer,), now=100.0)
    assert decisions.preemptions == ()


def test_preemption_only_happens_when_it_lets_the_job_start() -> None:
    jobs = (
        running("victim", ("r0n0",), preemptible=True),
        running("pinned", ("r0n1",), preemptible=False),
    )
    decisions = run(racks(1, 2), (job("urgent", nodes=2, priority=1),), jobs, now=100.0)
    assert decisions.preemptions == ()
    assert decisions.starts == ()


def test_max_preemptions_caps_preempting_starts() -> None:
    victims = tuple(running(f"v{i}", (f"r0n{i}",), preemptible=True) for i in range(2))
    pending = (job("u1", priority=1, submit=0.0), job("u2", priority=1, submit=1.0))
    decisions = run(racks(1, 2), pending, victims, now=100.0, max_preemptions=1)
    assert set(starts(decisions)) == {"u1"}
    assert len(decisions.preemptions) == 1


# -- input errors ---------------------------------------------------------------


def test_running_job_on_unknown_node_is_rejected() -> None:
    with pytest.raises(InvalidInput, match="ghost") as caught:
        run(racks(1, 1), (), (running("j", ("ghost",)),), now=0.0)
    assert caught.value.field == "running job j: nodes"


def test_overbooked_node_is_rejected() -> None:
    jobs = (running("a", ("r0n0",), gpus=6), running("b", ("r0n0",), gpus=6))
    with pytest.raises(InvalidInput, match=r"r0n0.*a, b"):
        run(racks(1, 1), (), jobs, now=0.0)


def test_duplicate_node_id_is_rejected() -> None:
    with pytest.raises(InvalidInput, match="twice"):
        run((node("n0"), node("n0", rack="r1")), now=0.0)


def test_job_both_running_and_pending_is_rejected() -> None:
    with pytest.raises(InvalidInput, match="both running and pending"):
        run(racks(1, 2), (job("a"),), (running("a", ("r0n0",)),), now=0.0)


def test_invalid_pending_job_names_the_field() -> None:
    with pytest.raises(InvalidInput) as caught:
        job("a", gpus=0)
    assert caught.value.field == "pending job a: gpus_per_node"


def test_non_finite_now_is_rejected() -> None:
    with pytest.raises(InvalidInput, match="now"):
        ClusterState(now=math.nan, nodes=())


# -- properties ---------------------------------------------------------------

TYPES = ("a100", "h100")


@st.composite
def cluster_states(draw: st.DrawFn) -> ClusterState:
    """Small mixed clusters (types, racks, domains, unhealthy nodes), jobs on them, a queue."""
    n_racks = draw(st.integers(1, 3))
    nodes = []
    for k in range(draw(st.integers(1, 10))):
        nodes.append(
            ClusterNode(
                id=f"n{k}",
                rack=f"r{draw(st.integers(0, n_racks - 1))}",
                gpus=draw(st.sampled_from((2, 4, 8))),
                gpu_type=draw(st.sampled_from(TYPES)),
                nvlink_domain=draw(st.sampled_from((None, "d0", "d1"))),
                schedulable=draw(st.sampled_from((True, True, True, False))),
            )
        )
    free = {n.id: n.gpus for n in nodes}
    now = 1000.0
    running_jobs = []
    for k in range(draw(st.integers(0, 6))):
        chosen = draw(
            st.lists(st.sampled_from([n.id for n in nodes]), min_size=1, max_size=3, unique=True)
        )
        room = min(free[n] for n in chosen)
        if room == 0:
            continue
        per_node = draw(st.integers(1, room))
        for n in chosen:
            free[n] -= per_node
        start = draw(st.floats(0.0, now))
        running_jobs.append(
            RunningJob(
                id=f"run{k}",
                team=draw(st.sampled_from("xyz")),
                priority=draw(st.integers(0, 2)),
                nodes=tuple(chosen),
                gpus_per_node=per_node,
                preemptible=draw(st.sampled_from((True, True, False))),
                start_time=start,
                max_runtime=draw(st.floats(1.0, 3000.0)),
                last_checkpoint_time=draw(st.none() | st.floats(start, now)),
            )
        )
    pending = tuple(
        PendingJob(
            id=f"job{k}",
            team=draw(st.sampled_from("xyz")),
            priority=draw(st.integers(0, 3)),
            nodes=draw(st.integers(1, 3)),
            gpus_per_node=draw(st.sampled_from((1, 2, 3, 4, 8))),
            max_runtime=draw(st.floats(1.0, 4000.0)),
            submit_time=draw(st.floats(0.0, now)),
            gpu_type=draw(st.sampled_from((None, *TYPES))),
            placement=draw(st.sampled_from(Placement)),
            placement_required=draw(st.booleans()),
        )
        for k in range(draw(st.integers(0, 8)))
    )
    teams = tuple(
        TeamShare(
            team,
            gpu_quota=draw(st.none() | st.integers(0, 40)),
            weight=draw(st.floats(0.5, 3.0)),
            usage=draw(st.floats(0.0, 100.0)),
        )
        for team in "xyz"
        if draw(st.booleans())
    )
    return ClusterState(
        now=now,
        nodes=tuple(nodes),
        running=tuple(running_jobs),
        pending=pending,
        teams=teams,
        spare_pool=draw(st.integers(0, 3)),
        previous_spares=frozenset(draw(st.lists(st.sampled_from([n.id for n in nodes])))),
        reservation_depth=draw(st.integers(0, 3)),
        max_preemptions=draw(st.integers(0, 3)),
    )


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _end(start: float, max_runtime: float, now: float) -> float:
    return max(now, start + max_runtime)


@PROPERTY
@given(cluster_states())
def test_every_pending_job_gets_exactly_one_decision(state: ClusterState) -> None:
    decisions = schedule(state)
    decided = [s.job_id for s in decisions.starts] + [w.job_id for w in decisions.waits]
    assert sorted(decided) == sorted(j.id for j in state.pending)


@PROPERTY
@given(cluster_states())
def test_no_job_ever_starts_on_part_of_its_gang(state: ClusterState) -> None:
    decisions = schedule(state)
    pending = {j.id: j for j in state.pending}
    nodes = {n.id: n for n in state.nodes}
    for start in decisions.starts:
        wanted = pending[start.job_id]
        assert len(start.nodes) == len(set(start.nodes)) == wanted.nodes
        assert start.gpus_per_node == wanted.gpus_per_node
        types = {nodes[n].gpu_type for n in start.nodes}
        assert len(types) == 1
        assert wanted.gpu_type is None or types == {wanted.gpu_type}


@PROPERTY
@given(cluster_states())
def test_no_gpu_is_ever_double_booked(state: ClusterState) -> None:
    decisions = schedule(state)
    evicted = {p.victim_id for p in decisions.preemptions}
    used: Counter[str] = Counter()
    for job_ in state.running:
        if job_.id not in evicted:
            for n in job_.nodes:
                used[n] += job_.gpus_per_node
    for start in decisions.starts:
        for n in start.nodes:
            used[n] += start.gpus_per_node
    for cluster_node in state.nodes:
        assert used[cluster_node.id] <= cluster_node.gpus


@PROPERTY
@given(cluster_states())
def test_jobs_started_without_preemption_never_need_a_victims_gpus(state: ClusterState) -> None:
    decisions = schedule(state)
    used: Counter[str] = Counter()  # while the victims are still stopping
    for job_ in state.running:
        for n in job_.nodes:
            used[n] += job_.gpus_per_node
    for start in decisions.starts:
        if not start.preempts:
            for n in start.nodes:
                used[n] += start.gpus_per_node
    for cluster_node in state.nodes:
        assert used[cluster_node.id] <= cluster_node.gpus


@PROPERTY
@given(cluster_states())
def test_spares_and_unschedulable_nodes_are_never_used(state: ClusterState) -> None:
    decisions = schedule(state)
    nodes = {n.id: n for n in state.nodes}
    busy = {n for job_ in state.running for n in job_.nodes}
    idle_healthy = [n.id for n in state.nodes if n.schedulable and n.id not in busy]
    assert len(decisions.spares) == min(state.spare_pool, len(idle_healthy))
    assert set(decisions.spares) <= set(idle_healthy)
    for start in decisions.starts:
        for n in start.nodes:
            assert nodes[n].schedulable
            assert n not in decisions.spares


@PROPERTY
@given(cluster_states())
def test_quotas_are_never_exceeded(state: ClusterState) -> None:
    decisions = schedule(state)
    quotas = {t.team: t.gpu_quota for t in state.teams if t.gpu_quota is not None}
    evicted = {p.victim_id for p in decisions.preemptions}
    pending = {j.id: j for j in state.pending}
    used: Counter[str] = Counter()
    for job_ in state.running:
        if job_.id not in evicted:
            used[job_.team] += job_.total_gpus
    for start in decisions.starts:
        used[pending[start.job_id].team] += pending[start.job_id].total_gpus
    for start in decisions.starts:
        team = pending[start.job_id].team
        if team in quotas:
            assert used[team] <= quotas[team]


@PROPERTY
@given(cluster_states())
def test_preemption_evicts_only_lower_priority_preemptible_jobs_that_free_its_nodes(
    state: ClusterState,
) -> None:
    decisions = schedule(state)
    running_ = {j.id: j for j in state.running}
    pending = {j.id: j for j in state.pending}
    started = starts(decisions)
    victims = [p.victim_id for p in decisions.preemptions]
    assert len(victims) == len(set(victims))
    for preempt in decisions.preemptions:
        victim = running_[preempt.victim_id]
        assert victim.preemptible
        assert victim.priority < pending[preempt.for_job_id].priority
        start = started[preempt.for_job_id]
        assert preempt.victim_id in start.preempts
        assert set(victim.nodes) & set(start.nodes)
    assert len({p.for_job_id for p in decisions.preemptions}) <= state.max_preemptions


@PROPERTY
@given(cluster_states())
def test_required_placements_are_honoured(state: ClusterState) -> None:
    decisions = schedule(state)
    pending = {j.id: j for j in state.pending}
    nodes = {n.id: n for n in state.nodes}
    for start in decisions.starts:
        wanted = pending[start.job_id]
        racks_used = {nodes[n].rack for n in start.nodes}
        if wanted.placement_required and wanted.placement is Placement.SPREAD:
            assert len(racks_used) == wanted.nodes
        elif wanted.placement_required:
            gpu_type = nodes[start.nodes[0]].gpu_type
            capacity = Counter(
                n.rack
                for n in state.nodes
                if n.schedulable
                and n.id not in decisions.spares
                and n.gpu_type == gpu_type
                and n.gpus >= wanted.gpus_per_node
            )
            fewest, total = 0, 0
            for count in sorted(capacity.values(), reverse=True):
                fewest, total = fewest + 1, total + count
                if total >= wanted.nodes:
                    break
            assert len(racks_used) == fewest


def _assert_reservations_hold(state: ClusterState, decisions: Decisions) -> None:
    """Every reserved start is still possible once this pass's decisions are carried out."""
    pending = {j.id: j for j in state.pending}
    evicted = {p.victim_id for p in decisions.preemptions}
    gpus = {n.id: n.gpus for n in state.nodes}
    seen: set[str] = set()
    for wait in decisions.waits:
        if wait.reserved_start is None:
            continue
        assert wait.reserved_start >= state.now
        assert len(wait.reserved_nodes) == pending[wait.job_id].nodes
        assert seen.isdisjoint(wait.reserved_nodes)
        seen.update(wait.reserved_nodes)
        # GPUs still held at the reserved start by everything that runs after this pass.
        holding: Counter[str] = Counter()
        for job_ in state.running:
            if job_.id not in evicted and (
                _end(job_.start_time, job_.max_runtime, state.now) > wait.reserved_start
            ):
                for n in job_.nodes:
                    holding[n] += job_.gpus_per_node
        for start in decisions.starts:
            if state.now + pending[start.job_id].max_runtime > wait.reserved_start:
                for n in start.nodes:
                    holding[n] += start.gpus_per_node
        for n in wait.reserved_nodes:
            assert gpus[n] - holding[n] >= pending[wait.job_id].gpus_per_node


@PROPERTY
@given(cluster_states())
def test_reservations_still_hold_after_the_pass(state: ClusterState) -> None:
    _assert_reservations_hold(state, schedule(state))


@st.composite
def backfill_states(draw: st.DrawFn) -> ClusterState:
    """A busy single-type cluster, a big blocked job ahead and small jobs behind it."""
    now = 1000.0
    gpus = draw(st.sampled_from((4, 8)))
    nodes = tuple(
        node(f"n{k}", rack=f"r{k % 2}", gpus=gpus) for k in range(draw(st.integers(2, 6)))
    )
    free = {n.id: gpus for n in nodes}
    running_jobs = []
    for k in range(draw(st.integers(1, 5))):
        where = draw(st.sampled_from([n.id for n in nodes]))
        if free[where] == 0:
            continue
        per_node = draw(st.integers(1, free[where]))
        free[where] -= per_node
        running_jobs.append(
            running(
                f"run{k}",
                (where,),
                per_node,
                start=now,
                max_runtime=draw(st.floats(0.0, 2000.0).map(lambda x: max(1.0, x))),
            )
        )
    pending = [
        job(
            f"big{k}",
            nodes=draw(st.integers(1, len(nodes))),
            gpus=draw(st.integers(1, gpus)),
            priority=9 - k,
            max_runtime=draw(st.floats(1.0, 3000.0)),
        )
        for k in range(draw(st.integers(1, 2)))
    ]
    pending += [
        job(
            f"small{k}",
            gpus=draw(st.integers(1, gpus)),
            priority=draw(st.integers(0, 2)),
            max_runtime=draw(st.floats(1.0, 3000.0)),
            submit=float(k),
        )
        for k in range(draw(st.integers(1, 6)))
    ]
    return ClusterState(
        now, nodes, tuple(running_jobs), tuple(pending), reservation_depth=draw(st.integers(1, 2))
    )


@PROPERTY
@given(backfill_states())
def test_backfill_never_delays_a_reserved_start(state: ClusterState) -> None:
    _assert_reservations_hold(state, schedule(state))


@settings(max_examples=100, deadline=None)
@given(cluster_states(), st.randoms(use_true_random=False))
def test_same_state_gives_same_decisions_in_any_input_order(
    state: ClusterState, rnd: random.Random
) -> None:
    def shuffled(items: tuple[_T, ...]) -> tuple[_T, ...]:
        out = list(items)
        rnd.shuffle(out)
        return tuple(out)

    again = dataclasses.replace(
        state,
        nodes=shuffled(state.nodes),
        running=tuple(
            dataclasses.replace(j, nodes=shuffled(j.nodes)) for j in shuffled(state.running)
        ),
        pending=shuffled(state.pending),
        teams=shuffled(state.teams),
    )
    assert schedule(state) == schedule(state) == schedule(again)
