"""What a job keeps of its failures, as typed records.

A :class:`Failure` is the planner's input and what a job's recovery records of what
failed: it is defined here, below the job, so that the job's record can hold it
(:mod:`supervisor.recovery.planner` re-exports it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FailureKind(enum.StrEnum):
    RANK_EXIT = "rank_exit"
    NODE_DRAIN = "node_drain"
    NODE_OFFLINE = "node_offline"
    HANG = "hang"
    LOSS_SPIKE = "loss_spike"  # the loss guard tripped (supervisor.recovery.rollback plans these)
    NAN = "nan"
    SDC = "sdc"  # a replica's parameters diverged from the others' (supervisor.recovery.sdc)
    GROW = "grow"  # no failure: a shrunk elastic job grows back onto returned nodes (rule 7)


@dataclass(frozen=True, slots=True)
class Failure:
    """One classified failure signal and its culprit."""

    kind: FailureKind
    node: str
    rank: int | None = None
    code: int | None = None
    signal: int | None = None
    step: int | None = None  # the culprit's last reported step
    detail: str = ""
    generation: int = 0
    # False for a node whose agent was stopped on purpose: replaced, but not drained.
    quarantine: bool = True
    # The step its generation restored, when the rank failed before reporting any step of
    # it (``step`` is then None): it failed at the step it restored.
    from_restore: int | None = None
    onset: int | None = None  # a loss guard's trip: the step the loss went bad

    def describe(self) -> str:
        where = (
            f"node {self.node}" if self.rank is None else f"rank {self.rank} on node {self.node}"
        )
        match self.kind:
            case FailureKind.RANK_EXIT if self.signal is not None:
                what = f"{where} was killed by signal {self.signal}"
            case FailureKind.RANK_EXIT if self.code is not None:
                what = f"{where} exited with code {self.code}"
            case FailureKind.RANK_EXIT:
                what = f"{where} was lost"
            case FailureKind.NODE_DRAIN:
                what = f"{where} was drained"
            case FailureKind.NODE_OFFLINE:
                what = f"{where} went offline"
            case FailureKind.HANG:
                what = f"the gang hung; culprit {where}"
            case FailureKind.LOSS_SPIKE:
                what = f"the loss spiked from step {self.onset} ({where}'s guard)"
            case FailureKind.NAN:
                what = f"the loss went NaN or infinite from step {self.onset} ({where}'s guard)"
            case FailureKind.SDC if not self.quarantine:
                what = (
                    "the replicas' parameters diverged with no majority to name a node "
                    f"({where} named for the record)"
                )
            case FailureKind.SDC:
                what = f"sdc_suspect: {where}'s parameters diverged from the other replicas'"
            case FailureKind.GROW:
                what = "elastic: nodes are free to grow back onto"
        at = f" at step {self.step}" if self.step is not None else ""
        if self.step is None and self.from_restore is not None:
            at = f" before its first step after restoring step {self.from_restore}"
        return f"{what}{at}" + (f" ({self.detail})" if self.detail else "")
