"""The loss guard over a real training job: tinylm with a poisoned batch.

A poisoned batch blows the loss up (``--poison-at``); the ranks' guard trips, the
supervisor rolls the gang back to a checkpoint from before the spike, the restarted
ranks skip the poisoned steps and the job succeeds with its loss back under the
guard's threshold. A poison that comes back after every skip spends the rollback
budget and fails the job with that reason. One node, two ranks, a tiny model, a few
seconds of training per generation.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.harness import Fleet
from tests.tinylm import REPO, tinylm

pytestmark = pytest.mark.integration

POISON_AT = 20
RATIO = 3.0
RUN = [
    *("--log-every", "1", "--steps", "40", "--ckpt-every", "5", "--step-sleep", "0.02"),
    *("--poison-at", str(POISON_AT), "--poison-len", "2"),
]
GUARD = {
    "ratio": RATIO,
    "window": 8,
    "patience": 2,
    "max_rollbacks": 2,
    "rollback_window": "1h",
}


def run(fleet: Fleet, name: str, *extra: str, **guard: Any) -> str:
    fleet.start_supervisor()
    fleet.start_agent("n01")
    fleet.wait_state("n01", "up")
    job = fleet.submit(
        name=name,
        nodes=1,
        ranks_per_node=2,
        workdir=str(REPO),
        command=tinylm(*RUN, *extra),
        grace_period=5,
        env={"OMP_NUM_THREADS": "1"},
        checkpoint={"tiers": ["ram", "nvme"], "interval": {"steps": 5}},
        guard={**GUARD, **guard},
    )
    job_id: str = job["id"]
    return job_id


def rank_0_lines(fleet: Fleet, job: dict[str, Any], generation: int) -> list[dict[str, Any]]:
    log = fleet.root / "nodes" / "n01" / "data" / "jobs" / job["id"] / f"g{generation}"
    text = (log / "rank-0.log").read_text()
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def guard_events(fleet: Fleet, job: str) -> list[dict[str, Any]]:
    events = fleet.client().get(f"/v1/events?job={job}&limit=1000")
    return [e["detail"] for e in events if e["kind"] == "loss_guard"]


def test_a_loss_spike_rolls_the_gang_back_past_the_poisoned_steps_and_the_job_succeeds(
    fleet: Fleet,
) -> None:
    job = run(fleet, "spike", lr_scale={"factor": 0.5, "steps": 5})

    done = fleet.wait_job(job, "succeeded", timeout=150)

    (incident,) = done["incidents"]
    (failure,) = incident["failures"]
    assert (failure["kind"], failure["onset"], failure["step"]) == ("loss_spike", 20, 21)
    assert incident["plan"]["action"] == "rollback"
    restored = incident["restored_step"]
    assert restored in (15, 20)  # the newest committed before the onset, step 20
    assert incident["plan"]["skip"] == [restored, 22]
    assert incident["outcome"] == "recovered"
    assert incident["lost_steps"] >= 21 - restored
    assert (done["rollbacks"], done["skipped_steps"], done["restarts"]) == (1, [[restored, 22]], 0)
    lines = rank_0_lines(fleet, done, done["generation"])
    assert {"ckpt_restored": restored}.items() <= next(
        line for line in lines if "ckpt_restored" in line
    ).items()
    trained = [line["step"] for line in lines if "loss" in line and "step" in line]
    assert trained[0] == 22 and trained[-1] == 39  # the poisoned steps were skipped
    scaled = [line["step"] for line in lines if line.get("lr_scale") == 0.5]
    assert scaled == [22, 23, 24, 25, 26]  # guard.lr_scale: the 5 steps after the skip
    trip = guard_events(fleet, job)[0]  # (each rank tells its own)
    threshold = RATIO * trip["baseline"]
    assert all(line["loss"] < threshold for line in lines if "loss" in line and "step" in line)
    status = fleet.cli("status", job).stdout
    assert "generation 1: loss_spike (rank " in status and "-> rollback: recovered" in status
    assert f"skipped steps {restored}-21" in status and "rollbacks: 1" in status


def test_a_poison_that_returns_after_every_skip_spends_the_budget_and_fails_the_job(
    fleet: Fleet,
) -> None:
    job = run(fleet, "poison", "--poison-returns")

    done = fleet.wait_job(job, "failed", timeout=150)

    assert done["reason"].startswith("rollback budget spent: 2 rollback(s) within 1h")
    assert [i["plan"]["action"] for i in done["incidents"]] == ["rollback", "rollback", "fail"]
    assert {i["failures"][0]["kind"] for i in done["incidents"]} == {"loss_spike"}
    first, second = (i["plan"]["skip"] for i in done["incidents"][:2])
    assert first[1] == 22 and second[1] == 24  # the poison came back right after each skip
    assert done["rollbacks"] == 2
