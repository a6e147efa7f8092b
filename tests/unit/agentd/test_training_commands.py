"""The agent's burn_in and save_now commands, executed by a real Agent on the sim backend
(its MQTT link is never connected: the commands go straight through its ledger)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from agentd.burnin import burn_in
from agentd.config import AgentSettings, CkptSettings, GpuSettings, HttpSettings, Thresholds
from agentd.daemon import Agent
from agentd.gpu.sim import SimBackend, inject
from phalanx import wire
from tests.wait import until

NODE = "n1"
JOB = "tinylm-abc123"
WAIT_S = 10.0


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[Agent]:
    settings = AgentSettings(
        node_id=NODE,
        data_dir=tmp_path / "data",
        gpu=GpuSettings(backend="sim", sim_gpus=2),
        http=HttpSettings(port=0),
        ckpt=CkptSettings(shm_dir=tmp_path / "shm"),
        thresholds=Thresholds(disk_drain_bytes=0, disk_warn_fraction=0),
    )  # any test machine
    backend = SimBackend(settings.sim_path(), node_id=NODE, gpus=2, model="sim")
    a = Agent(settings, backend)
    try:
        async with a.progress:
            try:
                yield a
            finally:
                await a.ranks.stop_all(grace_s=1.0)
    finally:
        await a.ckpt.close()
        a._sampler.shutdown(wait=True)
        backend.close()


async def eventually(check: Callable[[], bool], what: str) -> None:
    await until(check, WAIT_S, what, interval=0.02)


async def run(agent: Agent, args: wire.CommandArgsType) -> wire.CommandAck:
    return await agent.ledger.handle(wire.Command.new(NODE, args))


# --- burn-in -----------------------------------------------------------------------------


async def test_burn_in_passes_on_a_healthy_sim_node(agent: Agent) -> None:
    ack = await run(agent, wire.BurnInArgs())

    assert ack.status is wire.AckStatus.DONE
    assert (ack.result["passed"], ack.result["reasons"]) == (True, [])


async def test_burn_in_fails_after_a_double_bit_ecc_error_naming_the_gpu(agent: Agent) -> None:
    await asyncio.to_thread(inject, agent.settings.sim_path(), 1, "ecc-dbe")

    ack = await run(agent, wire.BurnInArgs())

    assert ack.result["passed"] is False
    assert any(r.startswith("ecc_dbe on GPU 1:") for r in ack.result["reasons"])
    assert any(r.startswith("xid_48 on GPU 1:") for r in ack.result["reasons"])


async def test_burn_in_ignores_warnings(agent: Agent) -> None:
    await asyncio.to_thread(inject, agent.settings.sim_path(), 0, "thermal")

    ack = await run(agent, wire.BurnInArgs())

    assert agent.health.status is wire.HealthStatus.WARN
    assert ack.result["passed"] is True


async def test_burn_in_fails_a_gpu_that_computes_wrong_with_a_clean_health(agent: Agent) -> None:
    await asyncio.to_thread(inject, agent.settings.sim_path(), 0, "sdc")

    ack = await run(agent, wire.BurnInArgs())

    assert agent.health.status is wire.HealthStatus.OK  # silent
    assert ack.result["passed"] is False
    assert ack.result["checks"] == ["health", "recompute"]
    assert ack.result["reasons"] == [
        "recompute on GPU 0: its result differs from the CPU's (silent data corruption)"
    ]


async def test_burn_in_on_nvml_without_cuda_judges_by_the_health_sample_alone() -> None:
    # torch here is a CPU build: the matmul child finds no CUDA and says so.
    result = await burn_in("nvml", wire.Health(status=wire.HealthStatus.OK), [0])

    assert (result.passed, result.checks) == (True, ["health"])


# --- save_now ----------------------------------------------------------------------------

# A rank stepping every 20 ms that prints a line whenever it is asked to save.
SAVING_RANK = r"""
import time
import phalanx.rank
for step in range(100000):
    if phalanx.rank.step(step, loss=1.0).save_now:
        print("saved at", step, flush=True)
    time.sleep(0.02)
"""


async def test_save_now_asks_each_of_the_nodes_ranks_to_save_once(
    agent: Agent, tmp_path: Path
) -> None:
    start = wire.StartRanksArgs(
        job=JOB,
        generation=1,
        command=[sys.executable, "-c", SAVING_RANK],
        workdir="/",
        world_size=2,
        group_rank=0,
        master_addr="127.0.0.1",
        master_port=29511,
        ranks=[wire.RankSlot(rank=0, local_rank=0), wire.RankSlot(rank=1, local_rank=1)],
        assign_gpus=False,
    )
    assert (await run(agent, start)).status is wire.AckStatus.DONE
    await eventually(lambda: len(agent.progress.progress(JOB, 1)) == 2, "both ranks report")

    ack = await run(agent, wire.SaveNowArgs(job=JOB, generation=1))

    # With the step each rank had reported: its save comes after its next report (the
    # supervisor takes no commit at or before that step + 1 for it).
    assert ack.result["ranks"] == [0, 1]
    reported = ack.result["steps"]
    assert sorted(reported) == ["0", "1"] and all(isinstance(s, int) for s in reported.values())
    logs = [tmp_path / "data" / "jobs" / JOB / "g1" / f"rank-{r}.log" for r in (0, 1)]
    await eventually(lambda: all("saved at" in log.read_text() for log in logs), "both ranks save")
    for rank, log in enumerate(logs):
        (at,) = [
            int(line.split()[-1]) for line in log.read_text().splitlines() if "saved at" in line
        ]
        assert at > reported[str(rank)]
    saved = {r: s.step for r, s in agent.progress.progress(JOB, 1).items()}
    await eventually(  # 15 more steps each: none of them is asked again
        lambda: all(s.step >= saved[r] + 15 for r, s in agent.progress.progress(JOB, 1).items()),
        "15 more steps of each rank",
    )
    assert [log.read_text().count("saved at") for log in logs] == [1, 1]


async def test_save_now_for_a_generation_not_running_here_asks_nobody(agent: Agent) -> None:
    ack = await run(agent, wire.SaveNowArgs(job=JOB, generation=3))

    assert (ack.status, ack.result) == (wire.AckStatus.DONE, {"ranks": [], "steps": {}})
