"""What a job keeps of its failures and recoveries, as typed records.

``Job.recovery`` is the :class:`Recovery` in progress (persisted with the job: a
restarted supervisor runs it again), ``Job.incidents`` the :class:`Incident` each
recovery left once it ended; both name the :class:`Failure` s they recovered from (the
planner's input, defined here, below the job, so that the job's record can hold them;
:mod:`supervisor.recovery.planner` re-exports them).

The store keeps each record, and the API shows it, as the dict its ``to_record()``
makes; ``from_record()`` reads what any earlier supervisor wrote. A key an older
record lacks stays absent when it is written back (``missing``), and a key this
supervisor does not know is kept and written back last (``extra``), so a record is
read and written again unchanged.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, Final, TypeVar

T = TypeVar("T")


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

    def to_record(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind.value}

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Failure:
        """A failure as any supervisor recorded it (a key it does not know is left out:
        one written before ``from_restore`` and ``onset`` were is written back with them
        null)."""
        names = {f.name for f in fields(cls)} - {"kind"}
        return cls(FailureKind(rec["kind"]), **{k: v for k, v in rec.items() if k in names})


class Unset(enum.Enum):
    """A record's field not set yet, told apart from one set to None (null)."""

    UNSET = "unset"


UNSET: Final = Unset.UNSET


def known(value: T | Unset) -> T | None:
    """``value``, or None where it is not set."""
    return None if isinstance(value, Unset) else value


def _read(rec: Mapping[str, Any], names: Iterable[str]) -> tuple[frozenset[str], dict[str, Any]]:
    """The keys of ``names`` that ``rec`` lacks, and the keys of ``rec`` not in ``names``."""
    wanted = set(names)
    return frozenset(wanted - rec.keys()), {k: v for k, v in rec.items() if k not in wanted}


def _written(
    pairs: Iterable[tuple[str, Any]], missing: frozenset[str], extra: Mapping[str, Any]
) -> dict[str, Any]:
    """A record's dict: ``pairs`` in order but the keys it was read without, then the
    keys it was read with that no field holds."""
    out = {k: v for k, v in pairs if k not in missing}
    out.update(extra)
    return out


@dataclass(frozen=True, slots=True)
class PlanRecord:
    """A recovery's plan (the planner's ``Plan``) as the recovery and its incident record
    it (:func:`supervisor.recovery.incidents.plan_record`). Equal to another exactly
    when their records are."""

    action: str
    cause: str
    reason: str
    nodes: tuple[str, ...] = ()
    quarantine: tuple[str, ...] = ()
    swaps: tuple[tuple[str, str], ...] = ()
    restore_step: int | None = None
    restore_note: str = ""
    restore_from: dict[str, str] = field(default_factory=dict)  # rank -> tier
    burn_in: tuple[str, ...] = ()
    reinstate: tuple[str, ...] = ()
    skip: tuple[int, int] | None = None
    sources: dict[str, int] = field(default_factory=dict)  # rank -> the saved rank it reads
    missing: frozenset[str] = field(default=frozenset(), repr=False)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    KEYS: ClassVar[tuple[str, ...]] = (
        "action",
        "cause",
        "reason",
        "nodes",
        "quarantine",
        "swaps",
        "restore_step",
        "restore_note",
        "restore_from",
        "burn_in",
        "reinstate",
        "skip",
        "sources",
    )

    def to_record(self) -> dict[str, Any]:
        return _written(
            [
                ("action", self.action),
                ("cause", self.cause),
                ("reason", self.reason),
                ("nodes", list(self.nodes)),
                ("quarantine", list(self.quarantine)),
                ("swaps", [list(s) for s in self.swaps]),
                ("restore_step", self.restore_step),
                ("restore_note", self.restore_note),
                ("restore_from", dict(self.restore_from)),
                ("burn_in", list(self.burn_in)),
                ("reinstate", list(self.reinstate)),
                ("skip", list(self.skip) if self.skip is not None else None),
                ("sources", dict(self.sources)),
            ],
            self.missing,
            self.extra,
        )

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> PlanRecord:
        missing, extra = _read(rec, cls.KEYS)
        skip = rec.get("skip")
        return cls(
            action=rec.get("action", ""),
            cause=rec.get("cause", ""),
            reason=rec.get("reason", ""),
            nodes=tuple(rec.get("nodes", ())),
            quarantine=tuple(rec.get("quarantine", ())),
            swaps=tuple((a, b) for a, b in rec.get("swaps", ())),
            restore_step=rec.get("restore_step"),
            restore_note=rec.get("restore_note", ""),
            restore_from=dict(rec.get("restore_from", {})),
            burn_in=tuple(rec.get("burn_in", ())),
            reinstate=tuple(rec.get("reinstate", ())),
            skip=(skip[0], skip[1]) if skip is not None else None,
            sources=dict(rec.get("sources", {})),
            missing=missing,
            extra=extra,
        )


