"""Burn-in: the supervisor's side, over a real registry and store; the agent's answer is
a hand-written fake at the command boundary."""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from phalanx import wire
from phalanx.agent_tokens import AgentKeys
from supervisor.config import SupervisorSettings
from supervisor.fleet.burnin import PROBE_COMMAND_S, BurnIns, Screening
from supervisor.fleet.registry import NodeState, Registry
from supervisor.store import Store
from tests.wait import until

OK = wire.Health(status=wire.HealthStatus.OK)


def birth(node: str, seq: int = 1, features: Collection[str] = ()) -> wire.NodeBirth:
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
        features=list(features),
    )


def announce_both_ways(registry: Registry, *nodes: str) -> None:
    """The nodes' agents restart on a version that probes a link both ways at once."""
    for node in nodes:
        registry.on_birth(birth(node, seq=2, features=[wire.FEATURE_PROBE_BOTH_WAYS]))


class Agents:
    """Answers burn-in commands as the agents would: passed unless told otherwise; and
    link probes, at 1,000 MB/s unless a link or a node is slow or cut, one way or both
    (``both_ways``)."""

    def __init__(self) -> None:
        self.failing: dict[str, str] = {}
        self.silent: set[str] = set()
        self.asked: list[str] = []
        self.perf: dict[str, object] = {}  # node -> the speed its burn-in reports
        self.slow: dict[str, float] = {}  # node -> MB/s of every link to it
        self.cut: set[str] = set()  # nodes no probe reaches
        self.probes: list[tuple[str, str, str | None]] = []  # (node, peer, its credential)
        self.both_ways: list[tuple[str, str]] = []  # (node, peer) of the both-ways probes
        self.ways: dict[tuple[str, str], float] = {}  # (from, to) -> MB/s of that way alone
        self.refused_uploads: set[str] = set()  # nodes whose agent refuses an upload
        self.probe_timeouts: list[float] = []
        self.probing: set[str] = set()  # the nodes of the probes under way
        self.probe_s = 0.0

    async def send(self, node: str, args: wire.CommandArgsType, timeout: float) -> wire.CommandAck:
        if isinstance(args, wire.ProbeLinkArgs):
            ends = (node, args.peer.node)
            self.probe_timeouts.append(timeout)
            assert not self.probing & set(ends), f"{ends} probed while {self.probing} were"
            self.probing |= set(ends)
            await asyncio.sleep(self.probe_s)
            self.probing -= set(ends)
            return self.probe(node, args)
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

    def probe(self, node: str, args: wire.ProbeLinkArgs) -> wire.CommandAck:
        peer = args.peer.node
        token = args.peer.token.get_secret_value() if args.peer.token else None
        self.probes.append((node, peer, token))
        result = self.way(peer, node)
        if args.both_ways:
            self.both_ways.append((node, peer))
            back = self.way(node, peer)
            if "mb_s" not in result:
                pass  # the agent does not send what it could not read
            elif peer in self.refused_uploads:
                result |= {"back_error": "answered 405 to the upload", "back_reached": True}
            elif "error" in back:
                result |= {"back_error": back["error"], "back_reached": back["reached"]}
            else:
                result |= {"back": back | {"nbytes": args.nbytes, "seconds": 0.1}}
        return wire.CommandAck(
            id="p", node=node, status=wire.AckStatus.DONE, result=result, acked_at=0.0
        )

    def way(self, sender: str, reader: str) -> dict[str, object]:
        if reader in self.cut:
            return {"error": "ConnectionRefusedError", "reached": False}
        usual = min(self.slow.get(reader, 1000.0), self.slow.get(sender, 1000.0))
        return {"mb_s": self.ways.get((sender, reader), usual)}


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
    await until(lambda: burnins.passed("n1"), 5.0, "n1's burn-in to pass")

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


async def test_a_burn_in_probes_three_idle_nodes_both_ways_and_a_slow_link_fails_it(
    fleet6: Registry, agents: Agents
) -> None:
    burnins = BurnIns(fleet6, agents.send, busy=lambda: {"n6"}, agent_keys=AgentKeys("s" * 32))
    for node in ("n1", "n2"):
        assert await burnins.run(node) == (True, "")
    # Each probes three idle nodes (n6 trains: never), the least lately probed first, both
    # ways; the reader presents the credential that opens the sender's probe route for
    # the reader alone.
    assert [(n, p) for n, p, _ in agents.probes] == [
        ("n1", "n2"), ("n2", "n1"), ("n1", "n3"), ("n3", "n1"), ("n1", "n4"), ("n4", "n1"),
        ("n2", "n1"), ("n1", "n2"), ("n2", "n5"), ("n5", "n2"), ("n2", "n3"), ("n3", "n2"),
    ]  # fmt: skip
    assert agents.probes[0][2] == AgentKeys("s" * 32).peer_credential(holder="n2", peer="n1")
    assert len(burnins.fleet_links()) == 12

    agents.slow["n3"] = 100.0  # n3's link is slow: its burn-in fails with the figures
    passed, why = await burnins.run("n3")
    assert not passed
    assert "slow_p2p: by their median, its links with nodes n2, n4, n1 (the slower" in why
    assert "carried 100.0 MB/s, 10% of the median of the 12 links" in why
    assert fleet6.nodes["n3"].state is NodeState.DRAIN


