"""Burn-in: the node's short health test before it is trusted with ranks.

Every backend: a fresh health sample, judged by the agent's classifier, must not be
``drain``. On real GPUs (the NVML backend) where torch with CUDA is importable, each
GPU also multiplies two seeded random matrices and the product is checked against
the CPU's; the product is computed ``MATMUL_ROUNDS`` times and must be bit-identical
every time (the deterministic recompute check: a GPU that computes wrong numbers
without an error, silent data corruption, rarely does it the same way twice). The
matmul runs in a child process (``python -m agentd.burnin --gpus 0,1``), so that the
agent never holds a CUDA context, and a wedged GPU costs a timeout, not the agent.

The simulated backend runs the recompute check as a stand-in: a seeded integer matmul
per GPU, whose digest a GPU marked ``corrupt`` in the sim file (the ``sdc`` fault)
gets wrong, as a faulty GPU would, while its health stays clean.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx import wire

log = logging.getLogger(__name__)

MATMUL_SIZE = 1024  # a 1024^3 matmul: under a millisecond on a GPU, ~0.1 s on the CPU
MATMUL_ROUNDS = 3
MATMUL_SEED = 1234
# The synthetic step each GPU is timed on (pre-flight screening): 10 bf16 matmuls of
# 8192², 11 TFLOP (~15 ms on an H100), the best of 3; and an all-reduce of 256 MiB.
PERF_SIZE = 8192
PERF_ROUNDS = 10
PERF_TRIES = 3
ALLREDUCE_MIB = 256
# Largest error allowed, relative to the largest entry of the float64 CPU product: fp32
# accumulation over 1024 terms errs ~1e-6; a flipped exponent or mantissa bit, far more.
MATMUL_TOLERANCE = 1e-4
MATMUL_TIMEOUT_S = 120.0  # the child, torch import and CUDA start included


@dataclass(frozen=True)
class BurnIn:
    """The outcome: ``passed``, else why not; ``checks`` names the tests that ran."""

    passed: bool
    reasons: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    # The node's speed, which the supervisor compares with the fleet's (pre-flight
    # screening): ``step_s``, its slowest GPU's synthetic step; ``gpu_step_s`` by GPU;
    # ``allreduce_gbps``, an all-reduce between its GPUs (None: one GPU, or not measured).
    perf: dict[str, Any] | None = None

    def as_result(self) -> dict[str, Any]:
        out = {"passed": self.passed, "reasons": list(self.reasons), "checks": list(self.checks)}
        if self.perf is not None:
            out["perf"] = self.perf
        return out


def health_failures(health: wire.Health) -> list[str]:
    """The reasons a health sample fails a burn-in: its ``drain`` ones."""
    if health.status is not wire.HealthStatus.DRAIN:
        return []
    return [
        f"{r.code}{f' on GPU {r.gpu}' if r.gpu is not None else ''}: {r.detail}"
        for r in health.reasons
        if r.severity == "drain"
    ]


async def burn_in(
    backend: str,
    health: wire.Health,
    gpus: Sequence[int],
    *,
    timeout_s: float = MATMUL_TIMEOUT_S,
    corrupt: Collection[int] = (),
    sim_perf: dict[str, Any] | None = None,
) -> BurnIn:
    """Judge a node by ``health`` (a sample taken for the burn-in) and, on the ``nvml``
    backend with torch and CUDA at hand, a matmul and recompute check of each of
    ``gpus``, with its speed measured; on the ``sim`` backend, the simulated recompute
    check (``corrupt``: the simulated GPUs that compute wrong) and the simulated GPUs'
    speed (``sim_perf``)."""
    reasons = health_failures(health)
    checks = ["health"]
    perf = None
    if backend == "nvml" and gpus and importlib.util.find_spec("torch") is not None:
        failures = await matmul_check(gpus, timeout_s=timeout_s)
        if failures is not None:
            checks.extend(["matmul", "recompute"])
            reasons.extend(failures)
            if not reasons:
                perf = await speed_check(gpus)
    elif backend == "sim" and gpus:
        checks.append("recompute")
        reasons.extend(await asyncio.to_thread(sim_recompute_check, gpus, frozenset(corrupt)))
        perf = sim_perf
    return BurnIn(passed=not reasons, reasons=reasons, checks=checks, perf=perf)


RECOMPUTE_SIZE = 32  # the simulated check's integer matmul: 32^3 products, ~10 ms
_MOD = (1 << 61) - 1


def recompute_digest(seed: int, *, corrupt: bool = False) -> int:
    """The simulated recompute: a seeded integer matmul modulo a prime, digested. A
    ``corrupt`` GPU flips one bit of one product, as a silently faulty GPU would."""
    n = RECOMPUTE_SIZE
    x = seed
    entries = []
    for _ in range(2 * n * n):
        x = (x * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        entries.append(x >> 33)
    a, b = entries[: n * n], entries[n * n :]
    out = 0
    for i in range(n):
        row = a[i * n : (i + 1) * n]
        for j in range(n):
            cell = sum(row[k] * b[k * n + j] for k in range(n)) % _MOD
            if corrupt and i == j == n // 2:
                cell ^= 1 << 17
            out = (out * 1000003 + cell) % _MOD
    return out


def sim_recompute_check(gpus: Sequence[int], corrupt: frozenset[int]) -> list[str]:
    """Each simulated GPU's recompute against the reference (the CPU's): the failures."""
    expected = recompute_digest(MATMUL_SEED)
    return [
        f"recompute on GPU {index}: its result differs from the CPU's (silent data corruption)"
        for index in gpus
        if any(
            recompute_digest(MATMUL_SEED, corrupt=index in corrupt) != expected
            for _ in range(MATMUL_ROUNDS)
        )
    ]


async def matmul_check(
    gpus: Sequence[int], *, timeout_s: float = MATMUL_TIMEOUT_S, python: str = sys.executable
) -> list[str] | None:
    """Run the matmul check of ``gpus`` (NVML indices) in a child process; the failures,
    or None when the child finds no CUDA."""
    ran = await _child(python, gpus, (), timeout_s)
    if ran is None:
        return [f"matmul check did not finish in {timeout_s:.0f}s (a GPU hangs?)"]
    out, err, code = ran
    try:
        result = json.loads(out.decode().strip().splitlines()[-1])
        if not result["cuda"]:
            return None
        return [str(f) for f in result["failures"]]
    except (ValueError, IndexError, KeyError, TypeError):
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        return [f"matmul check failed (exit {code}): {tail[0][:300]}"]


def _matmul(gpus: Sequence[int]) -> dict[str, Any]:
    """The child's work: each GPU's product of two seeded matrices against the CPU's."""
    import torch

    if not torch.cuda.is_available():
        return {"cuda": False, "failures": []}
    from phalanx.digest import digest

    torch.backends.cuda.matmul.allow_tf32 = False  # the check is about fp32 arithmetic
    g = torch.Generator().manual_seed(MATMUL_SEED)
    a = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=g)
    b = torch.randn(MATMUL_SIZE, MATMUL_SIZE, generator=g)
    expected = a.double() @ b.double()
    scale = float(expected.abs().max())
    failures = []
    for index in gpus:
        try:
            device = torch.device("cuda", index)
            da, db = a.to(device), b.to(device)
            worst = 0.0
            bits = set()  # the digest of each round's product, bit for bit
            for _ in range(MATMUL_ROUNDS):
                product = da @ db
                bits.add(digest([product]))
                got = product.double().cpu()
                worst = max(worst, float((got - expected).abs().max()) / scale)
            if not worst <= MATMUL_TOLERANCE:  # NaN fails too
                failures.append(
                    f"matmul on GPU {index}: error {worst:.2e} relative to the "
                    f"CPU's product > {MATMUL_TOLERANCE:.0e}"
                )
            if len(bits) > 1:
                failures.append(
                    f"recompute on GPU {index}: the same product differed between "
                    f"{MATMUL_ROUNDS} rounds (silent data corruption)"
                )
        except Exception as exc:
            failures.append(f"matmul on GPU {index}: {type(exc).__name__}: {exc}"[:500])
    return {"cuda": True, "failures": failures}


