"""The elastic contract: the spec's allowed sizes, the ranks' layout from the environment,
and the sampler that never repeats or skips a sample across a reshape."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.elastic import Elastic, ElasticSampler, from_environment
from phalanx.jobspec import JobSpecError, validate_spec

BASE: dict[str, Any] = {
    "name": "e",
    "team": "t",
    "command": ["python", "train.py"],
    "workdir": "/w",
    "nodes": 3,
    "ranks_per_node": 2,
}


def spec(**elastic: Any) -> Any:
    return validate_spec({**BASE, "elastic": elastic})


def test_the_allowed_sizes_keep_the_global_batch_a_multiple_of_micro_batch_times_dp() -> None:
    s = spec(min_nodes=1, global_batch=24, micro_batch=2)
    assert s.elastic_sizes() == [1, 2, 3]
    assert [s.elastic.accumulation(n, 2) for n in (1, 2, 3)] == [6, 3, 2]
    assert spec(min_nodes=1, global_batch=12, micro_batch=2).elastic_sizes() == [1, 3]
    assert validate_spec(BASE).elastic_sizes() == [3]  # not elastic: its own size only
    assert spec(min_nodes=1, global_batch=24, micro_batch=2).elastic.grow_after == 300.0
    assert (
        spec(min_nodes=2, global_batch=24, micro_batch=2, grow_after="10m").elastic.grow_after
        == 600
    )


@pytest.mark.parametrize(
    ("elastic", "message"),
    [
        (
            {"min_nodes": 1, "global_batch": 20, "micro_batch": 2},
            "elastic: global_batch 20 is not a multiple of micro_batch 2 x the data-parallel "
            "size 6 (3 nodes x 2 ranks) at the job's own size; allowed sizes from min_nodes "
            "1 to 3: 1",
        ),
        (
            {"min_nodes": 2, "global_batch": 20, "micro_batch": 2},
            "allowed sizes from min_nodes 2 to 3: none",
        ),
        ({"min_nodes": 4, "global_batch": 24, "micro_batch": 2}, "min_nodes 4 is more than nodes"),
        ({"min_nodes": 0, "global_batch": 24, "micro_batch": 2}, "elastic.min_nodes"),
        ({"min_nodes": 1, "global_batch": 24}, "elastic.micro_batch"),
        ({"min_nodes": 1, "global_batch": 24, "micro_batch": 2, "state": "fsdp"}, "elastic.state"),
        ({"min_nodes": 1, "global_batch": 24, "micro_batch": 2, "nodes": 2}, "elastic.nodes"),
        (
            {"min_nodes": 1, "global_batch": 24, "micro_batch": 2, "reshard": True},
            "elastic.reshard is for state: sharded",
        ),
    ],
)
def test_a_spec_with_no_allowed_size_or_a_bad_field_is_rejected_naming_it(
    elastic: dict[str, Any], message: str
) -> None:
    with pytest.raises(JobSpecError, match="elastic") as err:
        validate_spec({**BASE, "elastic": elastic})
    assert message in str(err.value)


def test_the_layout_round_trips_through_the_environment() -> None:
    e = Elastic.for_size(24, 2, 4, consumed_samples=480)
    assert e.accumulation == 3 and e.consumed(20) == 480
    assert from_environment(e.env()) == e
    assert from_environment({}) is None


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PHALANX_GLOBAL_BATCH": "24"}, "lacks PHALANX_MICRO_BATCH"),
        (
            {
                "PHALANX_GLOBAL_BATCH": "24",
                "PHALANX_MICRO_BATCH": "two",
                "PHALANX_DP_SIZE": "4",
                "PHALANX_ACCUM_STEPS": "3",
            },
            "malformed",
        ),
        (
            {
                "PHALANX_GLOBAL_BATCH": "24",
                "PHALANX_MICRO_BATCH": "2",
                "PHALANX_DP_SIZE": "4",
                "PHALANX_ACCUM_STEPS": "2",
            },
            "is not micro batch 2 x data-parallel size 4 x accumulation 2",
        ),
    ],
)
def test_a_partial_or_inconsistent_environment_is_an_error_never_a_guess(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        from_environment(env)


def test_the_sampler_refuses_a_rank_outside_the_gang_or_an_empty_dataset() -> None:
    e = Elastic.for_size(8, 2, 2)
    with pytest.raises(ValueError, match="data-parallel rank 2"):
        ElasticSampler(10, e, dp_rank=2)
    with pytest.raises(ValueError, match="0 samples"):
        ElasticSampler(0, e, dp_rank=0)


@settings(max_examples=150, deadline=None)
@given(
    size=st.integers(1, 60),
    micro=st.integers(1, 3),
    dps=st.lists(st.sampled_from([1, 2, 3, 4, 6]), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 12), min_size=3, max_size=3),
    seed=st.integers(0, 5),
    shuffle=st.booleans(),
)
def test_any_sequence_of_sizes_trains_every_sample_of_every_epoch_exactly_once(
    size: int, micro: int, dps: list[int], cuts: list[int], seed: int, shuffle: bool
) -> None:
    """A run reshaped at arbitrary steps (each generation a new sampler from the step it
    restored) trains each step on the same global batch as an undisturbed run, whose
    epochs are permutations of the dataset."""
    global_batch = 12 * micro  # a multiple of micro x every dp size drawn
    steps = 12
    bounds = sorted({0, *(c for c in cuts if 0 < c < steps), steps})
    trained: list[int] = []
    for i, (start, stop) in enumerate(itertools.pairwise(bounds)):
        dp = dps[i % len(dps)]
        layout = Elastic.for_size(global_batch, micro, dp, layout_consumed(global_batch, start))
        ranks = [
            iter(
                ElasticSampler(
                    size, layout, dp_rank=r, start_step=start, seed=seed, shuffle=shuffle
                )
            )
            for r in range(dp)
        ]
        for _step in range(start, stop):
            per_rank = [next(it) for it in ranks]
            for batches in per_rank:
                assert len(batches) == layout.accumulation
                assert all(len(b) == micro for b in batches)
            trained.extend(j for batches in per_rank for b in batches for j in b)
    assert len(trained) == steps * global_batch
    for epoch in range(len(trained) // size):
        assert sorted(trained[epoch * size : (epoch + 1) * size]) == list(range(size))
    rest = trained[(len(trained) // size) * size :]
    assert len(set(rest)) == len(rest)  # the epoch under way repeats nothing either


def layout_consumed(global_batch: int, step: int) -> int:
    return global_batch * step


def test_a_resharding_job_is_limited_to_the_ranks_its_catalogs_can_list() -> None:
    ok = spec(min_nodes=1, global_batch=24, micro_batch=2, state="sharded", reshard=True)
    assert ok.reshards and ok.resizes and not ok.reshapes
    assert not spec(min_nodes=1, global_batch=24, micro_batch=2, state="sharded").resizes
    big = {**BASE, "nodes": 65, "ranks_per_node": 8}
    elastic = {"min_nodes": 1, "global_batch": 520, "micro_batch": 1, "state": "sharded"}
    assert validate_spec({**big, "elastic": elastic}).resizes is False
    with pytest.raises(JobSpecError, match="reshard supports jobs of up to 512 ranks"):
        validate_spec({**big, "elastic": {**elastic, "reshard": True}})


@pytest.mark.parametrize("name", ["tinylm-elastic.yaml", "zero1-elastic.yaml"])
def test_the_elastic_examples_are_valid_specs(name: str) -> None:
    from pathlib import Path

    from phalanx.jobspec import load_spec_file

    spec = load_spec_file(Path(__file__).resolve().parents[3] / "examples" / name)
    assert spec.resizes and spec.elastic_sizes() == [1, 2, 3]


def test_a_resharding_job_needs_the_object_tier() -> None:
    elastic = {
        "min_nodes": 1,
        "global_batch": 24,
        "micro_batch": 2,
        "state": "sharded",
        "reshard": True,
    }
    no_object = {**BASE, "elastic": elastic, "checkpoint": {"tiers": ["ram", "nvme", "peer"]}}
    with pytest.raises(JobSpecError, match=r"elastic\.reshard needs the object tier"):
        validate_spec(no_object)
