"""What the training-metrics pipeline costs, hop by hop. Prints JSON.

    python bench/metrics.py [--ranks 4096] [--ranks-per-node 8] [--windows 20]

* ``rank_step``: ``phalanx.rank.step`` against a bare loop, as ``bench/rank_step.py``
  measures it (run as is, with ``--calls``): the training loop's only cost.
* ``agent_fold_ns``: what the agent's :class:`agentd.metrics.MetricsWindow` spends per
  step report (loss, grad_norm, tokens, lr, data_wait_s), and ``agent_flush_ms`` per
  window of a node's ranks.
* ``supervisor_ingest``: ``--ranks`` simulated ranks on ``--ranks-per-node`` nodes,
  10 steps/s each, windows of 5 s: every batch is encoded as an agent sends it, then
  parsed (``phalanx.wire.parse``) and taken (``TrainingMetrics.on_batch``) by the
  supervisor, which flushes each window into a real SQLite store on disk. Reported:
  rank-steps/s and batches/s ingested on one core, and the share of one core the
  real rate (ranks x 10 steps/s) takes.
* ``three_weeks``: one series after 3 weeks of one point per 5 s (362,880 points)
  written through the store: its rows, the bound (``supervisor.telemetry.series.row_bound``),
  and the rows of a job with six such series.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentd.metrics import MetricsWindow
from phalanx import wire
from phalanx.jobspec import validate_spec
from phalanx.progress import StepReport
from supervisor.jobs import Job, JobState
from supervisor.store import Store
from supervisor.telemetry.rows import SeriesRows
from supervisor.telemetry.series import Point, row_bound
from supervisor.telemetry.training import TrainingMetrics

REPO = Path(__file__).resolve().parents[1]
JOB = "bench-metrics-1"
STEPS_PER_S = 10.0
WINDOW_S = 5.0
THREE_WEEKS = int(21 * 86400 / WINDOW_S)


def rank_step(calls: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, str(REPO / "bench" / "rank_step.py"), "--calls", str(calls)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    found: dict[str, Any] = json.loads(out)
    return found


def scalars(step: int) -> dict[str, float]:
    return {
        "loss": 2.5 - step * 1e-5,
        "grad_norm": 0.9,
        "tokens": 16384.0,
        "lr": 3e-4,
        "data_wait_s": 0.001,
    }


def agent_fold(ranks: int, steps: int) -> tuple[float, float, MetricsWindow]:
    """ns per report folded, ms per flush of the window of ``ranks`` ranks."""
    window = MetricsWindow("node-0001")
    reports = [
        StepReport(JOB, 1, r, 1000 + r, s, 1e9 + s / STEPS_PER_S, scalars(s))
        for s in range(steps)
        for r in range(ranks)
    ]
    start = time.perf_counter_ns()
    for report in reports:
        window.add(report)
    fold = (time.perf_counter_ns() - start) / len(reports)
    start = time.perf_counter_ns()
    window.flush(1e9 + steps / STEPS_PER_S)
    flush = (time.perf_counter_ns() - start) / 1e6
    return fold, flush, window


def node_batches(ranks: int, per_node: int, window: int) -> list[tuple[str, bytes]]:
    """What every node sends for window number ``window`` (as topic, payload)."""
    steps = int(STEPS_PER_S * WINDOW_S)
    first = window * steps
    out = []
    for n in range(0, ranks, per_node):
        node = f"node-{n // per_node:04d}"
        batch = wire.MetricsBatch(
            node=node,
            job=JOB,
            generation=1,
            window_s=WINDOW_S,
            sent_at=1e9 + (first + steps) / STEPS_PER_S,
            ranks=[
                wire.RankWindow(
                    rank=r,
                    step_first=first,
                    step_last=first + steps - 1,
                    at=1e9 + (first + steps - 1) / STEPS_PER_S,
                    reports=steps,
                    step_time_s=1 / STEPS_PER_S,
                    tokens_per_s=16384.0 * STEPS_PER_S,
                    data_wait_s=0.001,
                    scalars={
                        "loss": (2.5, 2.4, 2.6, 2.5),
                        "grad_norm": (0.9, 0.8, 1.0, 0.9),
                        "lr": (3e-4, 3e-4, 3e-4, 3e-4),
                    },
                )
                for r in range(n, min(n + per_node, ranks))
            ],
        )
        out.append((wire.metrics_topic(node), wire.encode(batch)))
    return out


def supervisor_ingest(ranks: int, per_node: int, windows: int, folder: Path) -> dict[str, Any]:
    spec = validate_spec(
        {
            "name": "bench",
            "team": "bench",
            "command": ["true"],
            "workdir": "/tmp",
            "nodes": ranks // per_node,
            "ranks_per_node": per_node,
        }
    )
    job = Job(id=JOB, spec=spec, state=JobState.RUNNING, generation=1)
    store = Store(folder / "state.db")
    now = [0.0]
    metrics = TrainingMetrics(store, {JOB: job}.get, interval_s=WINDOW_S, clock=lambda: now[0])
    payloads = [node_batches(ranks, per_node, w) for w in range(windows)]
    size = len(payloads[0][0][1])
    parse_s = take_s = flush_s = 0.0
    for batches in payloads:
        t0 = time.perf_counter()
        parsed = [wire.parse(topic, data).message for topic, data in batches]
        t1 = time.perf_counter()
        for msg in parsed:
            assert isinstance(msg, wire.MetricsBatch)
            metrics.on_batch(msg)
        t2 = time.perf_counter()
        metrics.flush()
        t3 = time.perf_counter()
        parse_s, take_s, flush_s = parse_s + t1 - t0, take_s + t2 - t1, flush_s + t3 - t2
        now[0] += WINDOW_S
    store.close()
    total = parse_s + take_s + flush_s
    rank_steps = ranks * STEPS_PER_S * WINDOW_S * windows
    batches = len(payloads[0]) * windows
    real_rate = ranks * STEPS_PER_S
    return {
        "ranks": ranks,
        "nodes": len(payloads[0]),
        "windows": windows,
        "batch_bytes": size,
        "wire_messages_per_s": round(len(payloads[0]) / WINDOW_S, 1),
        "wire_bytes_per_s": round(sum(len(p) for _, p in payloads[0]) / WINDOW_S),
        "parse_us_per_batch": round(parse_s / batches * 1e6, 1),
        "take_us_per_batch": round(take_s / batches * 1e6, 1),
        "flush_ms_per_window": round(flush_s / windows * 1e3, 2),
        "batches_per_s": round(batches / total),
        "rank_steps_per_s": round(rank_steps / total),
        "core_share_at_10_steps_per_s": round(real_rate / (rank_steps / total), 4),
        "points_written": metrics.points,
    }


def three_weeks(folder: Path) -> dict[str, Any]:
    store = Store(folder / "weeks.db")
    counts: dict[tuple[str, int], int] = {}
    start = time.perf_counter()
    with store.batch():
        for i in range(THREE_WEEKS):
            v = 2.5 - i * 1e-6
            SeriesRows(store).add_point(
                JOB, "loss", Point(i * 50, 1e9 + i * WINDOW_S, v, v, v), counts
            )
    took = time.perf_counter() - start
    rows = len(SeriesRows(store).series(JOB, ["loss"])["loss"])
    store.close()  # the WAL checkpointed into the file
    db_bytes = (folder / "weeks.db").stat().st_size
    return {
        "points": THREE_WEEKS,
        "rows_one_series": rows,
        "row_bound_one_series": row_bound(THREE_WEEKS),
        "rows_job_of_6_series": 6 * rows,
        "db_bytes_one_series": db_bytes,
        "write_s": round(took, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4096)
    ap.add_argument("--ranks-per-node", type=int, default=8)
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--calls", type=int, default=100_000, help="rank_step.py --calls")
    args = ap.parse_args()
    results: dict[str, Any] = {"rank_step": rank_step(args.calls)}
    fold, flush, _ = agent_fold(args.ranks_per_node, int(STEPS_PER_S * WINDOW_S))
    results["agent_fold_ns"] = round(fold)
    results["agent_flush_ms"] = round(flush, 3)
    with tempfile.TemporaryDirectory(prefix="bench-metrics-") as tmp:
        results["supervisor_ingest"] = supervisor_ingest(
            args.ranks, args.ranks_per_node, args.windows, Path(tmp)
        )
        results["three_weeks"] = three_weeks(Path(tmp))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
