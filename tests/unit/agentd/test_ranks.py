"""RankRunner with real rank processes: environment, logs, exits, stops and generation fences."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import psutil
import pytest

from agentd.commands import CommandError
from agentd.host import interface_of
from agentd.ranks import RankRunner
from phalanx import wire
from tests.wait import wait_for

NODE = "n1"
JOB = "tinylm-abc123"
WAIT_S = 10.0  # bound on waiting for a rank process to exit


class Reporter:
    """Collects the runner's rank events and lets a test await them."""

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


_PREEXISTING: set[int] = set()


def new_children() -> set[int]:
    """Live children of this process that the current test started (other tests in the same
    session may leave their own children, e.g. daemons being reaped)."""
    return {
        p.pid
        for p in psutil.Process().children()
        if p.pid not in _PREEXISTING and p.status() != psutil.STATUS_ZOMBIE
    }


@pytest.fixture
async def runner(tmp_path: Path, reporter: Reporter) -> AsyncIterator[RankRunner]:
    _PREEXISTING.clear()
    _PREEXISTING.update(p.pid for p in psutil.Process().children())
    r = RankRunner(NODE, tmp_path / "data", tmp_path / "agent.sock", reporter)
    yield r
    await r.stop_all(grace_s=1.0)


def slots(*ranks: int, gpus: bool = False) -> list[wire.RankSlot]:
    return [
        wire.RankSlot(rank=r, local_rank=i, gpu=i if gpus else None) for i, r in enumerate(ranks)
    ]


def start_args(
    script: str,
    *,
    generation: int = 1,
    ranks: list[wire.RankSlot] | None = None,
    workdir: Path | str = "/",
    env: dict[str, str | wire.EnvFromFile] | None = None,
    world_size: int = 4,
    group_rank: int = 1,
) -> wire.StartRanksArgs:
    return wire.StartRanksArgs(
        job=JOB,
        generation=generation,
        command=["bash", "-c", script],
        workdir=str(workdir),
        env=env or {},
        world_size=world_size,
        group_rank=group_rank,
        master_addr="10.0.0.7",
        master_port=29511,
        ranks=ranks if ranks is not None else slots(2, 3),
        grace_s=1.0,
    )


async def rank_env(
    runner: RankRunner, reporter: Reporter, args: wire.StartRanksArgs, rank: int
) -> dict[str, str]:
    """Start ranks that print their environment; return ``rank``'s, read from its log."""
    await runner.start(args.model_copy(update={"command": ["env", "-0"]}))
    await reporter.wait_for(len(args.ranks))
    path = runner.log_path(JOB, rank)
    assert path is not None
    pairs = (item.split("=", 1) for item in path.read_text().split("\0") if "=" in item)
    return {k: v for k, v in pairs}


def wait_until(check: Callable[[], bool]) -> bool:
    """Bounded wait for something a rank process does on its own (no event loop needed);
    whether it happened."""
    try:
        wait_for(check, WAIT_S, "a rank process", interval=0.02)
    except AssertionError:
        return False
    return True


def has_text(path: Path, text: str) -> bool:
    return path.exists() and text in path.read_text()


