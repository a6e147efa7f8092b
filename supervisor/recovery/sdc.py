"""Silent data corruption: the replicas' parameter digests in, a verdict out. Pure.

Data-parallel replicas hold bit-identical parameters after every optimizer step. Every
``sdc.every`` steps each rank reports the digest of its parameters
(``phalanx.rank.digest``). A :class:`DigestBoard` follows one generation of a job: once
every rank of a data-parallel group (pure DDP: the whole gang) reported a step, the
digests are compared. All equal: the step is the newest *agreed* one. Otherwise the
digest a strict majority holds is the truth and the ranks that differ are suspects
(:class:`Verdict`); without a strict majority (two replicas, or a three-way split) no
rank can be named (``odd`` is empty, ``majority`` None).

A digest of step ``s`` is taken after its optimizer step: the state a checkpoint
labelled ``s + 1`` holds. So a checkpoint at or before ``agreed + 1`` is clean
(:attr:`Verdict.clean_upto`).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

MAX_PENDING_STEPS = 64  # steps awaiting the rest of their digests, per generation


@dataclass(frozen=True, slots=True)
class Verdict:
    step: int
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
    """One generation of a job: its world size and the digests heard so far."""

    world_size: int
    generation: int
    agreed: int | None = None
    pending: dict[int, dict[int, int]] = field(default_factory=dict)  # step -> rank -> digest
    diverged: bool = False  # a verdict of divergence was given: nothing more is judged

    def see(self, rank: int, step: int, digest: int) -> Verdict | None:
        """A rank's digest of ``step``; the verdict once every rank's is in and they differ
        (None while waiting, when they agree, or after a divergence)."""
        if self.diverged or not 0 <= rank < self.world_size:
            return None
        if self.agreed is not None and step <= self.agreed:
            return None
        got = self.pending.setdefault(step, {})
        got[rank] = digest
        if len(self.pending) > MAX_PENDING_STEPS:
            del self.pending[min(self.pending)]
        if len(got) < self.world_size:
            return None
        del self.pending[step]
        if len(set(got.values())) == 1:
            self.agreed = max(step, self.agreed if self.agreed is not None else step)
            return None
        self.diverged = True
        majority, odd = judge(got)
        return Verdict(step, dict(got), majority, odd, self.agreed)
