"""The real training of the recovery tests: tinylm with checkpoints at every tier, on a
fleet of three nodes and a spare, and what they check of it: rank 0's final digest (every
bit of the model, optimizer, scheduler and RNG state after the last step) against that of
an undisturbed run of the same command, computed as four plain torch.distributed
processes (gloo), no Phalanx at all; the steps and tiers each rank restored from.

Used by ``test_recovery_training`` (restarts in place), ``test_recovery_moves`` (ranks
moved to a spare, preemption), ``test_ha``, ``test_broker_list`` and ``test_dashboard``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

from phalanx.local import free_port
from tests import tinylm as tiny
from tests.harness import Fleet, wait_for
from tests.tinylm import REPO

STEPS = 200  # ~12 s: a fault injected after step 20 strikes well before the end
RUN = ("--log-every", "1000", "--steps", str(STEPS), "--ckpt-every", "10", "--step-sleep", "0.04")
TIERS = ["ram", "nvme", "peer", "object"]


def tinylm(*extra: str) -> list[str]:
    return tiny.tinylm(*RUN, *extra)


@cache
def undisturbed_digest(*extra: str) -> str:
    """Rank 0's final digest of the same training, run as 4 plain processes."""
    port = free_port()
    procs = []
    for rank in range(4):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "4",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        env = {k: v for k, v in env.items() if not k.startswith("PHALANX_")}
        procs.append(
            subprocess.Popen(
                tinylm("--step-sleep", "0"),
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outs = [p.communicate(timeout=240)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return str(json.loads(outs[0].strip().splitlines()[-1])["digest"])


def start(fleet: Fleet, *, nodes: int = 3, spares: int = 1, extra: str = "") -> None:
    fleet.start_supervisor(spares=spares, extra=extra)
    fleet.start_nodes(nodes, racks=2)


def submit(fleet: Fleet, name: str, *extra: str, **spec: Any) -> str:
    job = fleet.submit(
        name=name,
        nodes=2,
        ranks_per_node=2,
        workdir=str(REPO),
        command=tinylm(*extra),
        grace_period=5,
        env={"OMP_NUM_THREADS": "1"},
        checkpoint={"tiers": TIERS, "interval": {"steps": 10}},
        **spec,
    )
    job_id: str = job["id"]
    return job_id


def committed_step(fleet: Fleet, job: str, at_least: int, tier: str = "object") -> int | None:
    events = fleet.client().get(f"/v1/events?job={job}&limit=1000")
    steps = [
        e["detail"]["step"]
        for e in events
        if e["kind"] == "ckpt_committed" and e["detail"]["tier"] == tier
    ]
    newest = max(steps, default=-1)
    return newest if newest >= at_least else None


def running_after_a_commit(fleet: Fleet, job: str) -> dict[str, Any]:
    """The job's view once it runs and has step 20 committed at every tier."""
    running = fleet.wait_job(job, "running", timeout=60)
    wait_for(lambda: committed_step(fleet, job, 20), 90, "step 20 committed at every tier")
    return running


def warm_ready(fleet: Fleet, job: str, nodes: list[str]) -> int:
    """How many of the job's slots on ``nodes`` have a warm interpreter ready."""
    pattern = rf"job {job} local rank (\d+): warm interpreter ready"
    return sum(len(set(re.findall(pattern, fleet.agents[n].output()))) for n in nodes)


def rank_log(fleet: Fleet, job: dict[str, Any], rank: int) -> Path:
    """Rank ``rank``'s log of the job's generation in ``job`` (a job's view), on its node."""
    node = next(r["node"] for r in job["ranks"] if r["rank"] == rank)
    generation = f"g{job['generation']}"
    return (
        fleet.root / "nodes" / node / "data" / "jobs" / job["id"] / generation / f"rank-{rank}.log"
    )


def final_digest(fleet: Fleet, job: dict[str, Any]) -> str:
    last = json.loads(rank_log(fleet, job, 0).read_text().strip().splitlines()[-1])
    assert last["done"] is True
    return str(last["digest"])


def restored_lines(fleet: Fleet, job: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Each rank's ``ckpt_restored`` line of the job's generation in ``job`` (its last)."""
    out = {}
    for r in job["ranks"]:
        for line in rank_log(fleet, job, r["rank"]).read_text().splitlines():
            if line.startswith("{") and "ckpt_restored" in line:
                out[r["rank"]] = json.loads(line)
    return out


def restored_from(fleet: Fleet, job: dict[str, Any]) -> dict[int, str]:
    """The tier each rank of the job's generation restored from."""
    return {rank: str(line["from"]) for rank, line in restored_lines(fleet, job).items()}


def restored_steps(fleet: Fleet, job: dict[str, Any]) -> dict[int, int]:
    """The step each rank of the job's generation restored."""
    return {rank: int(line["ckpt_restored"]) for rank, line in restored_lines(fleet, job).items()}
