"""GPU health backends: real NVML, or the simulated fleet used by tests and demos."""

from __future__ import annotations

import logging

from agentd.config import AgentSettings
from agentd.gpu.base import (
    GpuBackend,
    GpuBackendError,
    GpuInfo,
    GpuSample,
    NodeSample,
    RecoveryAction,
    Throttle,
)
from agentd.gpu.sim import SimBackend

log = logging.getLogger(__name__)

__all__ = [
    "GpuBackend",
    "GpuBackendError",
    "GpuInfo",
    "GpuSample",
    "NodeSample",
    "RecoveryAction",
    "SimBackend",
    "Throttle",
    "open_backend",
]

SIM_HINT = (
    "on a machine without NVIDIA GPUs, choose the simulated backend: set "
    '`[gpu] backend = "sim"` in agentd.toml, PHALANX_AGENTD_GPU__BACKEND=sim, '
    "or pass --gpu.backend sim"
)


def open_backend(settings: AgentSettings) -> GpuBackend:
    """The backend the settings ask for; `auto` means NVML, and says how to pick sim."""
    choice = settings.gpu.backend
    if choice == "sim":
        return SimBackend(
            settings.sim_path(),
            node_id=settings.node_id,
            gpus=settings.gpu.sim_gpus,
            model=settings.gpu.sim_model,
        )
    from agentd.gpu.nvml import NvmlBackend

    try:
        return NvmlBackend.open()
    except GpuBackendError as exc:
        if choice == "auto":
            raise GpuBackendError(
                f"gpu.backend=auto found no usable NVML ({exc}); {SIM_HINT}"
            ) from exc
        raise
