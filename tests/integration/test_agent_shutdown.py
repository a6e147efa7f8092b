"""The agent's shutdown, with a real broker: what it owes the supervisor goes out first."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from agentd.config import AgentSettings, CkptSettings, GpuSettings, HttpSettings, Thresholds
from agentd.daemon import Agent
from agentd.gpu.sim import SimBackend
from phalanx import wire
from phalanx.settings import MqttSettings
from tests.harness import Broker, RawMqtt, wait_for

pytestmark = pytest.mark.integration

NODE = "n1"
JOB = "tinylm-abc123"


def agent_on(tmp_path: Path, broker: Broker) -> Agent:
    settings = AgentSettings(
        node_id=NODE,
        data_dir=tmp_path / "data",
        gpu=GpuSettings(backend="sim", sim_gpus=1),
        http=HttpSettings(port=0),
        ckpt=CkptSettings(shm_dir=tmp_path / "shm"),
        thresholds=Thresholds(disk_drain_bytes=0, disk_warn_fraction=0),
        mqtt=MqttSettings(port=broker.port),
        stop_grace_s=1.0,
    )
    return Agent(settings, SimBackend(settings.sim_path(), node_id=NODE, gpus=1, model="sim"))


def landing(step: int) -> wire.CkptLanding:
    return wire.CkptLanding(
        node=NODE, job=JOB, step=step, rank=0, tier="nvme", nbytes=4096, at=time.time()
    )


async def test_a_landing_reported_as_the_agent_stops_reaches_the_broker(
    tmp_path: Path, broker: Broker
) -> None:
    watcher = RawMqtt(broker.port)
    try:
        watcher.subscribe(wire.ckpt_topic(NODE))
        agent = agent_on(tmp_path, broker)
        async with agent:
            await agent.link.wait_connected(10)
            real_publish = agent.link.publish

            async def slow_landings(topic: str, payload: bytes, **kw: Any) -> None:
                # The fault, at the I/O boundary: a slow link for the landings' topic.
                if topic == wire.ckpt_topic(NODE):
                    await asyncio.sleep(0.5)
                await real_publish(topic, payload, **kw)

            agent.link.publish = slow_landings  # type: ignore[method-assign]
            real_close = agent.ckpt.close

            async def close_with_a_last_write_down(timeout: float = 30.0) -> None:
                await real_close(timeout)
                # The write-down that finishes as the service closes reports its landing.
                agent._publish_landing(landing(7))

            agent.ckpt.close = close_with_a_last_write_down  # type: ignore[method-assign]
            agent._publish_landing(landing(6))
        topic = wire.ckpt_topic(NODE)

        def steps() -> list[int]:  # one message each, or several packed in one
            found = []
            for payload in watcher.received(topic):
                message = wire.parse(topic, payload).message
                landings = message.landings if isinstance(message, wire.CkptLandings) else [message]
                found += [x.step for x in landings if isinstance(x, wire.CkptLanding)]
            return found

        wait_for(lambda: len(steps()) >= 2, 10, "landings")
        assert steps() == [6, 7]
    finally:
        watcher.close()


async def test_a_command_that_never_ends_is_cancelled_at_shutdown_naming_it(
    tmp_path: Path,
    broker: Broker,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from agentd import daemon

    monkeypatch.setattr(daemon, "COMMAND_DRAIN_S", 0.3, raising=False)
    agent = agent_on(tmp_path, broker)
    started = asyncio.Event()

    async def stuck(cmd: wire.Command) -> wire.CommandAck:
        # The fault: a command stuck in a call that never returns (a hung driver call).
        started.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async with asyncio.timeout(20):
        async with agent:
            await agent.link.wait_connected(10)
            monkeypatch.setattr(agent.ledger, "handle", stuck)
            cmd = wire.Command.new(NODE, wire.PingArgs())
            await agent.link.publish(wire.command_topic(NODE), wire.encode(cmd))
            await asyncio.wait_for(started.wait(), 10)
    assert f"still running after the 0.3 s shutdown limit: command-ping-{cmd.id}" in caplog.text
