"""Warm interpreters behind a job's ranks, with real processes: a restart hands each rank
to its slot's ready interpreter, which runs the command as a cold launch would."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import psutil
import pytest

from agentd.commands import CommandError
from agentd.ranks import RankRunner
from agentd.warm import launch_form, refill_at_once
from phalanx import wire
from tests.wait import until

JOB = "warmy-abc123"
WAIT_S = 20.0

# Prints what a script can see of how it was started; in generation 1 (a restart follows)
# or told to "sleep" it runs until stopped, else it exits with the code it is given.
SHOW = """
import json, os, sys, time
print(json.dumps({
    "name": __name__,
    "argv": sys.argv,
    "file": __file__,
    "path0": sys.path[0],
    "preloaded": "decimal" in sys.modules,
    "rank": os.environ["RANK"],
    "generation": os.environ["PHALANX_GENERATION"],
    "pid": os.getpid(),
}), flush=True)
if os.environ["PHALANX_GENERATION"] == "1" or sys.argv[1] == "sleep":
    time.sleep(600)
if sys.argv[1] == "raise":
    def inner():
        raise ValueError("injected")
    inner()
sys.exit(int(sys.argv[1]))
"""


class Reporter:
    def __init__(self) -> None:
        self.events: list[wire.RankEvent] = []
        self._changed = asyncio.Condition()

    async def __call__(self, event: wire.RankEvent) -> None:
        async with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    async def wait_for(self, count: int) -> list[wire.RankEvent]:
        async with asyncio.timeout(WAIT_S), self._changed:
            await self._changed.wait_for(lambda: len(self.events) >= count)
        return list(self.events)


@pytest.fixture
def reporter() -> Reporter:
    return Reporter()


@pytest.fixture
def work(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    (folder / "pkg").mkdir(parents=True)
    (folder / "show.py").write_text(SHOW)
    (folder / "pkg" / "__init__.py").write_text("")
    (folder / "pkg" / "show.py").write_text(SHOW)
    return folder


@pytest.fixture
async def runner(tmp_path: Path, reporter: Reporter) -> AsyncIterator[RankRunner]:
    r = RankRunner("n1", tmp_path / "data", tmp_path / "agent.sock", reporter)
    yield r
    await r.stop_all(grace_s=1.0)


def start_args(
    work: Path,
    generation: int,
    *args: str,
    command: list[str] | None = None,
    warm: bool = True,
) -> wire.StartRanksArgs:
    return wire.StartRanksArgs(
        job=JOB,
        generation=generation,
        command=command or [sys.executable, "show.py", *args],
        workdir=str(work),
        world_size=2,
        group_rank=0,
        master_addr="127.0.0.1",
        master_port=29500 + generation,
        ranks=[wire.RankSlot(rank=0, local_rank=0), wire.RankSlot(rank=1, local_rank=1)],
        grace_s=1.0,
        warm=wire.WarmPlan(imports=["decimal"]) if warm else None,
    )


async def eventually(check: Callable[[], object]) -> None:
    """Bounded wait for something the processes do on their own."""
    await until(check, WAIT_S, lambda: repr(check), interval=0.05)


async def warm_ready(runner: RankRunner, *local_ranks: int) -> dict[int, int]:
    """The pids of the job's ready warm interpreters, once every one named is ready."""
    await eventually(lambda: all(runner.warm.ready(JOB, lr) for lr in local_ranks))
    return {lr: pid for (_, lr), pid in runner.warm.pids(JOB).items()}


async def restarted(
    runner: RankRunner, reporter: Reporter, work: Path, *args: str, command: list[str] | None = None
) -> tuple[dict[int, int], dict[int, int]]:
    """Generation 1, its warm interpreters ready, stopped as a recovery stops it, and
    generation 2 started: (the warm pids by local rank, generation 2's pids by rank)."""
    await runner.start(start_args(work, 1, *args, command=command))
    warm = await warm_ready(runner, 0, 1)
    await runner.stop(JOB, 1, grace_s=1.0, keep_warm=True)
    await reporter.wait_for(2)
    started = await runner.start(start_args(work, 2, *args, command=command))
    assert started["pids"] == {0: warm[0], 1: warm[1]}  # each slot's warm interpreter
    assert started["cold"] == {}
    return warm, started["pids"]


