"""The checkpoint store against the alternatives, on one state, in one run. Prints JSON.

    python bench/checkpointing.py --size-gib 1 [--saves 5] [--dir /path/on/nvme] [--variants]

* ``memcpy_s``: the state's bytes copied into an already-touched buffer (the
  limit), with torch's default threads; ``memcpy_s_by_threads`` the same copy
  with 1 and 2 torch threads, and split over 2 Python threads.
* ``raw_write_fsync_s``: a buffered write + fsync of the same bytes from
  memory (the disk's speed); ``raw_direct_write_s`` the same with O_DIRECT.
* ``phalanx.stall_s``: how long ``save`` holds the training loop, per save
  (the first included), standalone, RAM slots reserved up front;
  ``stall_over_adjacent_memcpy`` each stall over the faster of two copies
  of the same bytes timed just before and just after that save (the limit as
  the machine was then: on this VM the copy alone moves 1.5-2x between
  seconds);
  ``cold_first_stall_s`` a cold instance whose first save allocates them;
  ``after_restore`` a restart's first two saves: a new instance restores from
  disk (no RAM slot left), trains 8 s, saves (``restore`` reserves the slots
  behind it);
  ``tier_write_s`` how long each tier took to write the shard down, both at
  once, and ``tier_write_alone_s`` each on its own (the folder object store
  shares this machine's one disk with the NVMe tier: a remote store would not);
  ``disk_write_beside_raw_s`` the NVMe tier alone against raw write + fsync
  timed just before it, the fastest of two rounds of each (target
  ``disk_tier_speed_vs_adjacent_raw``: the disk drifts over a run).
* ``agent``: the same through a real agent checkpoint service
  (``agentd.ckpt.CkptService`` behind its rank socket, in a process of its
  own, its RAM tier in ``/dev/shm`` as agentd keeps it, with a real supervisor
  catalog committing what lands): ``stall_s`` per save, ``wait_s`` until
  committed on RAM, NVMe and object store, restores from its RAM slot and,
  as a spare would (no slot file, no disk copy), ``object_into`` from the
  object store by way of a RAM slot the agent stages it in, and the compute
  lost while it writes down.
* ``peer``: the peer tier alone, pushing to a buddy (agentd's peer routes in a
  process of their own on a loopback port): ``write_s``, the CPU of the
  sender's write-down threads and of the buddy, and restores from it.
* ``torch_save_fsync_stall_s``; ``dcp_async_save``: torch's
  ``torch.distributed.checkpoint.async_save`` (single process, no group) as
  it comes (each call makes a new stager: every save stages into newly
  allocated memory) and ``warm``: one ``DefaultStager`` kept across the calls
  (the one it makes, CPU options), whose staging copies are cached by source
  storage, so its later saves copy into memory already touched: its best case.
* ``restore_s``: a verified restore from each tier (page cache dropped for
  disk reads): into newly allocated tensors, and ``*_into`` into the tensors
  of a live state of the same structure (``restore(into=...)``), against
  ``torch.load`` of the ``torch.save`` file.
* ``compute``: a matrix-multiply loop timed alone and during a background
  write-down of the same checkpoint, the seconds of compute it lost per GiB:
  ``disk`` (NVMe tier only, like DLRover, which writes to disk only) and
  ``full`` (NVMe + object store with zstd where it pays: on this fp32 noise,
  which saves 7.6%, the chunks go raw) and ``full_zstd_always`` (every chunk
  through zstd, ``compress_min_saving=0``), and ``all_tiers`` (NVMe, the
  peer tier to the buddy and the object store; the buddy runs on the same
  cores, and its CPU is counted with the writers': in a fleet the buddy is a
  node that trains too); ``writer_cpu_s_per_gib`` is the CPU the write-down
  threads used (robust to other load, which the matmul rates are not: on a
  shared machine read it first). With ``--variants`` the
  disk-only one again with writer threads at nice 19 and at SCHED_IDLE (not
  the full one: a zstd writer at SCHED_IDLE next to a loop that keeps every
  core busy gets ~2% of a core and takes minutes per GiB).
  ``dlrover_lost_s_per_gib`` is DLRover's figure from the issue, measured on
  this kind of machine.
* ``lazy`` (``--lazy-only`` runs just this, ``--skip lazy`` leaves it out; with
  ``--device cuda`` on the GPU, see ``lazy_saves``): a
  training loop over a state of ``--size-gib`` (parameters and SGD's momentum, half
  each; a "forward and backward" of matmuls about 3 copies long; a real optimizer
  step), saving through a blocking ``save`` and a lazy one (``Checkpointer.attach``),
  RAM tier only, ``--saves`` rounds each: ``save_call_s`` (how long the call held the
  loop), ``step_with_save_s`` (the call and the step after it, where the lazy copy
  runs), ``step_without_save_s`` (a step just before), ``step_extra_s`` (the two
  apart), ``best_extra_s`` (the fastest step with a save less the fastest without:
  other load only slows a step), ``fence_wait_s`` (how long a step waited for an
  unfinished copy). Its
  ``targets``: ``lazy_save_call_over_memcpy`` (the issue: <= 0.1),
  ``lazy_step_extra_over_memcpy`` (<= 1.0: the step with a save within a copy's time
  of one without), and ``overlap``, the share of a blocking save's cost to the loop
  that the lazy save hides (two cores share the copy, the seal and the compute here).
* ``targets``: the issue's targets as ratios (stall within 1.5x memcpy, DCP
  at least 3x ours, NVMe at 80% of raw disk, RAM restore within 2x memcpy,
  compute loss under half of DLRover's on a disk-only write-down).

The state is fp32 tensors of 16 MiB to 256 MiB, like a model's parameters and
Adam moments. Timings on a shared machine vary: compare within one run.

Measured at 1 GiB on the 2-core development machine (``memcpy_s`` 0.05-0.09
s; the VM's background load moves every figure by 20-50% between runs, so
compare within one run), ``python bench/checkpointing.py --size-gib 1 --saves 5``, three
runs (2026-11-23):

* stall 0.048-0.123 s: worst over the copies beside it 1.06-1.30x (over the
  run's best copy 1.17-1.99x: that copy moves 0.05-0.09 s between runs);
  through the agent 0.061-0.104 s, worst over the copies beside it 1.20-1.28x.
  (Until 2026-11-23 this bench gave the agent a RAM tier in a folder on ext4,
  not in ``/dev/shm``: every save was written back to disk beside the next,
  and the agent's worst stall read 1.75-2.3x.) ``torch.save`` + fsync
  0.99-2.9 s; DCP as it comes 0.36-0.81 s (3.1-4.8x our worst), warm
  0.07-0.11 s after a first save of 0.38-0.53 s.
* NVMe tier alone 0.62-0.93 s against raw write + fsync 0.72-0.83 s (raw
  O_DIRECT 0.51-0.64 s): 0.78-1.17x raw; beside the folder object store on the
  same disk 0.53-0.74 s. Object tier (folder) 0.71-0.94 s. Peer tier 1.6-1.8 s
  (sender's threads 0.62-0.75 s of CPU, the buddy 1.31-1.48 s, most of it
  aiohttp reading the body).
* RAM restore into a live state 0.114-0.144 s (1.25-1.86x the run's best
  copy; 2.9x in the run whose best copy took 0.049 s); through the agent
  0.17-0.25 s. Object store into a live state 1.19-1.39 s; through the agent
  as a spare restores (no slot file, no disk copy: the agent stages the copy in
  a RAM slot it allocates) 5.6-6.8 s, about 3 s of it the new slot's fresh
  memory (``reserve_s``: 1.6-2.9 s per GiB on this VM), which the rank's
  first save would pay otherwise. Into new tensors 0.36-0.45 s from RAM, and
  ``torch.load`` 1.0-1.5 s: on this VM a process's fresh memory costs up to 2-3
  s/GiB to fault in (memory freed a while ago is given back to the host),
  whatever allocates it; ``restore(into=...)`` allocates nothing.
* compute lost, disk only: 0.30-0.40 s/GiB (writer CPU 0.15-0.17; DLRover
  0.8; 0.07-0.25 on 2026-11-22). NVMe + object store: 0.50-1.29 s/GiB (writer
  CPU 0.47-0.51); through the agent 0.94-1.19 (writer 0.71). Every chunk through
  zstd: 1.8-2.5 (writer 1.8-1.9). All tiers with the peer: 2.8-3.4 (writers and
  buddy 2.6-2.9).

Lazy saves, ``python bench/checkpointing.py --lazy-only --size-gib 0.5 --saves 8
[--compute-threads 1]`` (2026-11-26, the 2-core machine quiet: load average 0.6, a 512
MiB copy 0.05-0.09 s; the GPU's figures follow these):

* the lazy ``save`` call held the loop 0.8 ms median: 0.008-0.017x the run's memcpy
  (target <= 0.1); the blocking call 0.89-1.05x. No optimizer step waited for a copy
  (``fence_wait_s`` empty).
* the training loop with one torch thread (``--compute-threads 1``: the copy and the
  seal get the other core, as they do beside a GPU's compute): a step with a lazy save
  0.013 s slower than one without, 0.14x the memcpy (target <= 1.0), against 0.081 s
  (0.89x) for a blocking save: the lazy save hides 84 % of what a blocking save costs
  the loop.
* with torch's default two threads on the two cores the lazy save hides nothing: a
  step with it 0.117 s slower (2.3x memcpy) against 0.100 s (2.0x) blocking. The copy
  thread takes a core from one of torch's two matmul threads and every matmul waits for
  the slower thread. CPU training that keeps every core busy gains nothing from
  ``attach``; leave a core free or save blocking.

On a GPU, ``python bench/checkpointing.py --lazy-only --device cuda --size-gib 8
--saves 5`` (one NVIDIA H200, torch 2.11 with CUDA 13, 2026-11-28; the forward and
backward 22 matmuls of 8192x8192, 0.48 s; the raw device-to-host copy into pinned memory
0.155 s, 55 GB/s):

* the lazy ``save`` call held the loop 0.84 ms median: 0.006x the copy (target <= 0.1);
  the blocking call 1.01x.
* a step with a lazy save 1.002x a step without one (target <= 1.05; blocking 1.33x):
  0.9 ms more, against 0.157 s for a blocking save, 99.4 % of it hidden. The optimizer's
  pre-hook spent 0.3-0.6 ms (``fence_wait_s``) ordering its kernels after the copy.
* ``after_restart``: a new instance restored the state from disk into the live GPU
  tensors (6.3 s, the disk), trained 8 s and saved: its first save stalled 1.03x the
  copy, its slots pinned behind the restore (before they were, a restart's first save of
  this state stalled 31x).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ckpt import Checkpointer, LocalFolderStore, ObjectTier, Pacing, ShardKey
from ckpt.peer import HttpPeerStore

GIB = 1 << 30
RAM_DIR = "/dev/shm"  # where the RAM tier's slots live, standalone and under an agent


def make_state(size_gib: float, device: str = "cpu") -> dict[str, Any]:
    total = int(size_gib * GIB) // 4
    sizes, left = [], total
    chunk = max(total // 12, 1)
    while left > 0:
        sizes.append(min(chunk, left))
        left -= sizes[-1]
    tensors = {f"p{i}": torch.randn(n, device=device) for i, n in enumerate(sizes)}
    return {"model": tensors, "step": 0, "loader": {"index": 0}}


def sync(device: str) -> None:
    """Wait for the GPU's queued work (nothing on the CPU): a GPU step is timed whole."""
    if device == "cuda":
        torch.cuda.synchronize()


