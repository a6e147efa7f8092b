"""Silent data corruption: the replicas' parameter digests in, a verdict out. Pure.

Data-parallel replicas hold bit-identical parameters after every optimizer step. Every
``sdc.every`` steps each rank reports the digest of its parameters
(``phalanx.rank.digest``). A :class:`DigestBoard` follows one generation of a job: once
every rank of a replica group (``sdc.model_parallel`` or ``sdc.groups``; pure DDP: the
whole gang) reported a step, the group's digests are compared. All equal: the step is
the group's newest *agreed* one. Otherwise the digest a strict majority holds is the
truth and the ranks that differ are suspects (:class:`Verdict`); without a strict
majority (two replicas, or a three-way split) no rank can be named (``odd`` is empty,
``majority`` None), and the supervisor rechecks the group's nodes.

A digest of step ``s`` is taken after its optimizer step: the state a checkpoint
labelled ``s + 1`` holds. So a checkpoint at or before ``agreed + 1`` is clean
(:attr:`Verdict.clean_upto`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

MAX_PENDING_STEPS = 64  # steps awaiting the rest of their digests, per generation


@dataclass(frozen=True, slots=True)
class Verdict:
    step: int
    group: tuple[int, ...]  # the replica group whose digests differ
    digests: dict[int, int]  # rank -> digest
    majority: int | None
    odd: tuple[int, ...]  # the ranks whose digest differs from the majority's
    agreed: int | None  # the newest step before this one whose digests all agreed

    @property
    def clean_upto(self) -> int:
        """The newest checkpoint step known clean (-1: none)."""
        return -1 if self.agreed is None else self.agreed + 1


def judge(digests: dict[int, int]) -> tuple[int | None, tuple[int, ...]]:
    """The digest a strict majority of ``digests`` (rank -> digest) holds and the ranks
    that differ from it; ``(None, ())`` without a strict majority."""
    if not digests:
        return None, ()
    top, count = Counter(digests.values()).most_common(1)[0]
    if count * 2 <= len(digests):
        return None, ()
    return top, tuple(sorted(r for r, d in digests.items() if d != top))


@dataclass
class DigestBoard:
    """One generation of a job: its replica groups and the digests heard so far."""

    groups: Sequence[tuple[int, ...]]
    generation: int
    # the newest step whose digests agreed in every group heard of (None: none yet)
    agreed: dict[int, int] = field(default_factory=dict)  # group index -> step
    pending: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)
    diverged: bool = False  # a verdict of divergence was given: nothing more is judged
    _group_of: dict[int, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._group_of = {r: i for i, g in enumerate(self.groups) for r in g if len(g) >= 2}

    def see(self, rank: int, step: int, digest: int) -> Verdict | None:
        """A rank's digest of ``step``; the verdict once every rank of its group reported
        and they differ (None while waiting, when they agree, for a rank in no group of
        two or more, or after a divergence)."""
        index = self._group_of.get(rank)
        if self.diverged or index is None:
            return None
        agreed = self.agreed.get(index)
        if agreed is not None and step <= agreed:
            return None
        got = self.pending.setdefault((index, step), {})
        got[rank] = digest
        if len(self.pending) > MAX_PENDING_STEPS * max(1, len(self.groups)):
            del self.pending[min(self.pending, key=lambda k: k[1])]
        group = self.groups[index]
        if len(got) < len(group):
            return None
        del self.pending[(index, step)]
        if len(set(got.values())) == 1:
            self.agreed[index] = max(step, agreed if agreed is not None else step)
            return None
        self.diverged = True
        majority, odd = judge(got)
        return Verdict(step, tuple(group), dict(got), majority, odd, agreed)