def shown_text(runner: RankRunner, rank: int) -> str:
    path = runner.log_path(JOB, rank)
    return path.read_text() if path is not None and path.exists() else ""


def proc_file(pid: int, name: str) -> bytes:
    with open(f"/proc/{pid}/{name}", "rb") as f:
        return f.read()


def shown(runner: RankRunner, rank: int) -> dict[str, object]:
    line = next(x for x in shown_text(runner, rank).splitlines() if x.startswith("{"))
    found: dict[str, object] = json.loads(line)
    return found


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


async def gone(pid: int) -> bool:
    deadline = time.monotonic() + WAIT_S
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


# --- a restart hands the ranks to warm interpreters --------------------------------


async def test_a_restart_hands_each_rank_to_its_slots_warm_interpreter(
    runner: RankRunner, reporter: Reporter, work: Path
) -> None:
    warm, pids = await restarted(runner, reporter, work, "0")

    assert pids == {0: warm[0], 1: warm[1]}
    events = await reporter.wait_for(4)
    assert {(e.generation, e.rank, e.code) for e in events[2:]} == {(2, 0, 0), (2, 1, 0)}
    assert shown(runner, 1)["preloaded"] is True


async def test_a_first_start_says_its_ranks_launched_cold_and_why(
    runner: RankRunner, work: Path
) -> None:
    first = await runner.start(start_args(work, 1, "0"))

    none_yet = "no warm interpreter was started for it yet"
    assert first["cold"] == {"0": none_yet, "1": none_yet}


def test_a_node_with_cpus_to_spare_starts_warm_interpreters_with_the_ranks() -> None:
    # A GPU node (12-28 cores a GPU) starts them at once; a laptop or a 2-core CI runner
    # waits for the ranks' first step, so their imports do not slow the ranks' start.
    assert refill_at_once(cpus=96, ranks=8)
    assert refill_at_once(cpus=8, ranks=2)
    assert not refill_at_once(cpus=4, ranks=1)  # fewer than MIN_CPUS_AT_ONCE
    assert not refill_at_once(cpus=16, ranks=8)
    assert not refill_at_once(cpus=2, ranks=2)


async def test_a_warm_script_sees_its_argv_name_and_file_as_a_cold_launch_shows_them(
    runner: RankRunner, reporter: Reporter, work: Path
) -> None:
    await restarted(runner, reporter, work, "0", "--flag", "x y")
    await reporter.wait_for(4)

    seen = shown(runner, 1)
    assert (seen["name"], seen["argv"], seen["file"]) == (
        "__main__",
        ["show.py", "0", "--flag", "x y"],
        str(work / "show.py"),
    )
    assert seen["path0"] == str(work)
    assert (seen["rank"], seen["generation"]) == ("1", "2")


async def test_a_warm_module_runs_as_python_dash_m_runs_it(
    runner: RankRunner, reporter: Reporter, work: Path
) -> None:
    command = [sys.executable, "-m", "pkg.show", "0"]
    await runner.start(start_args(work, 1, command=command))
    warm = await warm_ready(runner, 0, 1)
    await runner.stop(JOB, 1, grace_s=1.0, keep_warm=True)
    started = await runner.start(start_args(work, 2, command=command))
    await reporter.wait_for(4)

    assert started["pids"][0] == warm[0]
    seen = shown(runner, 0)
    assert (seen["name"], seen["argv"], seen["path0"]) == (
        "__main__",
        [str(work / "pkg" / "show.py"), "0"],
        str(work),
    )


async def test_a_warm_ranks_proc_cmdline_and_environ_show_the_rank(
    runner: RankRunner, reporter: Reporter, work: Path
) -> None:
    _, pids = await restarted(runner, reporter, work, "sleep")
    await eventually(lambda: "{" in shown_text(runner, 1))  # it has become the rank

    cmdline = proc_file(pids[1], "cmdline")
    environ = proc_file(pids[1], "environ")
    assert cmdline.rstrip(b"\0").split(b"\0") == [sys.executable.encode(), b"show.py", b"sleep"]
    variables = environ.split(b"\0")
    assert b"RANK=1" in variables and b"PHALANX_GENERATION=2" in variables
    assert f"PHALANX_JOB_ID={JOB}".encode() in variables
    assert not any(v.startswith(b"PHALANX_WARM_PAD=") for v in variables)