@dataclass(frozen=True, slots=True)
class Recheck:
    """What a recovery of replicas that diverged with no majority rechecks before it plans
    (:func:`supervisor.recovery.sdc_watch.recheck`): the group's nodes, each with its
    first rank of the group; how many replicas; the newest clean step."""

    nodes: dict[str, int]
    replicas: int
    clean: int

    def to_record(self) -> dict[str, Any]:
        return {"nodes": dict(self.nodes), "replicas": self.replicas, "clean": self.clean}

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Recheck:
        return cls(dict(rec.get("nodes", {})), rec.get("replicas", 0), rec.get("clean", -1))


@dataclass(frozen=True, slots=True)
class GuardTrip:
    """A loss guard's trip a rollback recovers from: the mean loss before it, the loss,
    and the guard's kind (``nan`` or ``loss_spike``)."""

    baseline: float | None
    value: float | None
    kind: str | None

    def to_record(self) -> dict[str, Any]:
        return {"baseline": self.baseline, "value": self.value, "kind": self.kind}

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> GuardTrip:
        return cls(rec.get("baseline"), rec.get("value"), rec.get("kind"))


@dataclass(slots=True)
class Awaiting:
    """The relaunched generation's ranks heard from so far: rank -> [when it restored, the
    seconds its restore took], and rank -> when it took its first step."""

    restored: dict[str, tuple[float, float]] = field(default_factory=dict)
    stepped: dict[str, float] = field(default_factory=dict)

    def to_record(self) -> dict[str, Any]:
        return {
            "restored": {r: [at, took] for r, (at, took) in self.restored.items()},
            "stepped": dict(self.stepped),
        }

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Awaiting:
        return cls(
            {r: (at, took) for r, (at, took) in rec.get("restored", {}).items()},
            dict(rec.get("stepped", {})),
        )


RECHECK: Final = "sdc_recheck"  # Recovery.recheck's key


