"""The simulated GPUs' file: its format, and the faults an operator or a test injects.

The simulated GPU backend (``agentd.gpu.sim``) reads this file at every sample as it
would read NVML; tests, ``phalanx local inject`` and the fault rig edit it while the
agent runs (:func:`inject` does it atomically). It lives here, below both the CLI and
the agent, so neither imports the other. The file looks like::

    {"gpus": [{"index": 0, "uuid": "GPU-sim-n01-0", "model": "...",
               "memory_bytes": 85899345920, "present": true,
               "ecc_dbe_volatile": 0, "temperature_c": 41, ...}],
     "xids": [{"gpu": 0, "xid": 79}],
     "nvml_error": null, "hang_s": 0}
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


class SimFileError(ValueError):
    """The file is unreadable or not a simulated-GPU file; the message names it."""


# The throttle reasons a thermal fault sets (``agentd.gpu.base.Throttle``'s values).
_THERMAL_THROTTLE = ["hw_thermal", "sw_thermal"]

FAULTS = (
    "ecc-dbe",
    "ecc-sbe",
    "xid-79",
    "thermal",
    "row-remap-pending",
    "gpu-lost",
    "sdc",
    "slow-gpu",
    "slow-nvlink",
    "clear",
)

# A simulated GPU's speed, as the burn-in reports it (pre-flight screening): its
# synthetic step and the all-reduce between a node's GPUs, at full speed; the faults
# ``slow-gpu`` and ``slow-nvlink`` divide them by these factors.
SIM_STEP_S = 0.010
SIM_ALLREDUCE_GBPS = 400.0
SLOW_GPU_FACTOR = 1.5
SLOW_NVLINK_FACTOR = 4.0

_HEALTHY: dict[str, Any] = {
    "present": True,
    "ecc_sbe_volatile": 0,
    "ecc_dbe_volatile": 0,
    "ecc_sbe_aggregate": 0,
    "ecc_dbe_aggregate": 0,
    "retired_pages": 0,
    "retired_pending": False,
    "remap_pending": False,
    "remap_failed": False,
    "temperature_c": 41.0,
    "temp_slowdown_c": 87.0,
    "temp_shutdown_c": 92.0,
    "throttle": [],
    "power_w": 95.0,
    "power_limit_w": 700.0,
    "util_pct": 0.0,
    "mem_used_bytes": 0,
    "recovery_action": "none",
    "nvlink_down": [],
    # Silent data corruption: the GPU computes wrong numbers and its health says nothing;
    # the burn-in's recompute check (agentd.burnin) finds it.
    "corrupt": False,
    "slow": 1.0,  # its synthetic step takes this many times a healthy GPU's
    "link_slow": 1.0,  # its all-reduce with the node's other GPUs: this many times slower
}


def new_state(
    node_id: str, gpus: int, model: str, memory_bytes: int = 80 * 1024**3
) -> dict[str, Any]:
    return {
        "gpus": [
            {
                "index": i,
                "uuid": f"GPU-sim-{node_id}-{i}",
                "model": model,
                "memory_bytes": memory_bytes,
                **_HEALTHY,
            }
            for i in range(gpus)
        ],
        "xids": [],
        "nvml_error": None,
        "hang_s": 0,
    }


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Replace the file atomically, so a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".sim-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(state, fh, indent=1)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def load(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise SimFileError(f"sim GPU file {path}: {exc}") from exc
    if not isinstance(state, dict) or not isinstance(state.get("gpus"), list):
        raise SimFileError(f"sim GPU file {path}: expected an object with a 'gpus' list")
    return state


def inject(path: Path, gpu: int, fault: str) -> dict[str, Any]:
    """Apply one named fault to one simulated GPU; returns the new GPU entry."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    state = load(path)
    entries = [g for g in state["gpus"] if g.get("index") == gpu]
    if not entries:
        raise ValueError(f"GPU {gpu} does not exist in {path} ({len(state['gpus'])} GPUs)")
    g = entries[0]
    if fault == "ecc-dbe":
        g["ecc_dbe_volatile"] = int(g.get("ecc_dbe_volatile", 0)) + 1
        g["ecc_dbe_aggregate"] = int(g.get("ecc_dbe_aggregate", 0)) + 1
        state["xids"].append({"gpu": gpu, "xid": 48})
    elif fault == "ecc-sbe":
        g["ecc_sbe_volatile"] = int(g.get("ecc_sbe_volatile", 0)) + 1000
        g["ecc_sbe_aggregate"] = int(g.get("ecc_sbe_aggregate", 0)) + 1000
    elif fault == "xid-79":
        state["xids"].append({"gpu": gpu, "xid": 79})
    elif fault == "thermal":
        g["temperature_c"] = float(g.get("temp_slowdown_c", 87.0)) + 2
        g["throttle"] = list(_THERMAL_THROTTLE)
    elif fault == "row-remap-pending":
        g["remap_pending"] = True
    elif fault == "gpu-lost":
        g["present"] = False
    elif fault == "sdc":
        g["corrupt"] = True
    elif fault == "slow-gpu":
        g["slow"] = SLOW_GPU_FACTOR
    elif fault == "slow-nvlink":
        g["link_slow"] = SLOW_NVLINK_FACTOR
    elif fault == "clear":
        g.update(_HEALTHY)
        state["nvml_error"] = None
        state["hang_s"] = 0
    write_state(path, state)
    return dict(g)
