"""Optuna, as the sweeps use it: the storage, a spec's sampler, pruner and distributions.

**Storage: Optuna's journal in the state directory** (``sweeps.journal`` beside
``state.db``). The supervisor is its one writer, appending each ask, report and tell
(a line, flushed) to a file no other process writes; the study survives a restart by
replaying it. Chosen over Optuna's RDB storage because that would be a second writer
on ``state.db`` (SQLAlchemy's connection beside the store's, each with its own
transactions: never two writers on one SQLite file), or a second SQLite database with
SQLAlchemy, Alembic migrations and their schema to carry for nothing the journal lacks
at this scale (a sweep is a few thousand trials at most).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
)
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend

from phalanx.sweepspec import CategoricalParam, FloatParam, IntParam, SweepSpec

JOURNAL = "sweeps.journal"

optuna.logging.set_verbosity(optuna.logging.WARNING)
optuna.logging.disable_default_handler()  # its records go to the supervisor's handlers
optuna.logging.enable_propagation()
logging.getLogger("optuna").setLevel(logging.WARNING)


def open_storage(state_dir: Path) -> JournalStorage:
    return JournalStorage(JournalFileBackend(str(state_dir / JOURNAL)))


def distributions(spec: SweepSpec) -> dict[str, BaseDistribution]:
    found: dict[str, BaseDistribution] = {}
    for name, p in spec.space.items():
        if isinstance(p, FloatParam):
            found[name] = FloatDistribution(p.low, p.high, log=p.log, step=p.step)
        elif isinstance(p, IntParam):
            found[name] = IntDistribution(p.low, p.high, log=p.log, step=p.step)
        else:
            found[name] = CategoricalDistribution(list(p.choices))
    return found


def _grid(spec: SweepSpec) -> dict[str, list[Any]]:
    grid: dict[str, list[Any]] = {}
    for name, p in spec.space.items():
        if isinstance(p, CategoricalParam):
            grid[name] = list(p.choices)
        elif isinstance(p, IntParam):
            grid[name] = list(range(p.low, p.high + 1, p.step))
        else:
            assert p.step is not None  # the spec refuses a grid over a float without one
            count = int((p.high - p.low) / p.step + 1e-9)
            grid[name] = [p.low + i * p.step for i in range(count + 1)]
    return grid


def sampler_of(spec: SweepSpec) -> optuna.samplers.BaseSampler:
    s = spec.sampler
    if s.type == "random":
        return optuna.samplers.RandomSampler(seed=s.seed)
    if s.type == "grid":
        return optuna.samplers.GridSampler(_grid(spec), seed=s.seed)
    return optuna.samplers.TPESampler(seed=s.seed, n_startup_trials=s.startup_trials)


def pruner_of(spec: SweepSpec) -> optuna.pruners.BasePruner:
    p = spec.pruner
    if p.type == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=p.min_steps, reduction_factor=p.reduction_factor
        )
    if p.type == "hyperband":
        assert p.max_steps is not None  # the spec requires it
        return optuna.pruners.HyperbandPruner(
            min_resource=p.min_steps, max_resource=p.max_steps, reduction_factor=p.reduction_factor
        )
    if p.type == "median":
        return optuna.pruners.MedianPruner(
            n_startup_trials=p.startup_trials,
            n_warmup_steps=p.warmup_steps,
            interval_steps=p.interval_steps,
        )
    return optuna.pruners.NopPruner()


def create(storage: JournalStorage, sweep_id: str, spec: SweepSpec) -> optuna.Study:
    return optuna.create_study(
        storage=storage,
        study_name=sweep_id,
        direction=spec.objective.direction,
        sampler=sampler_of(spec),
        pruner=pruner_of(spec),
    )


def load(storage: JournalStorage, sweep_id: str, spec: SweepSpec) -> optuna.Study:
    return optuna.load_study(
        storage=storage, study_name=sweep_id, sampler=sampler_of(spec), pruner=pruner_of(spec)
    )


def trial_of(storage: JournalStorage, study: optuna.Study, number: int) -> optuna.Trial:
    """The live trial ``number`` of ``study`` (in ``storage``; after a restart too)."""
    trial_id = storage.get_trial_id_from_study_id_trial_number(
        storage.get_study_id_from_name(study.study_name), number
    )
    return optuna.Trial(study, trial_id)