def alive(pid: int) -> bool:
    """A zombie (exited, not yet reaped by its new parent) counts as gone."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def wait_gone(pid: int) -> bool:
    return wait_until(lambda: not alive(pid))


# --- environment -------------------------------------------------------------------------


async def test_rank_gets_the_torch_distributed_environment(
    runner: RankRunner, reporter: Reporter
) -> None:
    env = await rank_env(runner, reporter, start_args(""), rank=3)
    assert {
        k: env.get(k)
        for k in (
            "RANK",
            "LOCAL_RANK",
            "WORLD_SIZE",
            "LOCAL_WORLD_SIZE",
            "GROUP_RANK",
            "MASTER_ADDR",
            "MASTER_PORT",
        )
    } == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.7",
        "MASTER_PORT": "29511",
    }


async def test_rank_gets_the_gpus_of_its_slots(runner: RankRunner, reporter: Reporter) -> None:
    env = await rank_env(runner, reporter, start_args("", ranks=slots(2, 3, gpus=True)), rank=2)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"


async def test_rank_without_gpus_gets_no_cuda_visible_devices(
    runner: RankRunner, reporter: Reporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = await rank_env(runner, reporter, start_args(""), rank=2)
    assert "CUDA_VISIBLE_DEVICES" not in env


async def test_rank_gets_the_nccl_fail_fast_and_flight_recorder_settings(
    runner: RankRunner, reporter: Reporter, tmp_path: Path
) -> None:
    env = await rank_env(runner, reporter, start_args(""), rank=2)
    assert {
        k: env.get(k)
        for k in (
            "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "TORCH_NCCL_DUMP_ON_TIMEOUT",
            "TORCH_FR_BUFFER_SIZE",
        )
    } == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": "20000",
    }
    assert env["TORCH_FR_DUMP_TEMP_FILE"] == str(
        tmp_path / "data" / "jobs" / JOB / "g1" / "nccl-trace-rank-2-"
    )


async def test_rank_gets_its_job_generation_node_and_agent_sockets(
    runner: RankRunner, reporter: Reporter, tmp_path: Path
) -> None:
    env = await rank_env(runner, reporter, start_args("", generation=4), rank=2)
    assert {k: v for k, v in env.items() if k.startswith("PHALANX_")} == {
        "PHALANX_JOB_ID": JOB,
        "PHALANX_GENERATION": "4",
        "PHALANX_NODE": NODE,
        "PHALANX_AGENT_SOCKET": str(tmp_path / "agent.sock"),
        "PHALANX_PROGRESS_SOCKET": str(tmp_path / "agent.progress"),
    }


async def test_rank_does_not_inherit_the_agents_own_settings(
    runner: RankRunner, reporter: Reporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PHALANX_AGENTD_MQTT__PASSWORD", "broker-secret")
    env = await rank_env(runner, reporter, start_args(""), rank=2)
    assert "PHALANX_AGENTD_MQTT__PASSWORD" not in env


async def test_rank_does_not_inherit_the_agents_object_store_credentials_or_api_token(
    runner: RankRunner, reporter: Reporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.setenv(name, f"agent-{name}")
    monkeypatch.setenv("PHALANX_TOKEN", "agent-PHALANX_TOKEN")  # the CLI's, in a local fleet
    monkeypatch.setenv("AWS_ENDPOINT_URL", "https://s3.internal")

    env = await rank_env(runner, reporter, start_args(""), rank=2)

    assert not any(value.startswith("agent-") for value in env.values())
    assert env["AWS_ENDPOINT_URL"] == "https://s3.internal"  # not a secret: it passes


async def test_a_job_gets_credentials_through_its_spec_and_the_operator_may_pass_the_agents(
    tmp_path: Path, reporter: Reporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "agent-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "agent-secret")
    monkeypatch.setenv("PHALANX_AGENTD_RACK", "r7")
    secret = tmp_path / "job-secret"
    secret.write_text("job-secret\n")
    runner = RankRunner(
        NODE,
        tmp_path / "data",
        tmp_path / "agent.sock",
        reporter,
        pass_env=["AWS_ACCESS_KEY_ID", "PHALANX_AGENTD_RACK"],
    )
    args = start_args("", env={"AWS_SECRET_ACCESS_KEY": wire.EnvFromFile(from_file=str(secret))})
    try:
        env = await rank_env(runner, reporter, args, rank=2)
    finally:
        await runner.stop_all(grace_s=1.0)

    assert env["AWS_ACCESS_KEY_ID"] == "agent-key"  # ranks.pass_env names it
    assert env["PHALANX_AGENTD_RACK"] == "r7"
    assert env["AWS_SECRET_ACCESS_KEY"] == "job-secret"  # the job's own, from its spec


async def test_rank_gets_the_specs_plain_env(runner: RankRunner, reporter: Reporter) -> None:
    env = await rank_env(runner, reporter, start_args("", env={"MODE": "fast"}), rank=2)
    assert env["MODE"] == "fast"


async def test_env_from_file_is_read_on_start(
    runner: RankRunner, reporter: Reporter, tmp_path: Path
) -> None:
    secret = tmp_path / "token"
    secret.write_text("hunter2\n")
    args = start_args("", env={"TOKEN": wire.EnvFromFile(from_file=str(secret))})
    env = await rank_env(runner, reporter, args, rank=2)
    assert env["TOKEN"] == "hunter2"


async def test_missing_env_file_fails_the_start_naming_the_file(
    runner: RankRunner, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-secret"
    args = start_args("sleep 30", env={"TOKEN": wire.EnvFromFile(from_file=str(missing))})
    with pytest.raises(CommandError, match=f"TOKEN: cannot read {missing}"):
        await runner.start(args)


async def test_env_file_that_is_not_text_fails_the_start_showing_none_of_its_bytes(
    runner: RankRunner, tmp_path: Path
) -> None:
    # A decode error names the offending byte and its offset: a piece of the secret.
    secret = tmp_path / "key"
    secret.write_bytes(b"k3y-\xa7\xfe-rest")
    args = start_args("sleep 30", env={"TOKEN": wire.EnvFromFile(from_file=str(secret))})
    with pytest.raises(CommandError, match=f"TOKEN: {secret} on node .* is not UTF-8") as raised:
        await runner.start(args)
    assert not any(part in str(raised.value) for part in ("0xa7", "\\xa7", "position", "k3y"))
    assert runner.running() == []


async def test_env_file_holding_a_nul_byte_fails_the_start_naming_the_variable(
    runner: RankRunner, tmp_path: Path
) -> None:
    secret = tmp_path / "key"
    secret.write_bytes(b"k3y\x00rest")
    args = start_args("sleep 30", env={"TOKEN": wire.EnvFromFile(from_file=str(secret))})
    with pytest.raises(CommandError, match=f"TOKEN: {secret} on node .* holds a NUL byte"):
        await runner.start(args)
    assert runner.running() == []
    assert new_children() == set()


async def test_missing_env_file_starts_nothing(runner: RankRunner, tmp_path: Path) -> None:
    args = start_args(
        "sleep 30", env={"TOKEN": wire.EnvFromFile(from_file=str(tmp_path / "missing"))}
    )
    with pytest.raises(CommandError):
        await runner.start(args)
    assert runner.running() == []
    assert new_children() == set()
    assert not (tmp_path / "data" / "jobs" / JOB).exists()


async def test_failed_start_can_be_retried_for_the_same_generation(
    runner: RankRunner, tmp_path: Path
) -> None:
    secret = tmp_path / "token"
    args = start_args("sleep 30", env={"TOKEN": wire.EnvFromFile(from_file=str(secret))})
    with pytest.raises(CommandError):
        await runner.start(args)
    secret.write_text("now here")
    assert "already_started" not in await runner.start(args)
    assert runner.running() == [wire.JobRanks(job=JOB, generation=1, ranks=[2, 3])]


async def test_missing_workdir_fails_the_start(runner: RankRunner, tmp_path: Path) -> None:
    with pytest.raises(CommandError, match=f"workdir {tmp_path / 'gone'} does not exist"):
        await runner.start(start_args("sleep 30", workdir=tmp_path / "gone"))
    assert runner.running() == []


async def test_rank_runs_in_the_workdir(
    runner: RankRunner, reporter: Reporter, tmp_path: Path
) -> None:
    await runner.start(start_args("pwd > where", workdir=tmp_path, ranks=slots(0)))
    await reporter.wait_for(1)
    assert (tmp_path / "where").read_text().strip() == str(tmp_path)


async def test_missing_executable_fails_the_start(runner: RankRunner) -> None:
    args = start_args("").model_copy(update={"command": ["/no/such/binary"]})
    with pytest.raises(CommandError, match="cannot start '/no/such/binary'"):
        await runner.start(args)


# --- logs and exits ----------------------------------------------------------------------


async def test_rank_output_goes_to_its_own_log_file(
    runner: RankRunner, reporter: Reporter, tmp_path: Path
) -> None:
    await runner.start(start_args('echo "out $RANK"; echo "err $RANK" >&2'))
    await reporter.wait_for(2)
    log = tmp_path / "data" / "jobs" / JOB / "g1" / "rank-3.log"
    assert runner.log_path(JOB, 3) == log
    assert sorted(log.read_text().splitlines()) == ["err 3", "out 3"]


async def test_exit_code_is_reported(runner: RankRunner, reporter: Reporter) -> None:
    await runner.start(start_args("exit $((RANK + 1))", generation=2))
    events = await reporter.wait_for(2)
    assert sorted(
        (e.node, e.job, e.generation, e.rank, e.event, e.code, e.signal) for e in events
    ) == [(NODE, JOB, 2, 2, "exited", 3, None), (NODE, JOB, 2, 3, "exited", 4, None)]


async def test_killing_signal_is_reported(runner: RankRunner, reporter: Reporter) -> None:
    await runner.start(start_args("kill -USR1 $$", ranks=slots(0)))
    (event,) = await reporter.wait_for(1)
    assert (event.code, event.signal) == (None, signal.SIGUSR1)


async def test_exit_event_carries_the_ranks_pid(runner: RankRunner, reporter: Reporter) -> None:
    started = await runner.start(start_args("exit 0", ranks=slots(0)))
    (event,) = await reporter.wait_for(1)
    assert event.pid == started["pids"][0]


async def test_children_left_behind_by_an_exited_rank_are_killed(
    runner: RankRunner, reporter: Reporter, tmp_path: Path
) -> None:
    await runner.start(
        start_args("sleep 300 & echo $! > child.pid; exit 0", workdir=tmp_path, ranks=slots(0))
    )
    await reporter.wait_for(1)
    assert wait_gone(int((tmp_path / "child.pid").read_text()))


# --- stop --------------------------------------------------------------------------------


async def test_stop_ends_ranks_with_sigterm(runner: RankRunner, reporter: Reporter) -> None:
    await runner.start(start_args("exec sleep 300"))
    assert await runner.stop(JOB, 1, grace_s=WAIT_S) == {"stopped": [2, 3]}
    events = await reporter.wait_for(2)
    assert {e.signal for e in events} == {signal.SIGTERM}


async def test_stop_kills_a_rank_that_traps_sigterm_after_the_grace(
    runner: RankRunner, reporter: Reporter, tmp_path: Path
) -> None:
    script = 'trap "echo got TERM" TERM; echo ready; while :; do sleep 0.05; done'
    await runner.start(start_args(script, ranks=slots(0)))
    log = tmp_path / "data" / "jobs" / JOB / "g1" / "rank-0.log"
    assert wait_until(lambda: has_text(log, "ready"))
    await runner.stop(JOB, 1, grace_s=0.5)
    (event,) = await reporter.wait_for(1)
    assert event.signal == signal.SIGKILL
    assert "got TERM" in log.read_text()


async def test_stop_ends_a_stopped_rank_with_sigterm_without_waiting_for_the_grace(
    runner: RankRunner, reporter: Reporter
) -> None:
    started = await runner.start(start_args("exec sleep 300", ranks=slots(0)))
    os.kill(started["pids"][0], signal.SIGSTOP)
    assert wait_until(lambda: psutil.Process(started["pids"][0]).status() == psutil.STATUS_STOPPED)

    began = time.monotonic()
    await runner.stop(JOB, 1, grace_s=60.0)

    (event,) = await reporter.wait_for(1)
    assert event.signal == signal.SIGTERM
    assert time.monotonic() - began < WAIT_S


async def test_stop_returns_once_the_ranks_are_gone(runner: RankRunner) -> None:
    started = await runner.start(start_args("exec sleep 300"))
    await runner.stop(JOB, 1, grace_s=WAIT_S)
    assert not any(alive(pid) for pid in started["pids"].values())
    assert runner.running() == []


async def test_stop_kills_the_ranks_child_processes(
    runner: RankRunner, reporter: Reporter, tmp_path: Path
) -> None:
    script = "sleep 300 & echo $! > child.pid; wait"
    await runner.start(start_args(script, workdir=tmp_path, ranks=slots(0)))
    pid_file = tmp_path / "child.pid"
    assert wait_until(lambda: has_text(pid_file, "\n"))
    child = int(pid_file.read_text())
    assert alive(child)
    await runner.stop(JOB, 1, grace_s=WAIT_S)
    assert wait_gone(child)


async def test_stop_of_a_job_with_no_ranks_stops_nothing(runner: RankRunner) -> None:
    assert await runner.stop(JOB, 1, grace_s=1.0) == {"stopped": []}


async def test_stop_leaves_other_jobs_running(runner: RankRunner) -> None:
    other = start_args("exec sleep 300", ranks=slots(0)).model_copy(update={"job": "other-1"})
    await runner.start(other)
    await runner.start(start_args("exec sleep 300", ranks=slots(0)))
    await runner.stop(JOB, 1, grace_s=WAIT_S)
    assert runner.running() == [wire.JobRanks(job="other-1", generation=1, ranks=[0])]


async def test_stop_all_stops_every_job(runner: RankRunner) -> None:
    await runner.start(
        start_args("exec sleep 300", ranks=slots(0)).model_copy(update={"job": "other-1"})
    )
    await runner.start(start_args("exec sleep 300"))
    await runner.stop_all(grace_s=WAIT_S)
    assert runner.running() == []


# --- generations -------------------------------------------------------------------------


async def test_repeated_start_of_the_same_generation_does_not_start_twice(
    runner: RankRunner,
) -> None:
    args = start_args("exec sleep 300")
    first = await runner.start(args)
    again = await runner.start(args)
    assert again == {"pids": first["pids"], "already_started": True}
    assert new_children() == set(first["pids"].values())


async def test_start_of_an_older_generation_is_refused(runner: RankRunner) -> None:
    await runner.start(start_args("exec sleep 300", generation=3))
    with pytest.raises(CommandError, match="generation 2 is older than generation 3"):
        await runner.start(start_args("exec sleep 300", generation=2))
    assert runner.running() == [wire.JobRanks(job=JOB, generation=3, ranks=[2, 3])]


async def test_stop_of_a_generation_stops_older_generations(
    runner: RankRunner, reporter: Reporter
) -> None:
    await runner.start(start_args("exec sleep 300", generation=1))
    assert await runner.stop(JOB, 2, grace_s=WAIT_S) == {"stopped": [2, 3]}
    events = await reporter.wait_for(2)
    assert {(e.generation, e.signal) for e in events} == {(1, signal.SIGTERM)}


async def test_stop_of_an_older_generation_leaves_the_newer_one_running(runner: RankRunner) -> None:
    await runner.start(start_args("exec sleep 300", generation=2))
    assert await runner.stop(JOB, 1, grace_s=WAIT_S) == {"stopped": []}
    assert runner.running() == [wire.JobRanks(job=JOB, generation=2, ranks=[2, 3])]


async def test_stop_fences_a_late_start_of_the_stopped_generation(runner: RankRunner) -> None:
    await runner.stop(JOB, 2, grace_s=1.0)
    assert await runner.start(start_args("exec sleep 300", generation=2)) == {
        "pids": {},
        "already_started": True,
    }
    assert runner.running() == []


async def test_start_of_a_newer_generation_stops_the_older_ranks_first(
    runner: RankRunner, reporter: Reporter
) -> None:
    old = await runner.start(start_args("exec sleep 300", generation=1, ranks=slots(0, 1)))
    await runner.start(start_args("exec sleep 300", generation=2, ranks=slots(2, 3)))
    assert not any(alive(pid) for pid in old["pids"].values())
    assert {(e.generation, e.rank) for e in await reporter.wait_for(2)} == {(1, 0), (1, 1)}
    assert runner.running() == [wire.JobRanks(job=JOB, generation=2, ranks=[2, 3])]


async def test_a_start_gives_older_ranks_ignoring_sigterm_the_short_grace_not_the_jobs(
    runner: RankRunner, reporter: Reporter, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A recovery relaunches without waiting for every stop's ack (issue 22): the start may
    # be first to find the old ranks. Its ack waits for them, so they get the recovery's
    # short grace (agentd.ranks.OLDER_STOP_GRACE_S, 5 s), not the job's grace_period.
    monkeypatch.setattr("agentd.ranks.OLDER_STOP_GRACE_S", 0.5)
    script = "trap '' TERM; echo ready; while true; do sleep 0.1; done"
    old = await runner.start(start_args(script, generation=1, ranks=slots(0, 1)))
    logs = tmp_path / "data" / "jobs" / JOB / "g1"
    # (a TERM before the trap is set would end the shell: not what is tested)
    assert wait_until(lambda: all(has_text(logs / f"rank-{r}.log", "ready") for r in (0, 1)))
    newer = start_args("exec sleep 300", generation=2, ranks=slots(2, 3))
    await asyncio.wait_for(runner.start(newer.model_copy(update={"grace_s": 600.0})), WAIT_S)
    assert not any(alive(pid) for pid in old["pids"].values())
    assert {(e.generation, e.signal) for e in await reporter.wait_for(2)} == {(1, signal.SIGKILL)}


async def test_newer_generation_on_the_same_ranks_leaves_no_untracked_process(
    runner: RankRunner,
) -> None:
    old = await runner.start(start_args("exec sleep 300", generation=1))
    new = await runner.start(start_args("exec sleep 300", generation=2))
    assert new_children() == set(new["pids"].values())
    assert not any(alive(pid) for pid in old["pids"].values())


# --- queries -----------------------------------------------------------------------------


async def test_running_lists_only_live_ranks(runner: RankRunner, reporter: Reporter) -> None:
    script = 'if [ "$RANK" = 2 ]; then exit 0; fi; exec sleep 300'
    await runner.start(start_args(script))
    await reporter.wait_for(1)
    assert runner.running() == [wire.JobRanks(job=JOB, generation=1, ranks=[3])]


async def test_running_groups_ranks_by_job_and_generation(runner: RankRunner) -> None:
    await runner.start(start_args("exec sleep 300", ranks=slots(1, 0)))
    await runner.start(
        start_args("exec sleep 300", generation=5, ranks=slots(4)).model_copy(
            update={"job": "other-1"}
        )
    )
    assert runner.running() == [
        wire.JobRanks(job="other-1", generation=5, ranks=[4]),
        wire.JobRanks(job=JOB, generation=1, ranks=[0, 1]),
    ]


async def test_log_path_finds_the_newest_generations_log(
    tmp_path: Path, reporter: Reporter
) -> None:
    data = tmp_path / "data"
    for gen in (2, 10, 9):
        (data / "jobs" / JOB / f"g{gen}").mkdir(parents=True)
        (data / "jobs" / JOB / f"g{gen}" / "rank-0.log").write_text(f"gen {gen}\n")
    fresh = RankRunner(NODE, data, tmp_path / "agent.sock", reporter)  # e.g. after a restart
    assert fresh.log_path(JOB, 0) == data / "jobs" / JOB / "g10" / "rank-0.log"


async def test_log_path_of_an_unknown_rank_is_none(runner: RankRunner) -> None:
    assert runner.log_path(JOB, 7) is None


def test_free_port_is_bindable() -> None:
    port = RankRunner.free_port()
    with socket.socket() as s:
        s.bind(("", port))
    assert 0 < port < 65536


async def test_two_jobs_starting_at_once_are_given_disjoint_gpus(
    tmp_path: Path, reporter: Reporter
) -> None:
    runner = RankRunner(
        NODE, tmp_path / "data", tmp_path / "agent.sock", reporter, gpus=[0, 1, 2, 3]
    )
    try:
        a, b = (
            start_args("exec sleep 300").model_copy(update={"job": job})
            for job in ("left-1", "right-1")
        )
        await asyncio.gather(runner.start(a), runner.start(b))

        held = [
            {r.slot.gpu for r in runner._ranks.values() if r.job == job}
            for job in ("left-1", "right-1")
        ]
        assert held[0].isdisjoint(held[1])
        assert held[0] | held[1] == {0, 1, 2, 3}
    finally:
        await runner.stop_all(grace_s=1.0)


async def test_gpus_of_a_job_whose_ranks_ended_are_free_again(
    tmp_path: Path, reporter: Reporter
) -> None:
    runner = RankRunner(NODE, tmp_path / "data", tmp_path / "agent.sock", reporter, gpus=[0, 1])
    try:
        await runner.start(start_args("exit 0").model_copy(update={"job": "first-1"}))
        await reporter.wait_for(2)
        await runner.start(start_args("exec sleep 300").model_copy(update={"job": "second-1"}))

        assert {r.slot.gpu for r in runner._ranks.values() if r.job == "second-1"} == {0, 1}
    finally:
        await runner.stop_all(grace_s=1.0)


async def test_a_stop_arriving_while_a_start_spawns_still_stops_every_rank(
    runner: RankRunner,
) -> None:
    starting = asyncio.create_task(runner.start(start_args("exec sleep 300")))
    await asyncio.sleep(0)  # the start is now inside its first await

    stopped = await runner.stop(JOB, 1, grace_s=1.0)
    started = await starting

    assert stopped["stopped"] == [2, 3]
    assert runner.running() == []
    assert not any(alive(pid) for pid in started["pids"].values())


async def test_no_start_is_accepted_once_the_runner_is_closing(runner: RankRunner) -> None:
    await runner.stop_all(grace_s=1.0)

    with pytest.raises(CommandError, match="stopping"):
        await runner.start(start_args("exec sleep 300"))


async def test_ranks_left_by_a_crashed_agent_are_killed_by_the_next_one(
    tmp_path: Path, reporter: Reporter
) -> None:
    crashed = RankRunner(NODE, tmp_path / "data", tmp_path / "agent.sock", reporter)
    started = await crashed.start(start_args("exec sleep 300"))
    pids = list(started["pids"].values())
    # The agent dies without stopping its ranks; a new one starts on the same data dir.
    successor = RankRunner(NODE, tmp_path / "data", tmp_path / "agent.sock", reporter)

    killed = successor.reap_orphans()

    assert sorted(killed) == sorted(pids)
    await asyncio.wait_for(asyncio.gather(*(r.done.wait() for r in crashed._ranks.values())), 10)
    assert not any(alive(pid) for pid in pids)


async def test_a_rank_that_outlives_its_sigkill_leaves_no_wait_behind(
    runner: RankRunner, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # The fault, at the OS boundary: signals never arrive (a process in D state, stuck in
    # the kernel, outlives even SIGKILL).
    from agentd import ranks as ranks_module

    real_killpg = os.killpg
    monkeypatch.setattr(ranks_module.os, "killpg", lambda pid, sig: None)
    monkeypatch.setattr(ranks_module, "KILL_WAIT_S", 0.2, raising=False)
    await runner.start(start_args("sleep 60", ranks=slots(2)))
    before = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
    await runner.stop(JOB, 1, grace_s=0.1)
    left = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()} - before
    assert [t for t in left if not t.get_name().startswith("rank-")] == []
    assert f"job {JOB} rank 2 outlived SIGKILL" in caplog.text
    monkeypatch.setattr(ranks_module.os, "killpg", real_killpg)
    real_killpg(next(iter(runner.pids(JOB, 1).values())), signal.SIGKILL)


async def test_rank_gets_the_interface_of_the_agents_address_for_gloo(
    runner: RankRunner, reporter: Reporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    runner.socket_ifname = "eth7"
    env = await rank_env(runner, reporter, start_args(""), rank=2)
    assert env["GLOO_SOCKET_IFNAME"] == "eth7"


async def test_a_jobs_own_gloo_interface_wins_over_the_agents(
    runner: RankRunner, reporter: Reporter
) -> None:
    runner.socket_ifname = "eth7"
    env = await rank_env(
        runner, reporter, start_args("", env={"GLOO_SOCKET_IFNAME": "ib0"}), rank=2
    )
    assert env["GLOO_SOCKET_IFNAME"] == "ib0"


def test_the_interface_of_an_address_is_found_and_loopback_is_none() -> None:
    for name, addrs in psutil.net_if_addrs().items():
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        if v4 and not v4[0].startswith("127."):
            assert interface_of(v4[0]) == name
            break
    assert interface_of("127.0.0.1") is None
    assert interface_of("198.51.100.77") is None  # TEST-NET-2: on no interface here
    assert interface_of("not-an-address") is None