async def test_a_warm_ranks_exit_code_is_reported_as_a_cold_ones(
    runner: RankRunner, reporter: Reporter, work: Path
) -> None:
    await restarted(runner, reporter, work, "7")

    events = await reporter.wait_for(4)
    assert {(e.rank, e.code, e.signal) for e in events[2:]} == {(0, 7, None), (1, 7, None)}


async def test_a_warm_ranks_uncaught_exception_exits_1_with_the_scripts_own_traceback(
    runner: RankRunner, reporter: Reporter, work: Path
) -> None:
    await restarted(runner, reporter, work, "raise")

    events = await reporter.wait_for(4)
    assert {e.code for e in events[2:]} == {1}
    path = runner.log_path(JOB, 0)
    assert path is not None
    text = path.read_text()
    assert "Traceback (most recent call last):" in text
    assert f'File "{work / "show.py"}", line' in text and "ValueError: injected" in text
    assert "phalanx/warm.py" not in text


async def test_a_warm_rank_is_stopped_with_sigterm_as_a_cold_one(
    runner: RankRunner, reporter: Reporter, work: Path
) -> None:
    _, pids = await restarted(runner, reporter, work, "sleep")

    await runner.stop(JOB, 2, grace_s=1.0)

    events = await reporter.wait_for(4)
    assert {(e.rank, e.signal) for e in events[2:]} == {(0, signal.SIGTERM), (1, signal.SIGTERM)}
    assert all([await gone(pid) for pid in pids.values()])


# --- keeping them --------------------------------------------------------------------


async def test_a_warm_interpreter_that_dies_before_it_becomes_a_rank_is_replaced_unnoticed(
    runner: RankRunner, reporter: Reporter, work: Path
) -> None:
    await runner.start(start_args(work, 1, "0"))
    before = await warm_ready(runner, 0, 1)
    pids_before = runner.warm.pids(JOB)

    os.kill(before[1], signal.SIGKILL)
    assert await gone(before[1])
    await eventually(lambda: runner.warm.ready(JOB, 1) and runner.warm.pids(JOB) != pids_before)
    after = await warm_ready(runner, 0, 1)

    assert after[0] == before[0] and after[1] != before[1]
    assert reporter.events == []  # no rank exited, nothing reported
    await runner.stop(JOB, 1, grace_s=1.0, keep_warm=True)
    started = await runner.start(start_args(work, 2, "0"))
    assert started["pids"][1] == after[1]


async def test_a_job_whose_warm_imports_fail_gets_cold_launches_after_three_tries(
    runner: RankRunner, reporter: Reporter, work: Path
) -> None:
    args = start_args(work, 1, "0").model_copy(
        update={"warm": wire.WarmPlan(imports=["no_such_module_for_phalanx"])}
    )
    await runner.start(args)
    folder = runner.data_dir / "jobs" / JOB / "warm"

    def tried() -> int:
        logs = folder.glob("local-rank-*.log") if folder.exists() else []
        return sum(p.read_text().count("ModuleNotFoundError") for p in logs)

    await eventually(lambda: tried() >= 3 and runner.warm.pids(JOB) == {})
    await asyncio.sleep(0.5)  # no fourth

    assert runner.warm.pids(JOB) == {} and tried() <= 4  # one per slot at most past 3
    assert reporter.events == []  # the ranks run on, nothing reported


async def test_a_job_that_opts_out_gets_cold_launches_and_no_warm_interpreter(
    runner: RankRunner, reporter: Reporter, work: Path
) -> None:
    first = await runner.start(start_args(work, 1, "0", warm=False))
    off = "the job keeps no warm interpreters (restart.warm is off)"
    assert first["cold"] == {"0": off, "1": off}
    await asyncio.sleep(0.5)
    assert runner.warm.pids(JOB) == {}
    await runner.stop(JOB, 1, grace_s=1.0, keep_warm=True)

    second = await runner.start(start_args(work, 2, "0", warm=False))

    assert set(second["pids"].values()).isdisjoint(first["pids"].values())
    await reporter.wait_for(4)
    assert shown(runner, 0)["preloaded"] is False
    assert runner.warm.pids(JOB) == {}