async def test_one_slow_peer_does_not_fail_a_burn_in_nor_do_too_few_peers(
    fleet6: Registry, agents: Agents
) -> None:
    busy = {"n3", "n4"}
    burnins = BurnIns(fleet6, agents.send, busy=lambda: busy)
    for node in ("n3", "n4", "n5"):  # the fleet's links so far: fast
        assert await burnins.screen_join(node, "n2") == (True, "")
    agents.slow["n6"] = 1.0  # n6's link is slow

    assert await burnins.run("n1") == (True, "")  # from n2, n5, n6: their median is fast
    assert {p for n, p, _ in agents.probes if n == "n1"} == {"n2", "n5", "n6"}
    busy.update({"n2", "n5"})
    assert await burnins.run("n6") == (True, "")  # from n1 alone: not judged


async def test_a_replacement_joins_only_over_a_link_as_fast_as_the_fleets(
    fleet6: Registry, agents: Agents
) -> None:
    burnins = BurnIns(fleet6, agents.send)
    assert await burnins.screen_join("n1", "n2") == (True, "")  # nothing to judge by yet
    for node in ("n3", "n4"):
        assert await burnins.screen_join(node, "n2") == (True, "")

    agents.slow["n5"] = 400.0
    joins, why = await burnins.screen_join("n5", "n2")
    assert not joins
    assert why.startswith("slow_p2p: the link from node n2 to node n5 carried 400.0 MB/s, 40%")
    assert agents.probes[-2:] == [
        ("n5", "n2", None),  # n5 reads from n2, then n2 from n5
        ("n2", "n5", None),
    ]
    assert fleet6.nodes["n5"].state is NodeState.UP  # not drained: the job goes elsewhere

    agents.cut.add("n6")
    joins, why = await burnins.screen_join("n6", "n2")
    assert not joins and why.startswith("unreachable_p2p: the link from node n2 to node n6")

    agents.cut.clear()
    agents.cut.add("n2")  # n6 reaches n2, but n2 not n6: one way is enough to keep it out
    joins, why = await burnins.screen_join("n6", "n2")
    assert not joins and why.startswith("unreachable_p2p: the link from node n6 to node n2")

    off = BurnIns(fleet6, agents.send, screening=Screening(probe_bytes=0))
    asked = len(agents.probes)
    assert await off.screen_join("n5", "n2") == (True, "")
    assert await off.run("n1") == (True, "")
    assert len(agents.probes) == asked


