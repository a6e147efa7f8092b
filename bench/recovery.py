"""Recovery against a fresh launch, on a local fleet of real processes, in one run. Prints JSON.

    python bench/recovery.py [--trials 3] [--hang-timeout 10] [--ettr-minutes 3] [--mtbf 60]
    python bench/recovery.py --quick          # 1 trial per case, a 1-minute ETTR run
    python bench/recovery.py --cases no_spare # an elastic job shrinking vs one waiting

Every case runs the same job: ``examples/tinylm.py`` (the integration tests'
tiny model, ``--ckpt-every 10``, ``--step-sleep 0.04``, steps without end)
on 2 nodes x 2 ranks (gloo on CPU) of a ``phalanx.local`` fleet (Mosquitto,
the supervisor, agents with simulated GPUs, a folder object store) with 1 hot
spare, checkpointing to RAM, NVMe, peer and object tiers. A fault trial gets a
fleet of its own, started in a temporary folder and torn down after it: the
planner treats a node that failed in another job within the hour as bad
hardware, so a fleet that saw a fault is not the same fleet any more.

* ``fresh_launch``: submit to the job's first step (every rank has done step 0:
  rank 0 prints step 0 after the step's all-reduce, its report to the agent and
  the step's ``--step-sleep``, which is subtracted; the time is the log's mtime),
  ``--trials`` jobs on one fleet, each cancelled after its first step. It is what
  a user would pay otherwise: the job launched again. ``running_s`` is submit to
  the job turning ``running`` (every rank process started).
* ``crash_in_place``: once step ``--commit-step`` is committed at every tier,
  rank 1 gets SIGKILL. The incident's phases (``detect``, ``plan``, ``stop``,
  ``launch``, ``restore``, ``first_step``) and ``mttr_s`` (fault to the new
  generation's first step) are the supervisor's (``fault_at`` is when the agent
  saw the rank exit); ``acked_s`` is its fault to every start acked (the rank
  processes spawned, not yet training);
  ``mttr_from_injection_s`` is the bench's kill to the new generation's first
  step (the incident's ``resumed_at``), ``other_s`` the MTTR no phase covers
  (backoff, burn-in, the gaps between). The kill waits until every slot of the job
  has a warm interpreter ready (``restart.warm``, on by default): the restart hands
  each rank to one. Target: MTTR within 2 s of this run's fresh-launch p50.
* ``crash_cold``: the same with ``restart.warm: false`` (a cold launch of every
  rank, as before warm interpreters); ``warm_vs_cold`` compares the two in this
  run, against the issue's target of 1.0 s from the kill to training again.
* ``crash_in_process``: the same with ``restart.in_process`` (tinylm ``--in-process``,
  under ``phalanx.rank.run``): the ranks left alive leave their collectives, park and
  become the next generation's in their own processes; only rank 1 is replaced, from a
  warm interpreter. ``in_process_restart`` judges ``mttr_from_injection_s`` p50
  against the issue's 0.5 s; ``resumed_ranks`` lists the ranks that stayed.
* ``ecc_to_spare``: the same, with a double-bit ECC error injected on GPU 0 of
  the job's second node (``phalanx.simgpu.inject``): the node drains, its
  ranks move to the spare, which restores from the peer copy or the object
  store. The supervisor's ``fault_at`` is the drain, not the injection; the
  agent's sampling and health report before it are in
  ``mttr_from_injection_s`` only. The fault waits until the spare has a warm
  interpreter ready for each of the job's local ranks (``spares_warm``: the
  supervisor's prewarm). Targets: within 5 s of the fresh launch, and
  ``ecc_to_warm_spare``: ``mttr_from_injection_s`` p50 <= 1.5 s.
* ``hang``: rank 2 gets SIGSTOP with ``restart.hang_timeout`` =
  ``--hang-timeout``; ``detect_s`` is SIGSTOP to the job turning
  ``recovering`` (polled every 50 ms), against what torch's default collective
  timeout (``torch.distributed.constants.default_pg_timeout``) would let the
  other ranks wait in their all-reduce. The stopped rank is SIGKILLed by the
  recovery's stop after its grace (5 s here).
* ``ettr``: one job for ``--ettr-minutes``, a fault every ``--mtbf`` seconds from
  its first step (SIGKILL of rank 1, then ECC on the node holding ranks 2-3,
  alternating; a fault waits for the previous recovery to be timed), enough
  spares for every ECC; the job's own ``goodput`` at the end (``ettr`` =
  (wall - downtime - lost work) / wall since it first started), every incident,
  and the ETTR the measured MTTR and lost work imply at one failure every 5
  minutes: 1 - (mean MTTR + mean lost work) / 300 (the issue's target: 97%),
  from this run's incidents and from the crash and ECC trials. ``restart.backoff``
  is ``--backoff`` (the product default, 1 s); it applies only to a generation a
  recovery started that fails again within a minute without training a step (a crash
  loop), so here no restart waits. (Until 2026-11-28 it applied to any generation that
  failed within a minute: with ``--mtbf 60`` and a 1 s recovery each generation ran 59 s,
  and the waits doubled to 60 s.)

* ``no_spare``: a 3-node x 2-rank job with no spare (global batch 24 in micro batches
  of 2), a double-bit ECC error on its second node, the node back ``--return-after``
  seconds later (its GPU cleared, undrained; the agents hold an XID 30 s), measured
  ``--window`` seconds after the fault: the elastic job (``min_nodes: 1``) shrinks to
  2 nodes at once and grows back ``--grow-after`` after the node returns; the same
  job with ``min_nodes: 3`` waits in ``recovering`` for the node, as every job did
  before ``elastic:``. Each job's own ETTR (``goodput``) and the optimizer steps it
  trained in the window (each the same 24 samples); ``steps_shrink_over_wait``
  compares them.

``--gpu``: the job on this machine's real GPUs instead, one node read through NVML, a
rank per GPU, NCCL, no spare (cases ``fresh``, ``crash`` and ``crash_cold``), and
``gpu_init``: in new processes, the imports, the CUDA context and NCCL's first
all-reduce, also beside another process's context on the GPU. On one NVIDIA H200
(2026-11-28): ``kill -9`` to training again 1.08 / 1.35 s warm (launch 0.49 / 0.64 s),
11.3 s cold, a fresh launch 10.9 s; the CUDA context 0.15 s, NCCL 0.29 s, the imports 7 s.

Every fault trial also reports its job's own ``launch_s`` (a fresh launch too);
without the ``fresh`` case in ``--cases``, the targets use their p50.

p50 is the median, p95 the nearest rank (with 3 trials: the worst). Figures on a
shared machine vary: compare within one run. Every wait has a timeout; every
fleet is torn down in a ``finally`` (SIGINT ignored while it is), also on
Ctrl-C or SIGTERM, and rank processes left behind by a fleet are SIGKILLed by
pid. A failed trial is reported with its error, and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

import torch
import torch.distributed.constants as dist_constants

from phalanx.client import ApiError, Client
from phalanx.local import Fleet, LocalFleetError, down, up
from phalanx.simgpu import inject

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass
class Layout:
    """Where the job runs: by default 2 nodes x 2 ranks of a simulated fleet with a hot
    spare; ``--gpu``: this machine's real GPUs as one node (NVML), a rank on each, NCCL,
    no spare."""

    nodes: int = 2
    ranks_per_node: int = 2
    spares: int = 1
    kill_rank: int = 1  # on the job's first node, which no ECC fault here ever hits
    gpu_backend: str = "sim"

    @property
    def world(self) -> int:
        return self.nodes * self.ranks_per_node


LAYOUT = Layout()  # main() makes it the GPU layout for --gpu
GPU_CASES = frozenset({"fresh", "crash", "crash_cold"})  # one node: no spare, no ECC move
STEPS = 10_000_000  # without end: every job is cancelled
CKPT_EVERY = 10
TIERS = ["ram", "nvme", "peer", "object"]
TINY = [
    "--vocab",
    "32",
    "--dim",
    "16",
    "--layers",
    "1",
    "--heads",
    "2",
    "--seq",
    "8",
    "--batch",
    "2",
    "--log-every",
    "1000",
]
GRACE_S = 5
# What tinylm imports, for its warm interpreters to have imported (restart.warm_imports).
WARM_IMPORTS = [
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch._dynamo",  # what DistributedDataParallel's constructor imports
    "numpy",
    "ckpt",
    "phalanx.rank",
]
PHASES = ("detect", "plan", "stop", "launch", "restore", "first_step")
HANG_RANK = 2
FIVE_MIN_S = 300.0
NO_SPARE_NODES = 3  # the no-spare case's job: 3 nodes x 2 ranks, no spare
NO_SPARE_BATCH = 24  # its global batch: micro batches of 2, accumulation 2 on 3 nodes, 3 on 2

FLEET_UP_S = 120.0
FIRST_STEP_S = 180.0
COMMIT_S = 120.0
RECOVERED_S = 240.0
WARM_S = 180.0
END_S = 60.0

T = TypeVar("T")
Json = dict[str, Any]


# --- waiting ----------------------------------------------------------------------


def wait_for(check: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1) -> T:
    """``check()``'s first truthy result; TimeoutError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(ApiError):  # a busy supervisor may miss one poll
            got = check()
            if got:
                return got
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        time.sleep(interval)


