"""Agent mode's pure parts: buddies, the supervisor's catalog, its wire messages, the env."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

import ckpt
from ckpt import Checkpointer, CheckpointError
from ckpt.peer import SealCheck
from phalanx import wire
from supervisor.checkpoints.catalog import (
    CheckpointCatalog,
    StepRows,
    Where,
    gang_restore,
    pick_buddies,
)
from supervisor.checkpoints.rows import CkptRows
from tests.unit.supervisor.conftest import OpenStore


def landing(
    step: int, rank: int, tier: str = "nvme", event: str = "landed", node: str = "n01"
) -> wire.CkptLanding:
    return wire.CkptLanding(
        node=node,
        job="j-1",
        step=step,
        rank=rank,
        tier=tier,  # type: ignore[arg-type]
        event=event,
        nbytes=100 + rank,
        checksum=f"xxh3_128:{rank:032x}",  # type: ignore[arg-type]
        at=time.time(),
    )


def test_buddies_leave_the_rack_when_another_rack_exists() -> None:
    racks = {"a1": "r1", "a2": "r1", "b1": "r2", "b2": "r2"}

    buddies = pick_buddies(list(racks), racks)

    assert set(buddies) == set(racks)
    assert all(racks[n] != racks[b] for n, b in buddies.items())
    assert sorted(buddies.values()) == sorted(racks)  # nobody holds two nodes' copies


def _buddies_node_by_node(nodes: list[str], racks: dict[str, str]) -> dict[str, str]:
    """The rule tried shift by shift and node by node: what pick_buddies must agree with."""
    if len(nodes) < 2:
        return {}
    ring = sorted(nodes, key=lambda n: (racks.get(n, ""), n))
    size = len(ring)
    moved = {
        s: sum(racks.get(ring[i], "") != racks.get(ring[(i + s) % size], "") for i in range(size))
        for s in range(1, size)
    }
    best = max(range(1, size), key=lambda s: (moved[s], -s))
    return {ring[i]: ring[(i + best) % size] for i in range(size)}


@given(st.lists(st.integers(0, 5), min_size=0, max_size=40))
def test_buddies_agree_with_trying_every_shift_node_by_node(rack_of: list[int]) -> None:
    racks = {f"n{i:02d}": f"r{r}" for i, r in enumerate(rack_of)}
    nodes = list(racks)

    assert pick_buddies(nodes, racks) == _buddies_node_by_node(nodes, racks)


def test_buddies_of_one_big_rack_and_many_lone_nodes_are_found_at_once() -> None:
    racks = {f"n{i:04d}": ("big" if i < 1100 else f"r{i}") for i in range(2048)}

    buddies = pick_buddies(list(racks), racks)

    assert sum(racks[n] != racks[b] for n, b in buddies.items()) == 2 * (2048 - 1100)


def test_buddies_of_2048_unlabelled_nodes_are_a_ring() -> None:
    nodes = [f"n{i:04d}" for i in range(2048)]

    buddies = pick_buddies(nodes, {})

    assert buddies["n0000"] == "n0001" and buddies["n2047"] == "n0000"


def test_buddies_in_one_rack_form_a_ring_and_a_lone_node_has_none() -> None:
    racks = {"n1": "r", "n2": "r", "n3": "r"}

    assert pick_buddies(list(racks), racks) == {"n1": "n2", "n2": "n3", "n3": "n1"}
    assert pick_buddies(["n1"], racks) == {}


def test_a_step_is_committed_at_a_tier_only_once_every_rank_landed_there(
    tmp_path: Path, open_store: OpenStore
) -> None:
    catalog = CheckpointCatalog(open_store())

    assert catalog.on_landing(landing(5, 0), world_size=2) is False
    assert [(m.node, m.steps) for m in catalog.messages("j-1", 2)] == [("n01", [])]
    assert catalog.on_landing(landing(5, 1, node="n02"), world_size=2) is True
    assert catalog.on_landing(landing(5, 1, node="n02"), world_size=2) is False  # redelivery

    n01, n02 = catalog.messages("j-1", 2)
    assert (n01.node, n02.node) == ("n01", "n02")
    assert [(s.step, sorted(s.committed)) for s in n01.steps] == [(5, ["nvme"])]
    # Each node hears of its own ranks' shards only.
    assert [(s.rank, s.nbytes) for s in n01.steps[0].shards] == [(0, 100)]
    assert [(s.rank, s.nbytes) for s in n02.steps[0].shards] == [(1, 101)]
    view = catalog.view("j-1", 2, ["ram", "nvme"])
    assert view["steps"][0]["partial"] == {} and view["steps"][0]["where"]["nvme"] == {
        "0": "n01",
        "1": "n02",
    }


def test_a_deleted_step_leaves_the_catalog_at_that_tier_only(
    tmp_path: Path, open_store: OpenStore
) -> None:
    catalog = CheckpointCatalog(open_store())
    for tier in ("nvme", "object"):
        for rank in (0, 1):
            catalog.on_landing(landing(5, rank, tier), world_size=2)

    assert catalog.on_landing(landing(5, 0, "object", "deleted"), world_size=2) is True

    assert [sorted(s.committed) for s in catalog.messages("j-1", 2)[0].steps] == [["nvme"]]


def test_every_node_with_a_shard_still_known_gets_a_catalog_and_no_other(
    open_store: OpenStore,
) -> None:
    catalog = CheckpointCatalog(open_store())
    for rank, node in ((0, "n01"), (1, "n02")):
        catalog.on_landing(landing(5, rank, "nvme", node=node), world_size=2)
    catalog.on_landing(landing(6, 0, "object", node="n03"), world_size=2)  # never committed
    catalog.on_landing(landing(7, 0, "ram", node="n04"), world_size=2)
    catalog.on_landing(landing(7, 0, "ram", "deleted", node="n04"), world_size=2)

    assert catalog.rows.shard_nodes("j-1") == {"n01", "n02", "n03"}
    assert catalog.rows.shard_nodes("j-2") == set()
    assert [m.node for m in catalog.messages("j-1", 2, nodes=["n05"])] == [
        "n01",
        "n02",
        "n03",
        "n05",
    ]


def test_the_catalog_message_is_retained_per_job_and_node_and_checks_its_topic() -> None:
    msg = wire.CkptCatalog(
        job="j-1",
        node="n01",
        world_size=1,
        steps=[
            wire.CkptStep(
                step=3,
                committed={"ram": 1.0},
                shards=[wire.CkptShard(rank=0, checksum="c", nbytes=1)],
            )
        ],
    )

    parsed = wire.parse(wire.catalog_topic("j-1", "n01"), wire.encode(msg))

    assert parsed.message == msg and parsed.node == "n01"
    assert wire.parse(wire.catalog_topic("j-1", "n01"), b"").message is None
    with pytest.raises(wire.WireError, match="names job"):
        wire.parse(wire.catalog_topic("j-2", "n01"), wire.encode(msg))
    with pytest.raises(wire.WireError, match="names node"):
        wire.parse(wire.catalog_topic("j-1", "n02"), wire.encode(msg))
    assert isinstance(
        wire.parse(wire.ckpt_topic("n01"), wire.encode(landing(1, 0))).message, wire.CkptLanding
    )


def test_the_message_of_a_node_stays_small_however_many_ranks_the_job_has(
    tmp_path: Path,
    open_store: OpenStore,
) -> None:
    world, per_node = 4096, 8  # one step of the old per-job message overflowed at ~2,400
    catalog = CheckpointCatalog(open_store())
    for step in (10, 20):
        for rank in range(world):
            catalog.on_landing(
                landing(step, rank, "object", node=f"n{rank // per_node:04d}"), world_size=world
            )
    placement = {r: f"n{r // per_node:04d}" for r in range(world)}

    messages = catalog.messages("j-1", world, placement=placement)

    assert len(messages) == world // per_node
    for msg in (messages[0], messages[-1]):
        payload = wire.encode(msg)
        assert len(payload) < wire.MAX_PAYLOAD_BYTES // 8
        assert wire.parse(wire.catalog_topic("j-1", msg.node), payload).message == msg
        assert [s.step for s in msg.steps] == [10, 20] and msg.restore_step == 20
        assert len(msg.steps[-1].shards) == per_node


def test_the_gang_restores_from_the_newest_step_every_rank_can_read_where_it_runs(
    tmp_path: Path,
    open_store: OpenStore,
) -> None:
    catalog = CheckpointCatalog(open_store())
    for rank, node, buddy in ((0, "n01", "n02"), (1, "n02", "n01")):
        for step, tiers in (
            (10, ("nvme", "object")),
            (20, ("ram", "nvme", "peer")),
            (30, ("ram",)),
        ):
            for tier in tiers:
                msg = landing(step, rank, tier, node=node)
                if tier == "peer":
                    msg = msg.model_copy(update={"holder": buddy})
                catalog.on_landing(msg, world_size=2)

    def restore(placement: dict[int, str], alive: set[str]) -> int | None:
        msgs = catalog.messages("j-1", 2, placement=placement, alive=alive)
        assert len({m.restore_step for m in msgs}) == 1  # one step for the whole gang
        return msgs[0].restore_step

    both = {"n01", "n02", "n03"}
    assert restore({0: "n01", 1: "n02"}, both) == 30  # each rank's own RAM
    # n02 died; a spare n03 takes rank 1: step 30 was only in n02's RAM, step 20's peer
    # copy of rank 1 lives on n01, alive.
    assert restore({0: "n01", 1: "n03"}, {"n01", "n03"}) == 20
    # n01 is gone too and rank 0 moved: only the object store has a copy for everyone.
    assert restore({0: "n03", 1: "n04"}, {"n03", "n04"}) == 10
    msg = catalog.messages("j-1", 2, placement={0: "n03", 1: "n04"}, alive={"n03", "n04"})[0]
    assert msg.restore_note == ""
    catalog.on_landing(landing(10, 0, "object", "corrupt"), world_size=2)
    msgs = catalog.messages("j-1", 2, placement={0: "n03", 1: "n04"}, alive={"n03", "n04"})
    assert msgs[0].restore_step is None
    assert "rank 0 (on n03) can read no copy of step 30" in msgs[0].restore_note


def test_a_rank_reporting_a_corrupt_copy_uncommits_the_step_at_that_tier_only(
    tmp_path: Path,
    open_store: OpenStore,
) -> None:
    catalog = CheckpointCatalog(open_store())
    for tier in ("nvme", "object"):
        for rank in (0, 1):
            catalog.on_landing(landing(5, rank, tier, node=f"n0{rank + 1}"), world_size=2)

    assert catalog.on_landing(landing(5, 1, "nvme", "corrupt", node="n02"), world_size=2)

    view = catalog.view("j-1", 2, ["nvme", "object"])["steps"][0]
    assert sorted(view["committed"]) == ["object"] and view["partial"] == {"nvme": 1}
    assert "ckpt_corrupt" in [e.kind for e in catalog.store.events(limit=5)]


def test_checkpointer_without_dir_outside_phalanx_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in ("PHALANX_AGENT_SOCKET", "PHALANX_JOB_ID", "PHALANX_GENERATION"):
        monkeypatch.delenv(key, raising=False)

    with pytest.raises(CheckpointError, match=r"PHALANX_AGENT_SOCKET.*pass dir=PATH"):
        Checkpointer()


@pytest.mark.parametrize("compressed", [True, False])
def test_a_buddy_accepts_a_sealed_shard_and_refuses_one_with_a_flipped_bit(
    compressed: bool,
) -> None:
    shard = ckpt.encode({"w": list(range(1000)), "b": b"x" * 5000})
    ckpt.seal(shard)
    bad = bytearray(shard)
    bad[100] ^= 0x01

    def check(data: bytes) -> str | None:
        if compressed:
            data = zstandard.ZstdCompressor(level=1).compress(data)
        seal = SealCheck(compressed)
        for start in range(0, len(data), 777):  # in pieces, as a body streams in
            seal.feed(data[start : start + 777])
        return seal.problem()

    assert check(bytes(shard)) is None
    assert "content hashes to" in (check(bytes(bad)) or "")
    assert "truncated" in (check(bytes(shard[:-5])) or "")


def test_landings_recorded_in_one_batch_commit_once_and_a_failed_batch_leaves_nothing(
    tmp_path: Path,
    open_store: OpenStore,
) -> None:
    store = open_store()
    catalog = CheckpointCatalog(store)

    with store.batch():
        committed = [catalog.on_landing(landing(5, rank), world_size=3) for rank in range(3)]
    assert committed == [False, False, True]
    assert CkptRows.of(store).commits("j-1")[0][:2] == (5, "nvme")

    with pytest.raises(RuntimeError), store.batch():
        catalog.on_landing(landing(6, 0), world_size=3)
        raise RuntimeError("the flush failed half way")
    catalog.forget()
    assert CkptRows.of(store).shard_rows_of("j-1", 6, "nvme") == {}
    for rank in range(3):  # the landings come again: the step still commits, once
        committed.append(catalog.on_landing(landing(6, rank), world_size=3))
    assert committed[3:] == [False, False, True]


def test_a_step_saved_again_by_a_newer_generation_never_commits_two_generations_shards(
    tmp_path: Path,
    open_store: OpenStore,
) -> None:
    catalog = CheckpointCatalog(open_store())

    def land(rank: int, generation: int) -> bool:
        msg = landing(8, rank).model_copy(
            update={"generation": generation, "checksum": f"g{generation}r{rank}"}
        )
        return catalog.on_landing(msg, world_size=2)

    # Generation 1 saved step 8 on rank 0 only, then failed; generation 2 restored an
    # older step and saves step 8 again. Rank 0's generation-1 shard does not count.
    assert land(0, 1) is False
    assert land(1, 2) is False
    assert land(0, 1) is False  # a late write-down of generation 1: ignored
    assert land(0, 2) is True  # committed with generation 2's shards only
    msg = catalog.messages("j-1", 2)[0]
    assert [s.checksum for s in msg.steps[0].shards] == ["g2r0", "g2r1"]
    # A committed step saved again by a newer generation is no longer committed there
    # until every rank of that generation landed it.
    assert land(1, 3) is True
    assert catalog.messages("j-1", 2)[0].steps == []
    assert land(0, 3) is True
    assert [s.checksum for s in catalog.messages("j-1", 2)[0].steps[0].shards] == ["g3r0", "g3r1"]


def test_a_staged_copy_of_a_save_counts_with_that_saves_shards(
    tmp_path: Path, open_store: OpenStore
) -> None:
    catalog = CheckpointCatalog(open_store())

    def land(rank: int, generation: int, checksum: str, node: str, event: str = "landed") -> bool:
        msg = landing(8, rank, tier="ram", node=node).model_copy(
            update={"generation": generation, "checksum": checksum, "event": event}
        )
        return catalog.on_landing(msg, world_size=2)

    assert land(0, 1, "g1r0", "n01") is False
    assert land(1, 1, "g1r1", "n02") is True  # generation 1 saved step 8 in RAM on both
    # n02 died; generation 2 runs rank 1 on the spare n03, which staged the copy it
    # restored in RAM: a copy of generation 1's save, so the step stays committed.
    assert land(1, 2, "g1r1", "n03", "staged") is False
    view = catalog.view("j-1", 2, ["ram"])
    assert view["steps"][0]["where"]["ram"] == {"0": "n01", "1": "n03"}
    assert land(1, 2, "nothing saved these bytes", "n03", "staged") is False  # ignored
    assert catalog.view("j-1", 2, ["ram"])["steps"][0]["where"]["ram"]["1"] == "n03"
    # A save of step 8 by generation 2 (other bytes) is one again: the old commit goes.
    assert land(0, 2, "g2r0", "n01") is True
    step = catalog.view("j-1", 2, ["ram"])["steps"][0]
    assert step["committed"] == {} and step["partial"] == {"ram": 1}


def test_a_newer_generations_save_of_the_same_bytes_is_a_save_not_a_copy(
    tmp_path: Path,
    open_store: OpenStore,
) -> None:
    # Generation 2 restored step 8 and trained to step 10 again: rank 0's state came out
    # bit for bit the same (a shard holds no time or generation), rank 1's did not. Both
    # are generation 2's saves: the step commits with them, and the agents hear of it.
    catalog = CheckpointCatalog(open_store())

    def land(rank: int, generation: int, checksum: str) -> bool:
        msg = landing(10, rank).model_copy(update={"generation": generation, "checksum": checksum})
        return catalog.on_landing(msg, world_size=2)

    assert land(0, 1, "A0") is False
    assert land(1, 1, "A1") is True
    assert land(0, 2, "A0") is True  # generation 1's commit goes: a newer save is coming
    assert land(1, 2, "B1") is True  # ... and generation 2's comes
    shards = catalog.messages("j-1", 2)[0].steps[0].shards
    assert [s.checksum for s in shards] == ["A0", "B1"]


def test_a_shrunk_gang_restores_the_shards_its_nodes_saved_at_the_larger_size(
    open_store: OpenStore,
) -> None:
    """Three nodes of two ranks saved step 20 in RAM; n02 is gone, the gang runs on n01 and
    n03 (ranks 0-3), n03's ranks 2 and 3 restoring the shards of its old ranks 4 and 5."""
    catalog = CheckpointCatalog(open_store())
    for rank in range(6):
        catalog.on_landing(landing(20, rank, "ram", node=f"n0{rank // 2 + 1}"), world_size=6)
    placement = {0: "n01", 1: "n01", 2: "n03", 3: "n03"}
    alive = {"n01", "n03"}
    plain = catalog.messages("j-1", 4, placement=placement, alive=alive)
    assert {m.restore_step for m in plain} == {None}  # ranks 2, 3 own no copy on n03
    msgs = {
        m.node: m
        for m in catalog.messages("j-1", 4, placement=placement, alive=alive, elastic=True)
    }
    assert {m.restore_step for m in msgs.values()} == {20}
    assert msgs["n03"].sources == {2: 4, 3: 5}
    # Step 20 was saved by 6 ranks: the manifests an agent writes of it say so.
    assert msgs["n03"].steps[0].world_size == 6
    assert msgs["n01"].sources == {}  # its ranks restore their own shards
    assert {4, 5} <= {s.rank for s in msgs["n03"].steps[0].shards}  # what its ranks read
    # A step the smaller gang saved itself is read by each rank as its own.
    for rank in range(4):
        catalog.on_landing(landing(30, rank, "ram", node=placement[rank]), world_size=4)
    msgs = {
        m.node: m
        for m in catalog.messages("j-1", 4, placement=placement, alive=alive, elastic=True)
    }
    assert msgs["n03"].restore_step == 30 and msgs["n03"].sources == {}
    step30 = next(s for s in msgs["n03"].steps if s.step == 30)
    assert step30.world_size is None  # saved by the gang's own 4 ranks
    assert "world_size" not in step30.model_dump(mode="json")  # what older agents read
    assert {s.rank for s in next(s for s in msgs["n03"].steps if s.step == 30).shards} == {2, 3}
    # The gang grows back to 3 nodes: n02's ranks 4, 5 (a new node, no copy) read shards
    # 0 and 1 from the object store (ranks 0 and 1 read them too: 4 shards, 6 ranks).
    for rank in range(4):
        catalog.on_landing(landing(30, rank, "object", node=placement[rank]), world_size=4)
    grown = {**placement, 4: "n02", 5: "n02"}
    msgs = {
        m.node: m
        for m in catalog.messages("j-1", 6, placement=grown, alive=alive | {"n02"}, elastic=True)
    }
    assert {m.restore_step for m in msgs.values()} == {30}
    assert msgs["n02"].sources == {4: 0, 5: 1} and msgs["n01"].sources == {}
    step30 = next(s for s in msgs["n02"].steps if s.step == 30)
    assert {0, 1} <= {s.rank for s in step30.shards}  # what n02's ranks read, listed there


