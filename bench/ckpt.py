"""The checkpoint store against the alternatives, on one state, in one run. Prints JSON.

    python bench/ckpt.py --size-gib 1 [--saves 5] [--dir /path/on/nvme]

* ``stall_s``: how long ``save`` holds the training loop, per save (the first
  included): Phalanx (RAM slots reserved up front; and a cold instance whose
  first save allocates them), ``torch.save`` + fsync, and
  ``torch.distributed.checkpoint.async_save`` (single process, no group).
* ``memcpy_s``: the same bytes copied into an already-touched buffer (the limit).
* ``tier_write_s``: how long each tier took to write the shard down, against a
  raw write + fsync of the same bytes from memory.
* ``restore_s``: a verified restore from each tier, against ``torch.load`` of
  the ``torch.save`` file (page cache dropped for both disk reads).
* ``compute``: a matrix-multiply loop timed alone and during a background
  write-down of the same checkpoint: the seconds of compute it lost, per GiB.

The state is fp32 tensors of 16 MiB to 256 MiB, like a model's parameters and
Adam moments. Timings on a shared machine vary: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

# This file is named like the package it measures: keep bench/ off the import path.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]
sys.path.insert(0, str(_HERE.parent))

from ckpt import Checkpointer, Pacing, ShardKey  # noqa: E402

GIB = 1 << 30


def make_state(size_gib: float) -> dict[str, Any]:
    total = int(size_gib * GIB) // 4
    sizes, left = [], total
    chunk = max(total // 12, 1)
    while left > 0:
        sizes.append(min(chunk, left))
        left -= sizes[-1]
    tensors = {f"p{i}": torch.randn(n) for i, n in enumerate(sizes)}
    return {"model": tensors, "step": 0, "loader": {"index": 0}}


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


def memcpy_limit(state: dict[str, Any], reps: int) -> float:
    flat = torch.empty(nbytes_of(state), dtype=torch.uint8)
    flat.zero_()  # touched
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        pos = 0
        for t in state["model"].values():
            n = t.numel() * 4
            flat[pos : pos + n].view(torch.float32).copy_(t)
            pos += n
        best = min(best, time.perf_counter() - start)
    return best


def raw_write_fsync(state: dict[str, Any], path: Path) -> float:
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in state["model"].values():
            view = memoryview(t.numpy()).cast("B")
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - start
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


def matmuls_during_write_down(
    c: Checkpointer, state: dict[str, Any], step: int
) -> tuple[int, float]:
    """Run the matmul loop from the end of a save until its write-down is done."""
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    c.save(step, state)
    n, start = 0, time.perf_counter()
    while not c.engine.idle():
        torch.mm(a, b)
        n += 1
    return n, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gib", type=float, default=0.25)
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where disk files go (default: a temp dir)")
    parser.add_argument("--nice", type=int, default=Pacing().nice, help="writer threads' nice")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    started = time.time() - 1
    root = Path(tempfile.mkdtemp(prefix="phalanx-bench-", dir=args.dir))
    state = make_state(args.size_gib)
    nbytes = nbytes_of(state)
    out: dict[str, Any] = {
        "size_gib": nbytes / GIB, "writer_nice": args.nice,
        "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
    }  # fmt: skip
    try:
        out["memcpy_s"] = memcpy_limit(state, 3)
        out["raw_write_fsync_s"] = min(raw_write_fsync(state, root / "raw.bin") for _ in range(2))

        # Phalanx, cold: the first save allocates the RAM slots itself.
        cold = Checkpointer(dir=root / "cold", tiers=[])
        start = time.perf_counter()
        cold.save(0, state)
        cold_first = time.perf_counter() - start
        cold.wait()
        cold.close()
        cold.ram.unlink()

        # Phalanx, reserved: the slots are allocated when the state exists.
        c = Checkpointer(dir=root / "phx", object_store=str(root / "objects"), keep=1,
                         pacing=Pacing(nice=args.nice))  # fmt: skip
        start = time.perf_counter()
        c.reserve(state)
        reserve_s = time.perf_counter() - start
        for step in range(1, args.saves + 1):
            state["step"] = step
            c.save(step, state)
            c.wait()  # one at a time, so each stall and tier time stands alone
        landed = [e for e in c.events if e.kind == "landed" and e.key.step == args.saves]
        sealed = [e for e in c.events if e.kind == "sealed" and e.key.step == args.saves]
        out["phalanx"] = {
            "stall_s": list(c.stalls),
            "first_stall_s": c.stalls[0],
            "cold_first_stall_s": cold_first,
            "reserve_s": reserve_s,
            "seal_s": sealed[0].seconds,
            "tier_write_s": {e.tier: e.seconds for e in landed if e.tier != "ram"},
        }

        # torch.save + fsync
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

        # torch.distributed.checkpoint.async_save, single process
        import torch.distributed.checkpoint as dcp

        stalls, totals = [], []
        p0 = state["model"]["p0"]
        p0_saved = p0.clone()
        for i in range(min(args.saves, 3)):
            start = time.perf_counter()
            future = dcp.async_save(state, checkpoint_id=str(root / f"dcp-{i}"))
            stalls.append(time.perf_counter() - start)
            if i == 0:
                p0.add_(1.0)  # training goes on: does the checkpoint see it?
            future.result()
            totals.append(time.perf_counter() - start)
            if i == 0:
                probe = {"model": {"p0": torch.empty_like(p0)}}
                dcp.load(probe, checkpoint_id=str(root / "dcp-0"))
                snapshot_ok = torch.equal(probe["model"]["p0"], p0_saved)
                p0.copy_(p0_saved)
                del probe
            shutil.rmtree(root / f"dcp-{i}")
        out["dcp_async_save"] = {"stall_s": stalls, "until_written_s": totals,
                                 "saved_state_as_of_the_call": snapshot_ok}  # fmt: skip

        # restores
        key = ShardKey("local", args.saves, 0)
        restore: dict[str, float] = {}
        for tier in [c.ram, *c.tiers]:
            if tier is not c.ram:
                drop_cache(root / "phx")
            start = time.perf_counter()
            got = c._read(tier, key)
            restore[tier.name] = time.perf_counter() - start
            assert got is not None and torch.equal(got[0]["model"]["p0"], state["model"]["p0"])
            del got
        start = time.perf_counter()
        loaded = torch.load(root / "torch-0.pt", weights_only=True)
        restore["torch_load"] = time.perf_counter() - start
        del loaded
        out["restore_s"] = restore

        # compute lost during a write-down
        # the alone rate is the best of runs before and after: other load only slows it
        before = [matmul_rate(1.0) for _ in range(3)]
        n, elapsed = matmuls_during_write_down(c, state, args.saves + 1)
        rate = max(before + [matmul_rate(1.0) for _ in range(2)])
        lost_s = max(elapsed - n / rate, 0.0)
        out["compute"] = {
            "matmul_per_s_alone": rate, "matmul_per_s_during": n / elapsed,
            "write_down_s": elapsed, "lost_s": lost_s, "lost_s_per_gib": lost_s / (nbytes / GIB),
            "dlrover_lost_s_per_gib": 0.8,
        }  # fmt: skip
        c.wait()
        c.close()
        c.ram.unlink()

        ph = out["phalanx"]
        worst = max(ph["stall_s"])
        out["targets"] = {
            "worst_stall_over_memcpy": worst / out["memcpy_s"],
            "first_stall_over_memcpy": ph["first_stall_s"] / out["memcpy_s"],
            "dcp_stall_over_phalanx_worst": min(out["dcp_async_save"]["stall_s"]) / worst,
            "disk_tier_speed_vs_raw": out["raw_write_fsync_s"] / ph["tier_write_s"]["disk"],
            "ram_restore_over_memcpy": restore["ram"] / out["memcpy_s"],
            "lost_vs_dlrover": out["compute"]["lost_s_per_gib"] / 0.8,
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)
        for segment in Path("/dev/shm").glob("phalanx-local-*"):  # ours, if a step failed
            if segment.stat().st_mtime >= started:
                segment.unlink(missing_ok=True)
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
