"""What ``phalanx.rank.step`` costs the training loop, in ns per call. Prints JSON.

    python bench/rank_step.py [--calls 200000] [--paced-hz 1000]

Each case calls ``step(i, loss=..., tokens=..., lr=...)`` in a tight loop and subtracts
a bare loop of the same length:

* ``no_env``: no ``PHALANX_PROGRESS_SOCKET`` (a rank run by hand): the no-op.
* ``no_agent``: the variable names a socket nobody binds (every report dropped).
* ``agent``: the agent's real ``ProgressMonitor`` listening, in a child process of its
  own. A tight loop outruns any receiver; ``drops`` says how many reports the full
  queue refused (the loop never waits for it).
* ``agent_paced``: the same, one call every 1/``--paced-hz`` s (a fast training loop):
  the cost of a report the agent does take, and whether any is dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from phalanx.rank import RankChannel

JOB = "bench-1"

SERVE = r"""
import asyncio, sys
from pathlib import Path
from agentd.progress import ProgressMonitor

async def main() -> None:
    async def report(event): pass
    monitor = ProgressMonitor("bench", Path(sys.argv[1]), Path(sys.argv[2]), report,
                              lambda job, gen: {})
    monitor.begin("bench-1", 1)
    async with monitor:
        print("ready", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        print(monitor.received, monitor.garbage, flush=True)

asyncio.run(main())
"""


def bare(calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        pass
    return (time.perf_counter_ns() - start) / calls


def timed(channel: RankChannel, calls: int) -> float:
    step = channel.step
    start = time.perf_counter_ns()
    for i in range(calls):
        step(i, loss=2.5, tokens=4096.0, lr=3e-4)
    return (time.perf_counter_ns() - start) / calls


def paced(channel: RankChannel, calls: int, hz: float) -> float:
    """Mean ns of the calls alone, one every 1/hz s."""
    period, spent = 1.0 / hz, 0
    next_at = time.perf_counter()
    for i in range(calls):
        while time.perf_counter() < next_at:
            pass
        start = time.perf_counter_ns()
        channel.step(i, loss=2.5, tokens=4096.0, lr=3e-4)
        spent += time.perf_counter_ns() - start
        next_at += period
    return spent / calls


def case(channel: RankChannel, ns: float, floor: float) -> dict[str, Any]:
    return {"ns_per_call": round(ns - floor, 1), "sent": channel.sent, "drops": channel.drops}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=200_000)
    ap.add_argument("--paced-hz", type=float, default=1000.0)
    ap.add_argument("--paced-calls", type=int, default=5000)
    args = ap.parse_args()
    floor = min(bare(args.calls) for _ in range(3))
    results: dict[str, Any] = {"calls": args.calls, "bare_loop_ns": round(floor, 1)}

    results["no_env"] = case(off := RankChannel(None), timed(off, args.calls), floor)
    with tempfile.TemporaryDirectory(prefix="rank-step-") as tmp:
        path = Path(tmp) / "agent.progress"
        nobody = RankChannel(path, job=JOB, generation=1, rank=0)
        results["no_agent"] = case(nobody, timed(nobody, args.calls), floor)
        nobody.close()

        agent = subprocess.Popen(
            [sys.executable, "-c", SERVE, str(path), tmp],
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONWARNINGS": "ignore"},
        )
        assert agent.stdout is not None and agent.stdin is not None
        try:
            if agent.stdout.readline().strip() != "ready":
                raise RuntimeError("the progress monitor did not start")
            tight = RankChannel(path, job=JOB, generation=1, rank=0)
            results["agent"] = case(tight, timed(tight, args.calls), floor)
            tight.close()
            slow = RankChannel(path, job=JOB, generation=1, rank=1)
            results["agent_paced"] = {
                "hz": args.paced_hz,
                **case(slow, paced(slow, args.paced_calls, args.paced_hz), 0.0),
            }
            slow.close()
            time.sleep(0.2)
            received, garbage = agent.communicate("", timeout=30)[0].split()
            results["agent_received"] = int(received)
            results["agent_garbage"] = int(garbage)
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