def test_a_resharding_gang_reads_any_saved_shard_so_every_node_lists_them_all(
    open_store: OpenStore,
) -> None:
    """``elastic.reshard``: a rank of the 4-rank gang may read any of the 6 shards step
    20 was saved in, so the step restores only once every node can read every one (the
    object store here), and every node's message lists all 6 of that step."""
    catalog = CheckpointCatalog(open_store())
    for rank in range(6):
        catalog.on_landing(landing(20, rank, "ram", node=f"n0{rank // 2 + 1}"), world_size=6)
    placement = {0: "n01", 1: "n01", 2: "n03", 3: "n03"}
    alive = {"n01", "n03"}

    def messages() -> dict[str, Any]:
        return {
            m.node: m
            for m in catalog.messages("j-1", 4, placement=placement, alive=alive, sharded=True)
        }

    msgs = messages()
    # Each node holds its old ranks' copies in RAM only: n03 cannot read n01's.
    assert {m.restore_step for m in msgs.values()} == {None}
    note = msgs["n01"].restore_note
    assert "node n03 can read no copy of saved rank 0's shard of step 20" in note
    for rank in range(6):
        catalog.on_landing(landing(20, rank, "object", node=f"n0{rank // 2 + 1}"), world_size=6)
    msgs = messages()
    assert {m.restore_step for m in msgs.values()} == {20}
    for node in ("n01", "n03"):
        assert msgs[node].sources == {}
        step20 = next(s for s in msgs[node].steps if s.step == 20)
        assert step20.world_size == 6
        assert {s.rank for s in step20.shards} == set(range(6))
    # A step the 4-rank gang saved itself: each node lists its own ranks' shards only.
    for rank in range(4):
        catalog.on_landing(landing(30, rank, "ram", node=placement[rank]), world_size=4)
    msgs = messages()
    assert msgs["n03"].restore_step == 30
    step30 = next(s for s in msgs["n03"].steps if s.step == 30)
    assert step30.world_size is None and {s.rank for s in step30.shards} == {2, 3}