@dataclass(slots=True)
class Recovery:
    """The recovery in progress of a job (:mod:`supervisor.recovery.executor`). The fields
    from ``size`` on are set as it goes; until then (None, False, ``UNSET``) their keys
    are not in its record."""

    generation: int  # the generation that failed (after a restart: the one it launched)
    failures: list[Failure]
    fault_at: float
    detected_at: float
    phase: str = "plan"  # "plan", "stopped" (the gang stopped), "launch"
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds it took
    size: dict[str, Any] | None = None  # of the generation it ends (Job.size)
    recheck: Recheck | None = None  # nodes to recheck before it plans (an SDC's)
    guard: GuardTrip | None = None  # the loss guard's trip it rolls back from
    plan: PlanRecord | None = None  # the newest plan
    quarantined: list[str] | None = None  # nodes drained for it (or let be: last wills)
    kept: list[str] | None = None  # nodes whose live ranks wait for an in-process restart
    suspects_tried: list[str] | None = None  # suspect nodes burned in
    vetted: list[str] | None = None  # ... and those that passed
    wait_since: float | None = None  # when it began to wait for a node
    backoff_s: float | None = None  # the wait before its restart (a crash loop)
    linked: list[str] | None = None  # replacements whose link to the job passed its probe
    rejected: list[str] | None = None  # replacements that failed their burn-in or probe
    rollback_applied: bool = False  # its rollback recorded on the job
    restart_counted: bool = False  # its restart spent of the budget
    awaiting: Awaiting | None = None  # the relaunch's ranks heard from, until it is acked
    launch_started_at: float | None = None
    restored_step: int | Unset | None = UNSET  # the step the relaunch restores
    cold_ranks: dict[str, str] | Unset | None = UNSET  # reason -> ranks started cold
    generation_new: int | None = None  # the generation it launched, once acked
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    # The keys of the fields from ``size`` on, in the order they were first set (or
    # read): its record writes them so, as the dict it replaces kept them.
    order: list[str] = field(default_factory=list, repr=False, compare=False)

    KEYS: ClassVar[tuple[str, ...]] = (
        "generation",
        "failures",
        "fault_at",
        "detected_at",
        "phase",
        "phases",
        "size",
        RECHECK,
        "guard",
        "plan",
        "quarantined",
        "kept",
        "suspects_tried",
        "vetted",
        "wait_since",
        "backoff_s",
        "linked",
        "rejected",
        "rollback_applied",
        "restart_counted",
        "awaiting",
        "launch_started_at",
        "restored_step",
        "cold_ranks",
        "generation_new",
    )
    # Set to null, told apart from not set (``UNSET``); None is not set for the others.
    NULLABLE: ClassVar[frozenset[str]] = frozenset({"restored_step", "cold_ranks"})

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        key = _LATE_KEYS.get(name)
        if key is None or not _is_set(key, value):
            return
        try:
            order: list[str] = object.__getattribute__(self, "order")
        except AttributeError:  # in __init__, before ``order``: __post_init__ sees to it
            return
        if key not in order:
            order.append(key)

    def __post_init__(self) -> None:
        for name, key in _LATE_KEYS.items():  # set when made: in the order a recovery sets
            if key not in self.order and _is_set(key, getattr(self, name)):
                self.order.append(key)

    def to_record(self) -> dict[str, Any]:
        """Its dict: the keys of the fields it set, in the order they were first set."""
        late: list[tuple[str, Any]] = [
            ("size", self.size),
            (RECHECK, self.recheck.to_record() if self.recheck is not None else None),
            ("guard", self.guard.to_record() if self.guard is not None else None),
            ("plan", self.plan.to_record() if self.plan is not None else None),
            ("quarantined", self.quarantined),
            ("kept", self.kept),
            ("suspects_tried", self.suspects_tried),
            ("vetted", self.vetted),
            ("wait_since", self.wait_since),
            ("backoff_s", self.backoff_s),
            ("linked", self.linked),
            ("rejected", self.rejected),
            ("rollback_applied", self.rollback_applied or None),
            ("restart_counted", self.restart_counted or None),
            ("awaiting", self.awaiting.to_record() if self.awaiting is not None else None),
            ("launch_started_at", self.launch_started_at),
            ("restored_step", self.restored_step),
            ("cold_ranks", self.cold_ranks),
            ("generation_new", self.generation_new),
        ]
        return _written(
            [
                ("generation", self.generation),
                ("failures", [f.to_record() for f in self.failures]),
                ("fault_at", self.fault_at),
                ("detected_at", self.detected_at),
                ("phase", self.phase),
                ("phases", self.phases),
                *_in_order(
                    [(k, v) for k, v in late if _is_set(k, v)],
                    self.order,
                ),
            ],
            frozenset(),
            self.extra,
        )

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Recovery:
        _, extra = _read(rec, cls.KEYS)
        recheck, guard, plan = rec.get(RECHECK), rec.get("guard"), rec.get("plan")
        awaiting = rec.get("awaiting")
        return cls(
            generation=rec.get("generation", 0),
            failures=[Failure.from_record(f) for f in rec.get("failures", ())],
            fault_at=rec.get("fault_at", 0.0),
            detected_at=rec.get("detected_at", 0.0),
            phase=rec.get("phase", "plan"),
            phases=dict(rec.get("phases", {})),
            size=rec.get("size"),
            recheck=Recheck.from_record(recheck) if recheck is not None else None,
            guard=GuardTrip.from_record(guard) if guard is not None else None,
            plan=PlanRecord.from_record(plan) if plan is not None else None,
            quarantined=rec.get("quarantined"),
            kept=rec.get("kept"),
            suspects_tried=rec.get("suspects_tried"),
            vetted=rec.get("vetted"),
            wait_since=rec.get("wait_since"),
            backoff_s=rec.get("backoff_s"),
            linked=rec.get("linked"),
            rejected=rec.get("rejected"),
            rollback_applied=bool(rec.get("rollback_applied")),
            restart_counted=bool(rec.get("restart_counted")),
            awaiting=Awaiting.from_record(awaiting) if awaiting is not None else None,
            launch_started_at=rec.get("launch_started_at"),
            restored_step=rec.get("restored_step", UNSET),
            cold_ranks=rec.get("cold_ranks", UNSET),
            generation_new=rec.get("generation_new"),
            extra=extra,
            order=[k for k in rec if k in _LATE_SET],
        )


