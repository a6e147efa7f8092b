"""The simulated GPU backend: a fake NVML whose counters live in a JSON file.

Tests, the local demo fleet and the fault rig edit the file while the agent
runs (:func:`inject` does it atomically) and the agent reads it at every
sample, exactly as it would read NVML. The file looks like::

    {"gpus": [{"index": 0, "uuid": "GPU-sim-n01-0", "model": "...",
               "memory_bytes": 85899345920, "present": true,
               "ecc_dbe_volatile": 0, "temperature_c": 41, ...}],
     "xids": [{"gpu": 0, "xid": 79}],
     "nvml_error": null, "hang_s": 0}

Any :class:`~agentd.gpu.base.GpuSample` field may appear on a GPU. ``xids``
is an append-only event log: each entry appended while the backend is open is
delivered once (events from before it opened are not, as with NVML). ``present: false``
makes a GPU vanish from the device list; ``nvml_error`` makes every call fail;
``hang_s`` makes a sample block that long (a wedged driver).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from agentd.gpu.base import (
    GpuBackendError,
    GpuInfo,
    GpuSample,
    NodeSample,
    RecoveryAction,
    Throttle,
)

FAULTS = ("ecc-dbe", "ecc-sbe", "xid-79", "thermal", "row-remap-pending", "gpu-lost", "clear")

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
}
_SAMPLE_FIELDS = set(GpuSample.__dataclass_fields__) - {"index", "uuid"}


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


def read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise GpuBackendError(f"sim GPU file {path}: {exc}") from exc
    if not isinstance(state, dict) or not isinstance(state.get("gpus"), list):
        raise GpuBackendError(f"sim GPU file {path}: expected an object with a 'gpus' list")
    return state


def inject(path: Path, gpu: int, fault: str) -> dict[str, Any]:
    """Apply one named fault to one simulated GPU; returns the new GPU entry."""
    if fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; choose one of {', '.join(FAULTS)}")
    state = read_state(path)
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
        g["throttle"] = [Throttle.HW_THERMAL.value, Throttle.SW_THERMAL.value]
    elif fault == "row-remap-pending":
        g["remap_pending"] = True
    elif fault == "gpu-lost":
        g["present"] = False
    elif fault == "clear":
        g.update(_HEALTHY)
        state["nvml_error"] = None
        state["hang_s"] = 0
    write_state(path, state)
    return dict(g)


class SimBackend:
    """A fake NVML over a JSON file; see the module doc."""

    name = "sim"

    def __init__(self, path: Path, *, node_id: str, gpus: int, model: str) -> None:
        self.path = path
        if not path.exists():
            write_state(path, new_state(node_id, gpus, model))
        # Like NVML's event set, only events after the backend opened are delivered.
        self._xids_seen = len(read_state(path).get("xids") or [])

    def inventory(self) -> list[GpuInfo]:
        state = read_state(self.path)
        return [
            GpuInfo(
                int(g["index"]),
                str(g["uuid"]),
                str(g.get("model", "sim")),
                int(g.get("memory_bytes", 0)),
            )
            for g in self._present(state)
        ]

    def sample(self) -> NodeSample:
        state = read_state(self.path)
        hang = float(state.get("hang_s") or 0)
        if hang > 0:
            time.sleep(hang)
        if state.get("nvml_error"):
            return NodeSample(gpus=(), errors=(f"nvmlDeviceGetCount: {state['nvml_error']}",))
        xids = state.get("xids") or []
        if len(xids) < self._xids_seen:  # the log was truncated by hand: start over
            self._xids_seen = 0
        fresh = tuple((int(x["gpu"]), int(x["xid"])) for x in xids[self._xids_seen :])
        self._xids_seen = len(xids)
        return NodeSample(gpus=tuple(self._sample(g) for g in self._present(state)), xids=fresh)

    def close(self) -> None:
        pass

    @staticmethod
    def _present(state: dict[str, Any]) -> list[dict[str, Any]]:
        return sorted(
            (g for g in state["gpus"] if g.get("present", True)), key=lambda g: int(g["index"])
        )

    @staticmethod
    def _sample(g: dict[str, Any]) -> GpuSample:
        try:
            values = {k: v for k, v in g.items() if k in _SAMPLE_FIELDS}
            values["throttle"] = frozenset(Throttle(t) for t in g.get("throttle") or [])
            values["nvlink_down"] = tuple(g.get("nvlink_down") or ())
            values["errors"] = tuple(g.get("errors") or ())
            if g.get("recovery_action") is not None:
                values["recovery_action"] = RecoveryAction(g["recovery_action"])
            values.setdefault("mem_total_bytes", g.get("memory_bytes"))
            return GpuSample(index=int(g["index"]), uuid=str(g["uuid"]), **values)
        except (KeyError, TypeError, ValueError) as exc:
            raise GpuBackendError(f"sim GPU entry {g.get('index')}: {exc}") from exc