def nbytes_of(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state["model"].values())


def drop_cache(path: Path) -> None:
    for p in [path] if path.is_file() else path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class Memcpy:
    """The state's tensors copied into one touched buffer: the limit a save is held to.

    ``threads`` > 0 splits the tensors over that many Python threads (each copy_
    releases the GIL); 0 copies them in turn with torch's own threads."""

    def __init__(self, state: dict[str, Any], threads: int = 0) -> None:
        self.threads = threads
        tensors = list(state["model"].values())
        # GPU tensors: the raw device-to-host copy, into pinned memory (as a save's is).
        self.cuda = any(t.device.type == "cuda" for t in tensors)
        flat = torch.empty(nbytes_of(state), dtype=torch.uint8, pin_memory=self.cuda)
        flat.zero_()  # touched
        self.jobs, pos = [], 0
        for t in state["model"].values():
            n = t.numel() * 4
            self.jobs.append((flat[pos : pos + n].view(torch.float32), t))
            pos += n

    @staticmethod
    def _copy(part: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for dst, src in part:
            dst.copy_(src)

    def seconds(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for dst, src in self.jobs:
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            return time.perf_counter() - start
        start = time.perf_counter()
        if self.threads <= 1:
            self._copy(self.jobs)
        else:
            workers = [
                threading.Thread(target=self._copy, args=(self.jobs[i :: self.threads],))
                for i in range(self.threads)
            ]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
        return time.perf_counter() - start


def memcpy_limit(state: dict[str, Any], reps: int, threads: int = 0) -> float:
    """The best of ``reps`` copies (see ``Memcpy``)."""
    copy = Memcpy(state, threads)
    return min(copy.seconds() for _ in range(reps))


def adjacent_ratios(stalls: list[float], copies: list[tuple[float, float]]) -> list[float]:
    """Each save's stall over the faster of the copies timed just before and after it:
    the limit as the machine was at that moment (a VM's background load moves the copy
    itself by 1.5-2x between runs seconds apart)."""
    return [stall / min(pair) for stall, pair in zip(stalls, copies, strict=True)]


def memcpy_by_threads(state: dict[str, Any]) -> dict[str, float]:
    default = torch.get_num_threads()
    out: dict[str, float] = {}
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out[f"torch_{n}"] = memcpy_limit(state, 3)
        torch.set_num_threads(1)
        out["python_threads_2_torch_1"] = memcpy_limit(state, 3, threads=2)
    finally:
        torch.set_num_threads(default)
    return out


def write_fsync(path: Path, views: list[memoryview], flags: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o644)
    try:
        for piece in views:
            while piece:
                piece = piece[os.write(fd, piece) :]
        os.fsync(fd)
    finally:
        os.close(fd)


def raw_write(state: dict[str, Any], path: Path, *, direct: bool = False) -> float:
    """A write + fsync of the state's bytes from memory (O_DIRECT from a page-aligned
    copy of them with ``direct``, as the NVMe tier writes from its RAM slot)."""
    source: Any = None
    views = [memoryview(t.numpy()).cast("B") for t in state["model"].values()]
    if direct:
        size = sum(len(v) for v in views)
        source = mmap.mmap(-1, -(-size // 4096) * 4096)
        pos = 0
        for v in views:
            source[pos : pos + len(v)] = v
            pos += len(v)
        views = [memoryview(source)[i : i + (8 << 20)] for i in range(0, len(source), 8 << 20)]
    start = time.perf_counter()
    write_fsync(path, views, os.O_DIRECT if direct else 0)
    seconds = time.perf_counter() - start
    del views
    if source is not None:
        source.close()
    drop_cache(path)
    path.unlink()
    return seconds


def matmul_rate(seconds: float) -> float:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        n += 1
    return n / (time.perf_counter() - start)


def cpu_seconds(stat_paths: list[str]) -> float:
    """utime + stime of threads or processes, from their /proc stat files."""
    ticks = 0
    for path in stat_paths:
        with open(path) as f:
            fields = f.read().rsplit(")", 1)[1].split()
        ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def compute_lost(
    save_and_poll: Callable[[], Callable[[], bool]], nbytes: int, writer_stats: list[str]
) -> dict[str, float]:
    """Run the matmul loop from the end of a save until its write-down is done.

    The alone rate is the best of runs before and after: other load only slows it.
    ``writer_cpu_s`` is the CPU the write-down's threads (or the agent's process) used:
    what it took from the cores, robust to other load on a shared machine."""
    before = [matmul_rate(1.0) for _ in range(3)]
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    cpu_before = cpu_seconds(writer_stats)
    busy = save_and_poll()
    n, start = 0, time.perf_counter()
    while busy():
        torch.mm(a, b)
        n += 1
    elapsed = time.perf_counter() - start
    writer_cpu = cpu_seconds(writer_stats) - cpu_before
    rate = max(before + [matmul_rate(1.0) for _ in range(2)])
    lost_s = max(elapsed - n / rate, 0.0)
    gib = nbytes / GIB
    return {
        "matmul_per_s_alone": rate,
        "matmul_per_s_during": n / elapsed,
        "write_down_s": elapsed,
        "lost_s": lost_s,
        "lost_s_per_gib": lost_s / gib,
        "writer_cpu_s_per_gib": writer_cpu / gib,
    }


def standalone_loss(
    root: Path,
    state: dict[str, Any],
    tiers: list[Any],
    pacing: Pacing,
    nbytes: int,
    namespace: str,
    other_writers: Sequence[str] = (),
) -> dict[str, Any]:
    c = Checkpointer(
        dir=root,
        tiers=tiers,
        object_store=str(root / "objects"),
        keep=1,
        pacing=pacing,
        ram_namespace=f"{namespace}-{root.name}",
    )
    try:
        c.reserve(state)
        c.save(1, state)  # warm: the files and directories exist
        c.wait()

        def save() -> Callable[[], bool]:
            c.save(2, state)
            return lambda: not c.engine.idle()

        stats = [f"/proc/self/task/{t.native_id}/stat" for t in c.engine.threads]
        stats += other_writers  # a buddy's process: its CPU is a node's too
        out: dict[str, Any] = dict(compute_lost(save, nbytes, stats))
        c.wait()
        out["tier_write_s"] = {
            e.tier: e.seconds
            for e in c.events
            if e.kind == "landed" and e.key.step == 2 and e.tier != "ram"
        }
        return out
    finally:
        c.close()
        c.ram.unlink()
        shutil.rmtree(root, ignore_errors=True)


def dcp_stalls(state: dict[str, Any], root: Path, saves: int, warm: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    # What async_save makes for itself on every call, but kept: its staging copies are
    # cached by source storage, so every save after the first copies into the same memory.
    stager = DefaultStager(StagingOptions(False, False, False, False)) if warm else None
    stalls, totals = [], []
    p0 = state["model"]["p0"]
    p0_saved = p0.clone()
    snapshot_ok = None
    for i in range(saves):
        where = root / f"dcp-{'warm' if warm else 'cold'}-{i}"
        start = time.perf_counter()
        future: Any = dcp.async_save(state, checkpoint_id=str(where), async_stager=stager)
        stalls.append(time.perf_counter() - start)
        if i == 0:
            p0.add_(1.0)  # training goes on: does the checkpoint see it?
        future.result()
        totals.append(time.perf_counter() - start)
        if i == 0:
            probe = {"model": {"p0": torch.empty_like(p0)}}
            dcp.load(probe, checkpoint_id=str(where))
            snapshot_ok = torch.equal(probe["model"]["p0"], p0_saved)
            p0.copy_(p0_saved)
            del probe
        shutil.rmtree(where)
    if stager is not None:
        stager.close()
    return {"stall_s": stalls, "until_written_s": totals, "saved_state_as_of_the_call": snapshot_ok}


def touched_like(state: dict[str, Any]) -> dict[str, Any]:
    """A live state of the same structure, its tensors allocated and touched."""
    return {
        "model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
        "step": 0,
        "loader": {"index": 0},
    }


def timed_restore(c: Checkpointer, state: dict[str, Any], into: Any = None) -> float:
    start = time.perf_counter()
    found = c.restore(into=into)
    seconds = time.perf_counter() - start
    assert found is not None and torch.equal(found[1]["model"]["p0"], state["model"]["p0"])
    if into is not None:
        assert found[1]["model"]["p0"] is into["model"]["p0"] and not c.restored_fresh
    return seconds


# --------------------------------------------------------------------------- peer tier


def serve_buddy(root: Path, port: int) -> None:
    """A buddy node's side of the peer tier, in a process of its own: agentd's peer
    routes (the seal check, the O_DIRECT staging) on a loopback port. Stops on SIGTERM."""
    import concurrent.futures
    from types import SimpleNamespace

    from aiohttp import web

    from agentd.access import Access
    from agentd.ckpt import add_peer_routes

    pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="ckpt-peer")
    agent = SimpleNamespace(
        node="buddy",
        ckpt=SimpleNamespace(
            peer_root=root, peer_io=pool, pacing=Pacing(), peer_store=LocalFolderStore(root)
        ),
    )
    app = web.Application()
    add_peer_routes(
        app,
        agent,
        Access("buddy", "-"),
        max_shard_bytes=64 * GIB,
    )
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=True)


class Buddy:
    """``serve_buddy`` in a child process, and peer tiers pushing to it."""

    def __init__(self, root: Path) -> None:
        from phalanx.local import free_port

        self.port = free_port()
        self.child = subprocess.Popen(
            [sys.executable, __file__, "--serve-buddy", str(root), "--buddy-port", str(self.port)]
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.child.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the bench's buddy did not start (exit {self.child.poll()})"
                    ) from None
                time.sleep(0.05)
        self.stat = f"/proc/{self.child.pid}/stat"

    def tier(self, pacing: Pacing) -> ObjectTier:
        """A peer tier as an agent builds one: zstd where it pays, over HTTP."""
        return ObjectTier(
            HttpPeerStore("buddy", "127.0.0.1", self.port, "-"),
            name="peer",
            pacing=pacing,
            level=pacing.compress_level,
        )

    def stop(self) -> None:
        self.child.send_signal(signal.SIGTERM)
        try:
            self.child.wait(60)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()


def tier_alone(
    root: Path, state: dict[str, Any], tier: str, pacing: Pacing, namespace: str
) -> float:
    """How long one save takes to write down to ``tier`` with no other tier writing: the
    folder object store shares this machine's one disk with the NVMe tier, which a
    remote store does not."""
    c = Checkpointer(
        dir=root,
        tiers=[tier],
        object_store=str(root / "objects"),
        keep=1,
        pacing=pacing,
        ram_namespace=f"{namespace}-{root.name}",
    )
    try:
        c.reserve(state)
        c.save(1, state)
        c.wait()
        return next(e.seconds for e in c.events if e.kind == "landed" and e.tier == tier)
    finally:
        c.close()
        c.ram.unlink()
        shutil.rmtree(root, ignore_errors=True)


def disk_beside_raw(
    root: Path, state: dict[str, Any], pacing: Pacing, namespace: str, rounds: int = 2
) -> tuple[float, float]:
    """The NVMe tier's write-down of one save alone, and a raw write + fsync of the same
    bytes timed just before it, ``rounds`` times: the fastest of each. A VM's disk drifts
    by 20-30% over minutes, which the raw writes at the start of the run miss."""
    c = Checkpointer(
        dir=root, tiers=["disk"], keep=1, pacing=pacing, ram_namespace=f"{namespace}-{root.name}"
    )
    try:
        c.reserve(state)
        rounds_s = []
        for step in range(1, rounds + 1):
            raw = raw_write(state, root / "raw.bin")
            c.save(step, state)
            c.wait()
            rounds_s.append(
                (
                    next(
                        e.seconds
                        for e in c.events
                        if e.kind == "landed" and e.tier == "disk" and e.key.step == step
                    ),
                    raw,
                )
            )
        # The fastest of each, in the same minutes: picking the round with the best ratio
        # would favour a round whose raw write hit a slow spell of the disk.
        return min(r[0] for r in rounds_s), min(r[1] for r in rounds_s)
    finally:
        c.close()
        c.ram.unlink()
        shutil.rmtree(root, ignore_errors=True)


def first_save_after_restore(
    root: Path,
    state: dict[str, Any],
    pacing: Pacing,
    namespace: str,
    train_s: float = 8.0,
    train: Callable[[float], object] = matmul_rate,
) -> dict[str, float]:
    """A restart: the state restored from disk by a new instance (no RAM slot left), the
    loop training for ``train_s`` (``train``: matrix multiplies), then its first two
    saves."""
    c = Checkpointer(
        dir=root, tiers=["disk"], keep=1, pacing=pacing, ram_namespace=f"{namespace}-{root.name}"
    )
    c.save(1, state)
    c.wait()
    c.close()  # committed on disk: the RAM slots go
    c = Checkpointer(
        dir=root, tiers=["disk"], keep=1, pacing=pacing, ram_namespace=f"{namespace}-{root.name}"
    )
    try:
        start = time.perf_counter()
        found = c.restore(into=state)
        restore_s = time.perf_counter() - start
        assert found is not None and c.restored_from == "disk"
        train(train_s)
        for step in (2, 3):
            c.save(step, state)
            c.wait()
        return {"restore_s": restore_s, "first_stall_s": c.stalls[0], "second_stall_s": c.stalls[1]}
    finally:
        c.close()
        c.ram.unlink()
        shutil.rmtree(root, ignore_errors=True)


def peer_tier(
    root: Path, state: dict[str, Any], buddy: Buddy, pacing: Pacing, namespace: str
) -> dict[str, Any]:
    """One save written down to the peer tier alone: how long, the sender's and the
    buddy's CPU, and restores from it (into new tensors and into a live state)."""
    c = Checkpointer(
        dir=root,
        tiers=[buddy.tier(pacing)],
        keep=1,
        pacing=pacing,
        ram_namespace=f"{namespace}-{root.name}",
    )
    try:
        c.reserve(state)
        stats = [f"/proc/self/task/{t.native_id}/stat" for t in c.engine.threads]
        mine, theirs = cpu_seconds(stats), cpu_seconds([buddy.stat])
        c.save(1, state)
        c.wait()
        out: dict[str, Any] = {
            "write_s": next(e.seconds for e in c.events if e.kind == "landed" and e.tier == "peer"),
            "sender_cpu_s": cpu_seconds(stats) - mine,
            "buddy_cpu_s": cpu_seconds([buddy.stat]) - theirs,
        }
        into = touched_like(state)
        key = ShardKey("local", 1, 0)
        for name, target in (("restore_s", None), ("restore_into_s", into)):
            start = time.perf_counter()
            got = c._read(c.tiers[0], key, target)
            out[name] = time.perf_counter() - start
            assert got is not None and torch.equal(got[0]["model"]["p0"], state["model"]["p0"])
            del got
        return out
    finally:
        c.close()
        c.ram.unlink()
        shutil.rmtree(root, ignore_errors=True)


# --------------------------------------------------------------------------- agent mode

AGENT_JOB = "bench"


def serve_agent(root: Path, shm: Path, nice: int) -> None:
    """The agent side, in a process of its own: agentd's checkpoint service behind its
    rank socket, and a supervisor catalog that commits what lands and answers with the
    catalog, as MQTT would carry it. Stops on SIGTERM."""

    from agentd.ckpt import CkptService, Standalone, start_rank_socket
    from phalanx import wire
    from supervisor.checkpoints.catalog import CheckpointCatalog
    from supervisor.store import Store

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        catalog = CheckpointCatalog(Store(root / "sup" / "state.db"))
        tasks: set[asyncio.Future[None]] = set()

        def landing(msg: wire.CkptLanding | wire.CkptReleased) -> None:  # from any thread
            if not isinstance(msg, wire.CkptLanding):
                return  # the job never ends here

            def on_loop() -> None:
                if catalog.on_landing(msg, world_size=1):
                    task = asyncio.ensure_future(
                        service.on_catalog(catalog.messages(AGENT_JOB, 1, generation=1)[0])
                    )
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)

            loop.call_soon_threadsafe(on_loop)

        service = CkptService(
            "n01",
            root / "data",
            shm,
            (root / "objects").as_uri(),
            landing,
            pacing=Pacing(nice=nice),
        )
        service.configure(
            AGENT_JOB,
            1,
            wire.CkptPlan(tiers=["ram", "nvme", "object"], keep={"ram": 1, "nvme": 1, "object": 1}),
        )
        async with start_rank_socket(Standalone("n01", service), root / "agent.sock"):
            (root / "ready").touch()
            await stop.wait()
        await service.close()

    asyncio.run(main())


def agent_mode(
    root: Path, state: dict[str, Any], saves: int, nbytes: int, nice: int
) -> dict[str, Any]:
    root.mkdir(parents=True)
    # The agent's RAM tier where agentd keeps it (ckpt.shm_dir, /dev/shm): a tmpfs. Slots
    # in a disk folder would be page cache the kernel writes back under every save.
    shm = Path(tempfile.mkdtemp(prefix="phalanx-bench-agent-", dir=RAM_DIR))
    child = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--serve-agent",
            str(root),
            "--agent-shm",
            str(shm),
            "--agent-nice",
            str(nice),
        ]
    )
    saved_env = {
        k: os.environ.get(k)
        for k in (
            "PHALANX_AGENT_SOCKET",
            "PHALANX_JOB_ID",
            "PHALANX_GENERATION",
            "RANK",
            "WORLD_SIZE",
        )
    }
    c: Checkpointer | None = None
    try:
        deadline = time.monotonic() + 60
        while not (root / "ready").exists():
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the bench's agent did not start (exit {child.poll()})")
            time.sleep(0.05)
        os.environ.update(
            {
                "PHALANX_AGENT_SOCKET": str(root / "agent.sock"),
                "PHALANX_JOB_ID": AGENT_JOB,
                "PHALANX_GENERATION": "1",
                "RANK": "0",
                "WORLD_SIZE": "1",
            }
        )
        c = Checkpointer()
        start = time.perf_counter()
        c.reserve(state)
        reserve_s = time.perf_counter() - start
        waits, copies = [], []
        memcpy = Memcpy(state)
        for step in range(1, saves + 1):
            before = memcpy.seconds()
            c.save(step, state)
            copies.append((before, memcpy.seconds()))
            start = time.perf_counter()
            c.wait(timeout=600)
            waits.append(time.perf_counter() - start)
        del memcpy
        out: dict[str, Any] = {
            "stall_s": list(c.stalls),
            "first_stall_s": c.stalls[0],
            "stall_over_adjacent_memcpy": adjacent_ratios(c.stalls, copies),
            "reserve_s": reserve_s,
            "wait_s": waits,
        }
        into = touched_like(state)
        out["restore_s"] = {
            "ram": timed_restore(c, state),
            "ram_into": timed_restore(c, state, into),
        }
        del into
        agent = c

        def save() -> Callable[[], bool]:
            waiter = threading.Thread(target=agent.wait, kwargs={"timeout": 600})
            agent.save(saves + 1, state)
            waiter.start()
            return waiter.is_alive

        out["compute_full"] = compute_lost(save, nbytes, [f"/proc/{child.pid}/stat"])

        # As a spare restores: no RAM slot file, no disk copy; the agent stages the object
        # store's copy in a RAM slot it allocates (fresh memory), the rank decodes it there.
        for segment in shm.iterdir():
            segment.unlink()
        (root / "data" / "ckpt" / ShardKey(AGENT_JOB, saves + 1, 0).relpath()).unlink()
        drop_cache(root / "objects")
        out["restore_s"]["object_into"] = timed_restore(c, state, touched_like(state))
        out["restored_object_from"] = c.restored_from
        return out
    finally:
        if c is not None:
            c.close()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        shutil.rmtree(shm, ignore_errors=True)


