"""The typed records a job keeps (supervisor.records, and the moves and waits of
supervisor.jobs): each is written as the dicts they replace were, key for key and in
the same order, and reads whatever an earlier supervisor wrote.

The ``OLD_*`` records are literal ones the dict-based code wrote (a node drained for a
double-bit ECC error and its ranks moved to a spare; the floats shortened), or built by
hand in the order that code set their keys.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from supervisor.api.app import make_app
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.jobs import Job, JobState, Transition, Waiting
from supervisor.records import (
    UNSET,
    Awaiting,
    Failure,
    FailureKind,
    GuardTrip,
    Incident,
    PlanRecord,
    Recheck,
    Recovery,
)
from supervisor.store import Store
from tests.unit.supervisor.test_jobs_state import make_spec

TOKEN = "t" * 32

OLD_FAILURE: dict[str, Any] = {
    "kind": "node_drain",
    "node": "n1",
    "rank": None,
    "code": None,
    "signal": None,
    "step": None,
    "detail": "double-bit ECC",
    "generation": 1,
    "quarantine": True,
    "from_restore": None,
    "onset": None,
}
OLD_PLAN: dict[str, Any] = {
    "action": "replace",
    "cause": "hardware",
    "reason": "node n1 was drained (double-bit ECC): node n1's ranks move to n2, from "
    "scratch (nothing committed)",
    "nodes": ["n0", "n2"],
    "quarantine": ["n1"],
    "swaps": [["n1", "n2"]],
    "restore_step": None,
    "restore_note": "",
    "restore_from": {},
    "burn_in": [],
    "reinstate": [],
    "skip": None,
    "sources": {},
}
OLD_SIZE = {"nodes": 2, "world_size": 4, "accumulation": None}
# A recovery whose relaunch was being acknowledged: its restored step null, not absent.
OLD_RECOVERY: dict[str, Any] = {
    "generation": 1,
    "failures": [OLD_FAILURE],
    "fault_at": 1795949487.94,
    "detected_at": 1795949487.94,
    "phase": "launch",
    "phases": {"detect": 0.0, "plan": 0.0002, "stop": 0.0},
    "size": OLD_SIZE,
    "plan": OLD_PLAN,
    "quarantined": ["n1"],
    "kept": [],
    "linked": ["n2"],
    "restart_counted": True,
    "awaiting": {"restored": {}, "stepped": {}},
    "launch_started_at": 1795949487.95,
    "restored_step": None,
}
# A recovery that waited for a node: a suspect burned in, a spare backed off from and
# rejected.
OLD_WAITING_RECOVERY: dict[str, Any] = {
    "generation": 4,
    "failures": [{**OLD_FAILURE, "kind": "rank_exit", "rank": 2, "code": 1, "generation": 4}],
    "fault_at": 1000.5,
    "detected_at": 1001.0,
    "phase": "stopped",
    "phases": {"detect": 0.5, "plan": 0.001, "stop": 1.2},
    "size": OLD_SIZE,
    "plan": {**OLD_PLAN, "action": "wait", "nodes": [], "burn_in": ["n1"], "swaps": []},
    "quarantined": ["n1"],
    "kept": [],
    "suspects_tried": ["n1"],
    "vetted": [],
    "wait_since": 1002.0,
    "backoff_s": 4.0,
    "rejected": ["n3"],
}
# Replicas that diverged with no majority, before their recheck.
OLD_RECHECK_RECOVERY: dict[str, Any] = {
    "generation": 1,
    "failures": [{**OLD_FAILURE, "kind": "sdc", "rank": 0, "step": 10, "quarantine": False}],
    "fault_at": 1000.0,
    "detected_at": 1000.0,
    "phase": "plan",
    "phases": {"detect": 0.0},
    "size": OLD_SIZE,
    "sdc_recheck": {"nodes": {"n0": 0, "n1": 2}, "replicas": 2, "clean": 5},
}
# A loss guard's rollback, launched: the agents' acks said nothing of cold ranks.
OLD_ROLLBACK_RECOVERY: dict[str, Any] = {
    "generation": 2,
    "failures": [{**OLD_FAILURE, "kind": "loss_spike", "rank": 0, "step": 21, "quarantine": False}],
    "fault_at": 1000.0,
    "detected_at": 1000.1,
    "phase": "launch",
    "phases": {"detect": 0.1, "plan": 0.001, "stop": 0.5, "port": 0.0},
    "size": OLD_SIZE,
    "guard": {"baseline": 2.5, "value": 9.0, "kind": "loss_spike"},
    "plan": {**OLD_PLAN, "action": "rollback", "skip": [18, 22], "restore_step": 15},
    "quarantined": [],
    "kept": [],
    "rollback_applied": True,
    "awaiting": {"restored": {"0": [1003.0, 0.5]}, "stepped": {"0": 1003.5}},
    "launch_started_at": 1002.0,
    "restored_step": 15,
    "cold_ranks": None,
}
OLD_INCIDENT: dict[str, Any] = {
    "generation": 1,
    "next_generation": 2,
    "failures": [OLD_FAILURE],
    "size": OLD_SIZE,
    "fault_at": 1795949487.94,
    "detected_at": 1795949487.94,
    "plan": OLD_PLAN,
    "phases": {
        "detect": 0.0,
        "plan": 0.0002,
        "stop": 0.0,
        "port": 0.0,
        "catalogs": 0.003,
        "starts": 0.0,
    },
    "cold_ranks": {"restart.warm is off": "2-3"},
    "launch_started_at": 1795949487.95,
    "outcome": "recovered",
    "failed_step": 120,
    "restored_step": None,
    "lost_steps": 120,
    "lost_work_s": 495.0,
    "downtime_s": 0.014,
    "resumed_at": 1795949487.96,
    "ran_s": 600.0000355243683,
    "trained_steps": 120,
    "acked_s": 0.014,
    "mttr_s": None,
    "awaiting": {
        "restored": {"0": [1795949487.97, 0.25], "1": [1795949487.98, 0.25]},
        "stepped": {"0": 1795949487.99},
    },
}
# As the first recovering supervisor wrote one: no size, cold ranks, trained steps nor
# acked time, a plan of fewer keys, failures without from_restore and onset.
FIRST_INCIDENT: dict[str, Any] = {
    "generation": 1,
    "next_generation": 2,
    "failures": [{k: v for k, v in OLD_FAILURE.items() if k not in ("from_restore", "onset")}],
    "fault_at": 1000.0,
    "detected_at": 1000.5,
    "plan": {k: OLD_PLAN[k] for k in list(OLD_PLAN)[:9]},
    "phases": {"detect": 0.5, "plan": 0.001, "stop": 1.0, "launch": 2.0},
    "launch_started_at": 1002.0,
    "outcome": "recovered",
    "failed_step": 120,
    "restored_step": 100,
    "lost_steps": 20,
    "lost_work_s": 10.0,
    "downtime_s": 4.0,
    "resumed_at": 1004.0,
    "ran_s": 600.0,
    "mttr_s": 4.0,
}
OLD_HISTORY = [
    {"at": 1795949487.94, "from": "running", "to": "recovering", "why": "node n1 was drained"},
    {"at": 1795949487.95, "from": "recovering", "to": "starting", "why": "placed on n0, n2"},
]
OLD_WAITING = {"reason": "no_spare", "detail": "no spare or healthy node for n1"}


def text(rec: Any) -> str:
    """A record as the store and the API write it: keys in order, every value."""
    return json.dumps(rec)


def every_field_set() -> list[Any]:
    failure = Failure(
        FailureKind.RANK_EXIT,
        "n1",
        rank=3,
        code=1,
        signal=None,
        step=40,
        detail="oops",
        generation=2,
        quarantine=False,
        from_restore=35,
        onset=None,
    )
    plan = PlanRecord(
        action="replace",
        cause="hardware",
        reason="moved",
        nodes=("n0", "n2"),
        quarantine=("n1",),
        swaps=(("n1", "n2"),),
        restore_step=30,
        restore_note="from the peer copy",
        restore_from={"0": "ram", "1": "peer"},
        burn_in=("n4",),
        reinstate=("n5",),
        skip=(31, 40),
        sources={"2": 0},
    )
    awaiting = Awaiting(restored={"0": (10.0, 0.5)}, stepped={"0": 11.0})
    recovery = Recovery(
        generation=2,
        failures=[failure],
        fault_at=1.0,
        detected_at=2.0,
        phase="launch",
        phases={"detect": 1.0, "plan": 0.01},
        size=OLD_SIZE,
        recheck=Recheck({"n0": 0, "n1": 2}, 2, 5),
        guard=GuardTrip(2.5, 9.0, "loss_spike"),
        plan=plan,
        quarantined=["n1"],
        kept=["n0"],
        suspects_tried=["n4"],
        vetted=["n4"],
        wait_since=3.0,
        backoff_s=2.0,
        linked=["n2"],
        rejected=["n3"],
        rollback_applied=True,
        restart_counted=True,
        awaiting=awaiting,
        launch_started_at=4.0,
        restored_step=None,
        cold_ranks={"restart.warm is off": "2-3"},
        generation_new=3,
    )
    incident = Incident(
        generation=2,
        next_generation=3,
        failures=[failure],
        size=OLD_SIZE,
        fault_at=1.0,
        detected_at=2.0,
        plan=plan,
        phases={"detect": 1.0},
        cold_ranks=None,
        launch_started_at=4.0,
        outcome="recovered",
        failed_step=40,
        restored_step=30,
        lost_steps=10,
        lost_work_s=None,
        downtime_s=9.0,
        resumed_at=10.0,
        ran_s=100.0,
        trained_steps=39,
        acked_s=8.0,
        mttr_s=9.0,
        awaiting=awaiting,
    )
    return [
        failure,
        plan,
        awaiting,
        recovery,
        incident,
        Recheck({"n0": 0}, 2, 5),
        GuardTrip(None, None, "nan"),
        Transition(1.0, JobState.RUNNING, JobState.RECOVERING, "a rank exited"),
        Waiting("resources", "needs 2 nodes"),
    ]


@pytest.mark.parametrize("record", every_field_set(), ids=lambda r: type(r).__name__)
def test_each_record_round_trips_through_json(record: Any) -> None:
    again = type(record).from_record(json.loads(text(record.to_record())))
    assert again == record
    assert text(again.to_record()) == text(record.to_record())


@pytest.mark.parametrize("kind", [PlanRecord, Recovery, Incident], ids=lambda k: k.__name__)
def test_a_record_with_every_field_set_writes_every_key_it_reads_in_order(kind: Any) -> None:
    (record,) = [r for r in every_field_set() if type(r) is kind]
    assert tuple(record.to_record()) == kind.KEYS


@pytest.mark.parametrize(
    ("kind", "old"),
    [
        (Recovery, OLD_RECOVERY),
        (Recovery, OLD_WAITING_RECOVERY),
        (Recovery, OLD_RECHECK_RECOVERY),
        (Recovery, OLD_ROLLBACK_RECOVERY),
        (Incident, OLD_INCIDENT),
        (PlanRecord, OLD_PLAN),
        (Failure, OLD_FAILURE),
        (Transition, OLD_HISTORY[0]),
        (Waiting, OLD_WAITING),
    ],
    ids=[
        "recovery-launching",
        "recovery-waiting",
        "recovery-recheck",
        "recovery-rollback",
        "incident",
        "plan",
        "failure",
        "transition",
        "waiting",
    ],
)
def test_a_record_the_dict_code_wrote_is_read_and_written_back_unchanged(
    kind: Any, old: dict[str, Any]
) -> None:
    assert text(kind.from_record(copy.deepcopy(old)).to_record()) == text(old)


def test_a_recovery_read_back_knows_its_null_restored_step_from_none_set() -> None:
    launching = Recovery.from_record(OLD_RECOVERY)
    waiting = Recovery.from_record(OLD_WAITING_RECOVERY)
    assert launching.restored_step is None and launching.cold_ranks is UNSET
    assert waiting.restored_step is UNSET and waiting.awaiting is None
    assert (launching.plan, launching.kept) == (PlanRecord.from_record(OLD_PLAN), [])


def test_an_old_recoverys_typed_fields_hold_what_its_keys_said() -> None:
    rollback = Recovery.from_record(OLD_ROLLBACK_RECOVERY)
    assert rollback.failures[0].kind is FailureKind.LOSS_SPIKE
    assert rollback.guard == GuardTrip(2.5, 9.0, "loss_spike")
    assert rollback.awaiting == Awaiting({"0": (1003.0, 0.5)}, {"0": 1003.5})
    assert rollback.plan is not None and rollback.plan.skip == (18, 22)
    assert Recovery.from_record(OLD_RECHECK_RECOVERY).recheck == Recheck({"n0": 0, "n1": 2}, 2, 5)


def test_an_incident_from_before_some_keys_existed_is_written_back_with_the_keys_it_had() -> None:
    incident = Incident.from_record(FIRST_INCIDENT)
    written = incident.to_record()
    # Its failures are the planner's Failure: those it lacked come back as null.
    (failure,) = written.pop("failures")
    assert failure == {**FIRST_INCIDENT["failures"][0], "from_restore": None, "onset": None}
    assert text(written) == text({k: v for k, v in FIRST_INCIDENT.items() if k != "failures"})
    assert not incident.has("acked_s") and incident.has("mttr_s")


def test_keys_no_field_holds_are_kept_and_written_back_last() -> None:
    newer = {**OLD_INCIDENT, "plan": {**OLD_PLAN, "sdc_group": [0, 2]}, "carbon_g": 12}
    incident = Incident.from_record(newer)
    assert incident.extra == {"carbon_g": 12}
    assert text(incident.to_record()) == text(newer)
    recovery = Recovery.from_record({**OLD_RECOVERY, "carbon_g": 12})
    assert recovery.to_record()["carbon_g"] == 12


def test_a_plan_equals_another_exactly_when_their_records_do() -> None:
    plan = PlanRecord.from_record(OLD_PLAN)
    older = PlanRecord.from_record({k: OLD_PLAN[k] for k in list(OLD_PLAN)[:9]})
    assert plan == PlanRecord.from_record(json.loads(text(OLD_PLAN)))
    assert plan != older  # as {...} != {... less keys}: a recovery records the newer one


def test_goodput_counts_an_old_incident_as_it_did() -> None:
    job = Job("j", make_spec(), state=JobState.RUNNING, first_started_at=900.0)
    job.incidents = [Incident.from_record(FIRST_INCIDENT), Incident.from_record(OLD_INCIDENT)]
    goodput = job.goodput(now=1900.0)
    assert (goodput["downtime_s"], goodput["lost_work_s"]) == (4.01, 505.0)
    assert (goodput["ettr_upper_bound"], goodput["lost_work_unknown"]) == (True, 0)


# --- a whole job, stored by the dict-based code -------------------------------------------


EXITED_NOT = {"code": None, "signal": None, "lost": False}


def old_job() -> dict[str, Any]:
    """A job's stored record: recovering for the second time (waiting for a node), one
    incident before it."""
    timed = {k: v for k, v in OLD_INCIDENT.items() if k != "awaiting"}
    return {
        "spec": make_spec(restart={"max_restarts": 3}).model_dump(mode="json"),
        "state": "recovering",
        "generation": 4,
        "nodes": ["n0", "n1"],
        "ranks": [
            {"rank": r, "node": f"n{r // 2}", "local_rank": r % 2, **EXITED_NOT} for r in range(4)
        ],
        "master_addr": "10.0.0.1",
        "master_port": 29500,
        "submitted_at": 900.0,
        "started_at": 950.0,
        "ended_at": None,
        "waiting": OLD_WAITING,
        "stop_target": None,
        "reason": "rank 2 on node n1 exited with code 1",
        "preemptions": 0,
        "history": OLD_HISTORY,
        "restarts": 1,
        "incidents": [timed],
        "recovery": OLD_WAITING_RECOVERY,
        "first_started_at": 900.0,
        "ran_before_s": 50.0,
        "progress": {"4": [0, 951.0, 10, 999.0]},
        "rollbacks": [],
        "worlds": {"4": 4},
        "sdc_agreed": None,
    }


def test_a_job_the_dict_code_stored_is_read_and_stored_again_unchanged() -> None:
    stored = old_job()
    job = Job.from_record("tinylm-abc123", copy.deepcopy(stored))
    assert text(job.record()) == text(stored)
    assert job.waiting == Waiting("no_spare", "no spare or healthy node for n1")
    assert job.history[1] == Transition(
        1795949487.95, JobState.RECOVERING, JobState.STARTING, "placed on n0, n2"
    )
    assert job.recovery is not None and job.recovery.rejected == ["n3"]


async def test_the_apis_view_of_a_job_recovering_after_an_incident_is_the_stored_one(
    tmp_path: Path,
) -> None:
    # A supervisor restarted on a store the dict-based code wrote shows the job as that
    # code showed it: its waiting, recovery and incidents as they were stored.
    stored = old_job()
    store = Store(tmp_path / "state.db")
    store.save_job("tinylm-abc123", "recovering", stored)
    store.close()
    sup = Supervisor(SupervisorSettings(state_dir=tmp_path), TOKEN)
    client: TestClient[Any, Any] = TestClient(TestServer(make_app(sup)))
    await client.start_server()
    try:
        resp = await client.get(
            "/v1/jobs/tinylm-abc123", headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert resp.status == 200, await resp.text()
        view = json.loads(await resp.text())
    finally:
        await client.close()
        sup.store.close()

    for key in ("waiting", "recovery", "incidents"):
        assert text(view[key]) == text(stored[key]), key
    assert view["restarts"] == 1 and view["state"] == "recovering"
    assert view["goodput"]["lost_work_s"] == 495.0


def test_a_recoverys_keys_are_written_in_the_order_it_first_set_them() -> None:
    """As the dict it replaces kept them: a spare rejected before the wait for a node
    writes ``rejected`` before ``wait_since``; the other way round, the other way."""
    first = Recovery(3, [], 1.0, 2.0, size={"nodes": 2})
    first.rejected = ["n9"]
    first.wait_since = 5.0
    assert [k for k in first.to_record() if k in ("rejected", "wait_since")] == [
        "rejected",
        "wait_since",
    ]
    second = Recovery(3, [], 1.0, 2.0, size={"nodes": 2})
    second.wait_since = 5.0
    second.rejected = ["n9"]
    record = second.to_record()
    assert [k for k in record if k in ("rejected", "wait_since")] == ["wait_since", "rejected"]
    # Read back, written again: the same order.
    assert list(Recovery.from_record(record).to_record()) == list(record)
