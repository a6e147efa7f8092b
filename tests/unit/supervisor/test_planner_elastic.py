"""Rule 6 of the recovery planner: an elastic job shrinks instead of waiting, onto its
healthy nodes at the largest allowed size, and restores the shards saved at the larger
size, each rank from its own node where it can."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.checkpoints.catalog import reshape_sources
from supervisor.recovery.planner import Action, CatalogView, JobView, plan_grow, plan_regrow
from tests.unit.supervisor.test_planner import (
    catalog,
    exit_,
    fleet,
    gang,
    job,
    lost,
    node,
    plan,
    strike,
)


def elastic(*nodes: str, sizes: tuple[int, ...], rpn: int = 2, **kw: object) -> JobView:
    return replace(job(*nodes, rpn=rpn), sizes=sizes, replicated=True, **kw)  # type: ignore[arg-type]


def test_a_lost_node_with_no_spare_shrinks_the_job_onto_the_others() -> None:
    j = elastic("a", "b", "c", sizes=(1, 2, 3))
    cat = catalog(j, {10: ["ram", "nvme", "peer"], 20: ["ram", "nvme"]})
    p = plan(j, lost("b"), fleet(*gang("a", "b", "c")), cat)
    assert p.action is Action.SHRINK
    assert p.nodes == ("a", "c") and p.quarantine == ("b",) and p.swaps == ()
    # Node c's new ranks 2, 3 read what c saved: the shards of its old ranks 4 and 5.
    assert p.restore_step == 20 and p.sources == {2: 4, 3: 5}
    assert p.restore_from == {0: "ram", 1: "ram", 2: "ram", 3: "ram"}
    assert "elastic: shrinking from 3 to 2 node(s) (a, c; leaving b)" in p.reason


def test_the_job_shrinks_to_the_largest_allowed_size_that_fits() -> None:
    j = elastic("a", "b", "c", "d", sizes=(1, 2, 4))  # 3 is not allowed
    p = plan(j, lost("c"), fleet(*gang("a", "b", "c", "d")), catalog(j, {10: ["object"]}))
    assert p.action is Action.SHRINK and p.nodes == ("a", "b")
    assert p.restore_step == 10 and p.restore_from == {r: "object" for r in range(4)}


def test_a_spare_is_used_first_unless_the_spec_prefers_shrinking() -> None:
    nodes = fleet(*gang("a", "b", "c"), node("s", spare=True))
    j = elastic("a", "b", "c", sizes=(1, 2, 3))
    assert plan(j, lost("b"), nodes).action is Action.REPLACE
    first = replace(j, shrink_first=True)
    p = plan(first, lost("b"), nodes)
    assert p.action is Action.SHRINK and p.nodes == ("a", "c")


def test_a_job_with_no_allowed_size_that_fits_waits_and_says_why() -> None:
    j = elastic("a", "b", "c", sizes=(3,))
    p = plan(j, lost("b"), fleet(*gang("a", "b", "c")))
    assert p.action is Action.WAIT
    assert "not shrinking: no allowed size (3 nodes) fits the 2 healthy node(s) left" in p.reason


def test_sharded_state_never_shrinks_and_the_plan_says_why() -> None:
    j = elastic("a", "b", "c", sizes=(1, 2, 3), shrink_blocked="elastic.state is sharded")
    p = plan(j, lost("b"), fleet(*gang("a", "b", "c")))
    assert p.action is Action.WAIT and "not shrinking: elastic.state is sharded" in p.reason


def test_a_job_that_is_not_elastic_waits_as_before() -> None:
    p = plan(job("a", "b", "c", rpn=2), lost("b"), fleet(*gang("a", "b", "c")))
    assert p.action is Action.WAIT and "shrink" not in p.reason


def test_a_shrink_with_no_local_copy_reads_the_shards_live_buddies_hold() -> None:
    j = elastic("a", "b", "c", sizes=(1, 2, 3))
    # Step 20 at the peer tier only: a's copies held by b, b's by c, c's by a (lost).
    cat = catalog(j, {20: ["peer"]})
    p = plan(j, lost("b"), fleet(*gang("a", "b", "c")), cat)
    assert p.action is Action.SHRINK and p.nodes == ("a", "c")
    # b's and c's shards are held by live buddies (c and a); a's by b, lost with it.
    assert p.sources == {0: 2, 1: 3, 2: 4, 3: 5}
    assert p.restore_from == {r: "peer" for r in range(4)}


def test_a_shrink_with_committed_steps_none_readable_waits_rather_than_start_afresh() -> None:
    j = elastic("a", "b", "c", sizes=(1, 2, 3))
    full = catalog(j, {20: ["ram"]})
    # c's copies are gone (its agent restarted), b's were only in b's RAM: c has none.
    cat = CatalogView(full.committed, {k: v for k, v in full.where.items() if v[0] != "c"})
    p = plan(j, lost("b"), fleet(*gang("a", "b", "c")), cat)
    assert p.action is Action.WAIT and "no healthy node to take node b's ranks" in p.reason
    assert "not shrinking: no committed step the 2-node gang can read whole (rank 2" in p.reason


def test_nothing_committed_shrinks_from_scratch() -> None:
    j = elastic("a", "b", "c", sizes=(1, 2, 3))
    p = plan(j, lost("c"), fleet(*gang("a", "b", "c")))
    assert p.action is Action.SHRINK and p.restore_step is None and p.sources == {}


def test_a_shrunk_gang_that_fails_before_its_first_commit_reads_the_larger_gangs_shards() -> None:
    big = elastic("a", "b", "c", sizes=(1, 2, 3))
    cat = catalog(big, {20: ["ram", "nvme"]})
    small = replace(big, nodes=("a", "c"))
    # A rank of the 2-node gang exits: in place, still reading step 20 as saved by 6.
    p = plan(small, exit_("c", rank=2), fleet(*gang("a", "c")), cat)
    assert p.action is Action.RESTART_IN_PLACE and p.restore_step == 20
    assert p.sources == {2: 4, 3: 5} and set(p.restore_from.values()) == {"ram"}
    # a is lost too: shrink again, to c alone, which reads its own saves 4 and 5.
    p = plan(small, lost("a"), fleet(*gang("a", "c")), cat)
    assert p.action is Action.SHRINK and p.nodes == ("c",)
    assert p.sources == {0: 4, 1: 5} and p.restore_from == {0: "ram", 1: "ram"}


def test_a_job_that_is_not_replicated_never_reads_another_ranks_shard() -> None:
    big = job("a", "b", "c", rpn=2)
    cat = catalog(big, {20: ["ram", "nvme"]})
    p = plan(replace(big, nodes=("a", "c")), exit_("c", rank=2), fleet(*gang("a", "c")), cat)
    assert p.restore_step is None and p.sources == {}


@settings(max_examples=200, deadline=None)
@given(
    old=st.integers(1, 6),
    new=st.integers(1, 6),
    rpn=st.integers(1, 4),
    data=st.data(),
)
def test_reshape_sources_give_every_rank_a_saved_shard_each_used_once_while_enough(
    old: int, new: int, rpn: int, data: st.DataObject
) -> None:
    names = [f"n{i}" for i in range(max(old, new) + 1)]
    before = names[:old]
    after = data.draw(st.permutations(names))[:new]
    where = {(7, g * rpn + lr, "ram"): (n, None) for g, n in enumerate(before) for lr in range(rpn)}
    placement = {g * rpn + lr: n for g, n in enumerate(after) for lr in range(rpn)}
    got = reshape_sources(7, {7: {"ram": 1.0}}, where, placement, set(names))
    saved = set(range(old * rpn))
    assert set(got) == set(placement) and set(got.values()) <= saved
    if new <= old:
        assert len(set(got.values())) == len(got)  # no shard read twice
    for rank, src in got.items():  # a rank on a node that saved shards reads one of them
        own = {r for (_s, r, _t), (n, _h) in where.items() if n == placement[rank]}
        if own and len(own) >= rpn:
            assert src in own


# -- rule 7: grow back ----------------------------------------------------------


def test_a_shrunk_job_grows_onto_free_healthy_nodes_to_the_largest_allowed_size() -> None:
    small = replace(elastic("a", "b", "c", "d", sizes=(1, 2, 4)), nodes=("a", "b"))
    cat = catalog(small, {30: ["ram", "object"]})
    nodes = fleet(*gang("a", "b"), node("c"), node("d"), node("s", spare=True))
    p = plan_grow(small, nodes, cat)
    assert p is not None and p.action is Action.GROW and p.nodes == ("a", "b", "c", "d")
    assert p.restore_step == 30
    assert "elastic: growing from 2 to 4 node(s) onto c, d" in p.reason
    assert {p.restore_from[r] for r in range(4)} == {"ram"}
    assert {p.restore_from[r] for r in range(4, 8)} == {"object"}
    # One free node makes no allowed size (3 is not): no growth, and never onto a spare.
    one = fleet(*gang("a", "b"), node("c"), node("s", spare=True))
    assert plan_grow(small, one, cat) is None


def test_no_growth_onto_nodes_that_are_drained_busy_unburned_or_of_another_gpu() -> None:
    small = replace(elastic("a", "b", "c", sizes=(1, 2, 3)), nodes=("a", "b"))
    for bad in (
        node("c", state="drain"),
        node("c", busy=True),
        node("c", burned_in=False),
        node("c", gpu_type="a100"),
        node("c", gpus=1),
    ):
        assert plan_grow(small, fleet(*gang("a", "b"), bad), CatalogView()) is None


def test_no_growth_while_the_new_nodes_can_read_no_committed_step() -> None:
    big = elastic("a", "b", "c", sizes=(1, 2, 3))
    small = replace(big, nodes=("a", "b"))
    cat = catalog(small, {40: ["ram", "nvme"]})  # nothing a new node can read
    nodes = fleet(*gang("a", "b"), node("c"))
    assert plan_grow(small, nodes, cat) is None
    # The grow's plan once stopped: in place, on its own nodes, from its own RAM.
    p = plan_regrow(small, nodes, cat)
    assert p.action is Action.RESTART_IN_PLACE and p.nodes == ("a", "b")
    assert p.restore_step == 40 and set(p.restore_from.values()) == {"ram"}
    with_peer = catalog(small, {40: ["ram", "peer"]})
    p = plan_regrow(small, nodes, with_peer)
    assert p.action is Action.GROW and p.sources == {4: 0, 5: 1}
    assert {p.restore_from[4], p.restore_from[5]} == {"peer"}


# -- from a review: the edges -----------------------------------------------------


def test_prefer_shrink_takes_a_spare_when_the_job_cannot_shrink() -> None:
    nodes = fleet(*gang("a", "b", "c"), node("s", spare=True))
    j = elastic("a", "b", "c", sizes=(3,), shrink_first=True)  # no smaller size
    p = plan(j, lost("b"), nodes)
    assert p.action is Action.REPLACE and p.swaps == (("b", "s"),)


def test_a_shrink_keeps_the_jobs_own_nodes_before_a_replacement() -> None:
    j = elastic("a", "b", "c", "d", sizes=(1, 2, 4))
    cat = catalog(j, {20: ["ram", "nvme"]})  # a new node could read nothing
    nodes = fleet(*gang("a", "b", "c", "d"), node("s", spare=True))
    p = plan(j, [lost("b"), lost("c")], nodes, cat)
    assert p.action is Action.SHRINK and p.nodes == ("a", "d") and p.swaps == ()
    assert p.restore_step == 20 and set(p.restore_from.values()) == {"ram"}


def test_a_vetted_suspect_kept_by_a_shrink_is_reinstated() -> None:
    j = elastic(
        "a",
        "b",
        "c",
        sizes=(1, 2, 3),
        quarantined=frozenset({"c"}),
        vetted=frozenset({"c"}),
    )
    nodes = fleet(*gang("a", "b"), node("c", state="drain", busy=True))
    p = plan(j, [lost("b"), exit_("c", rank=4)], nodes, node_incidents=[strike(node_id="c")])
    assert p.action is Action.SHRINK and p.nodes == ("a", "c") and p.reinstate == ("c",)


def test_a_stranded_suspect_is_burned_in_rather_than_shrunk_away() -> None:
    j = elastic("a", "b", sizes=(1, 2))
    p = plan(j, exit_("b", rank=2), fleet(*gang("a", "b")), node_incidents=[strike(node_id="b")])
    assert p.action is Action.WAIT and p.burn_in == ("b",)


def test_no_growth_while_a_node_of_the_job_is_unhealthy() -> None:
    small = replace(elastic("a", "b", "c", sizes=(1, 2, 3)), nodes=("a", "b"))
    cat = catalog(small, {40: ["ram", "object"]})
    for state in ("drain", "offline"):
        nodes = fleet(node("a", busy=True), node("b", state=state, busy=True), node("c"))
        assert plan_grow(small, nodes, cat) is None


# -- sharded state its ranks reshard (elastic.reshard) -----------------------------


def resharding(*nodes: str, sizes: tuple[int, ...], rpn: int = 2) -> JobView:
    return replace(job(*nodes, rpn=rpn), sizes=sizes, reshards=True)


def test_a_resharding_job_shrinks_to_a_step_every_node_can_read_every_saved_shard_of() -> None:
    j = resharding("a", "b", "c", sizes=(1, 2, 3))
    # Step 20 in RAM and at the peer tier: a's copies are held by b (lost), so node c
    # cannot read a's shards; step 10 is in the object store, which every node reads.
    cat = catalog(j, {10: ["ram", "object"], 20: ["ram", "nvme", "peer"]})
    p = plan(j, lost("b"), fleet(*gang("a", "b", "c")), cat)
    assert p.action is Action.SHRINK and p.nodes == ("a", "c")
    assert p.restore_step == 10 and p.sources == {}  # each rank reads what it needs
    # Each rank may read any of the 6 saved shards: its tier is its node's farthest.
    assert p.restore_from == {r: "object" for r in range(4)}


def test_a_resharding_job_whose_shards_no_node_can_all_read_waits_and_says_why() -> None:
    j = resharding("a", "b", "c", sizes=(1, 2, 3))
    cat = catalog(j, {20: ["ram", "nvme", "peer"]})
    p = plan(j, lost("b"), fleet(*gang("a", "b", "c")), cat)
    assert p.action is Action.WAIT
    assert "not shrinking: no committed step the 2-node gang can read whole" in p.reason
    assert "can read no copy of saved rank" in p.reason


def test_a_resharding_job_in_place_at_its_own_size_reads_its_own_shards() -> None:
    j = resharding("a", "b", sizes=(1, 2))
    cat = catalog(j, {20: ["ram", "nvme"]})
    p = plan(j, exit_("b", rank=2), fleet(*gang("a", "b")), cat)
    assert p.action is Action.RESTART_IN_PLACE and p.restore_step == 20 and p.sources == {}


def test_a_resharding_job_grows_once_the_new_nodes_can_read_every_saved_shard() -> None:
    small = replace(resharding("a", "b", "c", sizes=(1, 2, 3)), nodes=("a", "b"))
    nodes = fleet(*gang("a", "b"), node("c"))
    assert plan_grow(small, nodes, catalog(small, {40: ["ram", "nvme"]})) is None
    # a's copies at the peer tier are held by b, b's by a: every node reads all 4.
    p = plan_grow(small, nodes, catalog(small, {40: ["ram", "nvme", "peer"]}))
    assert p is not None and p.action is Action.GROW and p.nodes == ("a", "b", "c")
    assert p.restore_step == 40 and p.sources == {}
    assert p.restore_from == {r: "peer" for r in range(6)}
    # Not resharding (and not replicated), the 6-rank gang's ranks 4, 5 have no shard.
    plain = replace(small, reshards=False)
    assert plan_grow(plain, nodes, catalog(small, {40: ["ram", "nvme", "peer"]})) is None