async def test_a_command_that_is_not_python_gets_no_warm_interpreter(
    runner: RankRunner, work: Path
) -> None:
    started = await runner.start(start_args(work, 1, command=["bash", "-c", "sleep 600"]))
    why = "its command is not `python script.py` or `python -m module`"
    assert started["cold"] == {"0": why, "1": why}
    await asyncio.sleep(0.5)

    assert runner.warm.pids(JOB) == {}


async def test_a_final_stop_lets_the_jobs_warm_interpreters_go(
    runner: RankRunner, work: Path
) -> None:
    await runner.start(start_args(work, 1, "0"))
    warm = await warm_ready(runner, 0, 1)

    await runner.stop(JOB, 1, grace_s=1.0)

    assert runner.warm.pids(JOB) == {}
    assert all([await gone(pid) for pid in warm.values()])


async def test_a_job_whose_ranks_here_all_exit_0_lets_its_warm_interpreters_go(
    runner: RankRunner, reporter: Reporter, work: Path
) -> None:
    await restarted(runner, reporter, work, "0")
    await reporter.wait_for(4)  # generation 2 exits 0

    await eventually(lambda: runner.warm.pids(JOB) == {})


async def test_the_runner_stopping_leaves_no_warm_interpreter_running(
    tmp_path: Path, reporter: Reporter, work: Path
) -> None:
    r = RankRunner("n1", tmp_path / "data", tmp_path / "agent.sock", reporter)
    await r.start(start_args(work, 1, "0"))
    warm = await warm_ready(r, 0, 1)

    await r.stop_all(grace_s=1.0)

    assert all([await gone(pid) for pid in warm.values()])


# --- which commands -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("command", "form"),
    [
        (["python", "train.py", "--x"], ("script", "train.py")),
        (["/usr/bin/python3.11", "a/b.py"], ("script", "a/b.py")),
        (["python3", "-m", "pkg.train", "1"], ("module", "pkg.train")),
        (["python", "-u", "train.py"], None),
        (["python", "-c", "print(1)"], None),
        (["python"], None),
        (["torchrun", "train.py"], None),
        (["bash", "-c", "python train.py"], None),
    ],
)
def test_only_python_script_and_module_commands_can_run_warm(
    command: list[str], form: tuple[str, str] | None
) -> None:
    assert launch_form(command) == form


# Builds a DDP model in a process that imported only the job spec's default warm imports,
# and lists the torch modules that building it and one step imported after them.
DDP_IMPORTS = """
import importlib, json, sys, tempfile
for name in json.loads(sys.argv[1]):
    importlib.import_module(name)
before = set(sys.modules)
import torch, torch.distributed as dist
with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    model(torch.ones(2, 4)).sum().backward()
    dist.destroy_process_group()
print(json.dumps(sorted(m for m in set(sys.modules) - before if m.startswith("torch"))))
"""


