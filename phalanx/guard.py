"""The loss guard: a rank's losses in, a trip out. Pure: no I/O, no clock, no torch.

``phalanx.rank.step(step, loss=...)`` feeds every loss to a :class:`LossGuard` made from
the job spec's ``guard:`` block (the supervisor hands it to the ranks in
:data:`ENV_GUARD`). The guard *trips* on

* a NaN or infinite loss (kind ``nan``, the onset is that step), or
* a loss above ``ratio`` x the mean of the last ``window`` losses, ``patience`` steps in
  a row (kind ``loss_spike``; the onset is the first step of the run).

Spiking losses do not enter the window, so the mean stays the one before the spike.
Spikes are judged once the window is full (a NaN at once); a generation started by a
rollback is given the mean before the spike (``baseline``) and judges from its first
step. A mean at or below zero judges nothing (the ratio means nothing there).

The supervisor answers a trip with a rollback: the gang restarts from a checkpoint
older than the onset and skips the steps from that checkpoint through the trip. The
ranges to skip come in :data:`ENV_SKIP`, an optional LR scale in :data:`ENV_LR_SCALE`
(see ``docs/jobspec.md``, "The loss guard").
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "ENV_GUARD",
    "ENV_LR_SCALE",
    "ENV_SKIP",
    "GuardError",
    "LossGuard",
    "LrScale",
    "Rule",
    "Trip",
    "next_step",
    "parse_lr_scale",
    "parse_rule",
    "parse_skip",
]

ENV_GUARD: Final = "PHALANX_GUARD"  # {"ratio": 3.0, "window": 100, "patience": 3, "baseline": x}
ENV_SKIP: Final = "PHALANX_SKIP"  # [[start, stop], ...]: steps start..stop-1 are skipped
ENV_LR_SCALE: Final = "PHALANX_LR_SCALE"  # {"factor": 0.5, "from": a, "until": b}
MAX_WINDOW: Final = 100_000
MAX_SKIP_RANGES: Final = 1000

Kind = Literal["nan", "loss_spike"]


class GuardError(ValueError):
    """A guard rule, skip list or LR scale that cannot be read (names the variable)."""


@dataclass(frozen=True, slots=True)
class Rule:
    ratio: float = 3.0
    window: int = 100
    patience: int = 3
    baseline: float | None = None  # the mean to start from (a generation after a rollback)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.ratio) and self.ratio > 1.0):
            raise GuardError(f"guard ratio {self.ratio!r} is not a finite number above 1")
        if not 1 <= self.window <= MAX_WINDOW:
            raise GuardError(f"guard window {self.window!r} is not in [1, {MAX_WINDOW}]")
        if not 1 <= self.patience <= self.window:
            raise GuardError(f"guard patience {self.patience!r} is not in [1, window]")
        if self.baseline is not None and not math.isfinite(self.baseline):
            raise GuardError(f"guard baseline {self.baseline!r} is not a finite number")

    def encode(self) -> str:
        data: dict[str, float | int] = {
            "ratio": self.ratio,
            "window": self.window,
            "patience": self.patience,
        }
        if self.baseline is not None:
            data["baseline"] = self.baseline
        return json.dumps(data, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class Trip:
    """The guard tripped at ``step``: the loss went bad at ``onset`` (``value``, the first
    bad loss; ``baseline``, the window's mean before it, None when not yet known)."""

    kind: Kind
    step: int
    onset: int
    value: float
    baseline: float | None


class LossGuard:
    """One rank's guard (see the module doc). Call :meth:`see` once per step."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self._recent: deque[float] = deque(maxlen=rule.window)
        self._total = 0.0
        self._added = 0  # since the total was last summed afresh (rounding drifts)
        if rule.baseline is not None:
            self._recent.extend([rule.baseline] * rule.window)
            self._total = rule.baseline * rule.window
        self._onset: int | None = None
        self._first = math.nan
        self._run = 0
        self.tripped: Trip | None = None

    @property
    def mean(self) -> float | None:
        """The window's mean, once it is full."""
        if len(self._recent) < self.rule.window:
            return None
        return self._total / self.rule.window

    def see(self, step: int, loss: float) -> Trip | None:
        """Judge the loss of ``step``; the :class:`Trip` the first time the guard trips,
        else None (and None ever after)."""
        if self.tripped is not None:
            return None
        mean = self.mean
        if not math.isfinite(loss):
            onset = self._onset if self._onset is not None else step
            self.tripped = Trip("nan", step, onset, loss, mean)
            return self.tripped
        if mean is not None and mean > 0 and loss > self.rule.ratio * mean:
            if self._onset is None:
                self._onset, self._first = step, loss
            self._run += 1
            if self._run >= self.rule.patience:
                self.tripped = Trip("loss_spike", step, self._onset, self._first, mean)
                return self.tripped
            return None
        self._onset, self._run = None, 0
        if len(self._recent) == self._recent.maxlen:
            self._total -= self._recent[0]
        self._recent.append(loss)
        self._total += loss
        self._added += 1
        if self._added >= self.rule.window:
            self._total, self._added = math.fsum(self._recent), 0
        return None


@dataclass(frozen=True, slots=True)
class LrScale:
    """Scale the learning rate by ``factor`` for the steps ``start`` to ``until - 1``."""

    factor: float
    start: int
    until: int

    def at(self, step: int) -> float:
        return self.factor if self.start <= step < self.until else 1.0

    def encode(self) -> str:
        return json.dumps({"factor": self.factor, "from": self.start, "until": self.until})


def parse_rule(text: str) -> Rule:
    """A rule from :data:`ENV_GUARD`'s JSON; :class:`GuardError` naming what is wrong."""
    obj = _json_object(text, ENV_GUARD)
    unknown = set(obj) - {"ratio", "window", "patience", "baseline"}
    if unknown:
        raise GuardError(f"{ENV_GUARD}: unknown fields {sorted(unknown)}")
    try:
        baseline = obj.get("baseline")
        return Rule(
            ratio=float(_number(obj.get("ratio", 3.0), "ratio")),
            window=_integer(obj.get("window", 100), "window"),
            patience=_integer(obj.get("patience", 3), "patience"),
            baseline=None if baseline is None else float(_number(baseline, "baseline")),
        )
    except GuardError as exc:
        raise GuardError(f"{ENV_GUARD}: {exc}") from exc


def parse_skip(text: str) -> tuple[tuple[int, int], ...]:
    """The step ranges of :data:`ENV_SKIP` (``[[start, stop], ...]``, half-open), sorted
    and merged; :class:`GuardError` on anything else."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise GuardError(f"{ENV_SKIP} is not JSON: {exc}") from exc
    if not isinstance(raw, list) or len(raw) > MAX_SKIP_RANGES:
        raise GuardError(f"{ENV_SKIP} is not a list of at most {MAX_SKIP_RANGES} [start, stop]")
    ranges = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 2):
            raise GuardError(f"{ENV_SKIP}: {item!r} is not [start, stop]")
        try:
            start, stop = (_integer(v, "a skipped step") for v in item)
        except GuardError as exc:
            raise GuardError(f"{ENV_SKIP}: {exc}") from exc
        if not 0 <= start <= stop:
            raise GuardError(f"{ENV_SKIP}: [{start}, {stop}] is not a range of steps")
        ranges.append((start, stop))
    return merge_ranges(ranges)


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Half-open ranges sorted, the empty ones dropped, overlapping ones merged."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(r for r in ranges if r[0] < r[1]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return tuple(out)


def next_step(step: int, ranges: Sequence[tuple[int, int]]) -> int:
    """The first step at or after ``step`` that no range skips (``ranges`` merged)."""
    for start, stop in ranges:
        if start <= step < stop:
            return stop
    return step


def parse_lr_scale(text: str) -> LrScale:
    """The LR scale of :data:`ENV_LR_SCALE`; :class:`GuardError` on anything else."""
    obj = _json_object(text, ENV_LR_SCALE)
    try:
        factor = float(_number(obj.get("factor"), "factor"))
        start = _integer(obj.get("from"), "from")
        until = _integer(obj.get("until"), "until")
    except GuardError as exc:
        raise GuardError(f"{ENV_LR_SCALE}: {exc}") from exc
    if not (math.isfinite(factor) and factor > 0):
        raise GuardError(f"{ENV_LR_SCALE}: factor {factor!r} is not a positive number")
    return LrScale(factor, start, until)


def _json_object(text: str, name: str) -> dict[str, object]:
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise GuardError(f"{name} is not JSON: {exc}") from exc
    if not isinstance(obj, dict):
        raise GuardError(f"{name} is not a JSON object")
    return obj


def _number(value: object, name: str) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise GuardError(f"{name} {value!r} is not a number")
    return value


def _integer(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GuardError(f"{name} {value!r} is not a whole number")
    return value
