"""A job's state machine, its stored record and its API view."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from phalanx.jobspec import JobSpec, validate_spec
from supervisor.errors import IllegalTransition
from supervisor.jobs import TRANSITIONS, Job, JobState, RankPlace, Transition, Waiting
from supervisor.records import Incident

LEGAL = sorted((frm, to) for frm, tos in TRANSITIONS.items() for to in tos)
ILLEGAL = sorted(
    (frm, to) for frm, to in itertools.product(JobState, JobState) if to not in TRANSITIONS[frm]
)
FINAL = {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
VIEW_KEYS = {
    "id",
    "name",
    "team",
    "priority",
    "state",
    "world_size",
    "elastic",
    "nodes",
    "ranks",
    "generation",
    "master",
    "submitted_at",
    "started_at",
    "first_started_at",
    "ended_at",
    "waiting",
    "reason",
    "preemptions",
    "spec",
    "restarts",
    "max_restarts",
    "rollbacks",
    "skipped_steps",
    "recovery",
    "incidents",
    "goodput",
    "summary",
}


def make_spec(**overrides: Any) -> JobSpec:
    data: dict[str, Any] = {
        "name": "tinylm",
        "team": "research",
        "command": ["python", "t.py"],
        "workdir": "/srv/t",
        "nodes": 2,
        "ranks_per_node": 2,
    }
    return validate_spec({**data, **overrides})


def make_job(state: JobState = JobState.PENDING, **overrides: Any) -> Job:
    return Job(id="tinylm-abc123", spec=make_spec(**overrides), state=state)


def pair_id(pair: tuple[JobState, JobState]) -> str:
    return f"{pair[0].value}->{pair[1].value}"


# --- transitions -----------------------------------------------------------------------


def test_transition_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(JobState)


@pytest.mark.parametrize("pair", LEGAL, ids=pair_id)
def test_legal_transition_moves_and_records_history(pair: tuple[JobState, JobState]) -> None:
    frm, to = pair
    job = make_job(frm)
    job.move(to, "because")
    assert job.state is to
    (entry,) = job.history
    assert (entry.from_, entry.to, entry.why) == (frm, to, "because")
    assert isinstance(entry.at, float)


@pytest.mark.parametrize("pair", ILLEGAL, ids=pair_id)
def test_illegal_transition_raises_naming_both_states(pair: tuple[JobState, JobState]) -> None:
    frm, to = pair
    job = make_job(frm)
    with pytest.raises(IllegalTransition, match=f"{frm.value} -> {to.value}") as caught:
        job.move(to)
    assert (caught.value.job, caught.value.frm, caught.value.to) == (job.id, frm, to)


@pytest.mark.parametrize("pair", ILLEGAL[:1] + ILLEGAL[-1:], ids=pair_id)
def test_illegal_transition_leaves_job_untouched(pair: tuple[JobState, JobState]) -> None:
    frm, to = pair
    job = make_job(frm)
    with pytest.raises(IllegalTransition):
        job.move(to)
    assert (job.state, job.history, job.ended_at) == (frm, [], None)


def test_final_states_have_no_way_out() -> None:
    assert all(TRANSITIONS[s] == frozenset() for s in FINAL)
    assert {s for s in JobState if s.final} == FINAL


@pytest.mark.parametrize("pair", [p for p in LEGAL if p[1] in FINAL], ids=pair_id)
def test_move_into_final_state_sets_ended_at(pair: tuple[JobState, JobState]) -> None:
    job = make_job(pair[0])
    job.move(pair[1])
    assert job.ended_at is not None


@pytest.mark.parametrize("pair", [p for p in LEGAL if p[1] not in FINAL], ids=pair_id)
def test_move_into_open_state_leaves_ended_at_unset(pair: tuple[JobState, JobState]) -> None:
    job = make_job(pair[0])
    job.move(pair[1])
    assert job.ended_at is None


def test_whole_life_is_recorded_in_order() -> None:
    job = make_job()
    for to in (
        JobState.STARTING,
        JobState.RUNNING,
        JobState.STOPPING,
        JobState.PENDING,
        JobState.STARTING,
        JobState.RUNNING,
        JobState.SUCCEEDED,
    ):
        job.move(to)
    assert [h.to for h in job.history] == [
        "starting",
        "running",
        "stopping",
        "pending",
        "starting",
        "running",
        "succeeded",
    ]


def test_only_starting_running_stopping_and_recovering_hold_nodes() -> None:
    assert {s for s in JobState if s.holds_nodes} == {
        JobState.STARTING,
        JobState.RUNNING,
        JobState.STOPPING,
        JobState.RECOVERING,
    }


def test_recovering_job_restarts_or_ends_but_never_runs_without_a_launch() -> None:
    assert TRANSITIONS[JobState.RECOVERING] == {
        JobState.STARTING,
        JobState.STOPPING,
        JobState.FAILED,
        JobState.CANCELLED,
    }
    assert JobState.RECOVERING in TRANSITIONS[JobState.RUNNING]
    assert JobState.RECOVERING in TRANSITIONS[JobState.STARTING]


# --- record ------------------------------------------------------------------------------


def busy_job() -> Job:
    job = make_job(
        env={"TOKEN": {"from_file": "/etc/secret"}, "MODE": "fast"},
        max_runtime="2h",
        checkpoint={"interval": {"steps": 100}},
    )
    job.move(JobState.STARTING)
    job.move(JobState.RUNNING, "all ranks started")
    job.move(JobState.STOPPING, "rank 1 failed")
    job.generation = 3
    job.nodes = ["n1", "n2"]
    job.ranks = [
        RankPlace(0, "n1", 0, code=0),
        RankPlace(1, "n1", 1, code=1),
        RankPlace(2, "n2", 0, signal=9),
        RankPlace(3, "n2", 1, lost=True),
    ]
    job.master_addr, job.master_port = "10.0.0.1", 29500
    job.started_at = 1_000.0
    job.waiting = Waiting("resources", "needs 2 nodes")
    job.stop_target = JobState.FAILED
    job.reason = "rank 1 on node n1 exited with code 1"
    job.preemptions = 2
    return job


def test_record_round_trips_through_json() -> None:
    job = busy_job()
    again = Job.from_record(job.id, json.loads(json.dumps(job.record())))
    assert again == job


def test_round_trip_keeps_ranks_exits_waiting_and_stop_target() -> None:
    job = busy_job()
    again = Job.from_record(job.id, json.loads(json.dumps(job.record())))
    assert [(r.rank, r.node, r.local_rank, r.code, r.signal, r.lost) for r in again.ranks] == [
        (0, "n1", 0, 0, None, False),
        (1, "n1", 1, 1, None, False),
        (2, "n2", 0, None, 9, False),
        (3, "n2", 1, None, None, True),
    ]
    assert again.waiting == Waiting("resources", "needs 2 nodes")
    assert again.stop_target is JobState.FAILED
    assert again.state is JobState.STOPPING


def test_round_trip_keeps_a_pending_job_without_stop_target() -> None:
    job = make_job()
    again = Job.from_record(job.id, json.loads(json.dumps(job.record())))
    assert again == job
    assert again.stop_target is None


def test_record_keeps_the_secret_reference_not_a_value() -> None:
    job = busy_job()
    assert job.record()["spec"]["env"]["TOKEN"] == {"from_file": "/etc/secret"}


def test_record_keeps_only_the_last_hundred_history_entries() -> None:
    job = make_job()
    job.history = [Transition(float(i), JobState.PENDING, JobState.STARTING) for i in range(150)]
    kept = job.record()["history"]
    assert [h["at"] for h in kept] == [float(i) for i in range(50, 150)]


# --- view --------------------------------------------------------------------------------


def test_view_has_the_stable_keys() -> None:
    assert set(busy_job().view()) == VIEW_KEYS


def test_view_shows_state_world_size_generation_waiting_and_reason() -> None:
    view = busy_job().view()
    assert (view["id"], view["state"], view["world_size"], view["generation"]) == (
        "tinylm-abc123",
        "stopping",
        4,
        3,
    )
    assert view["waiting"] == {"reason": "resources", "detail": "needs 2 nodes"}
    assert view["reason"] == "rank 1 on node n1 exited with code 1"
    assert view["master"] == "10.0.0.1:29500"


def test_view_shows_each_rank_with_node_and_exit() -> None:
    assert busy_job().view()["ranks"] == [
        {"rank": 0, "node": "n1", "local_rank": 0, "exit_code": 0, "signal": None, "lost": False},
        {"rank": 1, "node": "n1", "local_rank": 1, "exit_code": 1, "signal": None, "lost": False},
        {"rank": 2, "node": "n2", "local_rank": 0, "exit_code": None, "signal": 9, "lost": False},
        {"rank": 3, "node": "n2", "local_rank": 1, "exit_code": None, "signal": None, "lost": True},
    ]


def test_view_of_new_job_has_no_reason_and_no_master() -> None:
    view = make_job().view()
    assert (view["reason"], view["master"], view["ranks"], view["generation"]) == (
        None,
        None,
        [],
        0,
    )


def test_view_redacts_env_secrets() -> None:
    view = busy_job().view()
    assert view["spec"]["env"] == {"TOKEN": "<from_file /etc/secret>", "MODE": "fast"}


def test_view_is_json_serialisable() -> None:
    assert json.loads(json.dumps(busy_job().view()))["state"] == "stopping"


# --- RankPlace ---------------------------------------------------------------------------


def test_rank_describes_its_exit_code() -> None:
    assert RankPlace(5, "n2", 1, code=3).describe() == "rank 5 on node n2 exited with code 3"


def test_rank_describes_the_signal_that_killed_it() -> None:
    assert RankPlace(5, "n2", 1, signal=9).describe() == (
        "rank 5 on node n2 was killed by signal 9"
    )


def test_rank_describes_being_lost() -> None:
    assert RankPlace(5, "n2", 1, lost=True).describe() == "rank 5 on node n2 was lost"


@pytest.mark.parametrize(
    ("place", "exited", "clean"),
    [
        (RankPlace(0, "n", 0), False, False),
        (RankPlace(0, "n", 0, code=0), True, True),
        (RankPlace(0, "n", 0, code=2), True, False),
        (RankPlace(0, "n", 0, signal=15), True, False),
        (RankPlace(0, "n", 0, lost=True), True, False),
    ],
)
def test_rank_exited_and_clean_follow_its_code_signal_and_loss(
    place: RankPlace, exited: bool, clean: bool
) -> None:
    assert (place.exited, place.clean) == (exited, clean)


def test_new_job_id_starts_with_the_name() -> None:
    job_id = Job.new_id("tinylm")
    assert job_id.startswith("tinylm-")
    assert len(job_id) == len("tinylm-") + 6


# --- progress and goodput --------------------------------------------------------------


def test_step_time_comes_from_the_first_and_last_step_heard_of() -> None:
    job = make_job()
    job.note_step(1, 10, 100.0)  # the generation's first step
    job.note_step(1, 30, 110.0)  # its last, when the rank reported it
    job.note_step(1, 30, 125.0)  # the exit that a later stop caused says the same step

    assert job.step_time(1) == 0.5


def test_goodput_counts_each_incidents_downtime_and_lost_work_against_wall_time() -> None:
    job = make_job(JobState.RUNNING)
    job.first_started_at = 1000.0
    job.incidents = [Incident.from_record({"downtime_s": 6.0, "lost_work_s": 4.0})]

    view = job.goodput(now=1100.0)

    assert (view["ettr"], view["wall_s"], view["lost_s"]) == (0.9, 100.0, 10.0)


def test_an_incident_whose_lost_work_is_unknown_makes_the_ettr_an_upper_bound() -> None:
    job = make_job(JobState.RUNNING)
    job.first_started_at = 1000.0
    job.incidents = [
        Incident.from_record(
            {"outcome": "recovered", "downtime_s": 6.0, "lost_work_s": None, "mttr_s": None}
        )
    ]

    view = job.goodput(now=1100.0)

    assert (view["ettr"], view["ettr_upper_bound"], view["lost_work_unknown"]) == (0.94, True, 1)


def test_incidents_with_known_lost_work_and_mttr_give_an_exact_ettr() -> None:
    job = make_job(JobState.RUNNING)
    job.first_started_at = 1000.0
    job.incidents = [
        Incident.from_record(
            {"outcome": "recovered", "downtime_s": 6.0, "lost_work_s": 0.0, "mttr_s": 6}
        )
    ]

    assert job.goodput(now=1100.0)["ettr_upper_bound"] is False


def test_a_job_never_started_has_no_ettr() -> None:
    assert make_job().goodput()["ettr"] is None


def test_a_job_keeps_each_generations_world_size_across_a_restart() -> None:
    """An elastic job's generations differ in size: a late landing of an earlier one
    commits against that generation's ranks (``world_size_of``)."""
    job = busy_job()
    job.worlds = {"1": 6, "2": 4}
    again = Job.from_record(job.id, json.loads(json.dumps(job.record())))
    assert again.worlds == {"1": 6, "2": 4}
    assert (again.world_size_of(1), again.world_size_of(2)) == (6, 4)
    assert again.world_size_of(7) == again.world_size  # not recorded: the current one's