async def test_a_survey_probes_two_idle_nodes_often_until_the_fleet_has_enough_figures(
    fleet6: Registry, agents: Agents, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = [1000.0]
    monkeypatch.setattr("supervisor.fleet.burnin.time.monotonic", lambda: clock[0])
    burnins = BurnIns(fleet6, agents.send, busy=lambda: {"n1", "n2"})

    async def settle() -> None:
        while burnins._surveying is not None:  # noqa: ASYNC110 - the task's own field
            await asyncio.sleep(0)

    burnins.survey()
    await settle()
    assert [(n, p) for n, p, _ in agents.probes] == [("n3", "n4"), ("n4", "n3")]
    burnins.survey()  # too soon
    clock[0] += 2.0
    burnins.survey()
    await settle()
    assert [(n, p) for n, p, _ in agents.probes][2:] == [("n5", "n6"), ("n6", "n5")]
    assert len(burnins.fleet_links()) == 4
    clock[0] += 2.0
    burnins.survey()  # enough figures: the next in ten minutes
    await settle()
    assert len(agents.probes) == 4
    clock[0] += 600.0
    burnins.survey()
    await settle()
    assert len(agents.probes) == 6


async def test_a_node_is_in_one_probe_at_a_time(fleet6: Registry, agents: Agents) -> None:
    # A recovery's probe of n3 while a survey probes n3 and n4: it waits its turn (the
    # fake fails a probe that overlaps another on a node).
    agents.probe_s = 0.05
    burnins = BurnIns(fleet6, agents.send, busy=lambda: {"n1", "n2", "n5", "n6"})
    burnins.survey()
    joined = await asyncio.gather(burnins.screen_join("n3", "n1"), burnins.screen_join("n5", "n6"))
    assert joined == [(True, ""), (True, "")]
    if burnins._surveying is not None:
        await burnins._surveying
    assert len(agents.probes) == 6  # the survey's two and the two joins' two each


async def test_links_that_carry_nothing_fail_a_burn_in_as_the_slowest(
    fleet6: Registry, agents: Agents
) -> None:
    burnins = BurnIns(fleet6, agents.send)
    for node in ("n1", "n2"):  # the fleet's figures
        assert await burnins.run(node) == (True, "")
    agents.cut.add("n3")  # n3's data network is dead: no probe reaches it, either way
    passed, why = await burnins.run("n3")
    assert not passed and "carried 0.000 MB/s, 0% of the median" in why


def test_a_probe_too_small_to_time_is_refused_in_the_settings() -> None:
    with pytest.raises(ValidationError, match="0 \\(no probes\\) or at least 65536"):
        SupervisorSettings(screen_probe_bytes=1000)
    assert SupervisorSettings(screen_probe_bytes=0).screen_probe_bytes == 0


async def test_one_command_probes_a_link_both_ways_when_both_agents_can_and_the_slower_counts(
    fleet6: Registry, agents: Agents
) -> None:
    announce_both_ways(fleet6, "n1", "n2", "n3", "n4", "n5", "n6")
    burnins = BurnIns(fleet6, agents.send)
    for node in ("n1", "n3", "n4"):  # the fleet's figures: both ways of each link
        assert await burnins.screen_join(node, "n2") == (True, "")
    assert len(burnins.fleet_links()) == 6

    agents.ways[("n5", "n2")] = 400.0  # slow from the replacement only: the way back
    joins, why = await burnins.screen_join("n5", "n2")

    assert not joins
    assert why.startswith("slow_p2p: the link from node n5 to node n2 carried 400.0 MB/s, 40%")
    assert agents.both_ways == [("n1", "n2"), ("n3", "n2"), ("n4", "n2"), ("n5", "n2")]
    assert len(agents.probes) == 4  # one command a link, not two
    assert sorted(burnins.fleet_links())[:2] == [400.0, 1000.0]  # both ways recorded
    assert len(burnins.fleet_links()) == 8
    assert min(agents.probe_timeouts) >= 2 * PROBE_COMMAND_S  # time for two ways


async def test_a_way_back_that_carries_nothing_keeps_a_replacement_out(
    fleet6: Registry, agents: Agents
) -> None:
    announce_both_ways(fleet6, "n2", "n6")
    burnins = BurnIns(fleet6, agents.send)
    agents.cut.add("n2")  # n6 reads from n2, but what n6 sends never reaches n2

    joins, why = await burnins.screen_join("n6", "n2")

    assert not joins and why.startswith("unreachable_p2p: the link from node n6 to node n2")
    assert agents.both_ways == [("n6", "n2")] and len(agents.probes) == 1


async def test_a_way_back_the_peer_refused_to_time_leaves_the_link_unjudged(
    fleet6: Registry, agents: Agents
) -> None:
    announce_both_ways(fleet6, "n2", "n6")
    burnins = BurnIns(fleet6, agents.send)
    agents.refused_uploads.add("n2")

    assert await burnins.screen_join("n6", "n2") == (True, "")  # no word on the link
    assert burnins.fleet_links() == [1000.0]  # the way that was measured still counts
    assert len(agents.probes) == 1


@pytest.mark.parametrize("announcing", [("n1",), ("n2",), ()], ids=["reader", "peer", "none"])
async def test_a_link_with_an_agent_from_before_both_ways_is_probed_by_two_commands(
    fleet6: Registry, agents: Agents, announcing: tuple[str, ...]
) -> None:
    announce_both_ways(fleet6, *announcing)
    burnins = BurnIns(fleet6, agents.send)

    assert await burnins.screen_join("n1", "n2") == (True, "")

    assert [(n, p) for n, p, _ in agents.probes] == [("n1", "n2"), ("n2", "n1")]
    assert agents.both_ways == []
    assert len(burnins.fleet_links()) == 2


async def test_a_node_is_in_one_both_ways_probe_at_a_time(fleet6: Registry, agents: Agents) -> None:
    # As with two commands: the fake fails a probe that overlaps another on a node.
    announce_both_ways(fleet6, "n1", "n2", "n3", "n4", "n5", "n6")
    agents.probe_s = 0.05
    burnins = BurnIns(fleet6, agents.send, busy=lambda: {"n1", "n2", "n5", "n6"})
    burnins.survey()
    joined = await asyncio.gather(burnins.screen_join("n3", "n1"), burnins.screen_join("n3", "n4"))
    assert joined == [(True, ""), (True, "")]
    if burnins._surveying is not None:
        await burnins._surveying
    assert len(agents.both_ways) == len(agents.probes) == 3  # the survey's, and a join's each