def test_the_default_warm_imports_hold_what_building_a_ddp_model_imports() -> None:
    # DistributedDataParallel imports torch._dynamo when it is built: 1.5 s on a quiet
    # core, most of a warm restart while the defaults left it out.
    from phalanx.jobspec import RestartSpec

    defaults = RestartSpec().warm_imports
    got = subprocess.run(
        [sys.executable, "-c", DDP_IMPORTS, json.dumps(defaults)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    late = json.loads(got.stdout.splitlines()[-1])
    assert not [m for m in late if m.startswith(("torch._dynamo", "torch._inductor", "torch.fx"))]
    # Without torch._dynamo among them, this test would see it imported late.
    bare = subprocess.run(
        [sys.executable, "-c", DDP_IMPORTS, json.dumps(["torch", "torch.distributed"])],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "torch._dynamo" in json.loads(bare.stdout.splitlines()[-1])


# --- a hot spare's prewarm ---------------------------------------------------------


async def test_a_spare_prewarmed_for_a_job_starts_its_moved_ranks_in_those_interpreters(
    runner: RankRunner, reporter: Reporter, work: Path
) -> None:
    # The order the job's first node got (ranks 0 and 1 of group 0).
    got = await runner.prewarm(wire.PrewarmArgs(start=start_args(work, 1, "0"), lease_s=60))
    assert got == {"warm": 2}
    warm = await warm_ready(runner, 0, 1)
    # Prewarmed again (a renewal): the same interpreters stay.
    await runner.prewarm(wire.PrewarmArgs(start=start_args(work, 1, "0"), lease_s=60))

    # The failed second node's ranks move here in generation 3: ranks 2 and 3 of group 1,
    # another rendezvous and another world.
    moved = start_args(work, 3, "0").model_copy(
        update={
            "master_addr": "10.1.2.3",
            "master_port": 29999,
            "world_size": 4,
            "group_rank": 1,
            "ranks": [wire.RankSlot(rank=2, local_rank=0), wire.RankSlot(rank=3, local_rank=1)],
        }
    )
    started = await runner.start(moved)

    assert started["pids"] == {2: warm[0], 3: warm[1]}
    events = await reporter.wait_for(2)
    assert sorted((e.rank, e.code) for e in events) == [(2, 0), (3, 0)]
    shown = json.loads(shown_text(runner, 2).splitlines()[0])
    assert (shown["preloaded"], shown["generation"], shown["argv"]) == (True, "3", ["show.py", "0"])
    assert shown["rank"] == "2"


async def test_a_spares_prewarm_lapses_after_its_lease_when_no_rank_of_the_job_came(
    runner: RankRunner, work: Path
) -> None:
    await runner.prewarm(wire.PrewarmArgs(start=start_args(work, 1, "0"), lease_s=3))
    await eventually(lambda: len(runner.warm.pids(JOB)) == 2)
    warm = runner.warm.pids(JOB)

    await eventually(lambda: not runner.warm.pids(JOB))
    for pid in warm.values():
        await eventually(lambda pid=pid: not psutil.pid_exists(pid))


async def test_a_prewarm_of_a_job_that_runs_here_or_cannot_run_warm_starts_nothing(
    runner: RankRunner, work: Path, tmp_path: Path
) -> None:
    cold = start_args(work, 1, "0", command=["bash", "-c", "exit 0"])
    assert (await runner.prewarm(wire.PrewarmArgs(start=cold, lease_s=60)))["warm"] == 0
    await runner.start(start_args(work, 1, "sleep"))
    got = await runner.prewarm(wire.PrewarmArgs(start=start_args(work, 1, "0"), lease_s=60))
    assert got["warm"] == 0 and "runs here" in got["note"]

    elsewhere = start_args(tmp_path / "missing", 1, "0").model_copy(update={"job": "other-abc123"})
    with pytest.raises(CommandError, match=r"workdir .*missing does not exist on node n1"):
        await runner.prewarm(wire.PrewarmArgs(start=elsewhere, lease_s=60))


async def test_a_spare_that_starts_ranks_of_one_job_lets_the_others_prewarmed_go(
    runner: RankRunner, reporter: Reporter, work: Path
) -> None:
    other = start_args(work, 1, "0").model_copy(update={"job": "other-abc123"})
    await runner.prewarm(wire.PrewarmArgs(start=other, lease_s=60))
    await runner.prewarm(wire.PrewarmArgs(start=start_args(work, 1, "0"), lease_s=60))
    await eventually(lambda: runner.warm.ready("other-abc123", 1) and runner.warm.ready(JOB, 1))
    kept, mine = runner.warm.pids("other-abc123"), runner.warm.pids(JOB)

    started = await runner.start(start_args(work, 2, "0"))

    assert started["pids"] == {0: mine[(JOB, 0)], 1: mine[(JOB, 1)]}
    assert runner.warm.pids("other-abc123") == {}
    for pid in kept.values():
        await eventually(lambda pid=pid: not psutil.pid_exists(pid))
    await reporter.wait_for(2)


async def test_a_start_that_fails_on_a_prewarmed_spare_leaves_its_interpreters_to_go_once_idle(
    runner: RankRunner, work: Path, tmp_path: Path
) -> None:
    runner.warm.idle_s = 0.5  # the lease no longer holds them once a start came: idle does
    await runner.prewarm(wire.PrewarmArgs(start=start_args(work, 1, "0"), lease_s=600))
    await eventually(lambda: len(runner.warm.pids(JOB)) == 2)

    with pytest.raises(CommandError, match="does not exist"):
        await runner.start(start_args(tmp_path / "gone", 2, "0"))

    await eventually(lambda: not runner.warm.pids(JOB))
