"""A big job's checkpoints through the supervisor's catalog publisher, on a real store.

    python bench/ckpt_commit.py [--nodes 2048] [--ranks-per-node 8] [--checkpoints 8]

The supervisor's own code (``CatalogPublisher``, ``CheckpointCatalog``, the SQLite store
in a temporary folder) takes what a job of ``--nodes`` nodes sends a checkpoint: every
rank's landing at RAM, NVMe, peer and object, node by node and flushed ``--per-flush``
at a time as the publisher's batches take them, then retention's deletions (the job keeps
2, 3, 2 and 5 steps at those tiers, as ``bench/fleet_scale.py``'s; every rank reports
each), each commit's catalogs built and handed to a link that takes them at once (in
the batches the supervisor's link takes). Every node
is born in the registry with its agent's peer routes, as in a fleet. Nothing
else shares the event loop or the machine, unlike the fleet bench, whose simulators and
broker do: this is the supervisor's share of a checkpoint alone, what a change to the
catalog path is measured with.

Prints JSON: per checkpoint once retention runs (the median over ``--checkpoints``
minus the first five): the event loop's time recording the landings and deletions, their
transactions (one fsync each), the loop's longest turn, and the build and hand-off of
the catalogs at the last tier's commit (``commit_publish_s``); and where the loop's turns
of 20 ms or more were (``long_turns``, by the supervisor's own stall watch).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from phalanx import wire
from phalanx.jobspec import validate_spec
from phalanx.loopwatch import LoopWatch, Stall
from supervisor import gcpolicy
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.checkpoints.publisher import CatalogPublisher
from supervisor.fleet.registry import Registry
from supervisor.jobs import Job, JobState, RankPlace
from supervisor.store import Store

JOB = "bench-1"
TIERS = ("ram", "nvme", "peer", "object")
KEEP = {"ram": 2, "nvme": 3, "peer": 2, "object": 5}
WATCH_S = 0.02  # the loop's turns this long or longer are located (long_turns)
WARM = 5  # checkpoints before retention has dropped a step at every tier


class Turns:
    """The event loop's longest turn while running: a task that wakes every millisecond
    and notes how late it was."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last - 0.001)
            last = now

    def start(self) -> None:
        self.longest = 0.0
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> float:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        return self.longest