def _speed(gpus: Sequence[int]) -> dict[str, Any] | None:
    """The GPUs' speed, for the supervisor to compare with the fleet's: each GPU's
    synthetic step (``PERF_ROUNDS`` bf16 matmuls of ``PERF_SIZE``², timed to their end
    on the device, the best of ``PERF_TRIES``) and an all-reduce of ``ALLREDUCE_MIB``
    between them (NCCL, in this one process; its bus bandwidth, as nccl-tests counts
    it). None when it cannot be measured: that is no failure."""
    import time

    import torch

    try:
        step_s: dict[str, float] = {}
        for index in gpus:
            device = torch.device("cuda", index)
            a = torch.randn(PERF_SIZE, PERF_SIZE, device=device, dtype=torch.bfloat16)
            b = torch.randn(PERF_SIZE, PERF_SIZE, device=device, dtype=torch.bfloat16)
            best = float("inf")
            for trial in range(PERF_TRIES + 1):  # the first warms the kernels up
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                for _ in range(PERF_ROUNDS):
                    a @ b
                torch.cuda.synchronize(device)
                if trial:
                    best = min(best, time.perf_counter() - t0)
            step_s[str(index)] = round(best, 6)
        gbps = None
        if len(gpus) > 1:
            import torch.cuda.nccl as nccl

            n = ALLREDUCE_MIB * 2**20 // 4
            bufs = [torch.ones(n, device=torch.device("cuda", i)) for i in gpus]
            best = float("inf")
            for trial in range(PERF_TRIES + 1):  # the first builds the communicator
                for i in gpus:
                    torch.cuda.synchronize(i)
                t0 = time.perf_counter()
                nccl.all_reduce(bufs)  # type: ignore[no-untyped-call]
                for i in gpus:
                    torch.cuda.synchronize(i)
                if trial:
                    best = min(best, time.perf_counter() - t0)
            k = len(gpus)
            gbps = round(n * 4 / best / 1e9 * 2 * (k - 1) / k, 3)
        return {"step_s": max(step_s.values()), "gpu_step_s": step_s, "allreduce_gbps": gbps}
    except Exception as exc:  # a measurement that fails is logged, not judged
        print(f"speed not measured: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


SPEED_TIMEOUT_S = 60.0  # the speed child, torch import, CUDA and NCCL start included


async def speed_check(
    gpus: Sequence[int], *, timeout_s: float = SPEED_TIMEOUT_S, python: str = sys.executable
) -> dict[str, Any] | None:
    """The GPUs' speed (:func:`_speed`), measured in a child of its own after the matmul
    check passed: a measurement that hangs (an NCCL start that never ends), crashes or
    says nothing costs its timeout and is None, never a failed burn-in."""
    ran = await _child(python, gpus, ("--speed",), timeout_s)
    if ran is None:
        log.warning("burn-in: the GPUs' speed was not measured in %.0fs", timeout_s)
        return None
    out, err, _ = ran
    try:
        perf = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = err.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        log.warning("burn-in: the GPUs' speed was not measured: %s", tail[0][:300])
        return None
    return perf if isinstance(perf, dict) else None


async def _child(
    python: str, gpus: Sequence[int], extra: Sequence[str], timeout_s: float
) -> tuple[bytes, bytes, int | None] | None:
    """Run ``python -m agentd.burnin --gpus ... EXTRA``: (stdout, stderr, exit status), or
    None when it did not end within ``timeout_s`` (it is killed)."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's indices are then NVML's
    proc = await asyncio.create_subprocess_exec(
        python,
        "-m",
        "agentd.burnin",
        "--gpus",
        ",".join(map(str, gpus)),
        *extra,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return None
    return out, err, proc.returncode


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agentd.burnin")
    ap.add_argument("--gpus", required=True, help="comma-separated GPU indices")
    ap.add_argument("--speed", action="store_true", help="measure the GPUs' speed instead")
    args = ap.parse_args(argv)
    gpus = [int(i) for i in args.gpus.split(",") if i]
    print(json.dumps(_speed(gpus) if args.speed else _matmul(gpus)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
