"""The sweeps: the supervisor as the one Optuna client, through ask-and-tell.

Every tick (:data:`TICK_S`, or sooner when woken) each running sweep is advanced:

* **ask and submit.** While fewer than ``parallelism`` trials run and the sweep has
  trials left (``n_trials``, retries not counted), a trial is asked of the study and
  submitted as a gang job named ``<sweep>-t<number>`` (its parameters in the job's
  ``hyperparams``, env ``HP_<NAME>`` and command, :meth:`SweepSpec.trial_spec`), at
  the sweep's priority: the scheduler packs it and preempts it like any job (a
  preempted trial goes back to pending and resumes from its checkpoint: still the
  same trial).
* **report and prune.** The objective's points that the metrics channel wrote for
  the trial's job since the last tick (``supervisor.telemetry.training``: rank 0's value at the
  last step of each window) are read by the series' insertion cursor. At each rung of
  the pruner (``PrunerSpec.next_rung``, in steps) the value at the first point at or
  past it (the latest, or the best so far with ``at: best``) is reported with
  ``trial.report(value, rung)``, and ``trial.should_prune()`` asked. A pruned trial is
  told PRUNED and its job stopped the way a preemption stops one: its ranks are asked
  to save first (``GangOrders.preempt``), then stopped, the job ``cancelled`` with the
  reason ``pruned by sweep ...``; its committed checkpoints stay in the catalog (only
  the RAM tier is freed when a job ends).
* **tell.** A trial whose job succeeded is told its value once the series holds the
  job's last step (or :attr:`Sweeps.settle_s` after its end): the metric at the last
  step, or its best. A job that failed after its own restarts is told FAIL and the
  trial retried once with the same parameters (``enqueue_trial``; a retry's own
  failure is final). A job cancelled by someone else fails its trial.

**Restarts.** The study is Optuna's journal in the state directory (see
:mod:`supervisor.sweeps.study`); the trials' jobs are ordinary jobs in ``state.db``,
taken up by the job controller like any other (their ranks never stopped). Ask-and-tell
has no heartbeat: the supervisor owns the trials' liveness through their jobs. After a
restart each running trial is found again by its job (the trial's ``job`` attribute, or
failing that the job named after it: the supervisor stopped between the ask and the
attribute), its series read again from the start, and the rungs the journal has no
report for are reported; a trial asked but never submitted is submitted now. A trial
told PRUNED or FAIL whose job still runs (stopped between the tell and the stop) has
its job stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import secrets
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from phalanx.jobspec import JobSpecError
from phalanx.sweepspec import SweepSpec
from supervisor.control.controller import JobController
from supervisor.errors import Refused, SupervisorError
from supervisor.jobs import Job, JobState
from supervisor.store import Store
from supervisor.sweeps import study as studies
from supervisor.telemetry.rows import SeriesRows
from supervisor.telemetry.series import Point
from supervisor.telemetry.training import json_number

log = logging.getLogger(__name__)

TICK_S = 1.0
IMPORTANCE_MIN_TRIALS = 4  # complete trials before Optuna's importance evaluator is asked


class SweepState(enum.StrEnum):
    RUNNING = "running"
    COMPLETE = "complete"
    CANCELLED = "cancelled"


class UnknownSweep(SupervisorError):
    def __init__(self, sweep: str) -> None:
        super().__init__(f"sweep {sweep!r} is not known to this supervisor")
        self.sweep = sweep


TRIAL_STATES = {
    TrialState.RUNNING: "running",
    TrialState.WAITING: "running",  # a retry about to be asked
    TrialState.COMPLETE: "complete",
    TrialState.PRUNED: "pruned",
    TrialState.FAIL: "failed",
}


@dataclass
class _Follow:
    """What the supervisor holds in memory of a running trial's objective."""

    job: str
    cursor: int = 0  # the series' insertion cursor read up to
    last: Point | None = None  # the point at the furthest step
    best: float | None = None
    ended_seen: float | None = None  # monotonic: when its job was first seen succeeded

    def see(self, p: Point, maximize: bool) -> None:
        if self.last is None or (p.step, p.ts) >= (self.last.step, self.last.ts):
            self.last = p
        if not math.isnan(p.value) and (
            self.best is None or (p.value > self.best if maximize else p.value < self.best)
        ):
            self.best = p.value

    def value(self, at: str) -> float | None:
        if at == "best":
            return self.best
        return None if self.last is None else self.last.value


