"""The node registry over a real SQLite store: births, heartbeats, deaths and drains."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx import wire
from phalanx.wire import Health, HealthStatus, Reason
from supervisor.errors import Refused, RegistryError, UnknownNode
from supervisor.fleet.registry import PORT_REUSE_S, NodeState, Registry
from supervisor.store import Event, Store
from tests.unit.supervisor.conftest import OpenStore

OFFLINE_AFTER_S = 15.0


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def store(open_store: OpenStore) -> Iterator[Store]:
    store = open_store()
    yield store
    store.close()


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry(store: Store, clock: Clock) -> Registry:
    return Registry(store, offline_after_s=OFFLINE_AFTER_S, clock=clock)


OK = Health(status=HealthStatus.OK)
WARN = Health(
    status=HealthStatus.WARN, reasons=[Reason(code="row_remap_pending", severity="warn", gpu=0)]
)
DRAIN = Health(
    status=HealthStatus.DRAIN,
    reasons=[
        Reason(code="ecc_dbe", severity="drain", gpu=1, detail="1 uncorrected"),
        Reason(code="load_high", severity="warn"),
    ],
)


def _birth(
    node: str = "n1", *, seq: int = 1, health: Health = OK, gpus: int = 2, rack: str = "r1"
) -> wire.NodeBirth:
    return wire.NodeBirth(
        node=node,
        seq=seq,
        hostname=f"{node}.example",
        address="10.0.0.1",
        http_port=9400,
        gpus=[
            wire.GpuDescriptor(
                index=i, uuid=f"GPU-{node}-{i}", model="H100", memory_bytes=80 * 2**30
            )
            for i in range(gpus)
        ],
        gpu_backend="sim",
        topology=wire.Topology(rack=rack),
        version="0.1.0",
        started_at=1700000000.0,
        health=health,
    )


def _beat(node: str = "n1", *, seq: int = 1, n: int = 1, health: Health = OK) -> wire.Heartbeat:
    return wire.Heartbeat(node=node, seq=seq, n=n, sent_at=1700000000.0, health=health)


def _kinds(events: list[Event]) -> list[str]:
    return [e.kind for e in events]


def test_a_birth_makes_a_node_up_with_its_gpus(registry: Registry) -> None:
    registry.on_birth(_birth(gpus=4))

    view = registry.get("n1").view()
    assert view["state"] == "up"
    assert view["rack"] == "r1"
    assert [g["uuid"] for g in view["gpus"]] == [f"GPU-n1-{i}" for i in range(4)]
    assert view["reasons"] == []


def _states(events: list[Event]) -> list[tuple[str, str]]:
    return [(e.detail["previous"], e.detail["state"]) for e in events if e.kind == "state_changed"]


def test_a_first_birth_records_a_join_and_a_change_to_up(registry: Registry, store: Store) -> None:
    registry.on_birth(_birth())

    events = store.events(node="n1")
    assert _kinds(events) == ["node_joined", "state_changed"]
    assert _states(events) == [("offline", "up")]


def test_warn_health_makes_the_node_warn(registry: Registry) -> None:
    registry.on_birth(_birth())

    assert registry.on_heartbeat(_beat(health=WARN)) is True
    assert registry.get("n1").state is NodeState.WARN


def test_drain_health_drains_the_node_automatically_with_its_codes(registry: Registry) -> None:
    registry.on_birth(_birth())

    registry.on_heartbeat(_beat(health=DRAIN))

    node = registry.get("n1")
    assert node.state is NodeState.DRAIN
    assert node.drain is not None
    assert node.drain.by == "auto"
    assert node.drain.codes == ["ecc_dbe"]
    assert "ecc_dbe on GPU 1" in node.drain.reason


def test_an_automatic_drain_is_recorded_as_an_event(registry: Registry, store: Store) -> None:
    registry.on_birth(_birth())

    registry.on_heartbeat(_beat(health=DRAIN))

    drained = [e for e in store.events(node="n1") if e.kind == "node_drained"]
    assert len(drained) == 1
    assert drained[0].detail["by"] == "auto"
    assert drained[0].detail["codes"] == ["ecc_dbe"]
    assert _states(store.events(node="n1"))[-1] == ("up", "drain")


def test_a_birth_that_already_reports_drain_drains_the_node(registry: Registry) -> None:
    registry.on_birth(_birth(health=DRAIN))

    assert registry.get("n1").state is NodeState.DRAIN


def test_recovered_health_keeps_the_automatic_drain(registry: Registry) -> None:
    registry.on_birth(_birth())
    registry.on_heartbeat(_beat(n=1, health=DRAIN))

    registry.on_heartbeat(_beat(n=2, health=OK))

    node = registry.get("n1")
    assert node.state is NodeState.DRAIN
    assert node.drain is not None and node.drain.by == "auto"


def test_a_rebirth_with_healthy_health_keeps_the_automatic_drain(registry: Registry) -> None:
    registry.on_birth(_birth(seq=1, health=DRAIN))

    registry.on_birth(_birth(seq=2, health=OK))

    assert registry.get("n1").state is NodeState.DRAIN


def test_undrain_is_refused_while_health_still_says_drain(registry: Registry) -> None:
    registry.on_birth(_birth(health=DRAIN))

    with pytest.raises(Refused, match="ecc_dbe"):
        registry.undrain("n1")

    assert registry.get("n1").state is NodeState.DRAIN


def test_undrain_with_force_lifts_a_drain_health_still_asks_for(
    registry: Registry, store: Store
) -> None:
    registry.on_birth(_birth(health=DRAIN))

    node = registry.undrain("n1", force=True)

    assert node.drain is None
    assert node.state is NodeState.UP
    undrained = [e for e in store.events(node="n1") if e.kind == "node_undrained"]
    assert undrained[0].detail["forced"] is True


def test_undrain_is_allowed_once_health_recovered(registry: Registry) -> None:
    registry.on_birth(_birth())
    registry.on_heartbeat(_beat(n=1, health=DRAIN))
    registry.on_heartbeat(_beat(n=2, health=OK))

    assert registry.undrain("n1").state is NodeState.UP


def test_a_node_that_is_not_drained_cannot_be_undrained(registry: Registry) -> None:
    registry.on_birth(_birth())

    with pytest.raises(Refused, match="not drained"):
        registry.undrain("n1")


def test_an_operator_drain_records_who_and_why(registry: Registry, store: Store) -> None:
    registry.on_birth(_birth())

    node = registry.drain("n1", "bad fan")

    assert node.state is NodeState.DRAIN
    assert node.drain is not None
    assert (node.drain.by, node.drain.reason) == ("operator", "bad fan")
    assert store.events(node="n1")[-1].detail == {"by": "operator", "reason": "bad fan"}


@pytest.mark.parametrize("reason", ["", "   "])
def test_an_operator_drain_needs_a_reason(registry: Registry, reason: str) -> None:
    registry.on_birth(_birth())

    with pytest.raises(RegistryError, match="reason"):
        registry.drain("n1", reason)

    assert registry.get("n1").drain is None


def test_an_operator_drain_of_an_auto_drained_node_keeps_it_automatic(
    registry: Registry,
) -> None:
    registry.on_birth(_birth(health=DRAIN))

    node = registry.drain("n1", "RMA ticket 42")

    assert node.drain is not None
    assert node.drain.by == "auto"
    assert "RMA ticket 42" in node.drain.reason


def test_an_operator_drained_node_stays_drained_when_healthy(registry: Registry) -> None:
    registry.on_birth(_birth())
    registry.drain("n1", "maintenance")

    registry.on_heartbeat(_beat(health=OK))

    assert registry.get("n1").state is NodeState.DRAIN


@pytest.mark.parametrize("action", ["get", "drain", "undrain"])
def test_an_unknown_node_raises_unknown_node(registry: Registry, action: str) -> None:
    with pytest.raises(UnknownNode, match="ghost") as caught:
        if action == "get":
            registry.get("ghost")
        elif action == "drain":
            registry.drain("ghost", "why not")
        else:
            registry.undrain("ghost")

    assert caught.value.node == "ghost"


def test_a_death_with_the_current_seq_makes_the_node_offline_by_last_will(
    registry: Registry,
) -> None:
    registry.on_birth(_birth(seq=4))

    registry.on_death(wire.NodeDeath(node="n1", seq=4))

    node = registry.get("n1")
    assert node.state is NodeState.OFFLINE
    assert node.view()["offline_cause"] == "last will"


def test_a_shutdown_death_is_a_clean_shutdown(registry: Registry) -> None:
    registry.on_birth(_birth(seq=4))

    registry.on_death(wire.NodeDeath(node="n1", seq=4, cause="shutdown"))

    assert registry.get("n1").offline_cause == "clean shutdown"


def test_a_death_older_than_the_current_birth_is_ignored(registry: Registry) -> None:
    registry.on_birth(_birth(seq=5))

    registry.on_death(wire.NodeDeath(node="n1", seq=4))

    assert registry.get("n1").state is NodeState.UP


def test_a_death_of_an_unknown_node_is_ignored(registry: Registry) -> None:
    registry.on_death(wire.NodeDeath(node="ghost", seq=1))

    assert "ghost" not in registry.nodes


def test_a_birth_older_than_the_current_one_is_ignored(registry: Registry) -> None:
    registry.on_birth(_birth(seq=5, rack="new"))

    registry.on_birth(_birth(seq=4, rack="old"))

    assert registry.get("n1").view()["rack"] == "new"
    assert registry.get("n1").birth_seq == 5


def test_a_heartbeat_with_a_newer_seq_than_the_known_birth_returns_false(
    registry: Registry,
) -> None:
    registry.on_birth(_birth(seq=1))

    assert registry.on_heartbeat(_beat(seq=2, health=DRAIN)) is False
    assert registry.get("n1").state is NodeState.UP


def test_a_heartbeat_with_an_older_seq_returns_false(registry: Registry) -> None:
    registry.on_birth(_birth(seq=3))

    assert registry.on_heartbeat(_beat(seq=2)) is False


def test_a_heartbeat_of_an_unknown_node_returns_false(registry: Registry) -> None:
    assert registry.on_heartbeat(_beat(node="ghost")) is False


def _port(n: int, port: int) -> wire.Heartbeat:
    return _beat(n=n).model_copy(update={"port": port})


def test_a_heartbeats_free_port_is_taken_once_and_not_offered_again(
    registry: Registry, clock: Clock
) -> None:
    registry.on_birth(_birth())
    assert registry.take_port("n1") is None  # no heartbeat yet: the launch asks the node

    registry.on_heartbeat(_port(1, 41000))
    assert registry.take_port("n1") == 41000
    assert registry.take_port("n1") is None  # one launch per port

    registry.on_heartbeat(_port(2, 41007))
    assert registry.take_port("n1") == 41007
    registry.on_heartbeat(_port(3, 41000))  # the first again: its rank 0 may not bind yet
    assert registry.take_port("n1") is None

    clock.now += PORT_REUSE_S + 1  # long bound (or given up) since
    registry.on_heartbeat(_port(4, 41000))
    assert registry.take_port("n1") == 41000


def test_a_port_alloc_port_handed_out_is_not_offered_by_a_heartbeat(registry: Registry) -> None:
    registry.on_birth(_birth())
    registry.on_heartbeat(_port(1, 41000))
    registry.port_given("n1", 41000)  # the node's answer to alloc_port named it too
    assert registry.take_port("n1") is None
    registry.on_heartbeat(_port(2, 41000))
    assert registry.take_port("n1") is None


def test_no_port_is_offered_by_a_reborn_offline_or_unknown_node(registry: Registry) -> None:
    registry.on_birth(_birth())
    registry.on_heartbeat(_beat().model_copy(update={"port": 41000}))
    registry.on_birth(_birth(seq=2))  # a new agent process: its old port says nothing
    assert registry.take_port("n1") is None

    registry.on_heartbeat(_beat(seq=2).model_copy(update={"port": 41001}))
    registry.on_death(wire.NodeDeath(node="n1", seq=2, cause="lost"))
    assert registry.take_port("n1") is None
    assert registry.take_port("ghost") is None


def test_check_timeouts_marks_a_silent_node_offline(registry: Registry, clock: Clock) -> None:
    registry.on_birth(_birth("silent"))
    clock.now += OFFLINE_AFTER_S + 1

    assert registry.check_timeouts() == ["silent"]
    node = registry.get("silent")
    assert node.state is NodeState.OFFLINE
    assert "no heartbeat" in node.offline_cause


def test_a_supervisor_behind_on_its_messages_gives_its_nodes_that_long_more(
    registry: Registry, clock: Clock
) -> None:
    registry.on_birth(_birth("quiet"))
    clock.now += OFFLINE_AFTER_S + 1

    assert registry.check_timeouts(behind_s=5.0) == []
    clock.now += 5.0
    assert registry.check_timeouts(behind_s=5.0) == ["quiet"]


def test_check_timeouts_leaves_a_node_that_beat_recently(registry: Registry, clock: Clock) -> None:
    registry.on_birth(_birth("silent"))
    registry.on_birth(_birth("fresh"))
    clock.now += OFFLINE_AFTER_S - 1
    registry.on_heartbeat(_beat("fresh"))
    clock.now += 2

    assert registry.check_timeouts() == ["silent"]
    assert registry.get("fresh").state is NodeState.UP


def test_nodes_heard_all_now_get_a_whole_timeout_again(registry: Registry, clock: Clock) -> None:
    registry.on_birth(_birth("quiet"))
    clock.now += OFFLINE_AFTER_S - 1  # the supervisor's own link was down meanwhile
    registry.heard_all_now()
    clock.now += OFFLINE_AFTER_S - 1

    assert registry.check_timeouts() == []
    clock.now += 2
    assert registry.check_timeouts() == ["quiet"]


def test_wills_the_broker_sent_as_it_went_down_are_taken_back(
    registry: Registry, clock: Clock
) -> None:
    registry.on_birth(_birth("early"))
    registry.on_birth(_birth("late"))
    registry.on_death(wire.NodeDeath(node="early", seq=1, cause="lost"))
    clock.now += 30.0
    link_lost = clock.now
    registry.on_death(wire.NodeDeath(node="late", seq=1, cause="lost"))

    assert registry.revive(since=link_lost - 5.0) == ["late"]
    assert registry.get("late").state is NodeState.UP
    assert registry.get("early").state is NodeState.OFFLINE  # died long before: it stays
    clock.now += OFFLINE_AFTER_S + 1
    assert registry.check_timeouts() == ["late"]  # and if it does not come back, it goes


def test_a_node_is_not_timed_out_twice(registry: Registry, clock: Clock) -> None:
    registry.on_birth(_birth())
    clock.now += OFFLINE_AFTER_S + 1
    registry.check_timeouts()

    assert registry.check_timeouts() == []


def test_a_heartbeat_after_a_timeout_brings_the_node_back(registry: Registry, clock: Clock) -> None:
    registry.on_birth(_birth())
    clock.now += OFFLINE_AFTER_S + 1
    registry.check_timeouts()

    assert registry.on_heartbeat(_beat()) is True
    assert registry.get("n1").state is NodeState.UP


def test_a_health_change_between_node_and_gpu_0_is_recorded(
    registry: Registry, store: Store
) -> None:
    node_wide = Health(
        status=HealthStatus.DRAIN, reasons=[Reason(code="nvml_error", severity="drain")]
    )
    on_gpu_0 = Health(
        status=HealthStatus.DRAIN, reasons=[Reason(code="nvml_error", severity="drain", gpu=0)]
    )
    registry.on_birth(_birth(health=node_wide))

    registry.on_heartbeat(_beat(health=on_gpu_0))

    changes = [e for e in store.events(node="n1") if e.kind == "health_changed"]
    assert [e.detail["reasons"][0]["gpu"] for e in changes] == [None, 0]


def test_on_event_sees_every_recorded_event(store: Store, clock: Clock) -> None:
    seen: list[Event] = []
    registry = Registry(store, offline_after_s=OFFLINE_AFTER_S, clock=clock, on_event=seen.append)

    registry.on_birth(_birth())

    assert seen == store.events()


def test_a_new_registry_over_the_same_store_remembers_drains_reasons_and_events(
    tmp_path: Path,
    clock: Clock,
    open_store: OpenStore,
) -> None:
    path = tmp_path / "state.db"
    first_store = open_store(path)
    first = Registry(first_store, offline_after_s=OFFLINE_AFTER_S, clock=clock)
    first.on_birth(_birth("sick", gpus=3))
    first.on_heartbeat(_beat("sick", health=DRAIN))
    first.on_birth(_birth("held"))
    first.drain("held", "maintenance window")
    events_before = first_store.events(limit=1000)
    first_store.close()

    store = open_store(path)
    try:
        again = Registry(store, offline_after_s=OFFLINE_AFTER_S, clock=clock)

        sick, held = again.get("sick"), again.get("held")
        assert sick.drain is not None and held.drain is not None
        assert (sick.drain.by, sick.drain.codes) == ("auto", ["ecc_dbe"])
        assert (held.drain.by, held.drain.reason) == ("operator", "maintenance window")
        assert [r.code for r in sick.health.reasons] == ["ecc_dbe", "load_high"]
        assert sick.view()["gpu_count"] == 3
        assert store.events(limit=1000) == events_before
    finally:
        store.close()


def test_a_restarted_registry_shows_remembered_nodes_offline_until_they_are_heard(
    tmp_path: Path,
    clock: Clock,
    open_store: OpenStore,
) -> None:
    path = tmp_path / "state.db"
    first_store = open_store(path)
    Registry(first_store, offline_after_s=OFFLINE_AFTER_S, clock=clock).on_birth(
        _birth(seq=2, health=DRAIN)
    )
    first_store.close()

    store = open_store(path)
    try:
        again = Registry(store, offline_after_s=OFFLINE_AFTER_S, clock=clock)
        assert again.get("n1").state is NodeState.OFFLINE

        assert again.on_heartbeat(_beat(seq=2, health=OK)) is True
        assert again.get("n1").state is NodeState.DRAIN
    finally:
        store.close()


def _gauged(temperature: float, *, status: HealthStatus = HealthStatus.OK) -> Health:
    return Health(
        status=status,
        reasons=[Reason(code="hot", severity="warn", detail="")]
        if status is HealthStatus.WARN
        else [],
        gpus=[
            wire.GpuGauges(index=i, temperature_c=temperature + i, throttle=["sw_power_cap"][:i])
            for i in range(2)
        ],
        host=wire.HostGauges(
            disk_free_bytes=1,
            disk_total_bytes=2,
            mem_available_bytes=3,
            mem_total_bytes=4,
            load1=0.5,
            cpu_count=8,
        ),
        sampled_at=1700000001.0,
    )


def test_a_heartbeat_s_gauges_are_kept_as_they_came_and_no_heartbeat_model_is_kept(
    registry: Registry,
) -> None:
    registry.on_birth(_birth())
    node = registry.get("n1")
    health = node.health

    registry.on_heartbeat(_beat(health=_gauged(40.0)))
    registry.on_heartbeat(_beat(n=2, health=_gauged(50.0)))

    sent = _gauged(50.0)
    assert node.gauges.gpu_dicts() == [g.model_dump() for g in sent.gpus]
    assert sent.host is not None and node.gauges.host_dict() == sent.host.model_dump()
    assert node.gauges.sampled_at == sent.sampled_at
    assert node.health is health  # the same status and reasons: the same object
    gc.collect()
    gc.collect()  # (the throttle tuple inside first, then the tuple holding it)
    assert not gc.is_tracked(node.gauges.gpus)  # the collector let go


def test_a_changed_health_is_kept_without_its_gauges(registry: Registry, store: Store) -> None:
    registry.on_birth(_birth())
    node = registry.get("n1")

    registry.on_heartbeat(_beat(health=_gauged(90.0, status=HealthStatus.WARN)))

    assert node.state is NodeState.WARN
    assert [r.code for r in node.reasons] == ["hot"]
    assert node.health.gpus == [] and node.health.host is None
    assert node.gauges.gpu_dicts()[1]["temperature_c"] == 91.0
    assert "health_changed" in _kinds(store.events(node="n1"))


def test_a_birth_s_gauges_are_the_node_s_until_its_first_heartbeat_and_not_kept_twice(
    registry: Registry,
) -> None:
    registry.on_birth(_birth(health=_gauged(60.0)))
    node = registry.get("n1")

    assert node.gauges.gpu_dicts()[0]["temperature_c"] == 60.0
    assert node.birth is not None and node.birth.health.gpus == []
    assert node.birth.health.host is None
    assert [g["uuid"] for g in node.view()["gpus"]] == ["GPU-n1-0", "GPU-n1-1"]
