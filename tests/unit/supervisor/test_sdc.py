"""Silent data corruption: the digest board (supervisor.recovery.sdc) and the digest itself
(phalanx.digest)."""

from __future__ import annotations

import torch

from phalanx.digest import digest
from supervisor.recovery.sdc import DigestBoard, judge


def board(world: int = 3) -> DigestBoard:
    return DigestBoard(world_size=world, generation=1)


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
