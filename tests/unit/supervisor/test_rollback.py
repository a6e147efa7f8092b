"""The rollback planner (supervisor.recovery.rollback, pure: a trip in, a plan out),
retention's hold for the guard, and what supervisor.recovery.rollbacks makes of a trip
and hands the next ranks."""

from __future__ import annotations

import pytest

from phalanx import wire
from phalanx.guard import LrScale, Rule, parse_lr_scale, parse_rule, parse_skip
from phalanx.jobspec import validate_spec
from supervisor.checkpoints.catalog import guard_hold
from supervisor.jobs import Job, JobState, is_void
from supervisor.records import Recovery
from supervisor.recovery.planner import Action, CatalogView, Failure, FailureKind
from supervisor.recovery.rollback import RollbackView, plan_rollback, skip_ranges, void
from supervisor.recovery.rollbacks import on_guard, start_env

NOW = 1_000_000.0
NODES = ("n1", "n2")


def job(**overrides: object) -> RollbackView:
    data: dict[str, object] = {
        "id": "tinylm-abc123",
        "nodes": NODES,
        "ranks_per_node": 2,
        "margin": 0,
        "max_rollbacks": 3,
        "rollback_window_s": 3600.0,
        "past": (),
    }
    data.update(overrides)
    return RollbackView(**data)  # type: ignore[arg-type]


def spike(onset: int, trip: int, kind: FailureKind = FailureKind.LOSS_SPIKE) -> Failure:
    return Failure(kind, "n1", rank=0, step=trip, onset=onset, detail="loss 40", quarantine=False)


def catalog(*steps: int, tier: str = "object") -> CatalogView:
    return CatalogView({s: {tier: NOW - 100} for s in steps}, {})


def test_the_gang_rolls_back_in_place_to_the_newest_step_before_the_onset() -> None:
    plan = plan_rollback(job(), spike(32, 34), catalog(20, 25, 30, 35), now=NOW)

    assert (plan.action, plan.restore_step, plan.nodes) == (Action.ROLLBACK, 30, NODES)
    assert plan.quarantine == ()


def test_the_skipped_steps_run_from_the_restored_step_through_the_trip() -> None:
    plan = plan_rollback(job(), spike(32, 34), catalog(20, 25, 30, 35), now=NOW)

    assert plan.skip == (30, 35)
    assert "skip steps 30-34" in plan.reason


def test_a_checkpoint_of_the_onset_step_itself_is_before_the_spike() -> None:
    plan = plan_rollback(job(), spike(30, 31), catalog(25, 30), now=NOW)

    assert plan.restore_step == 30


def test_the_margin_moves_the_restored_step_further_back() -> None:
    plan = plan_rollback(job(margin=6), spike(32, 34), catalog(20, 25, 30), now=NOW)

    assert (plan.restore_step, plan.skip) == (25, (25, 35))


