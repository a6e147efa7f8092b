"""ASHA against random search without pruning, on the same budget of steps. Prints JSON.

    python bench/sweep.py [--trials 8] [--steps 60] [--window 5] [--seed 3]

Both searches sample tinylm's ``lr`` (log, 1e-5..0.3) and ``dim`` (16 or 32) with
Optuna's random sampler and the same seed; they differ only in the pruner. The budget
is ``--trials`` x ``--steps`` steps: random search runs that many trials whole; ASHA
(rungs at 10, 20, 40 steps, reduction factor 2) keeps asking trials until it has spent
as many steps. Every trial goes through the supervisor's own :class:`Sweeps` (the
real store, job controller and Optuna journal): it trains tinylm (one rank, in this
process), its loss is written as the metrics channel writes it (a point every
``--window`` steps), and the sweep reports, prunes and tells as it does on a fleet.

Reported per search: trials, steps trained, rank-seconds (the time the trials trained:
GPU-seconds on a fleet), the best loss reached, and the rank-seconds spent when a trial
first reached the target loss (``target_loss``: random search's best loss x 1.02, so
random search reaches it by construction; null: never reached).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from phalanx.sweepspec import validate_sweep
from supervisor.config import SupervisorSettings
from supervisor.daemon import Supervisor
from supervisor.jobs import Job, JobState
from supervisor.sweeps import Sweep, SweepState
from supervisor.telemetry.rows import SeriesRows
from supervisor.telemetry.series import Point

REPO = Path(__file__).resolve().parents[1]
TOKEN = "bench-token-0123456789abcdef"


def tinylm_module() -> Any:
    spec = importlib.util.spec_from_file_location("tinylm", REPO / "examples" / "tinylm.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Trainer:
    """One trial's training: tinylm on one rank, a step at a time."""

    def __init__(self, tinylm: Any, lr: float, dim: int, steps: int) -> None:
        torch.manual_seed(0)
        self.vocab = 32
        self.model = tinylm.TinyLM(self.vocab, dim, 1, 2, 8)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=steps)
        self.stream = tinylm.TokenStream(self.vocab, 8, 4)
        self.loss_fn = nn.CrossEntropyLoss()

    def step(self, step: int) -> float:
        batch = self.stream.get(step)
        logits = self.model(batch[:, :-1])
        loss = self.loss_fn(logits.reshape(-1, self.vocab), batch[:, 1:].reshape(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.sched.step()
        return float(loss.item())


async def search(
    pruner: dict[str, Any], args: argparse.Namespace, tinylm: Any, state_dir: Path
) -> dict[str, Any]:
    budget = args.trials * args.steps
    sup = Supervisor(SupervisorSettings(state_dir=state_dir), TOKEN)
    spec = validate_sweep(
        {
            "name": "bench",
            "team": "bench",
            "trial": {
                "command": ["x", "{lr}", "{dim}"],
                "workdir": "/",
                "nodes": 1,
                "ranks_per_node": 1,
            },
            "space": {
                "lr": {"type": "float", "low": 1e-5, "high": 0.3, "log": True},
                "dim": {"type": "categorical", "choices": [16, 32]},
            },
            "objective": {"metric": "loss"},
            "sampler": {"type": "random", "seed": args.seed},
            "pruner": pruner,
            "n_trials": 10 * args.trials if pruner["type"] != "none" else args.trials,
            "parallelism": 1,
        }
    )
    sw = sup.sweeps.submit(spec)
    used_steps, rank_s, best = 0, 0.0, math.inf
    curve: list[tuple[float, float]] = []  # (rank-seconds so far, a loss reached)
    try:
        while sw.state is SweepState.RUNNING and used_steps < budget:
            sup.sweeps.tick()
            job = next((j for j in trial_jobs(sup, sw) if j.state is JobState.PENDING), None)
            if job is None:
                break
            job.move(JobState.STARTING)
            job.move(JobState.RUNNING)
            params = job.spec.hyperparams
            trainer = Trainer(tinylm, float(params["lr"]), int(params["dim"]), args.steps)
            counts = SeriesRows(sup.store).series_counts(job.id)
            for step in range(args.steps):
                t0 = time.perf_counter()
                loss = trainer.step(step)
                rank_s += time.perf_counter() - t0
                used_steps += 1
                if step % args.window == args.window - 1 or step == args.steps - 1:
                    point = Point(step, time.time(), loss, loss, loss)
                    SeriesRows(sup.store).add_point(job.id, "loss", point, counts)
                    job.note_step(job.generation, step, time.time())
                    if math.isfinite(loss):
                        best = min(best, loss)
                        curve.append((rank_s, loss))
                    sup.sweeps.tick()
                    await asyncio.sleep(0)
                if job.state is not JobState.RUNNING or used_steps >= budget:
                    break
            if job.state is JobState.RUNNING:
                job.move(JobState.SUCCEEDED)
                sup.sweeps.tick()
            for _ in range(100):  # a pruned trial's stop (the controller's task)
                if not len(sup.jobs.tasks):
                    break
                await asyncio.sleep(0.01)
        view = sup.sweeps.view(sw)
    finally:
        if sw.state is SweepState.RUNNING:
            sup.sweeps.cancel(sw.id)
        sup.store.close()
    states = [t["state"] for t in view["trials"]]
    return {
        "trials": len(states),
        "pruned": states.count("pruned"),
        "steps": used_steps,
        "rank_s": round(rank_s, 3),
        "best_loss": round(best, 4),
        "curve": curve,
    }


def trial_jobs(sup: Supervisor, sw: Sweep) -> list[Job]:
    return sorted(
        (j for j in sup.jobs.jobs.values() if j.spec.name.startswith(f"{sw.id}-t")),
        key=lambda j: int(j.spec.name.rsplit("-t", 1)[1]),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=8, help="random search's trials")
    ap.add_argument("--steps", type=int, default=60, help="steps of a whole trial")
    ap.add_argument("--window", type=int, default=5, help="steps between loss points")
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tinylm = tinylm_module()
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("random", "asha"):
            (Path(tmp) / name).mkdir()
        random = asyncio.run(search({"type": "none"}, args, tinylm, Path(tmp) / "random"))
        asha = asyncio.run(
            search(
                {"type": "asha", "min_steps": 10, "reduction_factor": 2},
                args,
                tinylm,
                Path(tmp) / "asha",
            )
        )
    target = random["best_loss"] * 1.02
    out: dict[str, Any] = {
        "budget_steps": args.trials * args.steps,
        "target_loss": round(target, 4),
    }
    for name, found in (("random", random), ("asha", asha)):
        reached = next((s for s, loss in found.pop("curve") if loss <= target), None)
        found["rank_s_to_target"] = None if reached is None else round(reached, 3)
        out[name] = found
    json.dump(out, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
