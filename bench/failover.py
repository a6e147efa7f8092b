"""A supervisor's death with a standby beside it, against one restarted in place. Prints JSON.

    python bench/failover.py [--trials 5] [--baseline 3]

It starts its own PostgreSQL (``initdb`` in a temporary folder, as the tests do), a real
Mosquitto, two supervisors on that store (``ha`` defaults: lease 4 s, poll 1 s), two
agents and a tinylm job on gloo (2 nodes x 2 ranks, a checkpoint every 10 steps). Then:

* ``takeover``: ``--trials`` times, the supervisor that leads is killed (SIGKILL, its
  process group) and the time is taken from the kill to the first command of the new
  leader acknowledged by a node: ``POST /v1/nodes/n01/ping`` through a client that
  knows both URLs (``PHALANX_API`` as an operator would set it), polled every 50 ms.
  The dead one is started again, as a standby, before the next trial.
* ``restart_in_place`` (what a user without a standby has, at best): the standby is
  stopped, the leader killed and started again at once (systemd waits ``RestartSec``,
  5 s, first; not counted here), timed the same way; ``--baseline`` times. A host that
  died does not come back this way at all.

``steps_lost``: the steps the job lost to all of it (the lost steps of its incidents; 0
when it never restarted), and ``job_restarts``. The job keeps running throughout.
Target (issue 26): ``takeover_p95_s`` <= 5 s, ``steps_lost`` 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from phalanx.client import ApiError, Client
from phalanx.local import free_port
from tests.harness import TOKEN, Broker, Fleet, Process, leader_of, wait_for
from tests.pg import PgCluster
from tests.tinylm import REPO, tinylm


def leads(url: str) -> bool:
    return bool((leader_of(url) or {}).get("leading"))


def stands_by(url: str) -> bool:
    return (leader_of(url) or {}).get("leading") is False


def first_command_after(client: Client, since: float, timeout: float = 60.0) -> float:
    """Seconds from ``since`` to the first ping of n01 that a leader sent and n01 acked."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            client.post("/v1/nodes/n01/ping")
            return time.monotonic() - since
        except ApiError:
            time.sleep(0.05)
    raise RuntimeError(f"no supervisor sent a command within {timeout:.0f}s")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--baseline", type=int, default=3)
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="phx-failover-"))
    pg = PgCluster().start()
    broker = Broker(root).start()
    fleet = Fleet(root, broker)
    try:
        store = f'[store]\nurl = "{pg.new_database()}"\n'
        ports = {"supervisor": free_port(), "supervisor-b": free_port()}
        urls = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        sups: dict[str, Process] = {}
        sups["supervisor"] = fleet.start_supervisor(sections=store, api_port=ports["supervisor"])
        wait_for(lambda: leads(urls["supervisor"]), 60, "the first supervisor to lead")
        sups["supervisor-b"] = fleet.start_supervisor(
            sections=store, api_port=ports["supervisor-b"], name="supervisor-b"
        )
        fleet.api_urls = list(urls.values())
        fleet.start_nodes(2)
        job = fleet.submit(
            name="failover",
            nodes=2,
            ranks_per_node=2,
            workdir=str(REPO),
            command=tinylm("--steps", "1000000", "--ckpt-every", "10", "--step-sleep", "0.04"),
            env={"OMP_NUM_THREADS": "1"},
            checkpoint={"tiers": ["ram", "nvme"], "interval": {"steps": 10}},
        )["id"]
        fleet.wait_job(job, "running", timeout=120)
        generation = fleet.job(job)["generation"]
        client = Client(",".join(urls.values()), TOKEN, timeout=1)

        takeovers: list[float] = []
        for _ in range(args.trials):
            leader = next(name for name, url in urls.items() if leads(url))
            time.sleep(3.0)  # steady state: the last takeover's catalogs are out
            sups[leader].kill9()
            killed = time.monotonic()
            takeovers.append(first_command_after(client, killed))
            sups[leader].start()  # again, as a standby
            url = urls[leader]
            wait_for(lambda: stands_by(url), 60, f"{leader} to stand by again")  # noqa: B023

        in_place: list[float] = []
        leader = next(name for name, url in urls.items() if leads(url))
        standby = next(name for name in urls if name != leader)
        sups[standby].stop()
        for _ in range(args.baseline):
            time.sleep(3.0)
            sups[leader].kill9()
            killed = time.monotonic()
            sups[leader].start()
            in_place.append(first_command_after(client, killed))

        view = fleet.job(job)
        steps_lost = sum(i.get("lost_steps") or 0 for i in view.get("incidents", []))
        result: dict[str, Any] = {
            "bench": "failover",
            "machine": f"{platform.node()} {os.cpu_count()} cores",
            "trials": args.trials,
            "lease_s": 4.0,
            "poll_s": 1.0,
            "takeover_s": [round(t, 3) for t in takeovers],
            "takeover_p50_s": round(statistics.median(takeovers), 3),
            "takeover_p95_s": round(percentile(takeovers, 0.95), 3),
            "restart_in_place_s": [round(t, 3) for t in in_place],
            "restart_in_place_p50_s": round(statistics.median(in_place), 3) if in_place else None,
            "job_state": view["state"],
            "job_restarts": view["restarts"],
            "generation_unchanged": view["generation"] == generation,
            "steps_lost": steps_lost,
            "target": {"takeover_p95_s": 5.0, "steps_lost": 0},
        }
        result["met"] = result["takeover_p95_s"] <= 5.0 and steps_lost == 0
        print(json.dumps(result, indent=1))
    finally:
        fleet.stop()
        broker.stop()
        pg.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
