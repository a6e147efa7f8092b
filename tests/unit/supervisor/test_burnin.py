"""Burn-in: the supervisor's side, over a real registry and store; the agent's answer is
a hand-written fake at the command boundary."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx import wire
from supervisor.fleet.burnin import BurnIns, Screening
from supervisor.fleet.registry import NodeState, Registry
from supervisor.store import Store

OK = wire.Health(status=wire.HealthStatus.OK)


def birth(node: str, seq: int = 1) -> wire.NodeBirth:
    return wire.NodeBirth(
        node=node,
        seq=seq,
        hostname=node,
        address="127.0.0.1",
        http_port=9400,
        gpus=[
            wire.GpuDescriptor(index=0, uuid=f"GPU-{node}", model="H100", memory_bytes=80 * 2**30)
        ],
        gpu_backend="sim",
        topology=wire.Topology(rack="r1"),
        version="0",
        started_at=0.0,
        health=OK,
    )


class Agents:
    """Answers burn-in commands as the agents would: passed unless told otherwise."""

    def __init__(self) -> None:
        self.failing: dict[str, str] = {}
        self.silent: set[str] = set()
        self.asked: list[str] = []
        self.perf: dict[str, object] = {}  # node -> the speed its burn-in reports

    async def send(self, node: str, args: wire.CommandArgsType, timeout: float) -> wire.CommandAck:
        assert isinstance(args, wire.BurnInArgs)
        self.asked.append(node)
        if node in self.silent:
            raise TimeoutError(f"no ack from node {node!r} within {timeout}s")
        passed = node not in self.failing
        return wire.CommandAck(
            id="x",
            node=node,
            status=wire.AckStatus.DONE,
            result={
                "passed": passed,
                "reasons": [self.failing.get(node, "")] if not passed else [],
                **({"perf": self.perf[node]} if node in self.perf else {}),
            },
            acked_at=0.0,
        )


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    store = Store(tmp_path / "state.db")
    yield store
    store.close()


@pytest.fixture
def registry(store: Store) -> Registry:
    registry = Registry(store, offline_after_s=15.0)
    for node in ("n1", "n2"):
        registry.on_birth(birth(node))
    return registry


@pytest.fixture
def agents() -> Agents:
    return Agents()


async def test_a_node_that_passes_is_trusted_until_it_is_drained(
    registry: Registry,
    agents: Agents,
) -> None:
    burnins = BurnIns(registry, agents.send)

    assert await burnins.run("n1") == (True, "")

    assert burnins.passed("n1")
    registry.drain("n1", "cable swap")
    burnins.observe()
    assert not burnins.passed("n1")


async def test_a_node_that_fails_is_drained_by_the_supervisor_with_the_reason(
    registry: Registry,
    agents: Agents,
) -> None:
    agents.failing["n2"] = "ecc_dbe on GPU 0"
    burnins = BurnIns(registry, agents.send)

    passed, why = await burnins.run("n2")

    assert not passed
    assert "ecc_dbe on GPU 0" in why
    node = registry.get("n2")
    assert node.state is NodeState.DRAIN
    assert node.drain is not None and node.drain.by == "supervisor"
    assert "failed burn-in" in node.drain.reason


async def test_an_undrained_node_is_not_schedulable_until_its_burn_in_passes(
    registry: Registry,
    agents: Agents,
) -> None:
    burnins = BurnIns(registry, agents.send)
    registry.drain("n1", "repair")
    burnins.observe()
    registry.undrain("n1")

    assert burnins.observe() == ["n1"]
    assert burnins.needs("n1")
    burnins.start("n1")
    for _ in range(100):
        if burnins.passed("n1"):
            break
        await asyncio.sleep(0.01)

    assert not burnins.needs("n1")
    assert burnins.observe() == []


async def test_a_burn_in_that_gets_no_answer_neither_passes_nor_drains(
    registry: Registry,
    agents: Agents,
) -> None:
    agents.silent.add("n1")
    burnins = BurnIns(registry, agents.send)

    passed, why = await burnins.run("n1")

    assert not passed and "did not run" in why
    assert registry.get("n1").state is NodeState.UP


async def test_a_pass_holds_for_one_birth_only(registry: Registry, agents: Agents) -> None:
    burnins = BurnIns(registry, agents.send)
    await burnins.run("n1")

    registry.on_birth(birth("n1", seq=2))  # the agent restarted: the node may have changed

    assert not burnins.passed("n1")


async def test_a_suspect_that_passed_while_drained_needs_no_second_burn_in_once_reinstated(
    registry: Registry,
    agents: Agents,
) -> None:
    burnins = BurnIns(registry, agents.send)
    registry.drain("n1", "quarantined by job j: rank 0 exited", by="supervisor")
    burnins.observe()

    assert await burnins.run("n1") == (True, "")
    burnins.observe()  # still drained: the pass does not make it schedulable yet
    registry.undrain("n1")
    burnins.reinstated("n1")

    assert burnins.observe() == []  # no second burn-in to start
    assert burnins.passed("n1") and not burnins.needs("n1")


def speed(step_s: float, gbps: float | None = 400.0) -> dict[str, object]:
    return {"step_s": step_s, "gpu_step_s": {"0": step_s}, "allreduce_gbps": gbps}


@pytest.fixture
def fleet6(registry: Registry) -> Registry:
    for node in ("n3", "n4", "n5", "n6"):
        registry.on_birth(birth(node))
    return registry


async def test_a_node_much_slower_than_the_fleets_median_fails_and_is_drained(
    fleet6: Registry, agents: Agents
) -> None:
    burnins = BurnIns(fleet6, agents.send, screening=Screening(0.05, 0.5, 3))
    for node, step in (("n1", 0.0100), ("n2", 0.0102), ("n3", 0.0099)):
        agents.perf[node] = speed(step)
        assert await burnins.run(node) == (True, "")
    agents.perf["n4"] = speed(0.0104)  # 4 % slower than the median: within the limit
    agents.perf["n5"] = speed(0.0150)
    agents.perf["n6"] = speed(0.0100, gbps=90.0)

    assert await burnins.run("n4") == (True, "")
    passed, why = await burnins.run("n5")
    assert not passed
    assert why.startswith("failed burn-in: slow_gpu: GPU 0's synthetic step took 15.0 ms")
    assert "slower than the median of 4 1-GPU H100 nodes (10.1 ms" in why
    assert fleet6.nodes["n5"].state is NodeState.DRAIN
    passed, why = await burnins.run("n6")
    assert not passed and "slow_link: the all-reduce between its GPUs ran at 90.0 GB/s" in why


async def test_the_first_nodes_are_not_judged_and_garbage_speed_is_ignored(
    fleet6: Registry, agents: Agents
) -> None:
    burnins = BurnIns(fleet6, agents.send, screening=Screening(0.05, 0.5, 3))
    agents.perf["n1"] = speed(0.0100)
    agents.perf["n2"] = speed(0.0300)  # one peer: nothing to compare with yet
    agents.perf["n3"] = {"step_s": "fast", "allreduce_gbps": float("nan")}
    agents.perf["n4"] = "garbage"

    for node in ("n1", "n2", "n3", "n4"):
        assert await burnins.run(node) == (True, "")


async def test_the_fleets_median_follows_a_change_of_every_node(
    fleet6: Registry, agents: Agents
) -> None:
    # After a driver upgrade every node is 6 % slower: the first few fail against the
    # old figures, and the median moves with the new ones (nothing stays out for ever).
    burnins = BurnIns(fleet6, agents.send, screening=Screening(0.05, 0.5, 3))
    for node in ("n1", "n2", "n3"):
        agents.perf[node] = speed(0.0100)
        assert (await burnins.run(node))[0]
    outcomes = []
    for node in ("n4", "n5", "n6", "n1", "n2"):
        if fleet6.nodes[node].drain is not None:
            fleet6.undrain(node)
        agents.perf[node] = speed(0.0106)
        burnins.observe()
        outcomes.append((await burnins.run(node))[0])
    assert outcomes[:2] == [False, False] and outcomes[-1] is True