@dataclass
class Sweep:
    id: str
    spec: SweepSpec
    study: optuna.Study
    state: SweepState
    created_at: float
    ended_at: float | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        self.follows: dict[int, _Follow] = {}
        self.dists = studies.distributions(self.spec)
        self.importance: tuple[int, dict[str, float] | None] = (0, None)  # (complete, found)

    def param_importance(self, complete: int) -> dict[str, float] | None:
        """Which parameters matter (Optuna's default evaluator, fANOVA), once at least
        :data:`IMPORTANCE_MIN_TRIALS` trials are complete; computed again only when
        more trials are."""
        if complete < IMPORTANCE_MIN_TRIALS or len(self.spec.space) < 2:
            return None
        if self.importance[0] != complete:
            found: dict[str, float] | None
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # "too few trials": the answer says so
                    found = {
                        k: round(float(v), 4)
                        for k, v in optuna.importance.get_param_importances(self.study).items()
                    }
            except (ValueError, RuntimeError) as exc:
                log.warning("sweep %s: no parameter importance: %s", self.id, exc)
                found = None
            self.importance = (complete, found)
        return self.importance[1]


class Sweeps:
    """The supervisor's sweeps: their studies in ``state_dir``'s journal, their trials as
    jobs of ``jobs``, their objective read from ``store``'s series."""

    def __init__(
        self, state_dir: Path, jobs: JobController, store: Store, *, settle_s: float = 15.0
    ) -> None:
        self._dir = state_dir
        self._ctl = jobs
        self._store = store
        self._series = SeriesRows(store)  # the trials' objective, as the metrics wrote it
        self.settle_s = settle_s
        self.sweeps: dict[str, Sweep] = {}
        self._wake = asyncio.Event()
        self._storage: optuna.storages.JournalStorage | None = None
        if (state_dir / studies.JOURNAL).exists():
            self._load()

    @property
    def storage(self) -> optuna.storages.JournalStorage:
        if self._storage is None:
            self._storage = studies.open_storage(self._dir)
        return self._storage

    def _load(self) -> None:
        for name in optuna.get_all_study_names(self.storage):
            try:
                attrs = self.storage.get_study_user_attrs(self.storage.get_study_id_from_name(name))
                spec = SweepSpec.model_validate(attrs["spec"])
                sw = Sweep(
                    name,
                    spec,
                    studies.load(self.storage, name, spec),
                    SweepState(attrs.get("state", "running")),
                    attrs.get("created_at", 0.0),
                    attrs.get("ended_at"),
                    attrs.get("reason", ""),
                )
            except Exception:  # one bad study must not keep the supervisor down
                log.exception("sweep %s: cannot be loaded from the journal", name)
                continue
            self.sweeps[name] = sw
        log.info("%d sweep(s) loaded from the journal", len(self.sweeps))

    # --- operators -------------------------------------------------------------

    def submit(self, spec: SweepSpec) -> Sweep:
        sweep_id = f"{spec.name}-{secrets.token_hex(3)}"
        study = studies.create(self.storage, sweep_id, spec)
        now = time.time()
        study.set_user_attr("spec", spec.model_dump(mode="json"))
        study.set_user_attr("created_at", now)
        study.set_user_attr("state", SweepState.RUNNING.value)
        sw = Sweep(sweep_id, spec, study, SweepState.RUNNING, now)
        self.sweeps[sweep_id] = sw
        self._event("sweep_submitted", sw, team=spec.team, n_trials=spec.n_trials)
        self.wake()
        return sw

    def get(self, sweep_id: str) -> Sweep:
        found = self.sweeps.get(sweep_id)
        if found is None:
            raise UnknownSweep(sweep_id)
        return found

    def cancel(self, sweep_id: str) -> Sweep:
        """End the sweep: every running trial is told FAIL (``sweep cancelled``) and its
        job cancelled; no trial starts any more."""
        sw = self.get(sweep_id)
        if sw.state is not SweepState.RUNNING:
            raise Refused(f"sweep {sweep_id} already ended ({sw.state.value})")
        self._end(sw, SweepState.CANCELLED, "cancelled by operator")
        for _ in sw.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            sw.study.ask(sw.dists)  # a retry not yet asked: asked, to be told FAIL below
        for ft in sw.study.get_trials(deepcopy=True, states=(TrialState.RUNNING,)):
            self._tell_fail(sw, ft.number, "sweep cancelled")
            job = self._job_of(ft)
            if job is not None and not job.state.final:
                with contextlib.suppress(Refused):
                    self._ctl.cancel(job.id)
                job.reason = f"sweep {sw.id} cancelled"
                self._ctl.save(job)
        return sw

    def wake(self) -> None:
        self._wake.set()

    async def loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            self._wake.clear()
            self.tick()

    def tick(self) -> None:
        for sw in list(self.sweeps.values()):
            try:
                self._advance(sw)
            except Exception:  # a sweep's trouble stays the sweep's: never the loop's
                log.exception("sweep %s: advancing it failed", sw.id)

    # --- the trials ------------------------------------------------------------

    def _advance(self, sw: Sweep) -> None:
        for ft in sw.study.get_trials(deepcopy=True):
            if ft.state is TrialState.RUNNING:
                self._follow(sw, ft)
            elif ft.state.is_finished():
                self._leftover(sw, ft)
        if sw.state is SweepState.RUNNING:
            self._fill(sw)

    def _fill(self, sw: Sweep) -> None:
        trials = sw.study.get_trials(deepcopy=False)
        running = sum(t.state is TrialState.RUNNING for t in trials)
        waiting = sum(t.state is TrialState.WAITING for t in trials)
        started = sum("retry_of" not in t.user_attrs for t in trials)
        while running < sw.spec.parallelism and (waiting or started < sw.spec.n_trials):
            trial = sw.study.ask(sw.dists)
            if "retry_of" in trial.user_attrs:
                waiting -= 1
            else:
                started += 1
            running += 1
            self._submit_trial(sw, trial.number, trial.params)
        if not running and not waiting and started >= sw.spec.n_trials:
            if any((j := self._job_of(t)) is not None and not j.state.final for t in trials):
                return  # a pruned or failed trial's job still stopping: its nodes not yet free
            done = sum(t.state is TrialState.COMPLETE for t in sw.study.get_trials(deepcopy=False))
            self._end(sw, SweepState.COMPLETE, f"{done} of {len(trials)} trials complete")

    def _submit_trial(self, sw: Sweep, number: int, params: dict[str, Any]) -> Job | None:
        try:
            spec = sw.spec.trial_spec(f"{sw.id}-t{number}", params)
        except JobSpecError as exc:
            self._tell_fail(sw, number, f"its job spec is invalid: {exc}")
            return None
        job = self._ctl.submit(spec)
        self._trial(sw, number).set_user_attr("job", job.id)
        sw.follows[number] = _Follow(job.id)
        self._event("sweep_trial_submitted", sw, trial=number, job=job.id, params=params)
        return job

    def _follow(self, sw: Sweep, ft: FrozenTrial) -> None:
        job = self._job_of(ft)
        if job is None:
            found = next(
                (j for j in self._ctl.jobs.values() if j.spec.name == f"{sw.id}-t{ft.number}"),
                None,
            )
            if found is None and "job" in ft.user_attrs:
                self._tell_fail(sw, ft.number, f"its job {ft.user_attrs['job']} is not known")
                return
            if found is None:  # asked, never submitted (a restart in between)
                self._submit_trial(sw, ft.number, ft.params)
                return
            self._trial(sw, ft.number).set_user_attr("job", found.id)
            job = found
        follow = sw.follows.get(ft.number)
        if follow is None or follow.job != job.id:
            follow = sw.follows[ft.number] = _Follow(job.id)
        if self._feed(sw, ft, job, follow):
            return
        if job.state is JobState.SUCCEEDED:
            self._complete(sw, ft, job, follow)
        elif job.state is JobState.FAILED:
            self._failed(sw, ft, job)
        elif job.state is JobState.CANCELLED:
            self._tell_fail(sw, ft.number, f"its job was cancelled: {job.reason}")

    def _feed(self, sw: Sweep, ft: FrozenTrial, job: Job, follow: _Follow) -> bool:
        """Report the rungs the objective's new points reach; True: the trial was pruned."""
        upto = self._series.cursor(job.id)
        if upto <= follow.cursor:
            return False
        metric = sw.spec.objective.metric
        points = self._series.series(job.id, [metric], after=follow.cursor, upto=upto)[metric]
        follow.cursor = upto
        maximize = sw.spec.objective.direction == "maximize"
        done = max(ft.intermediate_values, default=0)
        trial: optuna.Trial | None = None
        for p in sorted(points, key=lambda p: (p.step, p.ts)):
            follow.see(p, maximize)
            while (rung := sw.spec.pruner.next_rung(done)) is not None and rung <= p.step:
                value = follow.value(sw.spec.objective.at)
                if value is None:
                    break
                trial = trial or self._trial(sw, ft.number)
                trial.report(value, rung)
                done = rung
                # A job that ended has its rungs recorded, not judged (a restart missed them).
                if not job.state.final and trial.should_prune():
                    self._prune(sw, ft, job, rung, value)
                    return True
        return False

    def _prune(self, sw: Sweep, ft: FrozenTrial, job: Job, rung: int, value: float) -> None:
        reason = f"pruned by sweep {sw.id} at step {rung}"
        trial = self._trial(sw, ft.number)
        trial.set_user_attr("pruned_at", rung)
        trial.set_user_attr("reason", reason)
        sw.study.tell(ft.number, state=TrialState.PRUNED)
        log.info("sweep %s: trial %d %s (%s %s)", sw.id, ft.number, reason, "value", value)
        self._event("sweep_trial_pruned", sw, trial=ft.number, job=job.id, step=rung)
        self._stop_saving(job, reason)

    def _stop_saving(self, job: Job, reason: str) -> None:
        """Stop ``job`` as a preemption does (its ranks save first), to ``cancelled``."""
        if job.state.final or job.state is JobState.STOPPING:
            return
        if job.state is not JobState.RUNNING:  # pending, starting, recovering: no save
            with contextlib.suppress(Refused):
                self._ctl.cancel(job.id)
            job.reason = reason
            self._ctl.save(job)
            return
        self._ctl.incidents.abandon(job, "cancelled")
        job.stop_target = JobState.CANCELLED
        job.reason = reason
        self._ctl.move(job, JobState.STOPPING, reason)
        self._ctl.spawn(job, self._ctl.preempt(job))

    def _complete(self, sw: Sweep, ft: FrozenTrial, job: Job, follow: _Follow) -> None:
        progress = job.progress.get(str(job.generation))
        last_step = int(progress[2]) if progress else 0
        now = time.monotonic()
        follow.ended_seen = follow.ended_seen or now
        caught_up = follow.last is not None and follow.last.step >= last_step - 1
        if not caught_up and now - follow.ended_seen < self.settle_s:
            return  # the job's last windows may still be on their way
        value = follow.value(sw.spec.objective.at)
        if value is None or not math.isfinite(value):
            metric = sw.spec.objective.metric
            why = f"its job reported no {metric}" if value is None else f"{metric} is {value}"
            self._tell_fail(sw, ft.number, why)
            return
        sw.study.tell(ft.number, value)
        self._event("sweep_trial_complete", sw, trial=ft.number, job=job.id, value=value)
        self.wake()

    def _failed(self, sw: Sweep, ft: FrozenTrial, job: Job) -> None:
        retry = "retry_of" not in ft.user_attrs and sw.state is SweepState.RUNNING
        if retry and not any(
            t.user_attrs.get("retry_of") == ft.number for t in sw.study.get_trials(deepcopy=False)
        ):
            sw.study.enqueue_trial(ft.params, user_attrs={"retry_of": ft.number})
        self._tell_fail(sw, ft.number, f"its job failed: {job.reason}")
        self.wake()

    def _leftover(self, sw: Sweep, ft: FrozenTrial) -> None:
        """A trial told PRUNED or FAIL whose job still runs: stop it."""
        job = self._job_of(ft)
        if job is None or job.state.final or job.state is JobState.STOPPING:
            return
        reason = ft.user_attrs.get("reason") or f"trial {ft.number} ended"
        if ft.state is TrialState.PRUNED:
            self._stop_saving(job, reason)
        elif ft.state is TrialState.FAIL:
            with contextlib.suppress(Refused):
                self._ctl.cancel(job.id)
            job.reason = reason
            self._ctl.save(job)

    # --- plumbing ----------------------------------------------------------------

    def _tell_fail(self, sw: Sweep, number: int, reason: str) -> None:
        self._trial(sw, number).set_user_attr("reason", reason)
        sw.study.tell(number, state=TrialState.FAIL)
        log.info("sweep %s: trial %d failed: %s", sw.id, number, reason)
        self._event("sweep_trial_failed", sw, trial=number, reason=reason)

    def _trial(self, sw: Sweep, number: int) -> optuna.Trial:
        return studies.trial_of(self.storage, sw.study, number)

    def _job_of(self, ft: FrozenTrial) -> Job | None:
        job_id = ft.user_attrs.get("job")
        return self._ctl.jobs.get(job_id) if isinstance(job_id, str) else None

    def _end(self, sw: Sweep, state: SweepState, reason: str) -> None:
        sw.state, sw.ended_at, sw.reason = state, time.time(), reason
        sw.study.set_user_attr("state", state.value)
        sw.study.set_user_attr("ended_at", sw.ended_at)
        sw.study.set_user_attr("reason", reason)
        log.info("sweep %s: %s (%s)", sw.id, state.value, reason)
        self._event(f"sweep_{state.value}", sw, reason=reason)

    def _event(self, kind: str, sw: Sweep, **detail: Any) -> None:
        self._store.add_event(kind, None, {"sweep": sw.id, **detail})

    # --- views -------------------------------------------------------------------

    def view(self, sw: Sweep, *, trials: bool = True) -> dict[str, Any]:
        """The sweep as the API and ``phalanx sweep status -o json`` show it."""
        found = sw.study.get_trials(deepcopy=False)
        rows = [self.trial_view(t) for t in found]
        counts = {s: sum(r["state"] == s for r in rows) for s in set(TRIAL_STATES.values())}
        complete = [r for r in rows if r["state"] == "complete" and isinstance(r["value"], float)]
        pick = max if sw.spec.objective.direction == "maximize" else min
        best = pick(complete, key=lambda r: r["value"]) if complete else None
        spec = sw.spec
        view: dict[str, Any] = {
            "id": sw.id,
            "name": spec.name,
            "team": spec.team,
            "state": sw.state.value,
            "reason": sw.reason or None,
            "created_at": sw.created_at,
            "ended_at": sw.ended_at,
            "objective": spec.objective.model_dump(),
            "n_trials": spec.n_trials,
            "parallelism": spec.parallelism,
            "priority": spec.priority if spec.priority is not None else spec.trial.priority,
            "sampler": spec.sampler.model_dump(),
            "pruner": spec.pruner.model_dump(),
            "space": {k: v.model_dump(mode="json") for k, v in spec.space.items()},
            "counts": counts,
            "best": best,
        }
        if trials:
            view["importance"] = sw.param_importance(counts.get("complete", 0))
        if trials:
            view["trials"] = rows
            view["spec"] = {**spec.model_dump(mode="json"), "trial": spec.trial.redacted()}
        return view

    @staticmethod
    def trial_view(t: FrozenTrial) -> dict[str, Any]:
        state = TRIAL_STATES.get(t.state, t.state.name.lower())
        value = t.value if t.state in (TrialState.COMPLETE, TrialState.PRUNED) else None
        return {
            "number": t.number,
            "state": state,
            "params": dict(t.params),
            "value": None if value is None else json_number(value),
            "job": t.user_attrs.get("job"),
            "retry_of": t.user_attrs.get("retry_of"),
            "pruned_at": t.user_attrs.get("pruned_at"),
            "reason": t.user_attrs.get("reason"),
            "intermediate": [[s, json_number(v)] for s, v in sorted(t.intermediate_values.items())],
            "started_at": t.datetime_start.timestamp() if t.datetime_start else None,
            "ended_at": t.datetime_complete.timestamp() if t.datetime_complete else None,
        }