# --------------------------------------------------------------------------- lazy saves


class Training:
    """A training loop over a state of ``size_gib``: parameters (half of it) and SGD's
    momentum (the other half), a matmul "forward and backward" of ``compute_s``, and a real
    optimizer step (which reads and writes every parameter and momentum byte). On
    ``device`` "cuda" all of it is on the GPU, and a step is timed to its end on the GPU."""

    def __init__(self, size_gib: float, device: str = "cpu") -> None:
        self.device = device
        tensors = make_state(size_gib / 2, device)["model"]
        self.params = [torch.nn.Parameter(t) for t in tensors.values()]
        for p in self.params:
            p.grad = torch.full_like(p, 1e-6)
        self.opt = torch.optim.SGD(self.params, lr=1e-3, momentum=0.9)
        self.opt.step()  # the momentum buffers exist from here: the state is size_gib
        side = 8192 if device == "cuda" else 512  # a GPU matmul of ~1 ms would time launches
        self.a = torch.randn(side, side, device=device)
        self.b = torch.randn(side, side, device=device)
        self.mms = 1
        sync(device)

    def calibrate(self, compute_s: float) -> None:
        """Make the forward and backward pass take about ``compute_s``."""
        torch.mm(self.a, self.b)  # the first one loads the GPU's kernels
        sync(self.device)
        start, n = time.perf_counter(), 20
        for _ in range(n):
            torch.mm(self.a, self.b)
        sync(self.device)
        self.mms = max(1, round(compute_s / ((time.perf_counter() - start) / n)))

    def state(self, step: int) -> dict[str, Any]:
        model = {f"p{i}": p.detach() for i, p in enumerate(self.params)}
        return {"model": model, "optimizer": self.opt.state_dict(), "step": step}

    def tensors(self) -> dict[str, Any]:
        """Every tensor of the state, as ``Memcpy`` takes them."""
        momentum = [self.opt.state[p]["momentum_buffer"] for p in self.params]
        return {"model": {f"t{i}": t for i, t in enumerate([*self.params, *momentum])}}

    def step(self) -> None:
        for _ in range(self.mms):  # the forward and backward pass
            torch.mm(self.a, self.b)
        self.opt.step()
        sync(self.device)

    def train(self, seconds: float) -> None:
        """Steps for about ``seconds``."""
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            self.step()


