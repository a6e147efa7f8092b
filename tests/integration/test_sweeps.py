"""A sweep end to end (issue 25): real broker, supervisor, agents and tinylm trials.

tinylm over ``lr`` (log) and ``dim`` (categorical): 8 trials, 2 at a time, ASHA at
steps 10, 20, 40 of 60. A tiny model at a few ms a step, so that the whole sweep takes
about a minute on two cores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Fleet, processes_matching, wait_for
from tests.tinylm import REPO, tinylm

pytestmark = pytest.mark.integration

FAST = "metrics_interval_s = 0.5\n"
STEPS = 60


# The tiny model (tests.tinylm) with each trial's lr and dim, in batches of 4.
TINYLM = tinylm(
    *("--lr", "{lr}", "--dim", "{dim}", "--batch", "4"),
    *("--steps", str(STEPS), "--step-sleep", "0.02", "--log-every", "10", "--ckpt-every", "10"),
)


def sweep_yaml(path: Path, command: list[str], *, n_trials: int = 8) -> Path:
    path.write_text(
        "name: tiny\nteam: research\n"
        f"trial:\n  command: {json.dumps(command)}\n  workdir: {REPO}\n"
        "  env: {OMP_NUM_THREADS: '1'}\n  nodes: 1\n  ranks_per_node: 1\n  max_runtime: 5m\n"
        "  grace_period: 10\n  checkpoint: {tiers: [ram, nvme]}\n"
        "space:\n  lr: {type: float, low: 1.0e-5, high: 0.3, log: true}\n"
        "  dim: {type: categorical, choices: [8, 16]}\n"
        "objective: {metric: loss, direction: minimize}\n"
        "sampler: {type: random, seed: 3}\n"
        "pruner: {type: asha, min_steps: 10, reduction_factor: 2}\n"
        f"n_trials: {n_trials}\nparallelism: 2\npriority: 40\n"
    )
    return path


def two_nodes(fleet: Fleet) -> None:
    fleet.start_supervisor(extra=FAST)
    for node in ("n01", "n02"):
        fleet.start_agent(node, top=FAST)
    for node in ("n01", "n02"):
        fleet.wait_state(node, "up", timeout=30)


def status(fleet: Fleet, sweep: str) -> dict[str, Any]:
    view: dict[str, Any] = fleet.client().get(f"/v1/sweeps/{sweep}")
    return view


def cli_status(fleet: Fleet, sweep: str) -> dict[str, Any]:
    done = fleet.cli("sweep", "status", sweep, "-o", "json")
    assert done.returncode == 0, done.stderr
    view: dict[str, Any] = json.loads(done.stdout)
    return view


def test_a_sweep_prunes_trials_keeps_their_checkpoints_and_completes_across_a_restart(
    fleet: Fleet, tmp_path: Path
) -> None:
    two_nodes(fleet)
    submitted = fleet.cli("sweep", "submit", str(sweep_yaml(tmp_path / "sweep.yaml", TINYLM)))
    assert submitted.returncode == 0, submitted.stderr
    sweep = submitted.stdout.strip()
    wait_for(
        lambda: sum(t["state"] != "running" for t in status(fleet, sweep)["trials"]) >= 2,
        120,
        "two trials ended",
        interval=0.5,
    )

    assert fleet.supervisor is not None
    fleet.supervisor.stop()  # mid-sweep: trials run on, their study is in the journal
    fleet.start_supervisor(extra=FAST)
    final = wait_for(
        lambda: (s := status(fleet, sweep))["state"] != "running" and s,
        240,
        "the sweep to end",
        interval=0.5,
    )

    final = cli_status(fleet, sweep)
    trials = final["trials"]
    states = [t["state"] for t in trials]
    assert final["state"] == "complete"
    assert len([t for t in trials if t["retry_of"] is None]) == 8
    assert set(states) <= {"complete", "pruned"}, [t["reason"] for t in trials]
    assert "pruned" in states and "complete" in states
    complete = [t for t in trials if t["state"] == "complete"]
    best = min(complete, key=lambda t: t["value"])
    assert final["best"]["number"] == best["number"] and final["best"]["job"] == best["job"]
    for t in trials:
        job = fleet.job(t["job"])
        assert job["spec"]["hyperparams"] == t["params"]
        if t["state"] == "pruned":
            assert t["pruned_at"] in (10, 20, 40) and t["intermediate"][-1][0] == t["pruned_at"]
            assert job["state"] == "cancelled" and "pruned by sweep" in job["reason"]
            ckpts = fleet.client().get(f"/v1/jobs/{t['job']}/checkpoints")
            assert any("nvme" in s["committed"] for s in ckpts["steps"]), ckpts
        else:
            assert job["state"] == "succeeded"
            assert [s for s, _ in t["intermediate"]] == [10, 20, 40]
    listed = fleet.cli("sweep", "ls")
    assert sweep in listed.stdout and "complete" in listed.stdout


def test_sweep_cancel_stops_every_running_trial(fleet: Fleet, tmp_path: Path) -> None:
    two_nodes(fleet)
    sleeper = ["bash", "-c", "sleep 3535; echo {lr} {dim}"]
    spec = sweep_yaml(tmp_path / "long.yaml", sleeper, n_trials=4)
    sweep = fleet.cli("sweep", "submit", str(spec)).stdout.strip()
    running = wait_for(
        lambda: (
            len(jobs := [t["job"] for t in status(fleet, sweep)["trials"]]) == 2
            and all(fleet.job(j)["state"] == "running" for j in jobs)
            and jobs
        ),
        60,
        "two trials running",
        interval=0.3,
    )

    cancelled = fleet.cli("sweep", "cancel", sweep)

    assert cancelled.returncode == 0, cancelled.stderr
    for job in running:
        fleet.wait_job(job, "cancelled", timeout=30)
    view = cli_status(fleet, sweep)
    assert view["state"] == "cancelled"
    assert [t["state"] for t in view["trials"]] == ["failed", "failed"]
    wait_for(lambda: processes_matching("sleep 3535") == [] or None, 10, "no trial rank left")
