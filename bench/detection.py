"""Fault detection latency and agentd's idle cost, on a real local fleet. Prints JSON.

    python bench/detection.py [--reps 5] [--idle-seconds 30]

* ``ecc``: a double-bit ECC error written into a node's simulated GPU → the
  supervisor shows the node ``drain``.
* ``kill9``: an agent killed with SIGKILL → ``offline`` (the broker's last will).
* ``hung``: an agent frozen with SIGSTOP (no TCP close, so no will until the
  broker's keepalive runs out) → ``offline`` by the supervisor's heartbeat timeout.
* ``idle``: CPU share and RSS of an agent with production settings (8 sim GPUs,
  5 s heartbeats, 2 s samples), measured over ``--idle-seconds``.

Latencies are measured from the injecting action to the first API answer
showing the new state (the API is polled every 10 ms). The comparison is the
configured bound: two heartbeats for ECC, ``offline_after_s`` for a hang.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from phalanx import local
from phalanx.client import ApiError
from phalanx.simgpu import inject


def wait_state(fleet: local.Fleet, node: str, state: str, timeout: float = 30.0) -> float:
    client = fleet.client()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if client.get(f"/v1/nodes/{node}")["state"] == state:
                return time.monotonic()
        except ApiError:
            pass
        time.sleep(0.01)
    raise RuntimeError(f"{node} not {state} within {timeout}s")


def agent_proc(fleet: local.Fleet, node: str) -> local.Proc:
    return next(p for p in fleet.processes if p.node == node)


def restart_agent(fleet: local.Fleet, node: str, state: str = "up") -> None:
    old = agent_proc(fleet, node)
    conf = fleet.path / "nodes" / node / "agentd.toml"
    proc = local._spawn(
        [sys.executable, "-m", "agentd", "--config", str(conf)], Path(old.log), "agent", node
    )
    fleet.processes[fleet.processes.index(old)] = proc
    fleet.save()
    wait_state(fleet, node, state)


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median_s": round(statistics.median(values), 4),
        "min_s": round(min(values), 4),
        "max_s": round(max(values), 4),
        "n": len(values),
    }


def measure_idle(directory: Path, broker_port: int, seconds: float) -> dict[str, Any]:
    node_dir = directory / "idle-node"
    node_dir.mkdir(parents=True, exist_ok=True)
    conf = node_dir / "agentd.toml"
    conf.write_text(
        f'node_id = "idle01"\naddress = "127.0.0.1"\ndata_dir = "{node_dir / "data"}"\n'
        f"heartbeat_interval_s = 5.0\n[mqtt]\nport = {broker_port}\n"
        '[gpu]\nbackend = "sim"\nsim_gpus = 8\nsample_interval_s = 2.0\n'
        '[http]\nhost = "127.0.0.1"\nport = 0\n'
    )
    with (node_dir / "agent.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentd", "--config", str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        time.sleep(3.0)  # start-up (imports, first sample, birth) is not idle
        p = psutil.Process(proc.pid)
        t0, c0 = time.monotonic(), p.cpu_times()
        time.sleep(seconds)
        t1, c1 = time.monotonic(), p.cpu_times()
        busy = (c1.user - c0.user) + (c1.system - c0.system)
        return {
            "cpu_percent_of_one_core": round(100 * busy / (t1 - t0), 3),
            "rss_mib": round(p.memory_info().rss / 2**20, 1),
            "uss_mib": round(p.memory_full_info().uss / 2**20, 1),
            "seconds": seconds,
            "settings": {"gpus": 8, "heartbeat_s": 5.0, "sample_s": 2.0},
        }
    finally:
        proc.terminate()
        proc.wait(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--idle-seconds", type=float, default=30.0)
    args = ap.parse_args()
    heartbeat_s, offline_after_s = 1.0, 4.0
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as tmp:
        directory = Path(tmp)
        fleet = local.up(
            directory / "fleet",
            nodes=2,
            gpus_per_node=4,
            heartbeat_s=heartbeat_s,
            offline_after_s=offline_after_s,
        )
        try:
            ecc, kill9, hung = [], [], []
            for _ in range(args.reps):
                start = time.monotonic()
                inject(fleet.sim_file("n01"), 0, "ecc-dbe")
                ecc.append(wait_state(fleet, "n01", "drain") - start)
                # A fresh agent forgets the held XID 48 that came with the ECC error.
                inject(fleet.sim_file("n01"), 0, "clear")
                os.kill(agent_proc(fleet, "n01").pid, signal.SIGTERM)
                wait_state(fleet, "n01", "offline")
                restart_agent(fleet, "n01", state="drain")
                fleet.client().post("/v1/nodes/n01/undrain")
                wait_state(fleet, "n01", "up")

                pid = agent_proc(fleet, "n02").pid
                start = time.monotonic()
                os.kill(pid, signal.SIGKILL)
                kill9.append(wait_state(fleet, "n02", "offline") - start)
                restart_agent(fleet, "n02")

                pid = agent_proc(fleet, "n02").pid
                start = time.monotonic()
                os.kill(pid, signal.SIGSTOP)
                hung.append(wait_state(fleet, "n02", "offline") - start)
                os.kill(pid, signal.SIGCONT)
                wait_state(fleet, "n02", "up")
            idle = measure_idle(directory, fleet.broker_port, args.idle_seconds)
        finally:
            local.down(directory / "fleet")
    print(
        json.dumps(
            {
                "bench": "detection",
                "settings": {
                    "heartbeat_s": heartbeat_s,
                    "sample_interval_s": 0.5,
                    "offline_after_s": offline_after_s,
                    "mqtt_keepalive_s": 5,
                },
                "ecc_dbe_to_drain": {**summary(ecc), "bound_two_heartbeats_s": 2 * heartbeat_s},
                "sigkill_to_offline": summary(kill9),
                "hung_agent_to_offline": {
                    **summary(hung),
                    "bound_offline_after_s": offline_after_s,
                },
                "agent_idle": idle,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