TIER_NAMES = ("ram", "nvme", "peer", "object")


@st.composite
def restore_cases(draw: st.DrawFn) -> dict[str, Any]:
    """A job's committed steps, where each rank's shard of each lies, where its ranks run
    now and which nodes are alive and reachable."""
    nodes = [f"n{i}" for i in range(draw(st.integers(1, 5)))]
    world = draw(st.integers(1, 10))
    node_of = st.sampled_from(nodes)
    committed: dict[int, dict[str, float]] = {}
    rows: dict[tuple[int, str], StepRows] = {}
    for step in draw(st.sets(st.integers(1, 6), max_size=4)):
        tiers = draw(st.sets(st.sampled_from(TIER_NAMES), min_size=1))
        committed[step] = {tier: 1.0 for tier in tiers}
        for tier in tiers:
            by_rank = {
                r: (draw(node_of), draw(node_of) if tier == "peer" else None, 1, "c")
                for r in range(world)
                if tier == "object" or draw(st.integers(0, 9)) > 0  # a few ranks missing
            }
            rows[(step, tier)] = StepRows(by_rank)
    placement = {r: draw(node_of) for r in range(world) if draw(st.booleans())}
    alive = draw(st.none() | st.sets(node_of))
    reachable = draw(st.none() | st.sets(node_of))
    return {
        "committed": committed,
        "where": Where(rows),
        "world_size": world,
        "placement": placement,
        "alive": alive,
        "reachable": reachable,
    }


@given(restore_cases())
def test_the_restore_step_found_node_by_node_is_the_one_found_rank_by_rank(
    case: dict[str, Any],
) -> None:
    # Over the catalog's rows (a Where) the ranks that can read a step are found in sets,
    # node by node; over any other mapping, one rank at a time: both say the same.
    by_sets = gang_restore(**case)
    by_ranks = gang_restore(**{**case, "where": dict(case["where"].items())})
    assert by_sets == by_ranks
