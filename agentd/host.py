"""Host health from psutil: the data disk, memory and load."""

from __future__ import annotations

import os
from pathlib import Path

import psutil

from phalanx.wire import HostGauges


def sample_host(data_dir: Path) -> HostGauges:
    disk = psutil.disk_usage(str(_existing(data_dir)))
    mem = psutil.virtual_memory()
    load1 = os.getloadavg()[0]
    return HostGauges(
        disk_free_bytes=disk.free,
        disk_total_bytes=disk.total,
        mem_available_bytes=mem.available,
        mem_total_bytes=mem.total,
        load1=load1,
        cpu_count=psutil.cpu_count() or 1,
    )


def _existing(path: Path) -> Path:
    """The nearest existing ancestor, so a not-yet-created data dir still has a disk."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
