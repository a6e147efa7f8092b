"""The control plane with a simulated fleet: ``bench/fleet_scale.py`` at CI size.

A real broker and supervisor, and the ``mixed`` workload on 40 nodes simulated by two
processes of the agent's own wire code: a job on 20 of them, 2 hot spares, and small
jobs that queue for the rest and finish; one fault of each kind on the big job. These
tests assert what happened (every fault handled, nothing lost), never how fast: the
figures are the benchmark's (docs/operations.md, "Scale").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
NODES = 40  # the fleet: the big job on half of it


@pytest.fixture(scope="module")
def run() -> dict[str, Any]:
    bench = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "bench" / "fleet_scale.py"),
            "--workload=mixed",
            f"--nodes={NODES}",
            f"--per-process={NODES // 2}",  # two processes of simulated agents
            "--small-jobs=10",
            "--small-steps=3",
            "--heartbeat=2",
            "--offline-after=12",  # a starved CI machine may delay a heartbeat by seconds
            "--step=1",
            "--ckpt-every=5",
            "--steady=8",
            "--settle=3",
            "--rest-every=0.5",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its broker, supervisor and simulators go with it
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        out, err = bench.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(bench.pid, signal.SIGTERM)
        out, err = bench.communicate(timeout=60)
        pytest.fail(f"bench/fleet_scale.py did not finish in 300 s: {err[-3000:]}")
    assert bench.returncode == 0, err[-3000:]
    result: dict[str, Any] = json.loads(out)
    return result


def test_an_ecc_drain_on_a_job_node_moves_its_ranks_and_restarts_the_gang(
    run: dict[str, Any],
) -> None:
    (ecc,) = run["faults"]["ecc"]
    assert ecc["last"] > 0  # every node of the next generation got its start order


def test_a_node_lost_by_its_will_is_replaced_and_the_gang_restarted(run: dict[str, Any]) -> None:
    (lost,) = run["faults"]["node_lost"]
    assert lost["last"] > 0


def test_a_hang_report_restarts_the_gang(run: dict[str, Any]) -> None:
    (hang,) = run["faults"]["hang"]
    assert hang["last"] > 0


def test_a_broker_restart_brings_the_fleet_back_without_a_recovery(run: dict[str, Any]) -> None:
    (restart,) = run["faults"]["broker_restart"]
    assert restart["job_state"] == "running"
    assert restart["recoveries"] == 0


def test_nothing_sent_is_lost_through_a_drain_a_node_loss_and_a_hang(
    run: dict[str, Any],
) -> None:
    assert run["lost_before_broker_restart"] == {"rank": 0, "ckpt": 0, "metrics": 0}


def test_no_rank_event_landing_or_metrics_batch_is_lost_across_the_broker_restart(
    run: dict[str, Any],
) -> None:
    # each stuck outbox: [node, rank events, landings, metrics queued, link up, supervisor seen]
    assert run["queued_at_end"] == 0, run.get("stuck_outboxes")
    assert run["lost_by_kind"] == {"rank": 0, "ckpt": 0, "metrics": 0}


def test_every_node_of_the_job_gets_each_committed_step_in_its_catalog(
    run: dict[str, Any],
) -> None:
    assert run["commits_measured"] >= 1
    # and the supervisor accounted for the way out of each (GET /v1/stats: catalogs):
    # the bench finds a flush of its landings and a publish of its catalogs after it
    assert run["commit_steps"], run
    assert all({"record_s", "build_s", "send_s"} <= set(step) for step in run["commit_steps"]), run[
        "commit_steps"
    ]


def test_the_supervisor_takes_every_message_and_stays_up(run: dict[str, Any]) -> None:
    assert run["supervisor_alive"]
    assert run["bad_messages"] == 0


def test_small_jobs_queue_for_the_rest_of_the_fleet_start_and_finish(run: dict[str, Any]) -> None:
    assert run["job_nodes"] == NODES // 2
    states = run["small_jobs_by_state"]
    assert run["small_jobs"] == 10 and run["small_jobs_started"] >= 1
    assert states.get("succeeded", 0) >= 1
    assert set(states) <= {"succeeded", "running", "starting", "pending"}, states