# --- the fleet --------------------------------------------------------------------


def kill_leftovers(directory: Path) -> list[int]:
    """SIGKILL, by pid, every process whose environment names ``directory`` (ranks
    outlive an agent that was SIGKILLed: they run in sessions of their own)."""
    marker = str(directory).encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed.append(int(entry.name))
    return killed


@contextlib.contextmanager
def local_fleet(root: Path, label: str, *, nodes: int, spares: int) -> Iterator[Fleet]:
    """A fleet of ``nodes`` (2 per rack), ``spares`` of them hot spares, in a new folder
    under ``root``; torn down on the way out, whatever happened."""
    directory = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=root))
    try:
        yield up(
            directory,
            nodes=nodes,
            gpus_per_node=LAYOUT.ranks_per_node,
            spares=spares,
            timeout=FLEET_UP_S,
            gpu_backend=LAYOUT.gpu_backend,
        )
    finally:
        # A second Ctrl-C (or a SIGTERM) waits for the teardown.
        previous = {
            sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            down(directory, quiet=True)
            kill_leftovers(directory)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


# --- the job ----------------------------------------------------------------------


class Job:
    """One tinylm job on a fleet, seen through the API, the ranks' logs and /proc."""

    def __init__(
        self,
        fleet: Fleet,
        name: str,
        step_sleep: float,
        restart: Json | None = None,
        *,
        nodes: int | None = None,
        more: Json | None = None,
    ) -> None:
        self.fleet = fleet
        self.client: Client = fleet.client()
        self.step_sleep = step_sleep
        spec = {
            "name": name,
            "team": "bench",
            "nodes": nodes or LAYOUT.nodes,
            "ranks_per_node": LAYOUT.ranks_per_node,
            "workdir": str(REPO),
            "command": [
                sys.executable,
                "examples/tinylm.py",
                *TINY,
                "--steps",
                str(STEPS),
                "--ckpt-every",
                str(CKPT_EVERY),
                "--step-sleep",
                str(step_sleep),
            ],
            "env": {"OMP_NUM_THREADS": "1"},
            "grace_period": GRACE_S,
            "checkpoint": {"tiers": TIERS, "interval": {"steps": CKPT_EVERY}},
            "restart": {"spare_wait": 60, "warm_imports": WARM_IMPORTS, **(restart or {})},
            **(more or {}),
        }
        if (restart or {}).get("in_process"):
            spec["command"].append("--in-process")  # type: ignore[union-attr]
        self.submitted_at = time.time()
        self.id: str = self.client.post("/v1/jobs", {"spec": spec})["id"]

    def view(self) -> Json:
        got: Json = self.client.get(f"/v1/jobs/{self.id}")
        return got

    def _alive(self, view: Json, what: str) -> None:
        if view["state"] in ("failed", "succeeded", "cancelled"):
            raise RuntimeError(
                f"job {self.id} ended ({view['state']}: {view.get('reason')}) waiting for {what}"
            )

    def running_at(self) -> float:
        """When the job turned running (its ``job_running`` event)."""

        def check() -> float | None:
            self._alive(self.view(), "it to run")
            events = self.client.get(f"/v1/events?job={self.id}&limit=100")
            at = [e["ts"] for e in events if e["kind"] == "job_running"]
            return float(min(at)) if at else None

        return wait_for(check, FIRST_STEP_S, f"job {self.id} to run")

    def first_step_at(self, generation: int = 1) -> float:
        """When every rank of ``generation`` had done its first step: rank 0's line for
        it (printed after the step's sleep) appeared in its log."""

        def check() -> float | None:
            view = self.view()
            self._alive(view, "its first step")
            node = next((r["node"] for r in view["ranks"] if r["rank"] == 0), None)
            if node is None or view["generation"] != generation:
                return None
            log = (
                self.fleet.path
                / "nodes"
                / node
                / "data"
                / "jobs"
                / self.id
                / f"g{generation}"
                / "rank-0.log"
            )
            try:
                text = log.read_text(errors="replace")
                mtime = log.stat().st_mtime
            except OSError:
                return None
            if not any(line.startswith('{"step": ') for line in text.splitlines()):
                return None
            return float(min(mtime, time.time()) - self.step_sleep)

        return wait_for(check, FIRST_STEP_S, f"job {self.id}'s first step", interval=0.02)

    def committed(self, at_least: int, tier: str = "object") -> int:
        """Wait until step ``at_least`` or a later one is committed at ``tier``."""

        def check() -> int | None:
            self._alive(self.view(), f"step {at_least} committed at {tier}")
            events = self.client.get(f"/v1/events?job={self.id}&limit=300")
            steps = [
                e["detail"]["step"]
                for e in events
                if e["kind"] == "ckpt_committed" and e["detail"].get("tier") == tier
            ]
            newest = max(steps, default=-1)
            return int(newest) if newest >= at_least else None

        return wait_for(check, COMMIT_S, f"job {self.id}: step {at_least} committed at {tier}")

    def ready_slots(self, node: str) -> int:
        """The job's local rank slots on ``node`` with a warm interpreter ready, as its
        agent's log says."""
        pattern = re.compile(rf"job {re.escape(self.id)} local rank (\d+): warm interpreter ready")
        log = self.fleet.path / "logs" / f"agent-{node}.log"
        with contextlib.suppress(OSError):
            return len(set(pattern.findall(log.read_text(errors="replace"))))
        return 0

    def warm_ready(self) -> int:
        """Wait until every slot of the job has a warm interpreter ready; how many there
        are."""

        def check() -> int | None:
            view = self.view()
            self._alive(view, "its warm interpreters")
            ready = sum(self.ready_slots(node) for node in view["nodes"])
            return ready if ready >= LAYOUT.world else None

        return wait_for(check, WARM_S, f"job {self.id}: a warm interpreter behind every rank")

    def spare_warm_ready(self) -> int:
        """Wait until a spare (a node of the fleet outside the job) has a warm interpreter
        ready for each of the job's local ranks; how many spares have them."""

        def check() -> int | None:
            view = self.view()
            self._alive(view, "a spare's warm interpreters")
            others = {
                log.stem.removeprefix("agent-") for log in self.fleet.path.glob("logs/agent-*.log")
            }
            ready = sum(
                self.ready_slots(node) >= LAYOUT.ranks_per_node
                for node in others - set(view["nodes"])
            )
            return ready or None

        return wait_for(check, WARM_S, f"job {self.id}: warm interpreters on a spare")

    def warm_started(self, generation: int) -> int:
        """How many ranks of ``generation`` a warm interpreter became (the agents' logs)."""
        pattern = re.compile(
            rf"job {re.escape(self.id)} gen {generation}: started rank \d+ \(pid \d+, a warm"
        )
        found = 0
        for log in (self.fleet.path / "logs").glob("agent-*.log"):
            with contextlib.suppress(OSError):
                found += len(pattern.findall(log.read_text(errors="replace")))
        return found

    def resumed(self, generation: int) -> list[int]:
        """The ranks of ``generation`` resumed in their own processes (an in-process
        restart; the agents' logs)."""
        pattern = re.compile(
            rf"job {re.escape(self.id)} gen {generation}: rank (\d+) resumed in its process"
        )
        found: set[int] = set()
        for log in (self.fleet.path / "logs").glob("agent-*.log"):
            with contextlib.suppress(OSError):
                found.update(int(r) for r in pattern.findall(log.read_text(errors="replace")))
        return sorted(found)

    def rank_pid(self, rank: int) -> int:
        generation = str(self.view()["generation"])

        def check() -> int | None:
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    if b"examples/tinylm.py" not in (entry / "cmdline").read_bytes():
                        continue
                    env = dict(
                        item.split("=", 1)
                        for item in (entry / "environ").read_text(errors="replace").split("\0")
                        if "=" in item
                    )
                except OSError:
                    continue
                if (
                    env.get("PHALANX_JOB_ID") == self.id
                    and env.get("RANK") == str(rank)
                    and env.get("PHALANX_GENERATION") == generation
                ):
                    return int(entry.name)
            return None

        return wait_for(check, 10, f"job {self.id}: the pid of rank {rank}")

    def recovered(self, count: int) -> tuple[Json, Json]:
        """The job's ``count``-th incident once timed (every rank of the new generation
        reported its first step), and the job's view then."""

        def check() -> tuple[Json, Json] | None:
            view = self.view()
            incidents = view["incidents"]
            if len(incidents) >= count:
                incident: Json = incidents[count - 1]
                if incident["outcome"] != "recovered":
                    raise RuntimeError(
                        f"job {self.id}: recovery {count} {incident['outcome']}: "
                        f"{view.get('reason')}"
                    )
                if "awaiting" not in incident:
                    return incident, view
            self._alive(view, f"recovery {count}")
            return None

        return wait_for(check, RECOVERED_S, f"job {self.id}: recovery {count} timed")

    def cancel(self) -> None:
        with contextlib.suppress(ApiError):
            self.client.post(f"/v1/jobs/{self.id}/cancel")
        wait_for(
            lambda: self.view()["state"] in ("cancelled", "failed", "succeeded"),
            END_S,
            f"job {self.id} to end after cancel",
        )


# --- figures ----------------------------------------------------------------------


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def summary(trials: Sequence[Json], keys: Sequence[str]) -> Json:
    """p50/p95 of each of ``keys`` (dotted: ``phases.detect``) over the trials that have it."""
    out: Json = {}
    for key in keys:
        values = []
        for trial in trials:
            value: Any = trial
            for part in key.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            if isinstance(value, int | float):
                values.append(float(value))
        if values:
            out[key] = {
                "p50": round(statistics.median(values), 3),
                "p95": round(pct(values, 0.95), 3),
                "n": len(values),
            }
    return out


def incident_figures(incident: Json, fault_at: float) -> Json:
    first: Json = (incident.get("failures") or [{}])[0]
    phases = {p: incident["phases"].get(p) for p in PHASES}
    mttr = incident.get("mttr_s")
    covered = sum(v for v in phases.values() if v is not None)
    return {
        "action": (incident.get("plan") or {}).get("action"),
        "failure": {k: first.get(k) for k in ("kind", "node", "rank", "detail")},
        "phases": phases,
        "mttr_s": mttr,
        "acked_s": incident.get("acked_s"),
        "mttr_from_injection_s": round(incident["resumed_at"] - fault_at, 3),
        "detect_from_injection_s": round(incident["detected_at"] - fault_at, 3),
        "other_s": round(mttr - covered, 3) if mttr is not None else None,
        "downtime_s": incident.get("downtime_s"),
        "failed_step": incident.get("failed_step"),
        "restored_step": incident.get("restored_step"),
        "lost_steps": incident.get("lost_steps"),
        "lost_work_s": incident.get("lost_work_s"),
        "restore_from": (incident.get("plan") or {}).get("restore_from"),
        "swaps": (incident.get("plan") or {}).get("swaps"),
    }


FIGURE_KEYS = (
    *(f"phases.{p}" for p in PHASES),
    "mttr_s",
    "acked_s",
    "mttr_from_injection_s",
    "detect_from_injection_s",
    "other_s",
    "lost_work_s",
    "launch_s",
)


def target(trials: Sequence[Json], launch_p50: float | None, allowance: float) -> Json:
    """MTTR against ``allowance`` + the fresh launch's p50, judged on the MTTR from the
    injection (the supervisor's own ``mttr_s`` starts at the fault it saw). Without a
    fresh-launch case in the run, the trials' own launches stand in for it."""
    done = [t for t in trials if "error" not in t]
    launch_from = "fresh_launch"
    if launch_p50 is None and done:
        launch_p50 = round(statistics.median(float(t["launch_s"]) for t in done), 3)
        launch_from = "these trials' own launches"
    out: Json = {
        "target": f"MTTR <= {allowance:g} s + fresh launch p50",
        "launch_p50_s": launch_p50,
        "launch_from": launch_from,
    }
    if not done or launch_p50 is None:
        return {**out, "target_s": None, "met": None}
    limit = allowance + launch_p50
    out["target_s"] = round(limit, 3)
    for key in ("mttr_s", "mttr_from_injection_s"):
        values = [float(t[key]) for t in done]
        out[key.replace("mttr", "mttr_minus_launch", 1)] = {
            "p50": round(statistics.median(values) - launch_p50, 3),
            "p95": round(pct(values, 0.95) - launch_p50, 3),
        }
    values = [float(t["mttr_from_injection_s"]) for t in done]
    out["met"] = statistics.median(values) <= limit
    out["met_p95"] = pct(values, 0.95) <= limit
    out["judged_on"] = "mttr_from_injection_s"
    return out


def case(trials: list[Json], keys: Sequence[str] = FIGURE_KEYS) -> Json:
    return {
        "trials": trials,
        "ok": sum("error" not in t for t in trials),
        "summary": summary([t for t in trials if "error" not in t], keys),
    }


def failed(exc: BaseException) -> Json:
    return {"error": f"{type(exc).__name__}: {exc}"}


# --- the cases --------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace, root: Path) -> None:
        self.args = args
        self.root = root

    def log(self, message: str) -> None:
        print(
            f"[recovery bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True
        )

    def fleet(
        self, label: str, spares: int | None = None
    ) -> contextlib.AbstractContextManager[Fleet]:
        spares = LAYOUT.spares if spares is None else spares
        return local_fleet(self.root, label, nodes=LAYOUT.nodes + spares, spares=spares)

    def launched(self, job: Job) -> Json:
        first = job.first_step_at()
        return {
            "launch_s": round(first - job.submitted_at, 3),
            "running_s": round(job.running_at() - job.submitted_at, 3),
            "_first": first,
        }

    def fresh_launch(self) -> Json:
        trials: list[Json] = []
        try:
            with self.fleet("launch") as fleet:
                for i in range(self.args.trials):
                    self.log(f"fresh launch {i + 1}/{self.args.trials}")
                    try:
                        job = Job(fleet, "launch", self.args.step_sleep)
                        try:
                            got = self.launched(job)
                            got.pop("_first")
                            trials.append(got)
                        finally:
                            job.cancel()
                    except (TimeoutError, RuntimeError, ApiError) as exc:
                        trials.append(failed(exc))
        except LocalFleetError as exc:
            trials.append(failed(exc))
        return case(trials, ("launch_s", "running_s"))

    def fault_trial(
        self,
        label: str,
        fault: Callable[[Fleet, Job], tuple[float, Json]],
        restart: Json | None = None,
        *,
        nodes: int | None = None,
        spares: int | None = None,
        more: Json | None = None,
        after: Callable[[Job, float], Json] | None = None,
    ) -> Json:
        """A fleet of its own, a job, a commit, ``fault`` (returns when it struck and what
        it has to say), and ``after(job, struck)``'s figures: by default the incident's,
        once timed. ``nodes``, ``spares``: the job's and the fleet's spares; ``more``: more
        of the job's spec."""
        nodes = nodes or LAYOUT.nodes
        spares = LAYOUT.spares if spares is None else spares
        try:
            with local_fleet(self.root, label, nodes=nodes + spares, spares=spares) as fleet:
                job = Job(fleet, label, self.args.step_sleep, restart, nodes=nodes, more=more)
                try:
                    got = self.launched(job)
                    got.pop("_first")
                    got["committed_step"] = job.committed(self.args.commit_step)
                    struck, said = fault(fleet, job)
                    got.update(said)
                    got.update((after or self.timed)(job, struck))
                    return got
                finally:
                    with contextlib.suppress(TimeoutError, RuntimeError, ApiError):
                        job.cancel()
        except (TimeoutError, RuntimeError, ApiError, LocalFleetError, OSError) as exc:
            return failed(exc)

    @staticmethod
    def timed(job: Job, struck: float) -> Json:
        """The job's first incident, once timed."""
        incident, view = job.recovered(1)
        return {
            **incident_figures(incident, struck),
            "nodes_after": view["nodes"],
            "warm_ranks": job.warm_started(view["generation"]),
        }

    def trials(
        self,
        label: str,
        fault: Callable[[Fleet, Job], tuple[float, Json]],
        restart: Json | None = None,
    ) -> list[Json]:
        out = []
        for i in range(self.args.trials):
            self.log(f"{label} {i + 1}/{self.args.trials}")
            out.append(self.fault_trial(label, fault, restart))
        return out

    def crash_in_place(self, *, warm: bool = True) -> list[Json]:
        def kill(fleet: Fleet, job: Job) -> tuple[float, Json]:
            said: Json = {"killed_rank": LAYOUT.kill_rank, "warm": warm}
            if warm:
                said["warm_ready"] = job.warm_ready()
            pid = job.rank_pid(LAYOUT.kill_rank)
            at = time.time()
            os.kill(pid, signal.SIGKILL)
            return at, said

        if warm:
            return self.trials("crash", kill)
        return self.trials("crash-cold", kill, {"warm": False})

    def crash_in_process(self) -> list[Json]:
        """``crash_in_place`` with ``restart.in_process`` (tinylm under
        ``phalanx.rank.run``): the other ranks stay, parked, and become the next
        generation's in their processes; only the killed rank is replaced (from a warm
        interpreter). ``resumed_ranks``: the ranks resumed in their own processes."""

        def kill(fleet: Fleet, job: Job) -> tuple[float, Json]:
            said: Json = {"killed_rank": LAYOUT.kill_rank, "warm_ready": job.warm_ready()}
            pid = job.rank_pid(LAYOUT.kill_rank)
            at = time.time()
            os.kill(pid, signal.SIGKILL)
            return at, said

        def after(job: Job, struck: float) -> Json:
            got = self.timed(job, struck)
            got["resumed_ranks"] = job.resumed(2)
            return got

        out = []
        for i in range(self.args.trials):
            self.log(f"crash-in-process {i + 1}/{self.args.trials}")
            out.append(self.fault_trial("crash-inproc", kill, {"in_process": True}, after=after))
        return out

    def ecc_to_spare(self) -> list[Json]:
        def ecc(fleet: Fleet, job: Job) -> tuple[float, Json]:
            victim: str = job.view()["nodes"][1]
            said: Json = {
                "victim": victim,
                "warm_ready": job.warm_ready(),  # the surviving node restarts in place
                "spares_warm": job.spare_warm_ready(),
            }
            at = time.time()
            inject(fleet.sim_file(victim), 0, "ecc-dbe")
            return at, said

        out = self.trials("ecc", ecc)
        for got in out:
            if "error" not in got:
                got["moved_to_spare"] = got["victim"] not in got["nodes_after"]
        return out

    def no_spare(self) -> Json:
        """A node of a 3-node job fails with no spare and comes back ``--return-after``
        seconds later (its GPU cleared, undrained, burned in): the elastic job shrinks
        at once and grows back; the same job that may not shrink (``min_nodes`` = its
        size) waits for the node. Each job's own ETTR ``--window`` seconds after the
        fault, and the optimizer steps it trained in that window (the same global batch
        each: the work done)."""
        out: Json = {}
        for label, min_nodes in (("shrinks", 1), ("waits", NO_SPARE_NODES)):
            self.log(f"no spare: the job that {label}")
            out[label] = self.no_spare_trial(label, min_nodes)
        if all("error" not in out[k] for k in ("shrinks", "waits")):
            out["steps_shrink_over_wait"] = round(
                out["shrinks"]["steps_in_window"] / max(1, out["waits"]["steps_in_window"]), 2
            )
        return out

    def no_spare_trial(self, label: str, min_nodes: int) -> Json:
        before: Json = {}

        def ecc_and_back(fleet: Fleet, job: Job) -> tuple[float, Json]:
            victim: str = job.view()["nodes"][1]
            before["step"] = (job.view()["summary"] or {}).get("step") or 0
            at = time.time()
            inject(fleet.sim_file(victim), 0, "ecc-dbe")
            time.sleep(max(0.0, at + self.args.return_after - time.time()))
            inject(fleet.sim_file(victim), 0, "clear")
            wait_for(
                lambda: job.client.post(f"/v1/nodes/{victim}/undrain"),
                120,
                f"node {victim} undrained (its XID held 30 s)",
                interval=1.0,
            )
            return at, {"victim": victim, "returned_after_s": round(time.time() - at, 1)}

        def at_window_end(job: Job, struck: float) -> Json:
            time.sleep(max(0.0, struck + self.args.window - time.time()))
            view = job.view()
            job._alive(view, "the window's end")
            return {
                "min_nodes": min_nodes,
                "steps_in_window": ((view["summary"] or {}).get("step") or 0) - before["step"],
                "nodes_at_end": len(view["nodes"]),
                "goodput": view["goodput"],
                "restarts": view["restarts"],
                "incidents": [
                    {
                        "action": (i.get("plan") or {}).get("action"),
                        "downtime_s": i.get("downtime_s"),
                        "lost_work_s": i.get("lost_work_s"),
                        "restored_step": i.get("restored_step"),
                    }
                    for i in view["incidents"]
                ],
            }

        elastic = {
            "min_nodes": min_nodes,
            "global_batch": NO_SPARE_BATCH,
            "micro_batch": 2,
            "grow_after": self.args.grow_after,
        }
        return self.fault_trial(
            f"nospare-{label}",
            ecc_and_back,
            {"spare_wait": self.args.return_after + 300},
            nodes=NO_SPARE_NODES,
            spares=0,
            more={"elastic": elastic},
            after=at_window_end,
        )

    def hang(self) -> list[Json]:
        def sigstop(fleet: Fleet, job: Job) -> tuple[float, Json]:
            pid = job.rank_pid(HANG_RANK)
            at = time.time()
            os.kill(pid, signal.SIGSTOP)
            try:
                wait_for(
                    lambda: job.view()["state"] == "recovering",
                    self.args.hang_timeout + 60,
                    f"job {job.id}: the hang to be detected",
                    interval=0.05,
                )
            except BaseException:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)  # no stopped rank outlives the trial
                raise
            return at, {"stopped_rank": HANG_RANK, "detect_s": round(time.time() - at, 3)}

        return self.trials("hang", sigstop, {"hang_timeout": self.args.hang_timeout})

    def ettr(self) -> Json:
        span = self.args.ettr_minutes * 60.0
        mtbf = self.args.mtbf
        planned = [
            k * mtbf
            for k in range(1, int(span // mtbf) + 1)
            if k * mtbf + min(mtbf / 2, 20.0) <= span
        ]
        kinds = ["kill" if k % 2 == 0 else "ecc" for k in range(len(planned))]
        spares = max(1, kinds.count("ecc"))
        faults: list[Json] = []
        self.log(f"ETTR: {span:.0f}s, faults at {planned} ({', '.join(kinds)})")
        result: Json = {
            "minutes": self.args.ettr_minutes,
            "mtbf_s": mtbf,
            "spares": spares,
            "backoff_s": self.args.backoff,
            "faults": faults,
        }
        try:
            with self.fleet("ettr", spares=spares) as fleet:
                job = Job(
                    fleet,
                    "ettr",
                    self.args.step_sleep,
                    {"max_restarts": len(planned) + 2, "backoff": self.args.backoff},
                )
                try:
                    got = self.launched(job)
                    start = got["_first"]
                    result["launch_s"] = got["launch_s"]
                    job.committed(self.args.commit_step)
                    for k, (due, kind) in enumerate(zip(planned, kinds, strict=True)):
                        time.sleep(max(0.0, start + due - time.time()))
                        if k:
                            job.recovered(k)  # the previous one is over (bounded)
                        if kind == "kill":
                            pid = job.rank_pid(LAYOUT.kill_rank)
                            at = time.time()
                            os.kill(pid, signal.SIGKILL)
                            where = f"rank {LAYOUT.kill_rank}"
                        else:
                            victim = job.view()["nodes"][1]
                            at = time.time()
                            inject(fleet.sim_file(victim), 0, "ecc-dbe")
                            where = f"node {victim}"
                        faults.append(
                            {"kind": kind, "at_s": round(at - start, 2), "target": where, "_at": at}
                        )
                    incidents = []
                    for k, fault in enumerate(faults, start=1):
                        incident, _ = job.recovered(k)
                        incidents.append(incident_figures(incident, fault.pop("_at")))
                    time.sleep(max(0.0, start + span - time.time()))
                    view = job.view()
                    result["state_at_end"] = view["state"]
                    result["goodput"] = view["goodput"]
                    result["ettr"] = view["goodput"]["ettr"]
                    result["incidents"] = incidents
                finally:
                    with contextlib.suppress(TimeoutError, RuntimeError, ApiError):
                        job.cancel()
        except (TimeoutError, RuntimeError, ApiError, LocalFleetError, OSError) as exc:
            result.update(failed(exc))
        for fault in faults:
            fault.pop("_at", None)
        return result


def implied_ettr(incidents: Sequence[Json], every_s: float = FIVE_MIN_S) -> Json | None:
    """The ETTR the incidents' mean MTTR (from the injection) and lost work imply at one
    failure every ``every_s`` (a generation that ran that long restarts without backoff:
    ``supervisor.recovery.executor.backoff_delay``)."""
    mttr = [
        float(i["mttr_from_injection_s"])
        for i in incidents
        if i.get("mttr_from_injection_s") is not None
    ]
    if not mttr:
        return None
    lost = [float(i.get("lost_work_s") or 0.0) for i in incidents]
    mean_mttr, mean_lost = statistics.fmean(mttr), statistics.fmean(lost)
    ettr = 1.0 - (mean_mttr + mean_lost) / every_s
    return {
        "failure_every_s": every_s,
        "mean_mttr_s": round(mean_mttr, 3),
        "mean_lost_work_s": round(mean_lost, 3),
        "ettr": round(ettr, 4),
        "target": 0.97,
        "met": ettr >= 0.97,
        "incidents": len(mttr),
    }


def warm_vs_cold(warm: Json, cold: Json, target_s: float = 1.0) -> Json:
    """Kill to training again (``mttr_from_injection_s``) with warm interpreters against
    cold launches, p50 of each; the issue's target is ``target_s`` with them."""
    key = "mttr_from_injection_s"
    got = {
        name: figures[key]["p50"]
        for name, figures in (("warm", warm["summary"]), ("cold", cold["summary"]))
        if key in figures
    }
    out: Json = {"judged_on": f"{key} p50", **{f"{k}_s": v for k, v in got.items()}}
    if len(got) == 2:
        out["saved_s"] = round(got["cold"] - got["warm"], 3)
    out["target_s"] = target_s
    out["met"] = got["warm"] <= target_s if "warm" in got else None
    return out


def warm_target(got: Json, target_s: float) -> Json:
    """The fault to training again (``mttr_from_injection_s`` p50) against the issue's
    target for a recovery into warm interpreters."""
    key = "mttr_from_injection_s"
    p50 = got["summary"][key]["p50"] if key in got["summary"] else None
    return {
        "judged_on": f"{key} p50",
        "s": p50,
        "target_s": target_s,
        "met": p50 <= target_s if p50 is not None else None,
    }


def machine() -> Json:
    model = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "nproc": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def torch_timeouts() -> Json:
    out: Json = {"default_pg_timeout_s": dist_constants.default_pg_timeout.total_seconds()}
    nccl = getattr(dist_constants, "default_pg_nccl_timeout", None)
    out["default_pg_nccl_timeout_s"] = nccl.total_seconds() if nccl is not None else None
    if nccl is None:
        out["nccl_note"] = "None: this torch build has no NCCL (a CPU wheel)"
    return out


# What a rank pays on a GPU once its interpreter is warm: a CUDA context, then NCCL.
CUDA_INIT = """
import json, os, sys, time
t0 = time.perf_counter()
import torch, torch.distributed as dist, torch.nn.parallel, torch._dynamo
t1 = time.perf_counter()
torch.cuda.set_device(0)
torch.zeros(1, device="cuda")
torch.cuda.synchronize()
t2 = time.perf_counter()
dist.init_process_group("nccl", device_id=torch.device("cuda", 0))
x = torch.ones(1, device="cuda")
dist.all_reduce(x)
torch.cuda.synchronize()
t3 = time.perf_counter()
dist.destroy_process_group()
got = {"imports_s": t1 - t0, "cuda_context_s": t2 - t1, "nccl_first_all_reduce_s": t3 - t2}
print(json.dumps(got))
"""


def cuda_init(repeats: int = 3) -> Json:
    """How long a warm interpreter that becomes a rank still takes before it can train
    on a GPU: its CUDA context, and NCCL's first all-reduce (a world of one), each in a
    new process; with another process holding a context and 1 GiB on the same GPU (a
    previous generation's rank not yet gone) too, to show a context can be made beside
    it."""
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(29_700 + os.getpid() % 200),
    }

    def once() -> Json:
        got = subprocess.run(
            [sys.executable, "-c", CUDA_INIT], env=env, capture_output=True, text=True, timeout=120
        )
        if got.returncode != 0:
            return {"error": got.stderr[-500:]}
        return {k: round(v, 3) for k, v in json.loads(got.stdout.splitlines()[-1]).items()}

    out: Json = {"alone": [once() for _ in range(repeats)]}
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch, sys; x = torch.empty(1 << 30, dtype=torch.uint8, device='cuda'); "
            "print('ready', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        holder.stdout.readline()
        out["beside_another_context"] = once()
    finally:
        holder.kill()
        holder.wait()
    return out


def _sigterm(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--trials", type=int, default=3, help="trials per case")
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=10.0,
        help="restart.hang_timeout of the hang case's job, seconds",
    )
    parser.add_argument(
        "--ettr-minutes", type=float, default=3.0, help="how long the ETTR job runs"
    )
    parser.add_argument(
        "--mtbf", type=float, default=60.0, help="seconds between two faults of the ETTR job"
    )
    parser.add_argument(
        "--backoff",
        type=float,
        default=1.0,
        help="restart.backoff of the ETTR job (the product default: 1)",
    )
    parser.add_argument(
        "--step-sleep",
        type=float,
        default=0.04,
        help="tinylm's --step-sleep (the integration tests' pace)",
    )
    parser.add_argument(
        "--commit-step",
        type=int,
        default=20,
        help="a fault waits for this step committed at every tier",
    )
    parser.add_argument(
        "--cases",
        default="fresh,crash,crash_cold,crash_in_process,ecc,hang,ettr,no_spare",
        help="comma-separated subset of fresh,crash,crash_cold,crash_in_process,ecc,hang,"
        "ettr,no_spare",
    )
    parser.add_argument(
        "--return-after",
        type=float,
        default=60.0,
        help="no_spare: seconds from the fault to the failed node's return",
    )
    parser.add_argument(
        "--window",
        type=float,
        default=150.0,
        help="no_spare: seconds from the fault to the jobs' ETTR and steps",
    )
    parser.add_argument(
        "--grow-after",
        type=float,
        default=10.0,
        help="no_spare: elastic.grow_after of the job that shrinks",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="where the fleets go (kept, with their logs); default: a temporary folder, removed",
    )
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="the job on this machine's real GPUs: one node (NVML), a rank per GPU, NCCL, "
        "no spare; cases fresh, crash and crash_cold only",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 1 trial per case, a 1-minute ETTR run, mtbf 30 s",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.trials, args.ettr_minutes, args.mtbf = 1, 1.0, 30.0
    cases = {c.strip() for c in args.cases.split(",") if c.strip()}
    unknown = cases - {
        "fresh",
        "crash",
        "crash_cold",
        "crash_in_process",
        "ecc",
        "hang",
        "ettr",
        "no_spare",
    }
    if unknown or args.trials < 1 or args.mtbf <= 0 or args.ettr_minutes <= 0:
        parser.error(
            f"bad arguments: unknown cases {sorted(unknown)}"
            if unknown
            else "--trials, --mtbf and --ettr-minutes must be positive"
        )

    if args.gpu:
        if not torch.cuda.is_available():
            parser.error("--gpu: this torch sees no GPU")
        if cases - GPU_CASES:
            parser.error(f"--gpu: cases {sorted(cases - GPU_CASES)} need more than one node")
        global LAYOUT
        LAYOUT = Layout(
            nodes=1,
            ranks_per_node=torch.cuda.device_count(),
            spares=0,
            kill_rank=0,
            gpu_backend="nvml",
        )
    signal.signal(signal.SIGTERM, _sigterm)
    root = args.dir.absolute() if args.dir else Path(tempfile.mkdtemp(prefix="phx-rec-"))
    root.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    result: Json = {
        "machine": machine(),
        "torch": torch.__version__,
        "config": {
            "trials": args.trials,
            "job": f"tinylm {LAYOUT.nodes} nodes x {LAYOUT.ranks_per_node} ranks, "
            + (f"NCCL on {torch.cuda.get_device_name()}" if args.gpu else "gloo"),
            "spares": LAYOUT.spares,
            "step_sleep_s": args.step_sleep,
            "ckpt_every": CKPT_EVERY,
            "tiers": TIERS,
            "commit_step": args.commit_step,
            "quick": args.quick,
        },
    }
    bench = Bench(args, root)
    try:
        if args.gpu:
            bench.log("CUDA context and NCCL init")
            result["gpu_init"] = cuda_init()
        launch_p50 = None
        if "fresh" in cases:
            result["fresh_launch"] = bench.fresh_launch()
            launch = result["fresh_launch"]["summary"].get("launch_s")
            launch_p50 = launch["p50"] if launch else None
        if "crash" in cases:
            trials = bench.crash_in_place()
            result["crash_in_place"] = {**case(trials), **target(trials, launch_p50, 2.0)}
        if "crash_cold" in cases:
            trials = bench.crash_in_place(warm=False)
            result["crash_cold"] = {**case(trials), **target(trials, launch_p50, 2.0)}
        if "crash_in_process" in cases:
            trials = bench.crash_in_process()
            result["crash_in_process"] = {**case(trials), **target(trials, launch_p50, 2.0)}
            result["in_process_restart"] = warm_target(result["crash_in_process"], 0.5)
        if "crash_in_place" in result and "crash_cold" in result:
            result["warm_vs_cold"] = warm_vs_cold(result["crash_in_place"], result["crash_cold"])
        if "ecc" in cases:
            trials = bench.ecc_to_spare()
            result["ecc_to_spare"] = {**case(trials), **target(trials, launch_p50, 5.0)}
            result["ecc_to_warm_spare"] = warm_target(result["ecc_to_spare"], 1.5)
        if "hang" in cases:
            trials = bench.hang()
            timeouts = torch_timeouts()
            hang = case(trials, ("detect_s", *FIGURE_KEYS))
            hang["hang_timeout_s"] = args.hang_timeout
            hang["torch"] = {
                **timeouts,
                "note": "without hang detection the other ranks wait in their collective "
                "until the process group's timeout (gloo and NCCL use "
                "default_pg_timeout unless init_process_group is given one)",
            }
            detect = hang["summary"].get("detect_s")
            if detect:
                hang["torch_timeout_over_detect_p50"] = round(
                    timeouts["default_pg_timeout_s"] / detect["p50"], 1
                )
            result["hang"] = hang
        if "ettr" in cases:
            ettr = bench.ettr()
            ettr["implied_at_one_failure_per_5_min"] = implied_ettr(ettr.get("incidents", []))
            done = [
                t
                for name in ("crash_in_place", "ecc_to_spare")
                if name in result
                for t in result[name]["trials"]
                if "error" not in t
            ]
            ettr["implied_from_crash_and_ecc_trials"] = implied_ettr(done)
            result["ettr"] = ettr
        if "no_spare" in cases:
            result["no_spare"] = bench.no_spare()
    except KeyboardInterrupt:
        result["interrupted"] = True
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    result["wall_s"] = round(time.monotonic() - began, 1)
    result["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    json.dump(result, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 130 if result.get("interrupted") else 0


if __name__ == "__main__":
    sys.exit(main())