# Recovery's fields from ``size`` on, and their keys, in the order a recovery sets them.
_LATE_KEYS: Final = {
    "size": "size",
    "recheck": RECHECK,
    "guard": "guard",
    "plan": "plan",
    "quarantined": "quarantined",
    "kept": "kept",
    "suspects_tried": "suspects_tried",
    "vetted": "vetted",
    "wait_since": "wait_since",
    "backoff_s": "backoff_s",
    "linked": "linked",
    "rejected": "rejected",
    "rollback_applied": "rollback_applied",
    "restart_counted": "restart_counted",
    "awaiting": "awaiting",
    "launch_started_at": "launch_started_at",
    "restored_step": "restored_step",
    "cold_ranks": "cold_ranks",
    "generation_new": "generation_new",
}
_LATE_SET: Final = frozenset(_LATE_KEYS.values())


def _is_set(key: str, value: Any) -> bool:
    """Whether a late field's value puts its key in the record (None is not set, but for
    the nullable ones; False is not set)."""
    if value is UNSET or value is False:
        return False
    return value is not None or key in Recovery.NULLABLE


def _in_order(pairs: list[tuple[str, Any]], order: list[str]) -> list[tuple[str, Any]]:
    """``pairs`` with the keys of ``order`` first, in its order, then the rest as given."""
    rank = {k: i for i, k in enumerate(order)}
    return sorted(pairs, key=lambda kv: rank.get(kv[0], len(rank)))


