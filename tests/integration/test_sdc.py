"""Silent data corruption over a real training job: three data-parallel replicas of
tinylm, one bit of one parameter flipped on one rank (``--flip-bit``, as a faulty GPU
would, in the first generation only). The replicas' digests diverge at the next report,
the odd one's node is quarantined (``sdc_suspect``), its rank moves to the spare, the
gang resumes from the newest checkpoint before the divergence and ends bit for bit
where an undisturbed run ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.local import free_port
from tests.harness import Fleet

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TINY = [
    *("--vocab", "32", "--dim", "16", "--layers", "1", "--heads", "2"),
    *("--seq", "8", "--batch", "2", "--log-every", "1000", "--steps", "30"),
    *("--ckpt-every", "5", "--step-sleep", "0.02"),
]


def undisturbed_digest() -> str:
    """Rank 0's final digest of the same training, run as 3 plain processes."""
    port = free_port()
    procs = []
    for rank in range(3):
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")},
            "RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "examples/tinylm.py", *TINY, "--step-sleep", "0"],
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


def test_a_flipped_bit_quarantines_its_node_and_the_gang_resumes_before_it_bit_identical(
    fleet: Fleet,
) -> None:
    fleet.start_supervisor(spares=1)
    for i in range(4):
        fleet.start_agent(f"n{i + 1:02d}", rack=f"rack{i % 2 + 1}")
    for i in range(4):
        fleet.wait_state(f"n{i + 1:02d}", "up")
    job = fleet.submit(
        name="sdc",
        nodes=3,
        ranks_per_node=1,
        workdir=str(REPO),
        command=[sys.executable, "examples/tinylm.py", *TINY, "--flip-bit", "1@12"],
        grace_period=5,
        env={"OMP_NUM_THREADS": "1"},
        checkpoint={"tiers": ["ram", "nvme", "object"], "interval": {"steps": 5}},
        sdc={"every": 5},
    )

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
