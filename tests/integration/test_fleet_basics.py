from __future__ import annotations

import json
import subprocess
import sys

import pytest

from phalanx.simgpu import inject
from tests.harness import Fleet

pytestmark = pytest.mark.integration


def test_nodes_appear_with_their_gpus(fleet: Fleet) -> None:
    fleet.start_supervisor()
    fleet.start_agent("n01", gpus=4)
    fleet.start_agent("n02", gpus=2)
    fleet.wait_state("n01", "up")
    fleet.wait_state("n02", "up")

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "phalanx.cli",
            "--api",
            f"http://127.0.0.1:{fleet.api_port}",
            "--token",
            "test-token-0123456789abcdef",
            "nodes",
            "-o",
            "json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    nodes = {n["id"]: n for n in json.loads(out.stdout)}
    assert nodes["n01"]["state"] == "up"
    assert nodes["n01"]["rack"] == "rack1"
    assert [g["uuid"] for g in nodes["n01"]["gpus"]] == [f"GPU-sim-n01-{i}" for i in range(4)]
    assert len(nodes["n02"]["gpus"]) == 2
    assert nodes["n02"]["reasons"] == []


def test_double_bit_ecc_drains_the_node_with_its_reason_within_two_heartbeats(
    fleet: Fleet,
) -> None:
    fleet.start_supervisor()
    fleet.start_agent("n01", heartbeat_s=2.0)
    fleet.wait_state("n01", "up")

    inject(fleet.sim_file("n01"), 1, "ecc-dbe")

    node = fleet.wait_state("n01", "drain", timeout=2 * 2.0)
    codes = {(r["code"], r["gpu"]) for r in node["reasons"]}
    assert ("ecc_dbe", 1) in codes
    assert node["drain"]["by"] == "auto"
