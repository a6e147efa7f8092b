"""Sweeps in the supervisor (issue 25): ask, submit, report at the rungs, prune, tell,
retry, cancel, and a restart, against the real controller, store and Optuna journal.

No broker and no agent: a trial's job is moved through its states here as the
controller would on its agents' word, and its objective is written to the store's
series as the metrics channel writes it (an I/O boundary).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from phalanx.sweepspec import validate_sweep
from supervisor.api.app import make_app
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.jobs import Job, JobState
from supervisor.sweeps import Sweep, SweepState
from supervisor.telemetry.rows import SeriesRows
from supervisor.telemetry.series import Point
from tests.wait import until

TOKEN = "bootstrap-token-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
SWEEP: dict[str, Any] = {
    "name": "lm",
    "team": "research",
    "trial": {
        "command": ["python", "tinylm.py", "--lr", "{lr}", "--dim", "{dim}"],
        "workdir": "/work",
        "nodes": 1,
        "ranks_per_node": 2,
        "max_runtime": 600,
    },
    "space": {
        "lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True},
        "dim": {"type": "categorical", "choices": [16, 32]},
    },
    "objective": {"metric": "loss"},
    "sampler": {"type": "random", "seed": 7},
    "pruner": {"type": "asha", "min_steps": 10, "reduction_factor": 2},
    "n_trials": 4,
    "parallelism": 2,
    "priority": 30,
}


def supervisor(state_dir: Path) -> Supervisor:
    return Supervisor(SupervisorSettings(state_dir=state_dir), TOKEN)


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[Supervisor]:
    built = supervisor(tmp_path)
    yield built
    built.store.close()


def submitted(sup: Supervisor, **changes: Any) -> Sweep:
    sw = sup.sweeps.submit(validate_sweep({**SWEEP, **changes}))
    sup.sweeps.tick()
    return sw


def trial_jobs(sup: Supervisor, sw: Sweep) -> list[Job]:
    return sorted(
        (j for j in sup.jobs.jobs.values() if j.spec.name.startswith(f"{sw.id}-t")),
        key=lambda j: int(j.spec.name.rsplit("-t", 1)[1]),
    )


def run(job: Job) -> None:
    job.move(JobState.STARTING)
    job.move(JobState.RUNNING)


def losses(sup: Supervisor, job: Job, values: dict[int, float]) -> None:
    counts = SeriesRows(sup.store).series_counts(job.id)
    for i, (step, value) in enumerate(sorted(values.items())):
        SeriesRows(sup.store).add_point(
            job.id, "loss", Point(step, 1000.0 + i, value, value, value), counts
        )
        job.note_step(job.generation, step, 1000.0 + i)


def trials(sup: Supervisor, sw: Sweep) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = sup.sweeps.view(sw)["trials"]
    return rows


async def settle(sup: Supervisor) -> None:
    """Let the controller's tasks (a pruned trial's stop) finish."""
    await until(lambda: not len(sup.jobs.tasks), 5.0, "the controller's tasks to finish")


def test_a_sweep_runs_parallelism_trials_at_once_each_a_job_with_its_params(
    sup: Supervisor,
) -> None:
    sw = submitted(sup)

    jobs = trial_jobs(sup, sw)
    assert len(jobs) == 2 and all(j.state is JobState.PENDING for j in jobs)
    for row, job in zip(trials(sup, sw), jobs, strict=True):
        params = row["params"]
        assert row["state"] == "running" and row["job"] == job.id
        assert job.spec.hyperparams == params
        assert job.spec.priority == 30
        assert job.spec.command[3] == repr(params["lr"]) and job.spec.command[5] == str(
            params["dim"]
        )
        assert job.spec.env["HP_LR"] == repr(params["lr"])
        assert job.spec.env["HP_DIM"] == str(params["dim"])


async def test_a_trial_behind_the_others_at_a_rung_is_pruned_and_its_job_stopped(
    sup: Supervisor,
) -> None:
    sw = submitted(sup)
    first, second = trial_jobs(sup, sw)
    run(first)
    run(second)
    losses(sup, first, {5: 1.5, 10: 1.0})
    sup.sweeps.tick()
    losses(sup, second, {5: 2.5, 11: 2.0})

    sup.sweeps.tick()
    await settle(sup)

    rows = trials(sup, sw)
    assert [r["state"] for r in rows[:2]] == ["running", "pruned"]
    assert rows[0]["intermediate"] == [[10, 1.0]]
    assert rows[1]["intermediate"] == [[10, 2.0]] and rows[1]["pruned_at"] == 10
    assert second.state is JobState.CANCELLED
    assert second.reason == f"pruned by sweep {sw.id} at step 10"
    assert first.state is JobState.RUNNING


async def test_a_sweep_is_complete_only_once_its_last_pruned_trials_job_has_stopped(
    sup: Supervisor,
) -> None:
    sw = submitted(sup, n_trials=2)
    first, second = trial_jobs(sup, sw)
    run(first)
    run(second)
    losses(sup, first, {5: 1.5, 10: 1.0, 19: 0.5})
    sup.sweeps.tick()
    first.move(JobState.SUCCEEDED)
    sup.sweeps.tick()
    losses(sup, second, {5: 2.5, 11: 2.0})

    sup.sweeps.tick()  # the second trial is pruned: its job is told to stop, saving first

    assert [r["state"] for r in trials(sup, sw)] == ["complete", "pruned"]
    assert second.state is JobState.STOPPING
    sup.sweeps.tick()
    assert sw.state is SweepState.RUNNING  # its nodes are not free yet
    await settle(sup)
    sup.sweeps.tick()
    assert second.state is JobState.CANCELLED
    assert sw.state is SweepState.COMPLETE


def test_a_succeeded_trial_is_told_its_last_value_and_the_best_is_reported(
    sup: Supervisor,
) -> None:
    sw = submitted(sup, n_trials=2, pruner={"type": "none"})
    first, second = trial_jobs(sup, sw)
    for job, final in ((first, 0.7), (second, 0.4)):
        run(job)
        losses(sup, job, {10: 1.0, 19: final})
        job.move(JobState.SUCCEEDED)

    sup.sweeps.tick()
    sup.sweeps.tick()

    view = sup.sweeps.view(sw)
    assert [(t["state"], t["value"]) for t in view["trials"]] == [
        ("complete", 0.7),
        ("complete", 0.4),
    ]
    assert view["best"]["number"] == 1 and view["best"]["job"] == second.id
    assert view["state"] == "complete"


def test_once_four_trials_are_complete_the_sweep_says_which_params_matter(
    sup: Supervisor,
) -> None:
    sw = submitted(sup, n_trials=4, parallelism=4, pruner={"type": "none"})
    for job in trial_jobs(sup, sw):
        run(job)
        losses(sup, job, {9: 10 * float(job.spec.hyperparams["lr"])})
        job.move(JobState.SUCCEEDED)

    before = sup.sweeps.view(sw)["importance"]
    sup.sweeps.tick()
    after = sup.sweeps.view(sw)["importance"]

    assert before is None
    assert set(after) == {"lr", "dim"} and sum(after.values()) == pytest.approx(1, abs=0.01)


def test_a_failed_trial_is_told_fail_and_retried_once_with_the_same_params(
    sup: Supervisor,
) -> None:
    sw = submitted(sup, n_trials=1, parallelism=1)
    (job,) = trial_jobs(sup, sw)
    run(job)
    job.move(JobState.RECOVERING)
    job.move(JobState.FAILED, "rank 0 exited with code 1")

    sup.sweeps.tick()

    rows = trials(sup, sw)
    assert [r["state"] for r in rows] == ["failed", "running"]
    assert rows[1]["retry_of"] == 0 and rows[1]["params"] == rows[0]["params"]
    retry = sup.jobs.get(rows[1]["job"])
    assert retry.spec.hyperparams == job.spec.hyperparams
    run(retry)
    retry.move(JobState.RECOVERING)
    retry.move(JobState.FAILED)

    sup.sweeps.tick()

    assert [r["state"] for r in trials(sup, sw)] == ["failed", "failed"]
    assert sw.state is SweepState.COMPLETE


async def test_cancel_fails_every_running_trial_and_cancels_its_job(sup: Supervisor) -> None:
    sw = submitted(sup)
    jobs = trial_jobs(sup, sw)

    sup.sweeps.cancel(sw.id)
    sup.sweeps.tick()

    assert sw.state is SweepState.CANCELLED
    assert [r["state"] for r in trials(sup, sw)] == ["failed", "failed"]
    assert all(j.state is JobState.CANCELLED for j in jobs)
    assert len(trial_jobs(sup, sw)) == 2  # nothing more is asked


def test_a_restarted_supervisor_takes_up_the_study_and_reports_the_rungs_it_missed(
    tmp_path: Path,
) -> None:
    before = supervisor(tmp_path)
    sw = submitted(before)
    first, second = trial_jobs(before, sw)
    run(first)
    before.jobs.save(first)
    before.store.close()

    after = supervisor(tmp_path)
    try:
        again = after.sweeps.get(sw.id)
        job = after.jobs.get(first.id)
        losses(after, job, {10: 1.0, 20: 0.8})
        after.sweeps.tick()

        rows = trials(after, again)
        assert [r["job"] for r in rows] == [first.id, second.id]
        assert rows[0]["intermediate"] == [[10, 1.0], [20, 0.8]]
        assert len(trial_jobs(after, again)) == 2  # no trial asked twice
    finally:
        after.store.close()


@pytest.fixture
async def client(sup: Supervisor) -> Any:
    async with TestClient(TestServer(make_app(sup))) as c:
        yield c


async def test_the_api_submits_lists_shows_and_cancels_a_sweep(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    resp = await client.post("/v1/sweeps", json={"spec": SWEEP}, headers=ADMIN)
    assert resp.status == 201, await resp.text()
    made = await resp.json()
    sup.sweeps.tick()

    listed = await (await client.get("/v1/sweeps", headers=ADMIN)).json()
    one = await (await client.get(f"/v1/sweeps/{made['id']}", headers=ADMIN)).json()
    cancelled = await client.post(f"/v1/sweeps/{made['id']}/cancel", headers=ADMIN)
    again = await client.post(f"/v1/sweeps/{made['id']}/cancel", headers=ADMIN)
    unknown = await client.get("/v1/sweeps/nope-000000", headers=ADMIN)

    assert [s["id"] for s in listed] == [made["id"]] and "trials" not in listed[0]
    assert [t["state"] for t in one["trials"]] == ["running", "running"]
    assert (await cancelled.json())["state"] == "cancelled"
    assert again.status == 409 and unknown.status == 404


async def test_the_api_refuses_a_bad_sweep_spec_naming_the_field(
    client: TestClient[Any, Any],
) -> None:
    bad = {**SWEEP, "space": {"lr": {"type": "float", "low": 0, "high": 1, "log": True}}}

    resp = await client.post("/v1/sweeps", json={"spec": bad}, headers=ADMIN)

    assert resp.status == 400
    assert (await resp.json())["fields"][0]["field"] == "space.lr"


async def test_a_member_cannot_cancel_another_teams_sweep(
    client: TestClient[Any, Any], sup: Supervisor
) -> None:
    made = await client.post("/v1/tokens", json={"role": "member", "team": "vision"}, headers=ADMIN)
    secret = (await made.json())["secret"]
    sw = submitted(sup)

    resp = await client.post(
        f"/v1/sweeps/{sw.id}/cancel", headers={"Authorization": f"Bearer {secret}"}
    )

    assert resp.status == 403
    assert "member of team research" in (await resp.json())["error"]
    assert sw.state is SweepState.RUNNING
