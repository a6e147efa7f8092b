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
    agreed: int | None  # the newest step before this one whose digests agreed in every group

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
    """One generation of a job: its replica groups and the digests heard so far.

    ``floor``: the newest step known to have agreed before this generation (the job's
    record of it, no newer than the step the generation restored less one); each group
    starts there, so a board made afresh (a new generation, a restarted supervisor)
    never calls the whole run unclean."""

    groups: Sequence[tuple[int, ...]]
    generation: int
    floor: int | None = None
    agreed_in: dict[int, int] = field(default_factory=dict)  # group index -> newest agreed
    pending: dict[tuple[int, int], dict[int, int]] = field(default_factory=dict)
    diverged: bool = False  # a verdict of divergence was given: nothing more is judged
    _group_of: dict[int, int] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self._group_of = {r: i for i, g in enumerate(self.groups) for r in g if len(g) >= 2}

    @property
    def agreed(self) -> int | None:
        """The newest step whose digests agreed in every group (a checkpoint holds every
        group's state); None: none known."""
        steps = [
            self.agreed_in.get(i, self.floor) for i, g in enumerate(self.groups) if len(g) >= 2
        ]
        if not steps or any(s is None for s in steps):
            return self.floor
        return min(s for s in steps if s is not None)

    def see(self, rank: int, step: int, digest: int) -> Verdict | None:
        """A rank's digest of ``step``; the verdict once every rank of its group reported
        and they differ (None while waiting, when they agree, for a rank in no group of
        two or more, or after a divergence)."""
        index = self._group_of.get(rank)
        if self.diverged or index is None:
            return None
        mine = self.agreed_in.get(index, self.floor)
        if mine is not None and step <= mine:
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
            self.agreed_in[index] = step if mine is None else max(step, mine)
            return None
        self.diverged = True
        majority, odd = judge(got)
        return Verdict(step, tuple(group), dict(got), majority, odd, self.agreed)
