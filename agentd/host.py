"""Host health from psutil: the data disk, memory and load; the interface of an address."""

from __future__ import annotations

import ipaddress
import os
import socket
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


def interface_of(address: str) -> str | None:
    """The network interface that holds ``address`` (an IPv4 or IPv6 literal), or None:
    not an address of this host, not a literal, or a loopback address."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    if wanted.is_loopback:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(a.address.split("%", 1)[0]) == wanted:
                    return name
            except ValueError:
                continue
    return None
