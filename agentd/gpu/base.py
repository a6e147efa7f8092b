"""What a GPU backend reports, whatever reads it (NVML or the simulator).

A backend turns the hardware (or its simulation) into plain samples; it does
not judge them. Judging is `agentd.health`'s job, so the same thresholds apply
to a real H100 and to the simulated fleet in the tests.

A field is ``None`` when the device or driver cannot report it (an older GPU
without row remapping, a driver without ECC support): "unknown" must never be
read as "healthy zero".
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Protocol


class Throttle(enum.StrEnum):
    """Clock throttle / event reasons that matter for health (NVML's names, shortened)."""

    HW_SLOWDOWN = "hw_slowdown"
    HW_THERMAL = "hw_thermal"
    HW_POWER_BRAKE = "hw_power_brake"
    SW_THERMAL = "sw_thermal"
    SW_POWER_CAP = "sw_power_cap"


class RecoveryAction(enum.StrEnum):
    """NVML's GPU recovery action (driver 550+); anything but NONE needs an operator."""

    NONE = "none"
    GPU_RESET = "gpu_reset"
    NODE_REBOOT = "node_reboot"
    DRAIN_P2P = "drain_p2p"
    DRAIN_AND_RESET = "drain_and_reset"
    RECOVER_IMEX_DOMAIN = "recover_imex_domain"
    BUS_RESET = "bus_reset"
    SYSTEM_REBOOT = "system_reboot"


@dataclass(frozen=True)
class GpuInfo:
    """The identity of one GPU, as announced in the node's birth."""

    index: int
    uuid: str
    model: str
    memory_bytes: int


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU. Counters are cumulative as NVML reports them."""

    index: int
    uuid: str
    # ECC error counts: volatile (since the last driver reload) and aggregate (lifetime).
    ecc_sbe_volatile: int | None = None
    ecc_dbe_volatile: int | None = None
    ecc_sbe_aggregate: int | None = None
    ecc_dbe_aggregate: int | None = None
    # Page retirement (pre-Ampere).
    retired_pages: int | None = None
    retired_pending: bool | None = None
    # Row remapping (Ampere and later).
    remap_pending: bool | None = None
    remap_failed: bool | None = None
    # Thermal: the GPU's own thresholds, not a guess.
    temperature_c: float | None = None
    temp_slowdown_c: float | None = None
    temp_shutdown_c: float | None = None
    throttle: frozenset[Throttle] = frozenset()
    power_w: float | None = None
    power_limit_w: float | None = None
    util_pct: float | None = None
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    recovery_action: RecoveryAction | None = None
    # NVLink link ids that were up at start and are down now.
    nvlink_down: tuple[int, ...] = ()
    # NVML calls for this GPU that failed, as "call: error" strings.
    errors: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeSample:
    """One reading of every GPU on a node, plus the XID events seen since the last one."""

    gpus: tuple[GpuSample, ...]
    # (gpu index, xid code) for every XID event delivered since the previous sample.
    xids: tuple[tuple[int, int], ...] = ()
    # Failures that are not tied to one GPU (device count failed, event set broken, ...).
    errors: tuple[str, ...] = field(default=())


class GpuBackend(Protocol):
    """A source of GPU samples. Calls block (NVML does); the agent runs them in a thread."""

    name: str

    def inventory(self) -> list[GpuInfo]:
        """The GPUs visible now, ordered by index."""
        ...

    def sample(self) -> NodeSample:
        """Read every GPU once and drain pending XID events."""
        ...

    def close(self) -> None:
        """Release the backend (NVML shutdown); idempotent."""
        ...


class GpuBackendError(RuntimeError):
    """The backend could not be started (NVML missing, the sim file unreadable, ...)."""
