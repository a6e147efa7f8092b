"""The sweep spec: a YAML file that asks for a hyperparameter search, validated by pydantic.

A sweep is a base job spec (``trial``: every trial runs it as a gang job), a search
``space``, the ``objective`` (a metric the ranks report through ``phalanx.rank.step``),
the ``sampler`` and ``pruner`` (Optuna's, see ``supervisor.sweeps``), how many trials
run in all and at once, and their priority. See ``docs/sweeps.md`` for every field.

As with :mod:`phalanx.jobspec`, errors name the field and, where the YAML gives one, the
line: ``space.lr.low (line 9): Input should be greater than 0``; the trial's own fields
are named under ``trial.`` (``trial.nodes (line 5): ...``).

A trial's parameters reach its ranks three ways: as ``hyperparams`` in its job spec
(lineage records them with its checkpoints), as environment variables ``HP_<NAME>``
(upper case), and substituted into its command where an argument holds ``{name}``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from phalanx import jobspec
from phalanx.jobspec import JobSpec, JobSpecError, TeamOf
from phalanx.wire import SCALAR_NAME_PATTERN

SWEEP_NAME_PATTERN = r"^[a-z0-9][a-z0-9-]{0,39}$"  # room for "-xxxxxx-t9999" in job names
PARAM_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"
ENV_PREFIX = "HP_"
# ``{name}`` in an argument of the trial's command, not ``${name}`` (a shell's variable).
_PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")
MAX_TRIALS = 10_000


class SweepSpecError(JobSpecError):
    """A sweep spec that cannot be used; ``errors`` holds ``(field, line, message)``."""

    def __init__(self, errors: list[tuple[str, int | None, str]]) -> None:
        super().__init__(errors)
        lines = [f"{f}{f' (line {ln})' if ln else ''}: {m}" for f, ln, m in errors]
        self.args = ("invalid sweep spec:\n  " + "\n  ".join(lines),)

    def __str__(self) -> str:
        return str(self.args[0])


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class FloatParam(_Spec):
    type: Literal["float"]
    low: float = Field(description="Smallest value.")
    high: float = Field(description="Largest value.")
    log: bool = Field(default=False, description="Sample on a log scale (low must be > 0).")
    step: float | None = Field(default=None, gt=0, description="Discretize by this step.")

    @model_validator(mode="after")
    def _range(self) -> FloatParam:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError("a log scale needs low > 0")
        if self.log and self.step is not None:
            raise ValueError("log and step cannot both be given")
        return self


class IntParam(_Spec):
    type: Literal["int"]
    low: int = Field(description="Smallest value.")
    high: int = Field(description="Largest value.")
    log: bool = Field(default=False, description="Sample on a log scale (low must be >= 1).")
    step: int = Field(default=1, ge=1, description="Only low, low+step, ... (1 with log).")

    @model_validator(mode="after")
    def _range(self) -> IntParam:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low < 1:
            raise ValueError("a log scale needs low >= 1")
        if self.log and self.step != 1:
            raise ValueError("log and a step other than 1 cannot both be given")
        return self


Choice = Annotated[str, Field(max_length=256)] | bool | int | float


class CategoricalParam(_Spec):
    type: Literal["categorical"]
    choices: list[Choice] = Field(
        min_length=1, max_length=1000, description="The values to pick from."
    )

    @model_validator(mode="after")
    def _distinct(self) -> CategoricalParam:
        seen = [repr(c) for c in self.choices]
        if len(set(seen)) != len(seen):
            raise ValueError("choices must be distinct")
        return self


Param = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]


class Objective(_Spec):
    metric: str = Field(
        pattern=SCALAR_NAME_PATTERN,
        description="A scalar the ranks report with phalanx.rank.step (rank 0's series).",
    )
    direction: Literal["minimize", "maximize"] = Field(default="minimize")
    at: Literal["last", "best"] = Field(
        default="last", description="The trial's value: the metric at its last step, or its best."
    )


class SamplerSpec(_Spec):
    type: Literal["tpe", "random", "grid"] = Field(default="tpe")
    seed: int | None = Field(default=None, ge=0, le=2**32 - 1, description="For repeatable runs.")
    startup_trials: int = Field(
        default=4, ge=0, le=MAX_TRIALS, description="tpe: random trials before it models."
    )


class PrunerSpec(_Spec):
    """Where the pruner decides (its *rungs*), counted in the trial's steps."""

    type: Literal["asha", "hyperband", "median", "none"] = Field(default="asha")
    min_steps: int = Field(
        default=10, ge=1, le=10**9, description="asha, hyperband: the first rung."
    )
    reduction_factor: int = Field(
        default=3,
        ge=2,
        le=100,
        description="asha, hyperband: each rung is this many times the last; 1 in this "
        "many trials goes on at each.",
    )
    max_steps: int | None = Field(
        default=None,
        ge=1,
        le=10**9,
        description="hyperband (required): a trial's steps; asha: no rung past it.",
    )
    warmup_steps: int = Field(
        default=10, ge=0, le=10**9, description="median: no pruning before this step."
    )
    interval_steps: int = Field(
        default=10, ge=1, le=10**9, description="median: a rung every this many steps after."
    )
    startup_trials: int = Field(
        default=4, ge=0, le=MAX_TRIALS, description="median: trials that run whole first."
    )

    @model_validator(mode="after")
    def _hyperband(self) -> PrunerSpec:
        if self.type == "hyperband" and self.max_steps is None:
            raise ValueError("hyperband needs max_steps")
        if self.max_steps is not None and self.max_steps < self.min_steps:
            raise ValueError("max_steps must be at least min_steps")
        return self

    def next_rung(self, after: int) -> int | None:
        """The first rung past step ``after`` (None: no more)."""
        if self.type == "none":
            return None
        if self.type == "median":
            start = max(self.warmup_steps, 1)
            if after < start:
                return start
            return start + ((after - start) // self.interval_steps + 1) * self.interval_steps
        rung = self.min_steps
        while rung <= after:
            rung *= self.reduction_factor
        return rung if self.max_steps is None or rung <= self.max_steps else None

    def rungs(self, upto: int) -> list[int]:
        """The steps up to ``upto`` where this pruner decides (where a trial's
        objective is reported)."""
        if self.type == "none":
            return []
        if self.type == "median":
            start = max(self.warmup_steps, 1)
            return list(range(start, upto + 1, self.interval_steps))
        last = min(upto, self.max_steps) if self.max_steps is not None else upto
        found, rung = [], self.min_steps
        while rung <= last:
            found.append(rung)
            rung *= self.reduction_factor
        return found


class SweepSpec(_Spec):
    name: str = Field(pattern=SWEEP_NAME_PATTERN, description="Lower case, at most 40.")
    team: str = Field(min_length=1, max_length=64, description="Team charged for the trials.")
    trial: JobSpec = Field(description="The base job spec every trial runs.")
    space: dict[Annotated[str, Field(pattern=PARAM_NAME_PATTERN)], Param] = Field(
        min_length=1, max_length=64, description="The search space, by parameter name."
    )
    objective: Objective
    sampler: SamplerSpec = Field(default_factory=SamplerSpec)
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)
    n_trials: int = Field(ge=1, le=MAX_TRIALS, description="Trials in all (retries not counted).")
    parallelism: int = Field(default=1, ge=1, le=1000, description="Trials running at once.")
    priority: int | None = Field(
        default=None, ge=0, le=1000, description="The trials' priority (default: the trial's)."
    )

    @model_validator(mode="after")
    def _fits(self) -> SweepSpec:
        if self.sampler.type == "grid":
            for name, p in self.space.items():
                if isinstance(p, FloatParam) and p.step is None:
                    raise ValueError(f"grid: float parameter {name!r} needs a step")
        return self

    def trial_spec(self, job_name: str, params: dict[str, Any]) -> JobSpec:
        """The job spec of one trial: named ``job_name``, ``params`` in its hyperparams,
        its env (``HP_<NAME>``) and its command's ``{name}`` placeholders."""
        data = self.trial.model_dump(mode="json")
        text = {k: format_value(v) for k, v in params.items()}
        data["name"] = job_name
        data["command"] = [
            _PLACEHOLDER.sub(lambda m: text.get(m.group(1), m.group(0)), arg)
            for arg in data["command"]
        ]
        data["env"] = {**data["env"], **{ENV_PREFIX + k.upper(): v for k, v in text.items()}}
        data["hyperparams"] = {**data["hyperparams"], **params}
        if self.priority is not None:
            data["priority"] = self.priority
        return jobspec.validate_spec(data)


