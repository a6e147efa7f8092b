"""Silent data corruption over a real training job: data-parallel replicas of tinylm,
one bit of one parameter flipped on one rank (``--flip-bit``, as a faulty GPU would, in
the first generation only). The replicas' digests diverge at the next report. With
three replicas the odd one's node is quarantined (``sdc_suspect``); with two there is
no majority, so both nodes are rechecked (their burn-in's deterministic recompute check,
which the simulated GPU with the ``sdc`` fault fails) and the one that fails is. Its rank
moves to the spare, the gang resumes from the newest checkpoint before the divergence
and ends bit for bit where an undisturbed run ends."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import pytest

from phalanx.local import free_port
from phalanx.simgpu import inject
from tests.harness import Fleet
from tests.tinylm import REPO, tinylm

pytestmark = pytest.mark.integration

# tinylm's arguments past the tiny model (tests.tinylm)
TINY = [
    *("--log-every", "1000", "--steps", "30", "--ckpt-every", "5", "--step-sleep", "0.02"),
]


def undisturbed_digest(world: int = 3, args: list[str] = TINY) -> str:
    """Rank 0's final digest of the same training, run as ``world`` plain processes."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")},
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                tinylm(*args, "--step-sleep", "0"),
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
        )
    outs = [p.communicate(timeout=240)[0].decode() for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    return str(json.loads(outs[0].strip().splitlines()[-1])["digest"])


def final_digest(fleet: Fleet, job: dict[str, Any]) -> str:
    node = next(r["node"] for r in job["ranks"] if r["rank"] == 0)
    folder = fleet.root / "nodes" / node / "data" / "jobs" / job["id"] / f"g{job['generation']}"
    last = json.loads((folder / "rank-0.log").read_text().strip().splitlines()[-1])
    assert last["done"] is True
    return str(last["digest"])


def submit_replicas(fleet: Fleet, replicas: int, args: list[str], *, flip: str) -> dict[str, Any]:
    """A fleet of ``replicas`` nodes and a spare, and tinylm on ``replicas`` nodes of one
    rank each, its digests compared every 5 steps, ``flip`` (RANK@STEP) its bit flip."""
    fleet.start_supervisor(spares=1)
    for i in range(replicas + 1):
        fleet.start_agent(f"n{i + 1:02d}", rack=f"rack{i % 2 + 1}")
    for i in range(replicas + 1):
        fleet.wait_state(f"n{i + 1:02d}", "up")
    return fleet.submit(
        name=f"sdc-{replicas}",
        nodes=replicas,
        ranks_per_node=1,
        workdir=str(REPO),
        command=tinylm(*args, "--flip-bit", flip),
        grace_period=5,
        env={"OMP_NUM_THREADS": "1"},
        checkpoint={"tiers": ["ram", "nvme", "object"], "interval": {"steps": 5}},
        sdc={"every": 5},
    )


def test_a_flipped_bit_quarantines_its_node_and_the_gang_resumes_before_it_bit_identical(
    fleet: Fleet,
) -> None:
    job = submit_replicas(fleet, 3, TINY, flip="1@12")

    done = fleet.wait_job(job["id"], "succeeded", timeout=180)

    (incident,) = done["incidents"]
    (failure,) = incident["failures"]
    victim = failure["node"]
    assert (failure["kind"], failure["rank"], failure["step"]) == ("sdc", 1, 15)
    assert incident["plan"]["quarantine"] == [victim]
    assert victim not in done["nodes"]
    # The digests of step 10 agreed: its state is checkpoint 11's; the one before is 10.
    assert incident["restored_step"] in (5, 10)  # (10 unless the object store lagged)
    node = fleet.node(victim)
    assert node["state"] == "drain"
    assert "sdc_suspect" in json.dumps(node)
    assert final_digest(fleet, done) == undisturbed_digest()


def test_two_replicas_that_diverge_are_rechecked_and_the_faulty_gpus_node_quarantined(
    fleet: Fleet,
) -> None:
    tiny = [*TINY, "--steps", "60"]  # the flip at step 40 comes after the fault is injected
    job = submit_replicas(fleet, 2, tiny, flip="1@40")
    running = fleet.wait_job(job["id"], "running", timeout=60)
    faulty = next(r["node"] for r in running["ranks"] if r["rank"] == 1)
    healthy = next(r["node"] for r in running["ranks"] if r["rank"] == 0)
    # The GPU under rank 1 computes wrong: its flipped bit, and the recompute check.
    inject(fleet.sim_file(faulty), 0, "sdc")

    done = fleet.wait_job(job["id"], "succeeded", timeout=180)

    (incident,) = done["incidents"]
    (failure,) = incident["failures"]
    assert (failure["kind"], failure["node"], failure["step"]) == ("sdc", faulty, 40)
    assert "no majority" in failure["detail"] and "failed its recheck" in failure["detail"]
    assert incident["plan"]["quarantine"] == [faulty]
    assert faulty not in done["nodes"] and healthy in done["nodes"]
    # The digests of step 35 agreed: its state is checkpoint 36's; the one before is 35.
    assert incident["restored_step"] in (30, 35)  # (35 unless the object store lagged)
    assert fleet.node(faulty)["state"] == "drain"
    assert fleet.node(healthy)["state"] == "up"
    assert final_digest(fleet, done) == undisturbed_digest(2, tiny)