def test_a_step_no_rank_can_read_is_passed_over_for_an_older_one() -> None:
    committed = {25: {"nvme": NOW}, 30: {"nvme": NOW}}
    where = {(s, r, "nvme"): (NODES[r // 2], None) for s in (25, 30) for r in range(4)}
    del where[(30, 3, "nvme")]  # rank 3's copy of step 30 is gone

    plan = plan_rollback(job(), spike(32, 34), CatalogView(committed, where), now=NOW)

    assert plan.restore_step == 25


def test_a_job_that_never_committed_rolls_back_to_scratch_skipping_from_step_zero() -> None:
    plan = plan_rollback(job(), spike(12, 14, FailureKind.NAN), catalog(), now=NOW)

    assert (plan.action, plan.restore_step, plan.skip) == (Action.ROLLBACK, None, (0, 15))


def test_without_a_checkpoint_before_the_onset_the_job_fails_saying_so() -> None:
    plan = plan_rollback(job(), spike(12, 14), catalog(15, 20), now=NOW)

    assert plan.action is Action.FAIL
    assert "no checkpoint before the spike" in plan.reason


def test_past_max_rollbacks_within_the_window_the_job_fails_saying_so() -> None:
    past = (NOW - 3000, NOW - 2000, NOW - 10)
    plan = plan_rollback(job(past=past), spike(32, 34), catalog(30), now=NOW)

    assert plan.action is Action.FAIL
    assert plan.reason.startswith("rollback budget spent: 3 rollback(s) within 1h")
    assert "guard.max_rollbacks 3" in plan.reason and "from step 32" in plan.reason


def test_rollbacks_older_than_the_window_leave_the_budget() -> None:
    past = (NOW - 7200, NOW - 5000, NOW - 10)
    plan = plan_rollback(job(past=past), spike(32, 34), catalog(30), now=NOW)

    assert plan.action is Action.ROLLBACK


def test_max_rollbacks_zero_fails_the_first_trip() -> None:
    plan = plan_rollback(job(max_rollbacks=0), spike(32, 34), catalog(30), now=NOW)

    assert plan.action is Action.FAIL


def test_a_rollback_voids_the_steps_committed_after_the_one_it_restored() -> None:
    commits = [(25, "nvme"), (30, "nvme"), (30, "ram"), (35, "ram"), (40, "object")]

    assert void(commits, [{"after": 30, "generation": 2}]) == [(35, "ram"), (40, "object")]


def test_a_late_landing_is_void_only_from_a_rolled_back_generation_after_the_step() -> None:
    rollbacks = [{"after": 30, "generation": 2}]

    assert is_void(35, 2, rollbacks)
    assert not is_void(30, 2, rollbacks)
    assert not is_void(35, 3, rollbacks)


def test_the_skipped_steps_of_every_rollback_are_merged() -> None:
    rollbacks: list[dict[str, object]] = [{"skip": [30, 35]}, {"skip": [30, 40]}, {"skip": None}]

    assert skip_ranges(rollbacks) == ((30, 40),)


def test_retention_holds_the_newest_step_older_than_the_guards_reach_and_the_ladder_to_it() -> None:
    # reach 20: spans of 10 steps; the newest, 50, is in span 5; spans 4, 3, 2 end at 49,
    # 39 and 29; 30 is the newest at least 20 older than 50.
    assert guard_hold(range(0, 51), 20) == [29, 30, 39, 49]


def test_retention_holds_the_oldest_step_while_none_is_older_than_the_guards_reach() -> None:
    assert guard_hold([40, 50], 25) == [40]
    assert guard_hold([], 25) == []


@pytest.mark.parametrize("interval", [1, 3, 10, 99, 100, 250])
@pytest.mark.parametrize("reach", [2, 8, 100])
@pytest.mark.parametrize("keep", [1, 2])
def test_retention_with_the_hold_always_has_a_step_the_guards_reach_back(
    interval: int, reach: int, keep: int
) -> None:
    kept: list[int] = []
    for newest in range(interval, 12 * reach + 3 * interval, interval):
        kept.append(newest)
        held = set(guard_hold(kept, reach))
        oldest_kept = kept[-keep:][0]
        kept = [s for s in kept if s >= oldest_kept or s in held]

        assert len(kept) <= keep + 4
        if newest - reach >= interval:  # a step that old was committed once
            back = max(s for s in kept if s <= newest - reach)
            assert newest - back <= 2 * reach + interval


# --- what the next generation's ranks are given (supervisor.recovery.rollbacks) -------------------


def guarded_job(guard: object) -> Job:
    spec = validate_spec(
        {
            "name": "tinylm",
            "team": "t",
            "command": ["python"],
            "workdir": ".",
            "nodes": 1,
            "ranks_per_node": 2,
            "guard": guard,
        }
    )
    return Job(id="tinylm-abc123", spec=spec, generation=3)


def test_the_ranks_get_the_rule_the_skipped_steps_the_mean_before_and_the_lr_scale() -> None:
    job = guarded_job(
        {"ratio": 2, "window": 8, "patience": 2, "lr_scale": {"factor": 0.5, "steps": 10}}
    )
    job.rollbacks = [
        {"skip": [20, 22], "after": 20, "generation": 1, "baseline": 3.5, "at": NOW},
        {"skip": [20, 24], "after": 20, "generation": 2, "baseline": 3.25, "at": NOW},
    ]

    env = start_env(job)

    assert parse_rule(env["PHALANX_GUARD"]) == Rule(ratio=2, window=8, patience=2, baseline=3.25)
    assert parse_skip(env["PHALANX_SKIP"]) == ((20, 24),)
    assert parse_lr_scale(env["PHALANX_LR_SCALE"]) == LrScale(0.5, 24, 34)


def test_before_any_rollback_the_ranks_get_the_rule_alone() -> None:
    assert set(start_env(guarded_job({}))) == {"PHALANX_GUARD"}


def test_with_the_guard_off_the_ranks_get_nothing_of_it() -> None:
    assert start_env(guarded_job("off")) == {}


class Events:
    """The part of the actuator that on_guard uses: the event log and saves."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, object]]] = []

    def event(self, kind: str, job: Job, node: str | None = None, **detail: object) -> None:
        self.events.append((kind, detail))

    def save(self, job: Job) -> None:
        pass


def trip_event(generation: int = 3) -> wire.RankEvent:
    return wire.RankEvent(
        node="n1",
        job="tinylm-abc123",
        generation=generation,
        rank=0,
        event="guard",
        step=21,
        guard="loss_spike",
        onset=20,
        value=300.0,
        baseline=3.5,
        at=NOW,
    )


def test_a_trip_starts_a_recovery_of_kind_loss_spike_from_its_onset() -> None:
    job = guarded_job({})
    job.state = JobState.RUNNING

    report = on_guard(Events(), job, trip_event())  # type: ignore[arg-type]

    assert report is not None and report.guard is not None and report.guard.kind == "loss_spike"
    failure = report.failure
    assert (failure.kind, failure.step, failure.onset, failure.quarantine) == (
        FailureKind.LOSS_SPIKE,
        21,
        20,
        False,
    )


def test_a_trip_while_a_recoverys_launch_is_acknowledged_waits_for_it() -> None:
    job = guarded_job({})
    job.state = JobState.STARTING
    job.recovery = Recovery(2, [], NOW, NOW, launch_started_at=NOW)

    report = on_guard(Events(), job, trip_event())  # type: ignore[arg-type]

    assert report is None and job.guard_pending is not None


def test_a_resharding_job_rolls_back_only_to_a_step_every_node_reads_every_shard_of() -> None:
    """A job that shrank to 2 nodes (4 ranks) after step 20, saved by 6 ranks: its ranks
    reshard (elastic.reshard), so step 20 restores only where each node can read all 6
    shards; at the nvme tier each node holds its own, and the 4-rank gang's step 25 is
    read as usual."""
    big = {(20, r, "nvme"): (("n1", "n1", "n2", "n2", "n3", "n3")[r], None) for r in range(6)}
    own = {(25, r, "nvme"): (NODES[r // 2], None) for r in range(4)}
    committed = {20: {"nvme": NOW}, 25: {"nvme": NOW}}
    cat = CatalogView(committed, {**big, **own})

    plan = plan_rollback(job(reshards=True), spike(32, 34), cat, now=NOW)
    assert plan.restore_step == 25
    plan = plan_rollback(job(reshards=True), spike(24, 24), cat, now=NOW)
    assert plan.action is Action.FAIL and "can read no copy of saved rank" in plan.reason
    # In the object store every node reads every shard of step 20.
    cat = CatalogView({20: {"object": NOW}, 25: {"nvme": NOW}}, {**big, **own})
    plan = plan_rollback(job(reshards=True), spike(24, 24), cat, now=NOW)
    assert plan.restore_step == 20
