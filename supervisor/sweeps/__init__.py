"""Sweeps: hyperparameter search over gang-job trials, with Optuna (ask-and-tell).

The supervisor is the one Optuna client (:class:`Sweeps`); its REST routes are in
:mod:`supervisor.api.sweep_routes`. See :mod:`supervisor.sweeps.manager` for how trials are asked,
submitted, reported, pruned and told, and :mod:`supervisor.sweeps.study` for the storage.
"""

from supervisor.sweeps.manager import Sweep, Sweeps, SweepState, UnknownSweep

__all__ = ["Sweep", "SweepState", "Sweeps", "UnknownSweep"]