def format_value(value: Any) -> str:
    """A parameter as its command and env see it: ``0.001``, ``64``, ``true``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    return str(value)


def validate_sweep(
    data: dict[str, Any],
    *,
    lines: dict[tuple[Any, ...], int] | None = None,
    default_team: TeamOf | None = None,
) -> SweepSpec:
    """``data`` as a :class:`SweepSpec`, or :class:`SweepSpecError` naming each bad field.
    The trial needs no ``name`` or ``team``: it takes the sweep's."""
    if default_team is not None and data.get("team") is None:
        team = default_team()
        if team is None:
            raise SweepSpecError(
                [("team", None, "the spec names no team and the API token has none: add team")]
            )
        data = {**data, "team": team}
    trial = data.get("trial")
    if isinstance(trial, dict):
        # The trial is named per trial, and runs for the sweep's team.
        filled = {"name": "trial", **trial, "team": data.get("team") or "-"}
        data = {**data, "trial": filled}
    errors: list[tuple[str, int | None, str]] = []
    try:
        spec = SweepSpec.model_validate(data)
    except ValidationError as exc:
        errors.extend(_errors(exc, lines))
        raise SweepSpecError(errors) from exc
    used = {m.group(1) for arg in spec.trial.command for m in _PLACEHOLDER.finditer(arg)}
    unknown = sorted(used - set(spec.space))
    if unknown:
        line = (lines or {}).get(("trial", "command"))
        errors.append(
            (
                "trial.command",
                line,
                f"{{{unknown[0]}}} names no parameter of the space ({', '.join(spec.space)})",
            )
        )
    clash = sorted(
        ENV_PREFIX + k.upper() for k in spec.space if ENV_PREFIX + k.upper() in spec.trial.env
    )
    if clash:
        errors.append(("trial.env", None, f"{clash[0]} is set by the sweep for every trial"))
    if errors:
        raise SweepSpecError(errors)
    return spec


_TAGS = frozenset({"str", "FromFile", "float", "int", "categorical", "bool"})


def _errors(
    exc: ValidationError, lines: dict[tuple[Any, ...], int] | None
) -> list[tuple[str, int | None, str]]:
    """The spec's errors by field (:func:`phalanx.jobspec.field_errors`), the space's
    parameter kinds left out of the field's name too."""
    return jobspec.field_errors(exc, lines, _TAGS)


def load_sweep(
    text: str, *, source: str = "sweep spec", default_team: TeamOf | None = None
) -> SweepSpec:
    """Parse and validate YAML text (within :mod:`phalanx.jobspec`'s size limits);
    raises :class:`SweepSpecError`, and nothing else, for any text."""
    try:
        data, lines = jobspec.load_mapping(text, source=source, what="a sweep spec")
    except JobSpecError as exc:
        raise SweepSpecError(exc.errors) from exc
    return validate_sweep(data, lines=lines, default_team=default_team)


def load_sweep_file(path: Path, *, default_team: TeamOf | None = None) -> SweepSpec:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SweepSpecError([(str(path), None, f"cannot read: {exc.strerror}")]) from exc
    return load_sweep(text, source=str(path), default_team=default_team)
