"""The write-down off the training cores: writer threads on ``Pacing.cpus``, and the
ranks an agent starts kept off its ``ckpt.write_cpus``. Real threads, real processes;
the CPU sets are read back from the kernel."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from agentd.ranks import RankRunner
from ckpt import Checkpointer, Pacing
from tests.unit.agentd.test_ranks import JOB, Reporter, start_args
from tests.unit.ckpt.helpers import open_ckpt

USABLE = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(len(USABLE) < 2, reason="one usable CPU: nothing to keep apart")


@needs_two
def test_the_writer_threads_run_on_the_pacing_cpus_and_the_caller_keeps_its_own(
    tmp_path: Path, ckpts: list[Checkpointer]
) -> None:
    writer_cpu = USABLE[-1]
    c = open_ckpt(ckpts, tmp_path, pacing=Pacing(cpus=(writer_cpu,)))
    c.save(1, {"w": torch.ones(1000)})
    c.wait()  # every writer thread has run

    assert {t.name: os.sched_getaffinity(t.native_id) for t in c.engine.threads} == {
        t.name: {writer_cpu} for t in c.engine.threads
    }
    assert sorted(os.sched_getaffinity(0)) == USABLE  # the training thread is untouched


def test_pacing_refuses_a_cpu_this_process_may_not_use() -> None:
    with pytest.raises(ValueError, match=r"Pacing.cpus \[4095\].*not among"):
        Pacing(cpus=(4095,))


@needs_two
async def test_ranks_start_off_the_write_cpus_and_their_children_inherit_it(
    tmp_path: Path,
) -> None:
    reporter = Reporter()
    runner = RankRunner(
        "n1", tmp_path / "data", tmp_path / "agent.sock", reporter, not_on_cpus={USABLE[-1]}
    )
    try:
        # The child that reads its CPU set forks after the agent has set the rank's.
        await runner.start(start_args("sleep 0.5; grep Cpus_allowed_list /proc/self/status"))
        await reporter.wait_for(2)  # both ranks exited
        logs = [runner.log_path(JOB, rank) for rank in (2, 3)]
        assert all(p is not None for p in logs)
        listed = [p.read_text().split()[-1] for p in logs if p is not None]
    finally:
        await runner.stop_all(grace_s=1.0)

    wanted = set(USABLE) - {USABLE[-1]}
    assert [cpu_set(text) for text in listed] == [wanted, wanted]


async def test_without_write_cpus_ranks_run_on_every_cpu(tmp_path: Path) -> None:
    reporter = Reporter()
    runner = RankRunner("n1", tmp_path / "data", tmp_path / "agent.sock", reporter)
    try:
        await runner.start(start_args("sleep 0.2; grep Cpus_allowed_list /proc/self/status"))
        await reporter.wait_for(2)
        path = runner.log_path(JOB, 2)
        assert path is not None
        listed = path.read_text().split()[-1]
    finally:
        await runner.stop_all(grace_s=1.0)

    assert cpu_set(listed) == set(USABLE)


def cpu_set(text: str) -> set[int]:
    """``0-2,5`` as {0, 1, 2, 5}."""
    out: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out
