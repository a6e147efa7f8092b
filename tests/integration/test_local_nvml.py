"""``phalanx local up --gpu-backend nvml``: one agent on the machine's real GPUs.

This machine has no NVIDIA GPU, so the agent's ``pynvml`` is the hand-written fake
of ``tests/unit/agentd/fake_pynvml.py`` with two GPUs, put first on its import path
(the only stand-in; everything else is the real command, broker, supervisor, agent
and rank processes). What a real GPU adds (the driver's answers, CUDA in the ranks)
is not tested here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from phalanx import local
from tests.harness import wait_for
from tests.integration.test_cli import exports, phalanx

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

SHIM = '''"""pynvml, for this test's agent: FakeNvml with two GPUs."""
import os, sys
here = os.path.dirname(os.path.abspath(__file__))
del sys.modules["pynvml"]
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
import pynvml  # the real binding, for the fake's constants and errors
sys.path.insert(0, {repo!r})
from tests.unit.agentd.fake_pynvml import FakeDevice, FakeNvml
sys.modules["pynvml"] = FakeNvml([FakeDevice("GPU-fake-0"), FakeDevice("GPU-fake-1")])
'''


def test_local_up_with_nvml_runs_one_agent_on_the_gpus_nvml_reports_and_ranks_on_them(
    tmp_path: Path,
) -> None:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "pynvml.py").write_text(SHIM.format(repo=str(REPO)))
    path = os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH", "")) if p)
    directory = tmp_path / "fleet"

    up = phalanx(
        "local", "up", "--gpu-backend", "nvml", "--dir", str(directory), env={"PYTHONPATH": path}
    )
    try:
        assert up.returncode == 0, up.stderr
        assert "real GPUs (NVML)" in up.stderr
        env = exports(phalanx("local", "env", "--dir", str(directory)).stdout)
        (node,) = json.loads(phalanx("nodes", "-o", "json", env=env).stdout)
        assert (node["id"], node["gpu_backend"]) == ("n01", "nvml")
        assert [g["uuid"] for g in node["gpus"]] == ["GPU-fake-0", "GPU-fake-1"]
        assert "sim_gpus" not in (directory / "nodes" / "n01" / "agentd.toml").read_text()

        fleet = local.Fleet.load(directory)
        job = fleet.client().post(
            "/v1/jobs",
            {
                "spec": {
                    "name": "gpus",
                    "team": "research",
                    "workdir": str(tmp_path),
                    "nodes": 1,
                    "ranks_per_node": 2,
                    "command": ["bash", "-c", 'echo "gpus=$CUDA_VISIBLE_DEVICES $LOCAL_RANK"'],
                }
            },
        )
        wait_for(
            lambda: fleet.client().get(f"/v1/jobs/{job['id']}")["state"] == "succeeded" or None,
            60,
            "the job to succeed",
        )
        logs = directory / "nodes" / "n01" / "data" / "jobs" / job["id"] / "g1"
        seen = sorted((logs / f"rank-{r}.log").read_text().strip() for r in (0, 1))
        # The job's GPUs as NVML numbers them; LOCAL_RANK picks one, as under torchrun.
        assert seen == ["gpus=0,1 0", "gpus=0,1 1"]
        with pytest.raises(local.LocalFleetError, match="real GPUs"):
            fleet.sim_file("n01")
    finally:
        phalanx("local", "down", "--dir", str(directory))


def test_local_up_with_nvml_refuses_more_than_one_node(tmp_path: Path) -> None:
    up = phalanx("local", "up", "--gpu-backend", "nvml", "--nodes", "2", "--dir", str(tmp_path))
    assert up.returncode == 2
    assert "--nodes 2 with --gpu-backend nvml" in up.stderr
    assert not (tmp_path / "fleet.json").exists()
