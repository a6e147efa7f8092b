"""A recovery's orders (issue 22): the next generation's starts go out once every stop
of the gang is acknowledged, with the rendezvous port rank 0's node offered in its
heartbeat (no ``alloc_port`` round trip) when it offered one.

The controller, its store, registry, catalog and planner are real; the commands go to a
recording ``send`` whose stops are acknowledged only when the test lets them.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from phalanx import wire
from phalanx.jobspec import validate_spec
from supervisor.checkpoints.catalog import CheckpointCatalog
from supervisor.checkpoints.publisher import CatalogPublisher
from supervisor.config import SupervisorSettings
from supervisor.control import prewarm
from supervisor.control.controller import JobController
from supervisor.fleet.registry import Registry
from supervisor.jobs import Job, JobState, RankPlace
from supervisor.recovery.incidents import cold_ranks, rank_ranges
from supervisor.recovery.planner import Failure, FailureKind
from supervisor.store import Store
from tests.unit.supervisor.test_controller_growth import nowhere
from tests.unit.supervisor.test_dashboard_auth import birth

RPN = 2


class Fleet:
    """A running job on ``gang`` of ``nodes``; every command sent is recorded in order."""

    def __init__(self, tmp_path: Path, nodes: list[str], gang: list[str]) -> None:
        self.store = Store(tmp_path / "state.db")
        self.registry = Registry(self.store, offline_after_s=15.0)
        for node in nodes:
            self.registry.on_birth(birth(node, gpus=RPN))
        self.sent: list[tuple[str, str, int]] = []  # (node, op, generation)
        self.args: list[wire.CommandArgsType] = []  # what was sent, in order
        self.stops_acked = asyncio.Event()
        self.cold: dict[str, Any] = {}  # node -> what its start ack says of cold ranks
        self.burn_in: dict[str, Any] = {}  # node -> its burn-in's result (default: passed)
        self.burn_ins_answer = asyncio.Event()  # cleared: burn-ins wait for the test
        self.burn_ins_answer.set()
        self.jobs: dict[str, Job] = {}
        self.publisher = CatalogPublisher(
            CheckpointCatalog(self.store),
            nowhere,
            job=self.jobs.get,
            registry=self.registry,
            ram_linger_s=900.0,
        )
        self.ctl = JobController(
            self.store,
            self.registry,
            SupervisorSettings(state_dir=tmp_path),
            send=self.send,
            publisher=self.publisher,
            offline_confirmed=lambda since: True,
        )
        spec = validate_spec(
            {
                "name": "recovers",
                "team": "t",
                "command": ["true"],
                "workdir": "/tmp",
                "nodes": len(gang),
                "ranks_per_node": RPN,
                "restart": {"max_restarts": 3},
            }
        )
        self.job = Job(
            "j-1",
            spec,
            state=JobState.RUNNING,
            generation=1,
            nodes=list(gang),
            ranks=[
                RankPlace(rank=n * RPN + lr, node=node, local_rank=lr)
                for n, node in enumerate(gang)
                for lr in range(RPN)
            ],
            started_at=time.time() - 600,
        )
        self.ctl.jobs["j-1"] = self.jobs["j-1"] = self.job

    async def send(
        self, node: str, args: wire.CommandArgsType, timeout: float | None = None
    ) -> wire.CommandAck:
        generation = int(getattr(args, "generation", 0))
        self.sent.append((node, args.op, generation))
        self.args.append(args)
        result: dict[str, Any] = {}
        if isinstance(args, wire.StopRanksArgs):
            await self.stops_acked.wait()
        elif isinstance(args, wire.AllocPortArgs):
            result = {"port": 29500}
        elif isinstance(args, wire.StartRanksArgs) and node in self.cold:
            result = {"pids": {}, "cold": self.cold[node]}
        elif isinstance(args, wire.BurnInArgs):
            await self.burn_ins_answer.wait()
            result = self.burn_in.get(node, {"passed": True, "reasons": [], "checks": []})
            if result == "expired":
                return wire.CommandAck(
                    id="x", node=node, status=wire.AckStatus.EXPIRED, acked_at=time.time()
                )
        return wire.CommandAck(
            id=f"c{len(self.sent)}",
            node=node,
            status=wire.AckStatus.DONE,
            result=result,
            acked_at=time.time(),
        )

    def ops(self, op: str) -> list[tuple[str, int]]:
        return [(node, g) for node, o, g in self.sent if o == op]

    async def until(self, what: Any, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, f"not within {timeout}s; sent {self.sent}"
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        self.stops_acked.set()
        await self.ctl.shutdown(0.5)
        self.publisher.stop()
        self.publisher.close()
        self.store.close()


async def test_a_relaunch_sends_its_starts_once_every_stop_is_acknowledged(
    tmp_path: Path,
) -> None:
    # Not before: a start that reached a node while the old generation's ranks were still
    # in their grace would be fenced out of them (its generation configured, its catalog
    # built while they may still commit a step), and its ack would have to cover the stop.
    fleet = Fleet(tmp_path, ["n0", "n1", "n2"], gang=["n0", "n1", "n2"])
    try:
        fleet.ctl.recoveries.on_failure(
            fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=1)
        )
        await fleet.until(lambda: len(fleet.ops("stop_ranks")) == 3)
        await asyncio.sleep(0.2)
        assert sorted(fleet.ops("stop_ranks")) == [("n0", 1), ("n1", 1), ("n2", 1)]
        assert fleet.ops("start_ranks") == []  # the stops are not acknowledged yet

        fleet.stops_acked.set()
        await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
        assert sorted(fleet.ops("start_ranks")) == [("n0", 2), ("n1", 2), ("n2", 2)]
        assert fleet.job.generation == 2 and fleet.job.restarts == 1
        phases = fleet.job.incidents[-1].phases
        assert {"plan", "stop", "port", "catalogs", "starts"} <= set(phases)
    finally:
        await fleet.close()


async def test_a_relaunchs_incident_names_the_ranks_launched_cold_and_why(
    tmp_path: Path,
) -> None:
    # The launch phase of such a recovery paid a cold start (issue 28): the incident says
    # which ranks and why, from the agents' start acks. Garbage in an ack is left out.
    fleet = Fleet(tmp_path, ["n0", "n1"], gang=["n0", "n1"])
    fleet.cold = {
        "n0": {},
        "n1": {"2": "its warm interpreter was still importing", "x": "?", "3": 7},
    }
    try:
        fleet.stops_acked.set()
        fleet.ctl.recoveries.on_failure(
            fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=1)
        )
        await fleet.until(lambda: fleet.job.state is JobState.RUNNING)

        assert fleet.job.incidents[-1].cold_ranks == {
            "its warm interpreter was still importing": "2"
        }
        # An agent that says nothing of it (older than warm interpreters): unknown.
        fleet.cold = {"n1": "not a dict"}
        fleet.ctl.recoveries.on_failure(
            fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=2)
        )
        await fleet.until(lambda: fleet.job.generation == 3)
        await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
        assert fleet.job.incidents[-1].cold_ranks is None
    finally:
        await fleet.close()


def test_cold_ranks_are_kept_as_ranges_by_reason_and_bounded() -> None:
    def ack(cold: dict[str, str]) -> wire.CommandAck:
        return wire.CommandAck(
            id="c", node="n0", status=wire.AckStatus.DONE, result={"cold": cold}, acked_at=0
        )

    off = "restart.warm is off"
    acks = [ack({str(r): off for r in range(8 * n, 8 * n + 8)}) for n in range(2048)]
    assert cold_ranks(acks) == {off: "0-16383"}  # 16,384 ranks in one line
    assert cold_ranks([ack({"0": off, "1": off, "3": off, "5": "x"})]) == {off: "0-1, 3", "x": "5"}
    many = cold_ranks([ack({str(r): f"reason {r:02d}" for r in range(20)})])
    assert many is not None and len(many) == 9 and many["other reasons"] == "8-19"
    assert rank_ranges(range(0, 200, 2)).endswith(", 62, and 68 more")
    assert cold_ranks([ack({})]) == {} and cold_ranks([]) is None


async def test_a_launch_takes_the_rendezvous_port_from_rank_0s_heartbeat(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path, ["n0", "n1"], gang=["n0", "n1"])
    try:
        for i, node in enumerate(("n0", "n1")):
            fleet.registry.on_heartbeat(
                wire.Heartbeat(
                    node=node,
                    seq=1,
                    n=1,
                    sent_at=time.time(),
                    health=wire.Health(status=wire.HealthStatus.OK),
                    port=41000 + i,
                )
            )
        fleet.stops_acked.set()
        fleet.ctl.recoveries.on_failure(
            fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=1)
        )
        await fleet.until(lambda: fleet.job.state is JobState.RUNNING)

        assert fleet.ops("alloc_port") == []  # no round trip for it
        assert fleet.job.master_port == 41000
        # The next launch has no port from n0 until its next heartbeat: it asks.
        fleet.ctl.recoveries.on_failure(
            fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=1, generation=2)
        )
        await fleet.until(lambda: fleet.job.generation == 3)
        await fleet.until(lambda: fleet.job.state is JobState.RUNNING)
        assert fleet.ops("alloc_port") == [("n0", 0)]
        assert fleet.job.master_port == 29500
    finally:
        await fleet.close()


async def test_a_recovery_that_waits_for_a_node_has_its_stops_acknowledged_first(
    tmp_path: Path,
) -> None:
    # No spare: n1 drained by its failure, the job waits for a node.
    fleet = Fleet(tmp_path, ["n0", "n1"], gang=["n0", "n1"])
    try:
        fleet.ctl.recoveries.on_failure(
            fleet.job, Failure(FailureKind.NODE_DRAIN, "n1", detail="ecc", generation=1)
        )
        await fleet.until(lambda: len(fleet.ops("stop_ranks")) == 2)
        await asyncio.sleep(0.2)
        assert fleet.job.recovery is not None
        assert fleet.job.recovery.phase == "plan"  # still stopping
        assert fleet.ops("start_ranks") == []

        fleet.stops_acked.set()
        await fleet.until(lambda: fleet.job.recovery.phase == "stopped")  # type: ignore[union-attr]
        assert fleet.ops("start_ranks") == []  # nothing to start on: it waits
    finally:
        await fleet.close()


async def test_a_spare_is_sent_the_start_order_of_a_running_job_without_its_checkpoint_plan(
    tmp_path: Path,
) -> None:
    # A spare starts no rank: no buddy, and no node's credential at one, goes to it.
    fleet = Fleet(tmp_path, ["n0", "n1", "n2"], gang=["n0", "n1"])
    try:
        fleet.ctl.spares = ("n2",)
        fleet.ctl.tick()
        await fleet.until(lambda: fleet.ops("prewarm") == [("n2", 0)])

        (sent,) = [a for a in fleet.args if isinstance(a, wire.PrewarmArgs)]
        start = fleet.ctl.orders.start_args(fleet.job, 0, "n0")
        assert start.ckpt is not None and sent.start.ckpt is None
        assert sent.start == start.model_copy(update={"ckpt": None})
        assert sent.lease_s == prewarm.LEASE_S
    finally:
        await fleet.close()


def in_process(fleet: Fleet) -> None:
    fleet.job.spec = validate_spec(
        {
            **fleet.job.spec.model_dump(mode="json", exclude_none=True),
            "restart": {"max_restarts": 3, "in_process": True},
        }
    )


async def test_an_in_process_restart_leaves_the_survivors_running_and_says_so_to_the_agents(
    tmp_path: Path,
) -> None:
    # restart.in_process: a rank exited; the others wait, parked, for the next generation:
    # no stop goes to the gang, and each start tells its agent to resume them.
    fleet = Fleet(tmp_path, ["n0", "n1"], gang=["n0", "n1"])
    in_process(fleet)
    try:
        fleet.ctl.recoveries.on_failure(
            fleet.job, Failure(FailureKind.RANK_EXIT, "n1", rank=2, code=None, generation=1)
        )
        await fleet.until(lambda: fleet.job.state is JobState.RUNNING and fleet.job.generation == 2)
        assert fleet.ops("stop_ranks") == []
        starts = [a for a in fleet.args if isinstance(a, wire.StartRanksArgs)]
        assert sorted(a.group_rank for a in starts) == [0, 1]
        assert all(a.in_process and a.env["PHALANX_IN_PROCESS"] == "1" for a in starts)
    finally:
        await fleet.close()


async def test_an_in_process_job_that_hangs_is_stopped_as_usual(tmp_path: Path) -> None:
    # A hang leaves no rank to resume (they are stuck in a collective): the gang stops.
    fleet = Fleet(tmp_path, ["n0", "n1"], gang=["n0", "n1"])
    in_process(fleet)
    fleet.stops_acked.set()
    try:
        fleet.ctl.recoveries.on_failure(
            fleet.job, Failure(FailureKind.HANG, "n1", rank=2, generation=1)
        )
        await fleet.until(lambda: fleet.job.state is JobState.RUNNING and fleet.job.generation == 2)
        assert sorted(fleet.ops("stop_ranks")) == [("n0", 1), ("n1", 1)]
    finally:
        await fleet.close()


async def test_parked_survivors_in_a_heartbeat_are_no_orphans_while_their_job_starts(
    tmp_path: Path,
) -> None:
    # A heartbeat sent between a survivor's park and its agent's resume still lists the
    # failed generation: an in-process job starting its next one leaves it to the agent.
    fleet = Fleet(tmp_path, ["n0", "n1"], gang=["n0", "n1"])
    fleet.stops_acked.set()
    beat = wire.Heartbeat(
        node="n0",
        seq=1,
        n=1,
        sent_at=time.time(),
        health=wire.Health(status=wire.HealthStatus.OK),
        jobs=[wire.JobRanks(job="j-1", generation=1, ranks=[0, 1])],
    )
    try:
        fleet.job.state, fleet.job.generation = JobState.STARTING, 2
        in_process(fleet)
        fleet.ctl.reconciler.on_heartbeat(beat)
        await asyncio.sleep(0.2)
        assert fleet.ops("stop_ranks") == []
        fleet.job.spec = validate_spec(
            {**fleet.job.spec.model_dump(mode="json", exclude_none=True), "restart": {}}
        )
        fleet.ctl.reconciler.on_heartbeat(beat)
        await fleet.until(lambda: fleet.ops("stop_ranks") == [("n0", 1)])
    finally:
        await fleet.close()