async def run(args: argparse.Namespace) -> dict[str, Any]:
    nodes = [f"n{i:05d}" for i in range(args.nodes)]
    world = args.nodes * args.ranks_per_node
    spec = validate_spec(
        {
            "name": "bench",
            "team": "t",
            "command": ["true"],
            "workdir": "/tmp",
            "nodes": args.nodes,
            "ranks_per_node": args.ranks_per_node,
        }
    )
    ranks = [
        RankPlace(rank=r, node=nodes[r // args.ranks_per_node], local_rank=r % args.ranks_per_node)
        for r in range(world)
    ]
    job = Job(JOB, spec, state=JobState.RUNNING, generation=1, nodes=nodes, ranks=ranks)
    sent: dict[str, bytes] = {}

    async def publish(topic: str, payload: bytes, retain: bool = False, timeout: float = 5) -> None:
        sent[topic] = payload

    async def publish_many(
        items: Any, *, retain: bool = False, timeout: float = 5
    ) -> list[BaseException | None]:
        sent.update(items)
        return [None] * len(items)

    gcpolicy.tune()  # the collector as the supervisor's daemon has it
    with tempfile.TemporaryDirectory(prefix="phalanx-ckpt-commit-") as tmp:
        store = Store(Path(tmp) / "state.db")
        commits = 0

        def traced(sql: str) -> None:
            nonlocal commits
            commits += sql == "COMMIT"

        store.db.set_trace_callback(traced)  # type: ignore[attr-defined]
        # Every node born, its agent's peer routes known, as in a fleet: the peer tier's
        # shards carry their buddy's address.
        registry = Registry(store, offline_after_s=15.0)
        for node in nodes:
            registry.on_birth(
                wire.NodeBirth(
                    node=node,
                    seq=1,
                    hostname=node,
                    address="127.0.0.1",
                    http_port=9400,
                    gpus=[],
                    gpu_backend="sim",
                    topology=wire.Topology(),
                    version="ckpt-commit",
                    started_at=time.time(),
                    health=wire.Health(status=wire.HealthStatus.OK),
                )
            )
        publisher = CatalogPublisher(
            CheckpointCatalog(store),
            publish,
            job={JOB: job}.get,
            registry=registry,
            ram_linger_s=900.0,
            publish_many=publish_many,
        )
        real_publish = publisher.publish
        published: list[float] = []

        async def timed_publish(job_id: str) -> None:
            began = time.perf_counter()
            await real_publish(job_id)
            published.append(time.perf_counter() - began)

        publisher.publish = timed_publish  # type: ignore[method-assign]
        turns = Turns()
        # Where the loop's longest turns were (the supervisor's own stall watch, which
        # names the project's frames a turn was in).
        watch = LoopWatch(threshold_s=WATCH_S, keep=1024, log_s=float("inf"))
        rows: list[dict[str, float]] = []
        steps: list[int] = []

        async def deliver(msgs: list[wire.CkptLanding]) -> float:
            """Hand ``msgs`` to the publisher ``--per-flush`` a flush; the loop's time."""
            took = 0.0
            for i in range(0, len(msgs), args.per_flush):
                for msg in msgs[i : i + args.per_flush]:
                    publisher.on_landing(msg)
                began = time.perf_counter()
                await publisher.flush_landings()
                took += time.perf_counter() - began
            return took

        await watch.__aenter__()
        try:
            for n in range(args.checkpoints):
                if n == WARM:
                    watch.stalls.clear()
                step = 1000 + 100 * n
                steps.append(step)
                landings = {
                    tier: [
                        wire.CkptLanding(
                            node=nodes[r // args.ranks_per_node],
                            job=JOB,
                            step=step,
                            rank=r,
                            tier=tier,  # type: ignore[arg-type]
                            nbytes=1 << 30,
                            checksum=f"xxh3_128:{step:016x}{r:016x}",
                            holder=(
                                nodes[(r // args.ranks_per_node + 1) % args.nodes]
                                if tier == "peer"
                                else None
                            ),
                            generation=1,
                            at=time.time(),
                        )
                        for r in range(world)
                    ]
                    for tier in TIERS
                }
                deletions = {
                    tier: [
                        wire.CkptLanding(
                            node=nodes[r // args.ranks_per_node],
                            job=JOB,
                            step=steps[-keep - 1],
                            rank=r,
                            tier=tier,  # type: ignore[arg-type]
                            event="deleted",
                            at=time.time(),
                        )
                        for r in range(world)
                    ]
                    for tier, keep in KEEP.items()
                    if len(steps) > keep
                }
                commits = 0
                published.clear()
                turns.start()
                recorded = 0.0
                for tier in TIERS:
                    recorded += await deliver(landings[tier])
                commit_publish = published[-1] if published else float("nan")
                recorded -= sum(published)  # the catalogs' builds and hand-offs apart
                commits_landed = commits
                published.clear()
                deleted = 0.0
                for msgs in deletions.values():
                    deleted += await deliver(msgs)
                deleted -= sum(published)
                rows.append(
                    {
                        "landings_s": recorded,
                        "landing_transactions": commits_landed,
                        "deletions_s": deleted,
                        "deletion_transactions": commits - commits_landed,
                        "longest_turn_s": await turns.stop(),
                        "commit_publish_s": commit_publish,
                    }
                )
        finally:
            await watch.__aexit__(None, None, None)
            publisher.stop()
            publisher.close()
            store.close()
    by_where: dict[str, list[float]] = {}
    for stall in watch.stalls:
        if stall.stack:  # none: the bench's own making of the landings
            by_where.setdefault(stall.stack, []).append(stall.s)

    steady = rows[WARM:] or rows
    return {
        "bench": "ckpt_commit",
        "nodes": args.nodes,
        "ranks": world,
        "per_flush": args.per_flush,
        "checkpoints_measured": len(steady),
        "catalog_bytes": sum(len(p) for p in sent.values()) // max(1, len(sent)),
        **{
            key: round(statistics.median(r[key] for r in steady), 4)
            for key in (
                "landings_s",
                "landing_transactions",
                "deletions_s",
                "deletion_transactions",
                "longest_turn_s",
                "commit_publish_s",
            )
        },
        # The loop's turns of WATCH_S or longer, all, and in the store's statements.
        "long_turns_all": _total(watch.stalls),
        "long_turns_in_store": _total(
            s for s in watch.stalls if s.stack.startswith("supervisor/store")
        ),
        # Those turns, by where they were (the longest eight).
        "long_turns": sorted(
            (
                {"stack": where, "n": len(s), "max_s": round(max(s), 3)}
                for where, s in by_where.items()
            ),
            key=lambda t: -float(t["max_s"]),
        )[:8],
    }


def _total(stalls: Iterable[Stall]) -> dict[str, float]:
    """How many of ``stalls`` (the bench's own making of landings left out), their
    seconds in all."""
    found = [s.s for s in stalls if s.stack]
    return {"n": len(found), "s": round(sum(found), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=2048)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--checkpoints", type=int, default=8)
    ap.add_argument(
        "--per-flush", type=int, default=1024, help="landings a flush of the publisher takes"
    )
    print(json.dumps(asyncio.run(run(ap.parse_args())), indent=1))


if __name__ == "__main__":
    main()
