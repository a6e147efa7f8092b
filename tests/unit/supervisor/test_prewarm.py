"""Which running jobs each hot spare keeps warm interpreters for (``prewarm.plan``), and
the orders that say so: sent once, renewed only after ``EVERY_S``."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from phalanx import wire
from phalanx.jobspec import validate_spec
from phalanx.tasks import Tasks
from supervisor.control import prewarm
from supervisor.jobs import Job, JobState


def job(
    name: str,
    *,
    nodes: tuple[str, ...] = ("n01",),
    state: JobState = JobState.RUNNING,
    submitted: float = 0.0,
    **spec: Any,
) -> Job:
    data: dict[str, Any] = {
        "name": name,
        "team": "t",
        "command": ["python", "train.py"],
        "workdir": "/srv",
        "nodes": max(1, len(nodes)),
        "ranks_per_node": 2,
        **spec,
    }
    return Job(
        id=f"{name}-abc123",
        spec=validate_spec(data),
        state=state,
        nodes=list(nodes),
        submitted_at=submitted,
    )


def test_a_spare_keeps_the_running_jobs_that_use_warm_restarts_and_spares() -> None:
    jobs = [
        job("a"),
        job("off", restart={"warm": False}),
        job("nospare", restart={"use_spares": False}),
        job("pending", state=JobState.PENDING, nodes=()),
        job("recovering", state=JobState.RECOVERING),
    ]
    assert prewarm.plan(["s1", "s2"], jobs, {}) == {"s1": ["a-abc123"], "s2": ["a-abc123"]}


def test_the_highest_priority_then_the_largest_then_the_oldest_at_most_two_per_spare() -> None:
    jobs = [
        job("old", submitted=1.0),
        job("new", submitted=2.0),
        job("big", nodes=("n01", "n02"), submitted=3.0),
        job("urgent", priority=90, submitted=4.0),
    ]
    assert prewarm.plan(["s1"], jobs, {}) == {"s1": ["urgent-abc123", "big-abc123"]}
    assert prewarm.plan(["s1"], jobs, {}, per_spare=4)["s1"][2:] == ["old-abc123", "new-abc123"]


def test_a_job_whose_ranks_per_node_do_not_fit_the_spares_gpus_is_not_kept_there() -> None:
    jobs = [job("wide", ranks_per_node=8), job("narrow", ranks_per_node=2)]
    got = prewarm.plan(
        ["small", "large", "unknown"], jobs, {"small": (4, "H100"), "large": (8, "H100")}
    )
    assert got == {
        "small": ["narrow-abc123"],
        "large": ["narrow-abc123", "wide-abc123"],  # a tie: by id
        "unknown": ["narrow-abc123", "wide-abc123"],
    }


def test_a_job_that_needs_another_gpu_model_than_the_spares_is_not_kept_there() -> None:
    jobs = [job("h200", gpu_type="H200"), job("any")]
    got = prewarm.plan(
        ["h100", "h200", "unknown"], jobs, {"h100": (8, "H100"), "h200": (8, "H200")}
    )
    assert got == {
        "h100": ["any-abc123"],
        "h200": ["any-abc123", "h200-abc123"],
        "unknown": ["any-abc123", "h200-abc123"],
    }


def test_a_node_of_the_job_is_no_spare_of_it_and_no_job_means_no_order() -> None:
    assert prewarm.plan(["n01"], [job("a")], {}) == {}
    assert prewarm.plan(["s1"], [], {}) == {}


def start_args(j: Job, node: str) -> wire.StartRanksArgs:
    return wire.StartRanksArgs(
        job=j.id,
        generation=1,
        command=j.spec.command,
        workdir=j.spec.workdir,
        world_size=2,
        group_rank=0,
        master_addr="10.0.0.1",
        master_port=29500,
        ranks=[wire.RankSlot(rank=0, local_rank=0), wire.RankSlot(rank=1, local_rank=1)],
        warm=wire.WarmPlan(imports=["torch"]),
    )


class Spares:
    """A sender of prewarm orders with a clock of its own, and what the spares answer."""

    def __init__(self, status: wire.AckStatus = wire.AckStatus.DONE) -> None:
        self.now = 1000.0
        self.status = status
        self.sent: list[tuple[str, wire.PrewarmArgs]] = []
        self.tasks = Tasks("test")
        self.sender = prewarm.SparePrewarm(self.send, self.tasks, start_args, lambda: self.now)

    async def send(self, node: str, args: wire.PrewarmArgs, timeout: float | None = None) -> Any:
        self.sent.append((node, args))
        return wire.CommandAck(id="x", node=node, status=self.status, acked_at=0.0)

    async def tick(self, spares: list[str], jobs: list[Job]) -> list[tuple[str, str]]:
        """One tick, its orders answered: (spare, job) of each order it sent."""
        self.sent.clear()
        self.sender.tick(spares, {j.id: j for j in jobs}, {})
        for _ in range(5):
            await asyncio.sleep(0)
        return sorted((n, a.start.job) for n, a in self.sent)


async def test_each_spare_is_told_once_and_again_when_its_lease_needs_renewing() -> None:
    spares, jobs = Spares(), [job("a"), job("b")]

    assert await spares.tick(["s1"], jobs) == [("s1", "a-abc123"), ("s1", "b-abc123")]
    assert {a.lease_s for _, a in spares.sent} == {prewarm.LEASE_S}
    assert await spares.tick(["s1"], jobs) == []
    spares.now += prewarm.EVERY_S + 1
    assert await spares.tick(["s1"], jobs) == [("s1", "a-abc123"), ("s1", "b-abc123")]
    assert prewarm.LEASE_S > 2 * prewarm.EVERY_S  # two renewals may be lost before it lapses
    await spares.tasks.shutdown(5)


async def test_a_spare_that_leaves_the_pool_and_comes_back_is_told_again_at_once() -> None:
    spares, jobs = Spares(), [job("a")]
    assert await spares.tick(["s1"], jobs) == [("s1", "a-abc123")]
    assert await spares.tick([], jobs) == []
    assert await spares.tick(["s1"], jobs) == [("s1", "a-abc123")]
    await spares.tasks.shutdown(5)


async def test_a_spare_that_refuses_a_prewarm_is_asked_again_only_much_later() -> None:
    spares, jobs = Spares(wire.AckStatus.FAILED), [job("a")]
    assert await spares.tick(["s1"], jobs) == [("s1", "a-abc123")]
    spares.now += prewarm.EVERY_S + 1
    assert await spares.tick(["s1"], jobs) == []
    spares.now += prewarm.REFUSED_S
    assert await spares.tick(["s1"], jobs) == [("s1", "a-abc123")]
    await spares.tasks.shutdown(5)


async def test_a_spare_that_does_not_answer_is_logged_and_nothing_raises(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def send(node: str, args: wire.PrewarmArgs, timeout: float | None = None) -> Any:
        raise TimeoutError("no ack")

    caplog.set_level(logging.INFO, logger=prewarm.__name__)
    tasks = Tasks("test")
    prewarm.SparePrewarm(send, tasks, start_args).tick(["s1"], {"a-abc123": job("a")}, {})
    await tasks.shutdown(5)
    assert "prewarm of a-abc123 on spare s1 not acknowledged" in caplog.text
