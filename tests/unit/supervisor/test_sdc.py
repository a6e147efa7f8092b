"""Silent data corruption: the digest board (supervisor.recovery.sdc) and the digest itself
(phalanx.digest)."""

from __future__ import annotations

import pytest
import torch

from phalanx.digest import digest
from phalanx.jobspec import JobSpecError, validate_spec
from supervisor.recovery.sdc import DigestBoard, judge

SPEC = {
    "name": "a",
    "team": "t",
    "command": ["x"],
    "workdir": "/tmp",
    "nodes": 3,
    "ranks_per_node": 2,
}


def board(world: int = 3) -> DigestBoard:
    return DigestBoard([tuple(range(world))], generation=1)


def test_a_step_whose_digests_all_agree_is_the_newest_agreed_one() -> None:
    b = board()
    assert [b.see(r, 10, 0xAB) for r in range(3)] == [None, None, None]
    assert b.agreed == 10


def test_the_odd_replica_out_is_named_with_the_newest_agreed_step_before_it() -> None:
    b = board()
    for r in range(3):
        b.see(r, 10, 7)
    b.see(0, 15, 8)
    b.see(2, 15, 8)

    verdict = b.see(1, 15, 9)

    assert verdict is not None
    assert (verdict.step, verdict.majority, verdict.odd, verdict.agreed) == (15, 8, (1,), 10)
    assert verdict.clean_upto == 11  # the digest of step 10 is checkpoint 11's state


def test_nothing_is_judged_until_every_rank_reported_the_step() -> None:
    b = board()
    assert b.see(0, 5, 1) is None and b.see(1, 5, 2) is None
    assert b.agreed is None


def test_two_replicas_that_differ_name_no_one() -> None:
    b = board(world=2)
    b.see(0, 5, 1)

    verdict = b.see(1, 5, 2)

    assert verdict is not None and (verdict.majority, verdict.odd) == (None, ())
    assert verdict.group == (0, 1)


def test_replicas_are_compared_within_their_group_only() -> None:
    # Two-way model parallel over 6 ranks: ranks 0, 2, 4 hold one half of the model,
    # 1, 3, 5 the other; the halves' digests differ and that is no divergence.
    b = DigestBoard(
        validate_spec({**SPEC, "sdc": {"every": 5, "model_parallel": 2}}).sdc.replica_groups(6),
        generation=1,
    )  # type: ignore[union-attr]
    assert all(b.see(r, 5, 100 + r % 2) is None for r in range(6))
    assert b.agreed == 5
    for r in (0, 1, 2, 3, 5):
        assert b.see(r, 10, 200 + r % 2) is None
    verdict = b.see(4, 10, 999)  # rank 4 differs from 0 and 2, its replicas
    assert verdict is not None
    assert (verdict.group, verdict.majority, verdict.odd, verdict.agreed) == (
        (0, 2, 4),
        200,
        (4,),
        5,
    )


def test_the_clean_step_is_the_newest_every_group_agreed_on() -> None:
    # A checkpoint holds every group's state: group (1, 3) agreed only up to step 5.
    b = DigestBoard([(0, 2), (1, 3)], generation=1)
    for step in (5, 10):
        b.see(0, step, step)
        b.see(2, step, step)
    b.see(1, 5, 1)
    b.see(3, 5, 1)
    assert b.agreed == 5
    b.see(1, 15, 1)
    verdict = b.see(3, 15, 2)
    assert verdict is not None and (verdict.agreed, verdict.clean_upto) == (5, 6)


def test_a_board_made_afresh_starts_from_the_jobs_agreed_floor() -> None:
    # A new generation, or a restarted supervisor: without the floor its first
    # divergence would call every checkpoint of the run unclean (clean_upto -1).
    b = DigestBoard([(0, 1)], generation=2, floor=900)
    assert b.agreed == 900
    assert b.see(0, 900, 1) is None and b.see(1, 900, 2) is None  # not newer: not judged
    b.see(0, 950, 1)
    verdict = b.see(1, 950, 2)
    assert verdict is not None and verdict.clean_upto == 901


def test_a_rank_in_no_group_is_not_compared() -> None:
    b = DigestBoard([(0, 2)], generation=1)
    assert b.see(1, 5, 1) is None and b.see(3, 5, 2) is None
    assert b.see(0, 5, 7) is None and b.see(2, 5, 7) is None
    assert b.agreed == 5


def test_the_spec_rejects_groups_that_do_not_fit_the_gang() -> None:
    def error(sdc: dict[str, object], **spec: object) -> str:
        with pytest.raises(JobSpecError) as info:
            validate_spec({**SPEC, **spec, "sdc": sdc})
        return str(info.value)

    assert "does not divide the job's 6 ranks" in error({"every": 5, "model_parallel": 4})
    assert "leaves one replica" in error({"every": 5, "model_parallel": 6})
    assert "rank 1 is in more than one group" in error({"every": 5, "groups": [[0, 1], [1, 2]]})
    assert "names rank 9, but the job has 6 ranks" in error({"every": 5, "groups": [[0, 9]]})
    assert "not both" in error({"every": 5, "model_parallel": 2, "groups": [[0, 2]]})
    elastic = {"min_nodes": 1, "global_batch": 12, "micro_batch": 1}
    assert "use sdc.model_parallel" in error({"every": 5, "groups": [[0, 1]]}, elastic=elastic)
    # An elastic job may shrink to a lone replica: its digests are then not compared.
    ok = validate_spec(
        {
            **SPEC,
            "nodes": 2,
            "ranks_per_node": 1,
            "sdc": {"every": 5},
            "elastic": {"min_nodes": 1, "global_batch": 2, "micro_batch": 1},
        }
    )
    assert ok.sdc is not None and ok.sdc.replica_groups(1) == [(0,)]


def test_a_divergence_is_judged_once() -> None:
    b = board()
    for r, d in enumerate((1, 1, 2)):
        b.see(r, 5, d)
    assert all(b.see(r, 10, d) is None for r, d in enumerate((1, 1, 3)))


def test_a_strict_majority_is_the_truth() -> None:
    assert judge({0: 1, 1: 1, 2: 2, 3: 1}) == (1, (2,))
    assert judge({0: 1, 1: 1, 2: 2, 3: 2}) == (None, ())


def test_one_flipped_bit_anywhere_changes_the_digest() -> None:
    torch.manual_seed(0)
    tensors = [torch.randn(64, 64), torch.randn(64), torch.randn(3).to(torch.bfloat16)]
    before = digest(tensors)
    for t in tensors:
        for index in (0, t.numel() - 1):
            for bit in (0, 7, 15):
                ints = t.view(-1)[index : index + 1].view(
                    torch.int16 if t.element_size() == 2 else torch.int32
                )
                ints.bitwise_xor_(1 << bit)
                assert digest(tensors) != before, (t.shape, index, bit)
                ints.bitwise_xor_(1 << bit)
    assert digest(tensors) == before


def test_the_digest_of_a_model_is_that_of_its_parameters_in_order() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    assert digest(model) == digest(list(model.parameters()))
    assert digest(model) != digest(list(model.parameters())[::-1])
    assert 0 <= digest(model) < 2**64
