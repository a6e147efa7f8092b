"""How gently the write-down runs next to the training loop: ``Pacing`` (chunk
sizes, ``O_DIRECT``, niceness, the CPUs it may use, a rate cap), the ``Throttle``
that caps a writer's rate, and ``place_writer_thread``, which every writer thread
of the tiers calls first."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Pacing:
    """How gently the write-down runs next to the training loop.

    The writer thread writes ``chunk_bytes`` at a time. A shard file goes
    with ``O_DIRECT`` where it can (``direct_io``): the device reads the bytes
    straight from the RAM slot by DMA, with no copy into the page cache (on 2
    cores, 1 GiB took 0.07 s of CPU that way against 0.86 s buffered: the
    kernel's copy and page-cache bookkeeping are most of what a disk
    write-down takes from the training loop). Otherwise (a filesystem that
    refuses ``O_DIRECT``, a source not page-aligned, small files) it writes
    through the page cache, flushes every ``sync_bytes`` with ``fdatasync``
    (waiting on the device, not the CPU) and drops what it flushed from the
    cache (``drop_cache``: the RAM tier already holds the bytes; caching them
    twice costs memory and reclaim CPU later). ``max_bytes_per_s`` caps the
    rate (``None``: as fast as the device goes).

    ``compress_level`` is the zstd level of the tiers that compress (the
    object store; negative levels are zstd's fast ones). Level 1 costs about
    2.4 s of CPU per GiB here and saves 8% on fp32 noise; level -3 costs 0.5 s
    and saves nothing on it: a store whose bandwidth is well above the
    compressor's is better served by ``compression=None``.
    ``compress_min_saving``: zstd goes where it pays. Each chunk is compressed
    only when 128 KiB from its middle shrink by at least this fraction at that
    level (the sample costs ~1.5% of compressing the chunk); any other goes as
    a raw zstd frame, one copy. Measured at level 1: fp32 noise saves 7.6%
    (sent raw at the default 0.10), bf16 noise 22% (compressed); a state's
    JSON header and zero padding always compress. 0 compresses everything.

    ``nice`` lowers the writer threads' CPU priority (Linux sets it per
    thread) and ``idle`` puts them in ``SCHED_IDLE`` (they run only on a core
    nothing else wants). Both are off by default. Measured with bench/checkpointing.py
    at 1 GiB on 2 cores, disk tier only (the writer used 0.23 s of CPU either
    way): at nice 0 the matmul loop lost 0.39 s of compute and the write-down
    took 1.2 s; at nice 19 it lost 2.0 s over 14 s, and at ``SCHED_IDLE`` 15 s
    over 136 s. A deprioritized writer that holds the GIL is starved by the
    loop's own threads, which then wait for the GIL (a priority inversion).
    Where the engine runs in a process of its own (the agent, under Phalanx)
    there is no GIL to share, but on cores the loop keeps busy it still only
    trades compute for time: the agent's full write-down (zstd included) took
    6 s at nice 0, 34 s at nice 10 with no compute saved, 262 s at nice 19
    (agentd's ``ckpt.write_nice``).

    ``cpus`` keeps the writer threads on those CPUs (empty: wherever the
    scheduler puts them): the way to take the write-down off the training
    cores where a node has cores the ranks do not use (agentd's
    ``ckpt.write_cpus``, which also keeps the ranks off them). A CPU this
    process may not use is refused here.
    """

    chunk_bytes: int = 8 << 20
    sync_bytes: int = 64 << 20
    nice: int = 0
    max_bytes_per_s: float | None = None
    drop_cache: bool = True
    direct_io: bool = True
    idle: bool = False
    compress_level: int = 1
    compress_min_saving: float = 0.10
    cpus: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.cpus:
            usable = os.sched_getaffinity(0)
            if not set(self.cpus) <= usable:
                raise ValueError(
                    f"Pacing.cpus {sorted(self.cpus)}: CPU(s) "
                    f"{sorted(set(self.cpus) - usable)} are not among those this "
                    f"process may use ({_cpu_list(usable)})"
                )
        if self.chunk_bytes <= 0 or self.sync_bytes < self.chunk_bytes:
            raise ValueError("Pacing needs chunk_bytes > 0 and sync_bytes >= chunk_bytes")
        if not 0 <= self.nice <= 19:
            raise ValueError(f"Pacing.nice is {self.nice}; it must be in [0, 19]")
        if not -7 <= self.compress_level <= 22:
            raise ValueError(f"Pacing.compress_level is {self.compress_level}; zstd takes -7..22")
        if not 0 <= self.compress_min_saving < 1:
            raise ValueError(
                f"Pacing.compress_min_saving is {self.compress_min_saving}; it must be in [0, 1)"
            )


class Throttle:
    """Sleeps just enough to hold a byte rate (no-op without a cap)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.start = time.monotonic()
        self.done = 0

    def __call__(self, nbytes: int) -> None:
        if self.rate is None:
            return
        self.done += nbytes
        ahead = self.done / self.rate - (time.monotonic() - self.start)
        if ahead > 0:
            time.sleep(ahead)


def lower_thread_priority(nice: int, idle: bool = False) -> None:
    """Make the calling thread nicer, and with ``idle`` put it in ``SCHED_IDLE``
    (Linux: a thread id is a PRIO_PROCESS target, and pid 0 of
    ``sched_setscheduler`` is the calling thread)."""
    if nice > 0 and hasattr(os, "setpriority"):
        try:
            tid = threading.get_native_id()
            current = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, max(current, nice))
        except OSError as exc:  # a sandbox may refuse; pacing still works without it
            log.debug("could not renice the writer thread: %s", exc)
    if idle and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:
            log.debug("could not make the writer thread SCHED_IDLE: %s", exc)


def place_writer_thread(pacing: Pacing) -> None:
    """Apply ``pacing``'s niceness, ``SCHED_IDLE`` and CPUs to the calling thread (Linux:
    pid 0 of ``sched_setaffinity`` is the calling thread). Not fatal where refused."""
    lower_thread_priority(pacing.nice, pacing.idle)
    if pacing.cpus:
        try:
            os.sched_setaffinity(0, pacing.cpus)
        except OSError as exc:
            log.warning(
                "could not keep the writer thread on CPUs %s: %s", _cpu_list(pacing.cpus), exc
            )


def _cpu_list(cpus: Iterable[int]) -> str:
    return ",".join(str(c) for c in sorted(cpus))