def lazy_saves(
    root: Path, size_gib: float, reps: int, namespace: str, device: str = "cpu"
) -> dict[str, Any]:
    """A blocking save against a lazy one (``Checkpointer.attach``), in one training loop.

    Each round times a step without a save, then a save and the step after it (where a
    lazy save's copy runs, and its optimizer step waits for what is left of it), then
    waits for the write-down untimed. RAM tier only (its seal, xxh3 on one core, runs
    behind either save): the copy is what is measured. The compute is about 3 copies
    long, so that a whole copy could hide behind it. On ``device`` "cuda" the state and
    the compute are on the GPU, the limit (``memcpy_s``) is the raw device-to-host copy
    into pinned memory, and ``after_restart`` is a restart's first saves: a new
    instance restores from disk into the live GPU state, trains 8 s and saves twice."""
    training = Training(size_gib, device)
    out: dict[str, Any] = {"device": device, "memcpy_s": memcpy_limit(training.tensors(), 3)}
    if device == "cuda":
        out["gpu"] = torch.cuda.get_device_name()
    training.calibrate(3 * out["memcpy_s"])
    out["compute_matmuls"] = training.mms
    for mode in ("blocking", "lazy"):
        c = Checkpointer(dir=root / mode, tiers=[], ram_namespace=f"{namespace}-{mode}")
        try:
            if mode == "lazy":
                c.attach(training.opt)
            c.reserve(training.state(0))
            c.save(0, training.state(0))  # warm: the slots and the copier thread exist
            training.step()
            c.wait()
            plain, save, with_save = [], [], []
            for rep in range(1, reps + 1):
                start = time.perf_counter()
                training.step()
                plain.append(time.perf_counter() - start)
                start = time.perf_counter()
                c.save(rep, training.state(rep))
                saved = time.perf_counter()
                training.step()
                save.append(saved - start)
                with_save.append(time.perf_counter() - start)
                c.wait()
            out[mode] = {
                "save_call_s": save,
                "step_with_save_s": with_save,
                "step_without_save_s": plain,
                "step_extra_s": [w - p for w, p in zip(with_save, plain, strict=True)],
                "fence_wait_s": list(c.fence_waits),
            }
        finally:
            c.close()
            c.ram.unlink()
            shutil.rmtree(root / mode, ignore_errors=True)
    # Other load only slows a step: the fastest of the rounds is each one's own cost.
    memcpy, med = out["memcpy_s"], statistics.median
    for mode in ("blocking", "lazy"):
        got = out[mode]
        got["best_extra_s"] = min(got["step_with_save_s"]) - min(got["step_without_save_s"])
    blocking_extra = out["blocking"]["best_extra_s"]
    lazy_extra = out["lazy"]["best_extra_s"]
    out["targets"] = {
        "lazy_save_call_over_memcpy": med(out["lazy"]["save_call_s"]) / memcpy,  # <= 0.1
        "blocking_save_call_over_memcpy": med(out["blocking"]["save_call_s"]) / memcpy,
        # A step with a save, less one without, over the copy: <= 1.0 for the lazy save.
        "lazy_step_extra_over_memcpy": lazy_extra / memcpy,
        "blocking_step_extra_over_memcpy": blocking_extra / memcpy,
        # The share of a blocking save's cost to the loop that the lazy save hides.
        "overlap": 1.0 - lazy_extra / blocking_extra if blocking_extra > 0 else None,
    }
    if device == "cuda":
        # The GPU targets: a step with a lazy save no slower than 1.05x one without.
        for mode in ("blocking", "lazy"):
            got = out[mode]
            out["targets"][f"{mode}_step_with_save_over_without"] = med(
                got["step_with_save_s"]
            ) / med(got["step_without_save_s"])
        out["after_restart"] = first_save_after_restore(
            root / "restart",
            training.state(0),
            Pacing(),
            namespace,
            train=training.train,
        )
        out["targets"]["first_save_after_restart_over_memcpy"] = (
            out["after_restart"]["first_stall_s"] / memcpy
        )
    return out


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=0.25)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where disk files go (default: a temp dir)")
    parser.add_argument(
        "--variants",
        action="store_true",
        help="also measure the compute loss with writers at nice 19 and SCHED_IDLE",
    )
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated sections to leave out: baselines, dcp, peer, agent, compute, lazy",
    )
    parser.add_argument(
        "--lazy-only",
        action="store_true",
        help="only the lazy-save section (blocking against lazy saves in a training loop)",
    )
    parser.add_argument(
        "--compute-threads",
        type=int,
        default=0,
        help="torch threads of the lazy section's training loop (default: torch's own); 1 "
        "leaves the copy a core of its own, as a GPU's compute would",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the lazy section's state and training live (cuda: the GPU, the limit "
        "the raw device-to-host copy); --lazy-only only",
    )
    parser.add_argument(
        "--agent-nice",
        type=int,
        default=0,
        help="niceness of the agent's write-down threads (agentd's "
        "ckpt.write_nice; default 0, as there)",
    )
    parser.add_argument("--serve-agent", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--serve-buddy", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--buddy-port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--agent-shm", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_agent:
        serve_agent(Path(args.serve_agent), Path(args.agent_shm), args.agent_nice)
        return
    if args.serve_buddy:
        serve_buddy(Path(args.serve_buddy), args.buddy_port)
        return
    if args.device == "cuda" and not args.lazy_only:
        parser.error("--device cuda: only with --lazy-only")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this torch sees no GPU")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # still print what was measured
    skip = set(filter(None, args.skip.split(",")))
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    root = Path(tempfile.mkdtemp(prefix="phalanx-bench-", dir=args.dir))
    namespace = f"phalanx-local-{root.name}"  # this run's RAM segments, and no one else's
    # The lazy section makes a state of its own (where --device says).
    state = make_state(0 if args.lazy_only else args.size_gib)
    nbytes = nbytes_of(state)
    pacing = Pacing()
    out: dict[str, Any] = {
        "size_gib": args.size_gib if args.lazy_only else nbytes / GIB,
        "pacing": {f: getattr(pacing, f) for f in pacing.__slots__},
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    buddy: Buddy | None = None
    if args.compute_threads:
        torch.set_num_threads(args.compute_threads)
        out["torch_threads"] = torch.get_num_threads()
    if args.lazy_only:
        del state
        try:
            out["lazy"] = lazy_saves(root, args.size_gib, args.saves, namespace, args.device)
        finally:
            shutil.rmtree(root, ignore_errors=True)
            json.dump(out, sys.stdout, indent=2)
            sys.stdout.write("\n")
        return
    try:
        out["memcpy_s"] = memcpy_limit(state, 3)
        out["memcpy_s_by_threads"] = memcpy_by_threads(state)
        out["raw_write_fsync_s"] = min(raw_write(state, root / "raw.bin") for _ in range(2))
        out["raw_direct_write_s"] = min(
            raw_write(state, root / "raw.bin", direct=True) for _ in range(2)
        )

        # Phalanx, cold: the first save allocates the RAM slots itself.
        cold = Checkpointer(dir=root / "cold", tiers=[], ram_namespace=f"{namespace}-cold")
        start = time.perf_counter()
        cold.save(0, state)
        cold_first = time.perf_counter() - start
        cold.wait()
        cold.close()
        cold.ram.unlink()

        # Phalanx, reserved: the slots are allocated when the state exists.
        c = Checkpointer(
            dir=root / "phx",
            object_store=str(root / "objects"),
            keep=1,
            pacing=pacing,
            ram_namespace=f"{namespace}-phx",
        )
        start = time.perf_counter()
        c.reserve(state)
        reserve_s = time.perf_counter() - start
        memcpy = Memcpy(state)
        copies = []
        for step in range(1, args.saves + 1):
            state["step"] = step
            before = memcpy.seconds()
            c.save(step, state)
            copies.append((before, memcpy.seconds()))
            c.wait()  # one at a time, so each stall and tier time stands alone
        del memcpy
        landed = [e for e in c.events if e.kind == "landed" and e.key.step == args.saves]
        sealed = [e for e in c.events if e.kind == "sealed" and e.key.step == args.saves]
        out["phalanx"] = {
            "stall_s": list(c.stalls),
            "stall_over_adjacent_memcpy": adjacent_ratios(c.stalls, copies),
            "first_stall_s": c.stalls[0],
            "cold_first_stall_s": cold_first,
            "reserve_s": reserve_s,
            "seal_s": sealed[0].seconds,
            "tier_write_s": {e.tier: e.seconds for e in landed if e.tier != "ram"},
            "tier_write_alone_s": {
                tier: tier_alone(root / f"alone-{tier}", state, tier, pacing, namespace)
                for tier in ("disk", "object")
            },
        }
        disk_alone, raw_beside = disk_beside_raw(root / "beside-raw", state, pacing, namespace)
        out["phalanx"]["after_restore"] = first_save_after_restore(
            root / "restart", state, pacing, namespace
        )
        out["phalanx"]["disk_write_beside_raw_s"] = {"disk": disk_alone, "raw": raw_beside}

        # restores, from each tier, into new tensors and into a live state's
        restore: dict[str, float] = {}
        into = touched_like(state)
        key = ShardKey("local", args.saves, 0)
        for tier in [c.ram, *c.tiers]:
            for target in (None, into):
                if tier is not c.ram:
                    drop_cache(root / "phx")
                    drop_cache(root / "objects")
                start = time.perf_counter()
                got = c._read(tier, key, target)
                seconds = time.perf_counter() - start
                assert got is not None and torch.equal(got[0]["model"]["p0"], state["model"]["p0"])
                if target is not None:
                    assert got[0]["model"]["p0"] is into["model"]["p0"] and not c.restored_fresh
                restore[tier.name + ("_into" if target is not None else "")] = seconds
                del got
        del into
        c.close()
        c.ram.unlink()

        if "baselines" not in skip:
            stalls = []
            for i in range(min(args.saves, 3)):
                path = root / f"torch-{i}.pt"
                start = time.perf_counter()
                with open(path, "wb") as f:
                    torch.save(state, f)
                    f.flush()
                    os.fsync(f.fileno())
                stalls.append(time.perf_counter() - start)
                drop_cache(path)
                if i:
                    path.unlink()
            out["torch_save_fsync_stall_s"] = stalls
            start = time.perf_counter()
            loaded = torch.load(root / "torch-0.pt", weights_only=True)
            restore["torch_load"] = time.perf_counter() - start
            del loaded
        out["restore_s"] = restore

        buddy = None if "peer" in skip else Buddy(root / "buddy")
        if buddy is not None:
            out["peer"] = peer_tier(root / "peer", state, buddy, pacing, namespace)
            restore["peer"] = out["peer"]["restore_s"]
            restore["peer_into"] = out["peer"]["restore_into_s"]

        if "dcp" not in skip:
            out["dcp_async_save"] = dcp_stalls(state, root, min(args.saves, 3), warm=False)
            out["dcp_async_save"]["warm"] = dcp_stalls(state, root, min(args.saves, 3), warm=True)

        if "compute" not in skip:
            compute: dict[str, Any] = {"dlrover_lost_s_per_gib": 0.8}
            runs = [
                ("disk", ["disk"], pacing),
                ("full", ["disk", "object"], pacing),
                ("full_zstd_always", ["disk", "object"], Pacing(compress_min_saving=0)),
            ]
            if args.variants:  # disk only: a starved zstd writer takes minutes per GiB
                runs += [
                    ("nice19_disk", ["disk"], Pacing(nice=19)),
                    ("idle_disk", ["disk"], Pacing(idle=True)),
                ]
            for name, tiers, p in runs:
                compute[name] = standalone_loss(
                    root / f"loss-{name}", state, tiers, p, nbytes, namespace
                )
            if buddy is not None:  # every tier: the buddy's CPU counts as the writers'
                compute["all_tiers"] = standalone_loss(
                    root / "loss-all",
                    state,
                    ["disk", buddy.tier(pacing), "object"],
                    pacing,
                    nbytes,
                    namespace,
                    [buddy.stat],
                )
            out["compute"] = compute

        if "agent" not in skip:
            out["agent"] = agent_mode(root / "agent", state, args.saves, nbytes, args.agent_nice)
            out["agent"]["write_nice"] = args.agent_nice

        if "lazy" not in skip:
            out["lazy"] = lazy_saves(root / "lazy", args.size_gib, args.saves, namespace)

        ph = out["phalanx"]
        worst = max(ph["stall_s"])
        targets: dict[str, Any] = {
            "worst_stall_over_memcpy": worst / out["memcpy_s"],
            # The worst of a few saves follows the VM's background load; the median less so.
            "median_stall_over_memcpy": statistics.median(ph["stall_s"]) / out["memcpy_s"],
            "first_stall_over_memcpy": ph["first_stall_s"] / out["memcpy_s"],
            "first_stall_after_restore_over_memcpy": (
                ph["after_restore"]["first_stall_s"] / out["memcpy_s"]
            ),
            "worst_stall_over_adjacent_memcpy": max(ph["stall_over_adjacent_memcpy"]),
            "disk_tier_speed_vs_raw": (out["raw_write_fsync_s"] / ph["tier_write_alone_s"]["disk"]),
            "disk_tier_speed_vs_adjacent_raw": (
                ph["disk_write_beside_raw_s"]["raw"] / ph["disk_write_beside_raw_s"]["disk"]
            ),
            "disk_tier_speed_vs_raw_beside_object": (
                out["raw_write_fsync_s"] / ph["tier_write_s"]["disk"]
            ),
            "ram_restore_over_memcpy": restore["ram"] / out["memcpy_s"],
            "ram_restore_into_over_memcpy": restore["ram_into"] / out["memcpy_s"],
        }
        if "dcp_async_save" in out:
            targets["dcp_stall_over_phalanx_worst"] = min(out["dcp_async_save"]["stall_s"]) / worst
            targets["dcp_warm_stall_over_phalanx_worst"] = (
                min(out["dcp_async_save"]["warm"]["stall_s"]) / worst
            )
        if "compute" in out:
            targets["disk_lost_vs_dlrover"] = out["compute"]["disk"]["lost_s_per_gib"] / 0.8
            targets["full_lost_vs_dlrover"] = out["compute"]["full"]["lost_s_per_gib"] / 0.8
        if "agent" in out:
            targets["agent_worst_stall_over_memcpy"] = (
                max(out["agent"]["stall_s"]) / out["memcpy_s"]
            )
            targets["agent_median_stall_over_memcpy"] = (
                statistics.median(out["agent"]["stall_s"]) / out["memcpy_s"]
            )
            targets["agent_worst_stall_over_adjacent_memcpy"] = max(
                out["agent"]["stall_over_adjacent_memcpy"]
            )
            targets["agent_ram_restore_into_over_memcpy"] = (
                out["agent"]["restore_s"]["ram_into"] / out["memcpy_s"]
            )
        out["targets"] = targets
    except BaseException as exc:
        out["error"] = repr(exc)  # what was measured so far still gets printed
        raise
    finally:
        if buddy is not None:
            buddy.stop()
        shutil.rmtree(root, ignore_errors=True)
        for segment in Path(RAM_DIR).glob(f"{namespace}-*.slot*"):  # if a step failed
            segment.unlink(missing_ok=True)
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")


if __name__ == "__main__":
    main()
