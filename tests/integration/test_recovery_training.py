"""Recovery of a real training job in place: tinylm with checkpoints, faults injected
mid-run (a rank killed, stopped, crashing, resumed after its restart; a script that knows
nothing of Phalanx; an in-process restart). The ranks moved to a spare, and preemption:
``test_recovery_moves``; the training and what is checked of it: ``training``.

Each case that recovers ends with the job ``succeeded`` and rank 0's final digest equal
to that of an undisturbed run of the same command: the recovered run is the run that
never failed. (Two files, not one, so that two workers of ``make test`` share these
tests: one file ran on one worker for over ten minutes, the stage's longest.)
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.harness import Fleet, rank_pid, wait_for
from tests.integration.training import (
    final_digest,
    restored_from,
    running_after_a_commit,
    start,
    submit,
    undisturbed_digest,
    warm_ready,
)

pytestmark = pytest.mark.integration


TORCHRUN_STYLE = """
import os, sys, time, torch, torch.distributed as dist
dist.init_process_group("gloo")  # env:// rendezvous, as torchrun sets it up
rank = dist.get_rank()
snap = f"snapshot-{rank}.pt"
start, total = 0, torch.zeros(1)
if os.path.exists(snap):  # its own snapshots, nothing of Phalanx
    saved = torch.load(snap)
    start, total = saved["step"], saved["total"]
for step in range(start, 60):
    x = torch.ones(1) * (step + 1)
    dist.all_reduce(x)
    total += x
    if (step + 1) % 10 == 0:
        torch.save({"step": step + 1, "total": total}, snap + ".tmp")
        os.replace(snap + ".tmp", snap)
    time.sleep(0.05)