def test_the_view_of_the_ranks_follows_exits_losses_and_a_new_gang() -> None:
    """The ranks' view is made once and again only after a change (issue 22): an exit, a
    loss, a new gang, or a gang of another size."""
    job = make_job(JobState.RUNNING)
    job.nodes = ["n1", "n2"]
    job.ranks = [RankPlace(rank=r, node=f"n{1 + r // 2}", local_rank=r % 2) for r in range(4)]
    first = job.view()["ranks"]
    assert [r["exit_code"] for r in first] == [None] * 4
    assert job.view()["ranks"] is first  # nothing changed: the same view

    place = job.place(1)
    assert place is not None
    job.rank_exited(place, 0, None)
    assert [r["exit_code"] for r in job.view()["ranks"]] == [None, 0, None, None]
    job.ranks_lost(job.places_on("n2"))
    assert [r["lost"] for r in job.view()["ranks"]] == [False, False, True, True]

    job.ranks = [RankPlace(rank=r, node="n3", local_rank=r) for r in range(2)]
    assert [(r["rank"], r["node"]) for r in job.view()["ranks"]] == [(0, "n3"), (1, "n3")]
    job.ranks.append(RankPlace(rank=2, node="n3", local_rank=2))
    assert len(job.view()["ranks"]) == 3


def test_holds_follows_the_jobs_nodes() -> None:
    job = make_job(JobState.RUNNING)
    assert not job.holds("n1")
    job.nodes = ["n1", "n2"]
    assert job.holds("n1") and not job.holds("n3")
    job.nodes.append("n3")
    assert job.holds("n3")
    job.nodes = ["n4"]
    assert not job.holds("n1") and job.holds("n4")