@dataclass(slots=True)
class Incident:
    """What one recovery of a job cost, recorded when it ended
    (:meth:`supervisor.recovery.incidents.Incidents.finish`); its last phases, its
    MTTR and when it resumed are timed once every rank of the new generation stepped
    (``awaiting`` until then)."""

    generation: int = 0  # the generation that failed
    next_generation: int | None = None  # the one it launched (None: it failed)
    failures: list[Failure] = field(default_factory=list)
    size: dict[str, Any] | None = None  # of the generation it ended (Job.size)
    fault_at: float = 0.0
    detected_at: float = 0.0
    plan: PlanRecord | None = None
    phases: dict[str, float] = field(default_factory=dict)
    cold_ranks: dict[str, str] | None = None  # reason -> ranks the relaunch started cold
    launch_started_at: float | None = None
    outcome: str = ""  # "recovered", "failed", "launch_failed", "cancelled", ...
    failed_step: int | None = None
    restored_step: int | None = None
    lost_steps: int | None = None
    lost_work_s: float | None = None  # None: not known (the job reports no steps)
    downtime_s: float = 0.0
    resumed_at: float | None = None
    ran_s: float | None = None  # how long the failed generation ran
    trained_steps: int | None = None  # steps it trained past its first
    acked_s: float | None = None  # fault to every start of the new generation acked
    mttr_s: float | None = None  # fault to the new generation's first step
    awaiting: Awaiting | None = None  # None: not awaited (and not in its record)
    missing: frozenset[str] = field(default=frozenset(), repr=False)
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    KEYS: ClassVar[tuple[str, ...]] = (
        "generation",
        "next_generation",
        "failures",
        "size",
        "fault_at",
        "detected_at",
        "plan",
        "phases",
        "cold_ranks",
        "launch_started_at",
        "outcome",
        "failed_step",
        "restored_step",
        "lost_steps",
        "lost_work_s",
        "downtime_s",
        "resumed_at",
        "ran_s",
        "trained_steps",
        "acked_s",
        "mttr_s",
        "awaiting",
    )

    def has(self, key: str) -> bool:
        """Whether its record has ``key`` (one an older supervisor wrote may lack some)."""
        return key not in self.missing and (key != "awaiting" or self.awaiting is not None)

    def to_record(self) -> dict[str, Any]:
        pairs: list[tuple[str, Any]] = [
            ("generation", self.generation),
            ("next_generation", self.next_generation),
            ("failures", [f.to_record() for f in self.failures]),
            ("size", self.size),
            ("fault_at", self.fault_at),
            ("detected_at", self.detected_at),
            ("plan", self.plan.to_record() if self.plan is not None else None),
            ("phases", self.phases),
            ("cold_ranks", self.cold_ranks),
            ("launch_started_at", self.launch_started_at),
            ("outcome", self.outcome),
            ("failed_step", self.failed_step),
            ("restored_step", self.restored_step),
            ("lost_steps", self.lost_steps),
            ("lost_work_s", self.lost_work_s),
            ("downtime_s", self.downtime_s),
            ("resumed_at", self.resumed_at),
            ("ran_s", self.ran_s),
            ("trained_steps", self.trained_steps),
            ("acked_s", self.acked_s),
            ("mttr_s", self.mttr_s),
        ]
        if self.awaiting is not None:
            pairs.append(("awaiting", self.awaiting.to_record()))
        return _written(pairs, self.missing, self.extra)

    @classmethod
    def from_record(cls, rec: Mapping[str, Any]) -> Incident:
        missing, extra = _read(rec, cls.KEYS)
        plan, awaiting = rec.get("plan"), rec.get("awaiting")
        return cls(
            generation=rec.get("generation", 0),
            next_generation=rec.get("next_generation"),
            failures=[Failure.from_record(f) for f in rec.get("failures", ())],
            size=rec.get("size"),
            fault_at=rec.get("fault_at", 0.0),
            detected_at=rec.get("detected_at", 0.0),
            plan=PlanRecord.from_record(plan) if plan is not None else None,
            phases=dict(rec.get("phases", {})),
            cold_ranks=rec.get("cold_ranks"),
            launch_started_at=rec.get("launch_started_at"),
            outcome=rec.get("outcome", ""),
            failed_step=rec.get("failed_step"),
            restored_step=rec.get("restored_step"),
            lost_steps=rec.get("lost_steps"),
            lost_work_s=rec.get("lost_work_s"),
            downtime_s=rec.get("downtime_s", 0.0),
            resumed_at=rec.get("resumed_at"),
            ran_s=rec.get("ran_s"),
            trained_steps=rec.get("trained_steps"),
            acked_s=rec.get("acked_s"),
            mttr_s=rec.get("mttr_s"),
            awaiting=Awaiting.from_record(awaiting) if awaiting is not None else None,
            missing=missing - {"awaiting"},
            extra=extra,
        )
