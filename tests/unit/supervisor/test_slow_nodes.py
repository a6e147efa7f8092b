"""Which nodes are slow in several jobs at once, as the pure function judges the flags."""

from __future__ import annotations

import math

import pytest

from supervisor.telemetry.slow_nodes import STRAGGLER, Flag, SlowJob, slow_nodes


def flag(
    job: str, node: str, *, rank: int = 0, ratio: float = 1.5, since: float = 10.0, gen: int = 1
) -> Flag:
    return Flag(job=job, generation=gen, rank=rank, node=node, since=since, ratio=ratio)


LIVE = {"a": 1, "b": 1, "c": 1}


def test_no_flags_make_no_slow_node() -> None:
    assert slow_nodes([], LIVE, min_jobs=2) == {}


def test_a_node_flagged_in_one_job_is_not_slow_at_two_jobs() -> None:
    assert slow_nodes([flag("a", "n1")], LIVE, min_jobs=2) == {}


def test_a_node_flagged_in_one_job_is_slow_at_one_job() -> None:
    assert list(slow_nodes([flag("a", "n1")], LIVE, min_jobs=1)) == ["n1"]


def test_a_node_flagged_in_two_jobs_is_slow_naming_both() -> None:
    got = slow_nodes(
        [flag("b", "n1", rank=3, ratio=1.25, since=20.0), flag("a", "n1", rank=1, since=30.0)],
        LIVE,
        min_jobs=2,
    )
    [slow] = got.values()
    assert slow.node == "n1" and slow.job_ids == ("a", "b")
    assert slow.jobs == (SlowJob("a", 1, 1.5, 30.0), SlowJob("b", 3, 1.25, 20.0))
    assert slow.since == 30.0  # slow in two jobs once the second job's flag came


def test_two_ranks_of_the_same_job_on_a_node_count_as_one_job() -> None:
    flags = [flag("a", "n1", rank=0), flag("a", "n1", rank=1)]
    assert slow_nodes(flags, LIVE, min_jobs=2) == {}


def test_the_same_job_twice_names_its_slowest_rank_and_first_flag() -> None:
    flags = [
        flag("a", "n1", rank=0, ratio=1.3, since=5.0),
        flag("a", "n1", rank=1, ratio=1.9, since=8.0),
        flag("b", "n1"),
    ]
    [slow] = slow_nodes(flags, LIVE, min_jobs=2).values()
    assert slow.jobs[0] == SlowJob("a", 1, 1.9, 5.0)


def test_flags_of_two_jobs_on_different_nodes_make_no_slow_node() -> None:
    assert slow_nodes([flag("a", "n1"), flag("b", "n2")], LIVE, min_jobs=2) == {}


def test_only_the_node_flagged_in_enough_jobs_is_slow() -> None:
    flags = [flag("a", "n1"), flag("b", "n1"), flag("c", "n2"), flag("a", "n2", rank=4)]
    assert sorted(slow_nodes(flags, LIVE, min_jobs=2)) == ["n1", "n2"]
    assert sorted(slow_nodes([*flags, flag("c", "n1")], LIVE, min_jobs=3)) == ["n1"]


def test_a_cleared_flag_no_longer_counts() -> None:
    standing = [flag("a", "n1"), flag("b", "n1")]
    assert list(slow_nodes(standing, LIVE, min_jobs=2)) == ["n1"]
    assert slow_nodes(standing[:1], LIVE, min_jobs=2) == {}  # b's flag cleared


def test_flags_of_a_job_that_ended_do_not_count() -> None:
    flags = [flag("a", "n1"), flag("b", "n1")]
    assert slow_nodes(flags, {"a": 1}, min_jobs=2) == {}


def test_flags_of_an_older_generation_do_not_count() -> None:
    flags = [flag("a", "n1", gen=1), flag("b", "n1", gen=1)]
    assert slow_nodes(flags, {"a": 2, "b": 1}, min_jobs=2) == {}


def test_the_reason_is_a_warn_naming_the_jobs_and_how_much_slower() -> None:
    flags = [flag("a", "n1", rank=3, ratio=1.4216), flag("b", "n1", rank=0, ratio=math.inf)]
    [slow] = slow_nodes(flags, LIVE, min_jobs=2).values()
    reason = slow.reason()
    assert (reason.code, reason.severity, reason.gpu) == (STRAGGLER, "warn", None)
    assert reason.detail == (
        "step time above the median in 2 jobs: a (rank 3, 1.42x its gang's median), "
        "b (rank 0, infinitely above its gang's median)"
    )


@pytest.mark.parametrize("min_jobs", [0, -1])
def test_min_jobs_below_one_is_refused(min_jobs: int) -> None:
    with pytest.raises(ValueError, match="min_jobs must be at least 1"):
        slow_nodes([], LIVE, min_jobs=min_jobs)
