"""The job every scenario runs: tinylm with DDP on two GPU hosts x two ranks, checkpointing
every 10 steps to every tier, allowed three restarts and the spares."""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.rig.fleet import REPO
from tests.tinylm import MODEL

STEPS = 150
CKPT_EVERY = 10
TINY = [
    *MODEL,  # the tiny model every test trains (tests.tinylm)
    *("--log-every", "1", "--steps", str(STEPS)),
    *("--ckpt-every", str(CKPT_EVERY), "--step-sleep", "0.05"),
]
TIERS = ["ram", "nvme", "peer", "object"]
HANG_TIMEOUT_S = 20  # a partition is a hang on gloo: detected this long after the last step


def spec(
    name: str,
    *extra: str,
    python: str = sys.executable,
    workdir: str = str(REPO),
) -> dict[str, Any]:
    """The job; ``python`` and ``workdir`` are where it runs on the GPU hosts
    (``Fleet.job_runtime``: this machine's for namespaces, the agents' on real hosts)."""
    return {
        "name": name,
        "team": "rig",
        "nodes": 2,
        "ranks_per_node": 2,
        "workdir": workdir,
        "command": [python, "examples/tinylm.py", *TINY, *extra],
        "grace_period": 5,
        # No GLOO_SOCKET_IFNAME: every namespace shares one host name (127.0.0.1), as hosts
        # whose name is not in DNS would; the agent names its address's interface for gloo.
        "env": {"OMP_NUM_THREADS": "1"},
        "checkpoint": {"tiers": TIERS, "interval": {"steps": CKPT_EVERY}},
        "restart": {
            "max_restarts": 3,
            "use_spares": True,
            "hang_timeout": HANG_TIMEOUT_S,
            "spare_wait": 60,
        },
    }


def last_step(log: str) -> int | None:
    """The last step rank 0's log reports (tinylm prints one JSON line per step)."""
    for line in reversed(log.splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("step"), int):
            return int(data["step"])
    return None


def final_digest(log: str) -> str | None:
    for line in reversed(log.splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and data.get("done"):
            return str(data["digest"])
    return None