print("total", float(total[0]), flush=True)
dist.barrier()
"""


def test_a_rank_killed_with_sigkill_restarts_in_place_and_ends_bit_identical(
    fleet: Fleet,
) -> None:
    start(fleet)
    # Warm, as for a user (the harness's default: off). Slower steps (the digest does not
    # depend on them): a warm interpreter starts once its rank stepped, and on a loaded CI
    # machine took 26 s to import torch, while 200 steps at 0.04 s ended the job first.
    job = submit(fleet, "kill", "--step-sleep", "0.2", restart={"warm": True})
    running = running_after_a_commit(fleet, job)
    # Four interpreters importing torch on a 2-core CI machine beside three other test
    # workers took over 120 s once (each is ~7 s of CPU alone): a wait, not a figure.
    wait_for(lambda: warm_ready(fleet, job, running["nodes"]) >= 4 or None, 240, "warm ranks")

    os.kill(wait_for(lambda: rank_pid(job, 3), 10, "rank 3"), signal.SIGKILL)

    done = fleet.wait_job(job, "succeeded", timeout=180)
    assert done["nodes"] == running["nodes"]
    assert done["restarts"] == 1
    (incident,) = done["incidents"]
    assert incident["plan"]["action"] == "restart_in_place"
    assert incident["restored_step"] >= 20
    assert set(restored_from(fleet, done).values()) == {"ram"}
    assert final_digest(fleet, done) == undisturbed_digest()
    # Every rank of the restart was a warm interpreter (restart.warm is on by default).
    started_warm = {
        int(m)
        for node in done["nodes"]
        for m in re.findall(
            rf"job {job} gen 2: started rank (\d+) \(pid \d+, a warm interpreter\)",
            fleet.agents[node].output(),
        )
    }
    assert started_warm == {0, 1, 2, 3}
    phases = incident["phases"]
    assert all(
        phases.get(p) is not None
        for p in ("detect", "plan", "stop", "prepare", "launch", "restore", "first_step")
    ), phases


def test_a_stopped_rank_is_detected_as_a_hang_named_and_recovered(fleet: Fleet) -> None:
    start(fleet)
    job = submit(fleet, "hang", restart={"hang_timeout": 4})
    running_after_a_commit(fleet, job)
    pid = wait_for(lambda: rank_pid(job, 2), 10, "rank 2")

    os.kill(pid, signal.SIGSTOP)
    stopped_at = time.time()
    # An in-place restart can pass through `recovering` faster than a poll sees it:
    # read the failure from the job's events instead.
    failure = wait_for(
        lambda: next(
            (
                e
                for e in fleet.client().get(f"/v1/events?job={job}&limit=1000")
                if e["kind"] == "job_failure"
            ),
            None,
        ),
        30,
        "the hang to be detected",
    )
    detected_after = failure["ts"] - stopped_at

    assert detected_after < 4 + 10  # the hang timeout plus a few reports' worth
    assert failure["detail"]["failure"] == "hang" and failure["detail"]["rank"] == 2
    done = fleet.wait_job(job, "succeeded", timeout=180)
    (incident,) = done["incidents"]
    assert incident["failures"][0]["kind"] == "hang"
    assert incident["failures"][0]["rank"] == 2
    assert final_digest(fleet, done) == undisturbed_digest()


def test_a_crash_at_the_same_step_every_time_fails_fast_as_following_the_code(
    fleet: Fleet,
) -> None:
    start(fleet)
    job = submit(fleet, "buggy", "--fail-at-step", "35", "--fail-rank", "1")

    failed = fleet.wait_job(job, "failed", timeout=180)

    assert "follows the code" in failed["reason"]
    assert failed["restarts"] <= 1
    assert all(i["plan"]["swaps"] == [] for i in failed["incidents"] if i.get("plan"))
    for node in ("n01", "n02", "n03"):
        assert fleet.node(node)["state"] == "up"  # no node blamed, no spare used


def test_a_crash_before_the_first_step_after_a_restore_follows_the_code_at_once(
    fleet: Fleet,
) -> None:
    # Rank 2 raises at the start of step 60, just after the save of step 60: every
    # generation after the first restores step 60 and crashes before it reports a step.
    start(fleet)
    job = submit(
        fleet,
        "early",
        "--fail-at-step",
        "60",
        "--fail-rank",
        "2",
        "--ckpt-every",
        "20",
        restart={"max_restarts": 5},
    )

    failed = fleet.wait_job(job, "failed", timeout=180)

    assert "follows the code" in failed["reason"], failed["reason"]
    assert failed["restarts"] == 1  # the second failure ended it: no restart spent on it
    assert "before its first step after restoring step 60" in failed["reason"]


def test_a_rank_of_the_old_generation_resumed_after_the_restart_cannot_join_or_commit(
    fleet: Fleet,
) -> None:
    start(fleet)
    job = submit(fleet, "stale")
    running = running_after_a_commit(fleet, job)
    victim = running["nodes"][1]
    # The node freezes whole (agent and a rank): its stop can never land, so the frozen
    # rank of generation 1 outlives the restart on the spare.
    frozen = wait_for(lambda: rank_pid(job, 2, generation=1), 10, "rank 2")
    fleet.agents[victim].signal(signal.SIGSTOP)
    os.kill(frozen, signal.SIGSTOP)
    fleet.wait_generation(job, 2, timeout=90)  # on the spare

    os.kill(frozen, signal.SIGCONT)  # it wakes up in a world that moved on
    fleet.agents[victim].signal(signal.SIGCONT)

    done = fleet.wait_job(job, "succeeded", timeout=180)
    assert victim not in done["nodes"]
    assert final_digest(fleet, done) == undisturbed_digest()
    # The stale rank joined nothing: it died (or was stopped as an orphan) on its own.
    wait_for(
        lambda: rank_pid(job, 2, generation=1) is None or None, 60, "the stale rank to be gone"
    )


def test_a_torchrun_style_script_that_knows_nothing_of_phalanx_is_restarted_in_place(
    fleet: Fleet,
    tmp_path: Path,
) -> None:
    start(fleet, nodes=2, spares=0)
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(TORCHRUN_STYLE)
    job = fleet.submit(
        name="plain",
        nodes=2,
        ranks_per_node=1,
        workdir=str(work),
        command=[sys.executable, "train.py"],
        grace_period=2,
        env={"OMP_NUM_THREADS": "1"},
    )["id"]
    fleet.wait_job(job, "running", timeout=60)
    wait_for(lambda: (work / "snapshot-1.pt").exists() or None, 60, "a first snapshot")

    os.kill(wait_for(lambda: rank_pid(job, 1, marker="train.py"), 10, "rank 1"), signal.SIGKILL)

    done = fleet.wait_job(job, "succeeded", timeout=120)
    assert (done["generation"], done["restarts"]) == (2, 1)
    log = fleet.root / "nodes" / done["nodes"][0] / "data" / "jobs" / job / "g2" / "rank-0.log"
    # sum over steps of 2 * (step + 1): the same as a run that never crashed
    assert log.read_text().strip().splitlines()[-1] == f"total {2.0 * 60 * 61 / 2}"


def test_in_process_the_survivors_stay_and_only_the_killed_rank_is_replaced(
    fleet: Fleet,
) -> None:
    """``restart.in_process``: tinylm under ``phalanx.rank.run``. A rank killed with
    SIGKILL: the other three leave their collectives alive, park, and become generation
    2's ranks in the same processes (same pids); only rank 3 is started anew; the job
    ends with the undisturbed run's digest."""
    start(fleet, spares=0)
    job = submit(fleet, "inproc", "--in-process", restart={"in_process": True, "warm": True})
    running = running_after_a_commit(fleet, job)
    pids = {r: wait_for(lambda r=r: rank_pid(job, r), 10, f"rank {r}") for r in range(4)}

    os.kill(pids[3], signal.SIGKILL)

    done = fleet.wait_job(job, "succeeded", timeout=180)
    assert done["nodes"] == running["nodes"] and done["restarts"] == 1
    (incident,) = done["incidents"]
    assert incident["plan"]["action"] == "restart_in_place"
    resumed = {
        (int(r), int(p))
        for node in done["nodes"]
        for r, p in re.findall(
            rf"job {job} gen 2: rank (\d+) resumed in its process \(pid (\d+)\)",
            fleet.agents[node].output(),
        )
    }
    assert resumed == {(r, pids[r]) for r in (0, 1, 2)}
    assert set(restored_from(fleet, done).values()) == {"ram"}
    assert final_digest(fleet, done) == undisturbed_digest()
