"""The agent's side of the supervisors' election (docs/wire.md, "Leadership term"): it
keeps the newest term seen and refuses older orders, takes term 0 (a supervisor alone)
always, and takes any status as proof that the broker holds the supervisor's session.
A real Agent on the sim backend; its MQTT link is never connected: messages go straight
to its handler."""

from __future__ import annotations

import time

from agentd.daemon import Agent
from phalanx import wire
from tests.unit.agentd.test_training_commands import NODE, agent

__all__ = ["agent"]  # the fixture, shared


async def deliver(agent: Agent, topic: str, message: wire.Msg) -> None:
    await agent._on_message(topic, wire.encode(message))


def status(term: int) -> wire.SupervisorStatus:
    return wire.SupervisorStatus(online=True, since=time.time(), term=term)


async def test_an_order_of_an_older_term_is_refused_and_not_run(agent: Agent) -> None:
    await deliver(agent, wire.SUPERVISOR_STATUS_TOPIC, status(7))
    assert agent.term == 7

    stale = wire.Command.new(NODE, wire.ResampleArgs(), term=6)
    await deliver(agent, wire.command_topic(NODE), stale)
    assert agent.refused_stale == 1 and agent.ledger.executed == 0

    newer = wire.Command.new(NODE, wire.PingArgs(), term=8)
    await deliver(agent, wire.command_topic(NODE), newer)
    assert agent.term == 8 and agent.refused_stale == 1


async def test_an_older_status_still_opens_the_outboxes_gate(agent: Agent) -> None:
    await deliver(agent, wire.SUPERVISOR_STATUS_TOPIC, status(9))
    agent.supervisor_known.clear()  # as a new connection does
    await deliver(agent, wire.SUPERVISOR_STATUS_TOPIC, status(3))  # a stale retained one
    assert agent.supervisor_known.is_set()
    assert agent.term == 9 and agent.refused_stale == 1


async def test_term_0_a_supervisor_alone_is_always_taken(agent: Agent) -> None:
    await deliver(agent, wire.SUPERVISOR_STATUS_TOPIC, status(9))
    alone = wire.Command.new(NODE, wire.PingArgs())  # term 0: left out of the message
    assert b'"term"' not in wire.encode(alone)
    await deliver(agent, wire.command_topic(NODE), alone)
    assert agent.refused_stale == 0 and agent.term == 9
