"""The simulated GPU backend: a fake NVML whose counters live in a JSON file.

Tests, the local demo fleet and the fault rig edit the file while the agent runs
(:func:`phalanx.simgpu.inject` does it atomically; the file's format lives there) and
the agent reads it at every sample, exactly as it would read NVML. The file looks like::

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
from phalanx.simgpu import (  # the file's format, re-exported for the agent's side
    FAULTS,
    SIM_ALLREDUCE_GBPS,
    SIM_STEP_S,
    SimFileError,
    inject,
    load,
    new_state,
    write_state,
)

__all__ = ["FAULTS", "SimBackend", "inject", "new_state", "read_state", "write_state"]


def read_state(path: Path) -> dict[str, Any]:
    """The file's state; an unreadable or malformed file is a :class:`GpuBackendError`."""
    try:
        return load(path)
    except SimFileError as exc:
        raise GpuBackendError(str(exc)) from exc


_SAMPLE_FIELDS = set(GpuSample.__dataclass_fields__) - {"index", "uuid"}


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

    def corrupt(self) -> frozenset[int]:
        """The simulated GPUs that compute wrong numbers (the ``sdc`` fault): silent in
        their samples, found by the burn-in's recompute check."""
        return frozenset(
            int(g["index"]) for g in self._present(read_state(self.path)) if g.get("corrupt")
        )

    def perf(self) -> dict[str, Any] | None:
        """The speed the burn-in reports for the simulated GPUs (``agentd.burnin``): the
        nominal synthetic step and all-reduce, slowed by the ``slow-gpu`` and
        ``slow-nvlink`` faults."""
        gpus = self._present(read_state(self.path))
        if not gpus:
            return None
        steps = {str(g["index"]): round(SIM_STEP_S * _factor(g, "slow"), 6) for g in gpus}
        gbps = None
        if len(gpus) > 1:
            gbps = round(SIM_ALLREDUCE_GBPS / max(_factor(g, "link_slow") for g in gpus), 3)
        return {"step_s": max(steps.values()), "gpu_step_s": steps, "allreduce_gbps": gbps}

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


def _factor(g: dict[str, Any], key: str) -> float:
    """A simulated GPU's slow-down factor (1.0 where the file has none, or garbage)."""
    try:
        value = float(g.get(key, 1.0))
    except (TypeError, ValueError):
        return 1.0
    return value if 1.0 <= value < 1e6 else 1.0
