"""Warm interpreters end to end: the job spec's restart.warm through the supervisor to the
agents. A restart in place hands each rank to a warm interpreter that already imported
the job's modules; a job that opts out gets a cold launch. (The tinylm kill test in
test_recovery_training.py shows the same for a real training job, bit-identical.)"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.simgpu import inject
from tests.harness import Fleet, rank_pid, wait_for

pytestmark = pytest.mark.integration

# Reports a step (the agent starts warm interpreters behind ranks that did), says what it
# sees of how it was started, and in generation 1 waits to be killed.
PROBE = """
import json, os, sys, time
import phalanx.rank
phalanx.rank.step(0)
print(json.dumps({
    "name": __name__,
    "argv": sys.argv,
    "preloaded": "decimal" in sys.modules,
    "generation": os.environ["PHALANX_GENERATION"],
}), flush=True)
if os.environ["PHALANX_GENERATION"] == "1":
    time.sleep(600)
"""


def start(fleet: Fleet) -> None:
    fleet.start_supervisor()
    fleet.start_agent("n01")
    fleet.wait_state("n01", "up")


def submit(fleet: Fleet, work: Path, name: str, **restart: Any) -> str:
    (work / "probe.py").write_text(PROBE)
    job: str = fleet.submit(
        name=name,
        nodes=1,
        ranks_per_node=2,
        workdir=str(work),
        command=[sys.executable, "probe.py", "--flag", "two words"],
        grace_period=2,
        restart={"warm": True, "warm_imports": ["decimal"], **restart},
    )["id"]
    return job


def seen(fleet: Fleet, job: str, rank: int, generation: int, node: str = "n01") -> dict[str, Any]:
    log = (
        fleet.root / "nodes" / node / "data" / "jobs" / job / f"g{generation}" / f"rank-{rank}.log"
    )
    line = next(x for x in log.read_text().splitlines() if x.startswith("{"))
    found: dict[str, Any] = json.loads(line)
    return found


def warm_started(fleet: Fleet, job: str, generation: int, node: str = "n01") -> set[int]:
    pattern = rf"job {job} gen {generation}: started rank (\d+) \(pid \d+, a warm interpreter\)"
    return {int(m) for m in re.findall(pattern, fleet.agents[node].output())}


def warm_ready(fleet: Fleet, job: str, node: str = "n01") -> int:
    pattern = rf"job {job} local rank \d: warm interpreter ready"
    return len(re.findall(pattern, fleet.agents[node].output()))


def kill_rank_1_once_warm(fleet: Fleet, job: str, *, warm: bool) -> None:
    fleet.wait_job(job, "running", timeout=60)
    if warm:  # both slots have a warm interpreter behind them
        wait_for(
            lambda: (
                len(
                    re.findall(
                        rf"job {job} local rank \d: warm interpreter ready",
                        fleet.agents["n01"].output(),
                    )
                )
                >= 2
                or None
            ),
            60,
            "two warm interpreters ready",
        )
    os.kill(wait_for(lambda: rank_pid(job, 1, marker="probe.py"), 30, "rank 1"), signal.SIGKILL)


def test_a_restart_in_place_runs_the_script_in_warm_interpreters_with_its_argv_and_name(
    fleet: Fleet, tmp_path: Path
) -> None:
    start(fleet)
    job = submit(fleet, tmp_path, "warm")

    kill_rank_1_once_warm(fleet, job, warm=True)

    done = fleet.wait_job(job, "succeeded", timeout=90)
    assert (done["generation"], done["restarts"]) == (2, 1)
    assert warm_started(fleet, job, 2) == {0, 1}
    assert done["incidents"][-1]["cold_ranks"] == {}
    for rank in (0, 1):
        got = seen(fleet, job, rank, 2)
        assert got == {
            "name": "__main__",
            "argv": ["probe.py", "--flag", "two words"],
            "preloaded": True,
            "generation": "2",
        }


def test_a_job_that_opts_out_of_warm_interpreters_restarts_with_a_cold_launch(
    fleet: Fleet, tmp_path: Path
) -> None:
    start(fleet)
    job = submit(fleet, tmp_path, "cold", warm=False)

    kill_rank_1_once_warm(fleet, job, warm=False)

    done = fleet.wait_job(job, "succeeded", timeout=90)
    assert (done["generation"], done["restarts"]) == (2, 1)
    assert warm_started(fleet, job, 2) == set()
    off = "the job keeps no warm interpreters (restart.warm is off)"
    assert done["incidents"][-1]["cold_ranks"] == {off: "0-1"}
    assert "warm interpreter" not in fleet.agents["n01"].output()
    assert seen(fleet, job, 0, 2)["preloaded"] is False


def test_ranks_moved_to_a_spare_start_in_the_warm_interpreters_it_kept_for_the_job(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.start_supervisor(spares=1)
    fleet.start_nodes(2)
    job = submit(fleet, tmp_path, "spare-warm")
    running = fleet.wait_job(job, "running", timeout=60)
    (victim,) = running["nodes"]
    (spare,) = {"n01", "n02"} - {victim}
    # The spare keeps a warm interpreter for each of the job's local ranks.
    wait_for(lambda: warm_ready(fleet, job, spare) >= 2 or None, 60, "two warm on the spare")

    inject(fleet.sim_file(victim), 1, "ecc-dbe")

    done = fleet.wait_job(job, "succeeded", timeout=90)
    assert done["nodes"] == [spare]
    assert (done["generation"], done["restarts"]) == (2, 1)
    assert warm_started(fleet, job, 2, spare) == {0, 1}
    for rank in (0, 1):
        assert seen(fleet, job, rank, 2, spare) == {
            "name": "__main__",
            "argv": ["probe.py", "--flag", "two words"],
            "preloaded": True,
            "generation": "2",
        }
