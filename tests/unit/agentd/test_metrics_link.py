"""The agent's metrics batches reach a supervisor that was away when they were sent (QoS 1
on its persistent session), and a window is kept, not dropped, while the agent's link is
down. A real Agent (sim backend) and a real Mosquitto."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiomqtt
import pytest

from agentd.config import AgentSettings, CkptSettings, GpuSettings, HttpSettings, Thresholds
from agentd.daemon import Agent
from agentd.gpu.sim import SimBackend
from phalanx import wire
from phalanx.progress import StepReport
from phalanx.settings import MqttSettings
from tests.harness import Broker
from tests.wait import until

NODE = "n1"
JOB = "tinylm-abc123"
SUPERVISOR_ID = "phalanx-supervisor-test"


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    (tmp_path / "broker").mkdir()
    b = Broker(tmp_path / "broker").start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
async def agent(tmp_path: Path, broker: Broker) -> AsyncIterator[Agent]:
    settings = AgentSettings(
        node_id=NODE,
        data_dir=tmp_path / "data",
        gpu=GpuSettings(backend="sim", sim_gpus=1),
        http=HttpSettings(port=0),
        ckpt=CkptSettings(shm_dir=tmp_path / "shm"),
        thresholds=Thresholds(disk_drain_bytes=0, disk_warn_fraction=0),
        mqtt=MqttSettings(
            brokers=[f"127.0.0.1:{broker.port}"], reconnect_initial_s=0.05, reconnect_max_s=0.2
        ),
    )
    backend = SimBackend(settings.sim_path(), node_id=NODE, gpus=1, model="sim")
    a = Agent(settings, backend)
    try:
        yield a
    finally:
        await a.ckpt.close()
        a._sampler.shutdown(wait=True)
        backend.close()


def steps(agent: Agent, first: int, last: int) -> None:
    for step in range(first, last + 1):
        agent.metrics.add(StepReport(JOB, 1, 0, 100, step, 1000.0 + step, {"loss": 10.0 - step}))


async def supervisor_away(port: int) -> None:
    """The supervisor's persistent session, subscribed to every node's metrics, then gone:
    its status says so (retained), as its will would."""
    async with aiomqtt.Client(
        "127.0.0.1", port, identifier=SUPERVISOR_ID, clean_session=False
    ) as sup:
        await sup.subscribe(wire.metrics_topic(NODE), qos=1)
        status = wire.SupervisorStatus(online=False, since=1.0)
        await sup.publish(wire.SUPERVISOR_STATUS_TOPIC, wire.encode(status), qos=1, retain=True)


async def test_a_window_is_kept_while_the_link_is_down_and_reaches_a_supervisor_back_later(
    agent: Agent, broker: Broker
) -> None:
    await supervisor_away(broker.port)
    steps(agent, 0, 4)
    agent.queue_metrics()  # no link yet: the window stays
    assert (agent.metrics_sent, len(agent.metrics_out)) == (0, 0)

    async with agent.link:
        await agent.link.wait_connected(15)
        await until(agent.supervisor_known.is_set, 15, "the supervisor's status", interval=0.02)
        steps(agent, 5, 9)
        agent.queue_metrics()
        assert (agent.metrics_sent, len(agent.metrics_out)) == (1, 1)
        await agent.metrics_out.flush(timeout=10)
    assert (len(agent.metrics_out), agent.metrics_dropped) == (0, 0)

    got: list[wire.MetricsBatch] = []
    async with aiomqtt.Client(
        "127.0.0.1", broker.port, identifier=SUPERVISOR_ID, clean_session=False
    ) as sup:
        async with asyncio.timeout(10):
            async for message in sup.messages:  # queued for its session while it was away
                parsed = wire.parse(str(message.topic), bytes(message.payload)).message
                assert isinstance(parsed, wire.MetricsBatch)
                got.append(parsed)
                break
    [batch] = got
    [window] = batch.ranks
    assert (batch.job, window.step_first, window.step_last, window.reports) == (JOB, 0, 9, 10)
    assert window.scalars["loss"][0] == 1.0
