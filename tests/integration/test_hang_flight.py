"""A hang's culprit from the ranks' flight recorders (issue 23, part 4), end to end on
gloo: two nodes, a rank each, all-reducing every step. Rank 1 stops entering the
collectives (asleep in Python, as a stuck data loader would leave it); rank 0 waits in
the next all-reduce. Both stop stepping at once, so progress alone cannot tell them
apart; the agents ask the ranks' libraries for their flight recorders, and the dumps
show rank 1 never entered the collective that rank 0 waits in."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import Fleet, wait_for

pytestmark = pytest.mark.integration

RANK = """
import os, time
import torch
import torch.distributed as dist
import phalanx.rank

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(4)
for step in range(100000):
    if rank == 1 and step == 30:
        time.sleep(3600)  # never enters the next all-reduce
    dist.all_reduce(t)
    phalanx.rank.step(step)
    time.sleep(0.02)
"""


def events(fleet: Fleet, job: str, kind: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = fleet.client().get(f"/v1/events?job={job}&limit=1000")
    return [e for e in found if e["kind"] == kind]


def test_the_flight_recorders_name_the_rank_that_never_entered_the_collective(
    fleet: Fleet, tmp_path: Path
) -> None:
    (tmp_path / "rank.py").write_text(RANK)
    fleet.start_supervisor()
    fleet.start_nodes(2, gpus=1)
    job = fleet.submit(
        name="flight",
        nodes=2,
        ranks_per_node=1,
        workdir=str(tmp_path),
        command=[sys.executable, "rank.py"],
        grace_period=2,
        env={"OMP_NUM_THREADS": "1"},
        restart={"hang_timeout": 3, "max_restarts": 0},
    )["id"]

    done = fleet.wait_job(job, "failed", timeout=120)

    (named,) = wait_for(lambda: events(fleet, job, "hang_flight_recorder") or None, 10, "named")
    assert named["detail"]["rank"] == 1
    assert named["detail"]["detail"].startswith(
        "rank 1 never entered collective #31 (gloo:all_reduce) of process group "
    )
    assert "in which rank 0 waits; its newest is #30" in named["detail"]["detail"]
    (failure,) = events(fleet, job, "job_failure")
    assert (failure["detail"]["failure"], failure["detail"]["rank"]) == ("hang", 1)
    assert "flight recorder: rank 1 never entered collective #31" in done["reason"]
    # Each rank's dump was written where torch writes one on a timeout, on its node.
    dumps = sorted(p.name for p in fleet.root.glob(f"nodes/n0*/data/jobs/{job}/g1/nccl-trace-*"))
    assert dumps == ["nccl-trace-rank-0-0", "nccl-trace-rank-1-1"]
