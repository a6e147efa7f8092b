"""The training channel: phalanx.rank.step against the agent's ProgressMonitor, on real
unix datagram sockets, and hang detection over real rank processes."""

from __future__ import annotations

import asyncio
import json
import math
import os
import pickle
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import pytest

import agentd.progress as progress_module
import phalanx.rank
from agentd.metrics import MetricsWindow
from agentd.progress import HANG_FLOOR_S, ProgressMonitor, hang_timeout, socket_beside
from agentd.ranks import RankRunner
from phalanx import progress, wire
from phalanx.guard import LossGuard, parse_rule
from phalanx.progress import ProgressError, Requests, StepReport
from phalanx.rank import RankChannel
from tests.wait import until

NODE = "n1"
JOB = "tinylm-abc123"
WAIT_S = 10.0  # bound on waiting for something the other side does
CHECK_S = 0.05  # the monitor's hang check interval in these tests
HANG_S = 1.0  # hang timeout given with the start in these tests


class Reporter:
    """Collects the events the monitor (and a runner) report."""

    def __init__(self) -> None:
        self.events: list[wire.RankEvent] = []

    async def __call__(self, event: wire.RankEvent) -> None:
        self.events.append(event)

    def of(self, kind: str) -> list[wire.RankEvent]:
        return [e for e in self.events if e.event == kind]


async def eventually(check: Callable[[], bool], what: str) -> None:
    await until(check, WAIT_S, what)


@pytest.fixture
def reporter() -> Reporter:
    return Reporter()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return socket_beside(tmp_path / "agent.sock")


class Clock:
    """The monitor's clock: monotonic time, which a test moves ahead (``ahead``) rather
    than sleep out a hang timeout, or stops (``freeze``) and then moves by hand."""

    def __init__(self) -> None:
        self.ahead = 0.0
        self.at: float | None = None  # frozen here

    def __call__(self) -> float:
        return self.at if self.at is not None else time.monotonic() + self.ahead

    def freeze(self) -> None:
        self.at = self()

    def advance(self, seconds: float) -> None:
        if self.at is not None:
            self.at += seconds
        else:
            self.ahead += seconds


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def node(
    tmp_path: Path,
    path: Path,
    reporter: Reporter,
    clock: Clock,
) -> AsyncIterator[tuple[RankRunner, ProgressMonitor]]:
    """A runner and a monitor wired as the agent wires them."""
    runners: list[RankRunner] = []
    monitor = ProgressMonitor(
        NODE,
        path,
        tmp_path / "data",
        reporter,
        lambda job, gen: runners[0].pids(job, gen),
        check_interval_s=CHECK_S,
        clock=clock,
    )
    runner = RankRunner(
        NODE,
        tmp_path / "data",
        tmp_path / "agent.sock",
        reporter,
        progress_socket=path,
        last_step=monitor.last_step,
    )
    runners.append(runner)
    async with monitor:
        try:
            yield runner, monitor
        finally:
            await runner.stop_all(grace_s=1.0)


@pytest.fixture
def runner(node: tuple[RankRunner, ProgressMonitor]) -> RankRunner:
    return node[0]


@pytest.fixture
def monitor(node: tuple[RankRunner, ProgressMonitor]) -> ProgressMonitor:
    return node[1]


async def send_raw(path: Path, data: bytes) -> None:
    """Send one datagram as any local process could, waiting while the queue is full."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as raw:
        raw.setblocking(False)
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                raw.sendto(data, str(path))
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.01)


def channel(path: Path, *, rank: int = 0, generation: int = 1) -> RankChannel:
    return RankChannel(path, job=JOB, generation=generation, rank=rank)


@pytest.fixture
def channels() -> Iterator[list[RankChannel]]:
    made: list[RankChannel] = []
    yield made
    for c in made:
        c.close()


async def caught_up(monitor: ProgressMonitor, path: Path) -> None:
    """Wait until the monitor has read every report sent to its socket so far: one of a
    job it does not know, sent after them, is counted."""
    before = monitor.unknown
    await send_raw(path, progress.encode_report(StepReport("other-abc123", 1, 0, 1, 0, 0.0)))
    await eventually(lambda: monitor.unknown > before, "the monitor reads its socket")


async def reported(monitor: ProgressMonitor, rank: int, step: int, generation: int = 1) -> None:
    def check() -> bool:
        r = monitor.progress(JOB, generation).get(rank)
        return r is not None and r.step >= step

    await eventually(check, f"rank {rank} reports step {step}")


# --- the rank API against the agent ------------------------------------------------------


async def test_a_step_reaches_the_agent_with_its_scalars(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel]
) -> None:
    monitor.begin(JOB, 1)
    ch = channel(path, rank=3)
    channels.append(ch)

    requests = ch.step(7, loss=2.5, tokens=4096, lr=3e-4)

    assert requests == Requests(save_now=False)
    await reported(monitor, 3, 7)
    status = monitor.progress(JOB, 1)[3]
    assert (status.step, status.pid) == (7, os.getpid())
    assert status.scalars == {"loss": 2.5, "tokens": 4096.0, "lr": 3e-4}
    assert abs(status.reported_at - time.time()) < WAIT_S
    assert (ch.sent, ch.drops) == (1, 0)


async def test_a_ranks_last_step_counts_its_reports_still_queued_on_the_socket(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel]
) -> None:
    # A rank that reports step 34 and dies at once: its exit may be handled before the
    # loop reads the datagram, and the exit event would say 33 (a step-35 crash that
    # comes back after a restore then looked like a failure at another step: one restart
    # more before "follows the code").
    monitor.begin(JOB, 1)
    ch = channel(path, rank=1)
    channels.append(ch)
    ch.step(33, loss=1.0)
    await reported(monitor, 1, 33)

    ch.step(34, loss=1.0)  # no await: the loop has not read it
    assert monitor.last_step(JOB, 1, 1) == 34


async def test_the_module_level_step_uses_the_agents_environment(
    monitor: ProgressMonitor, path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monitor.begin(JOB, 2)
    monkeypatch.setattr(phalanx.rank, "_default", None)
    monkeypatch.setenv("PHALANX_PROGRESS_SOCKET", str(path))
    monkeypatch.setenv("PHALANX_JOB_ID", JOB)
    monkeypatch.setenv("PHALANX_GENERATION", "2")
    monkeypatch.setenv("RANK", "5")
    try:
        phalanx.rank.step(11, loss=1.0)
        await reported(monitor, 5, 11, generation=2)
        assert phalanx.rank.drops() == 0
    finally:
        phalanx.rank.channel().close()


def test_step_without_the_environment_variable_does_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PHALANX_PROGRESS_SOCKET", raising=False)
    monkeypatch.setattr(phalanx.rank, "_default", None)

    requests = phalanx.rank.step(1, loss=0.5)

    assert not requests
    assert not phalanx.rank.channel().enabled
    assert (phalanx.rank.channel().sent, phalanx.rank.drops()) == (0, 0)


def test_an_environment_without_the_jobs_ids_gives_a_channel_that_does_nothing(path: Path) -> None:
    for env in (
        {"PHALANX_PROGRESS_SOCKET": str(path)},
        {
            "PHALANX_PROGRESS_SOCKET": str(path),
            "PHALANX_JOB_ID": "Not A Job",
            "PHALANX_GENERATION": "1",
            "RANK": "0",
        },
        {
            "PHALANX_PROGRESS_SOCKET": str(path),
            "PHALANX_JOB_ID": JOB,
            "PHALANX_GENERATION": "one",
            "RANK": "0",
        },
    ):
        ch = RankChannel.from_environment(env)
        assert not ch.enabled
        assert not ch.step(1, loss=1.0)


def test_reports_nobody_listens_to_are_counted_as_drops(
    tmp_path: Path, channels: list[RankChannel]
) -> None:
    ch = channel(tmp_path / "no-agent.progress")
    channels.append(ch)

    results = [ch.step(s, loss=1.0) for s in range(5)]

    assert not any(results)
    assert (ch.sent, ch.drops) == (0, 5)


def test_reports_beyond_a_full_agent_queue_are_dropped_without_blocking(
    path: Path, channels: list[RankChannel]
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as deaf:  # an agent that never reads
        deaf.bind(str(path))
        ch = channel(path)
        channels.append(ch)

        for s in range(200):
            ch.step(s, loss=1.0)

    assert ch.drops > 0
    assert ch.sent + ch.drops == 200


def test_a_report_that_cannot_be_encoded_is_dropped_not_raised(
    path: Path, channels: list[RankChannel]
) -> None:
    ch = channel(path)
    channels.append(ch)

    ch.step(1, **{"not a name": 1.0})
    ch.step(-1, loss=1.0)
    ch.step(2, **{f"s{i}": 1.0 for i in range(progress.MAX_SCALARS + 1)})

    assert ch.drops == 3


def test_a_closed_channel_does_nothing(path: Path) -> None:
    ch = channel(path)
    ch.close()

    assert not ch.step(1, loss=1.0)
    assert (ch.sent, ch.drops) == (0, 0)


# --- the agent's side ----------------------------------------------------------------------


async def test_garbage_datagrams_are_counted_and_the_agent_keeps_receiving(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel]
) -> None:
    monitor.begin(JOB, 1)
    report = json.loads(progress.encode_report(StepReport(JOB, 1, 0, 1, 3, time.time())))
    garbage = [
        b"",
        b"\xff\xfe\x00",
        b"[1, 2]",
        b"{",
        b'{"v": 1}',
        b"x" * 5000,
        json.dumps({**report, "v": 2}).encode(),
        json.dumps({**report, "step": "3"}).encode(),
        json.dumps({**report, "rank": -1}).encode(),
        json.dumps({**report, "job": "Bad/Job"}).encode(),
        json.dumps({**report, "scalars": {"loss": "low"}}).encode(),
        json.dumps({**report, "extra": 1}).encode(),
        b"[" * 100_000,
    ]
    for data in garbage:
        await send_raw(path, data)
    ch = channel(path, rank=1)
    channels.append(ch)
    ch.step(4, loss=1.0)

    await reported(monitor, 1, 4)
    assert monitor.garbage == len(garbage)
    assert 0 not in monitor.progress(JOB, 1)


async def test_a_nan_loss_and_an_infinite_grad_norm_are_recorded(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel]
) -> None:
    monitor.begin(JOB, 1)
    ch = channel(path)
    channels.append(ch)

    ch.step(9, loss=math.nan, grad_norm=math.inf)

    await reported(monitor, 0, 9)
    scalars = monitor.progress(JOB, 1)[0].scalars
    assert math.isnan(scalars["loss"])
    assert scalars["grad_norm"] == math.inf


async def test_reports_of_an_older_generation_are_ignored(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel]
) -> None:
    monitor.begin(JOB, 1)
    monitor.begin(JOB, 2)
    old, new = channel(path, generation=1), channel(path, generation=2)
    channels += [old, new]

    old.step(500, loss=1.0)
    new.step(3, loss=1.0)

    await reported(monitor, 0, 3, generation=2)
    assert monitor.progress(JOB, 2)[0].step == 3
    assert monitor.progress(JOB, 1) == {}
    assert monitor.fenced == 1


async def test_a_ranks_first_step_and_its_restore_are_reported_once_each(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel], reporter: Reporter
) -> None:
    monitor.begin(JOB, 2)
    rank = channel(path, generation=2)
    channels.append(rank)

    rank.restored(40, 1.25)
    rank.restored(40, 1.25)  # a second restore of the same rank is not news
    rank.step(40, loss=1.0)
    rank.step(41, loss=1.0)
    await reported(monitor, 0, 41, generation=2)
    await eventually(lambda: len(reporter.of("stepped")) == 1, "the first step's event")

    (restored,) = reporter.of("restored")
    assert (restored.generation, restored.rank, restored.step, restored.took_s) == (2, 0, 40, 1.25)
    (stepped,) = reporter.of("stepped")
    assert (stepped.generation, stepped.rank, stepped.step) == (2, 0, 40)
    assert monitor.progress(JOB, 2)[0].step == 41  # a restore is not a step


async def test_reports_of_a_job_not_started_here_are_ignored(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel]
) -> None:
    monitor.begin(JOB, 1)
    stranger, ours = channel(path, generation=2), channel(path, generation=1)
    channels += [stranger, ours]

    stranger.step(1, loss=1.0)
    ours.step(1, loss=1.0)

    await reported(monitor, 0, 1)
    assert monitor.unknown == 1
    assert monitor.progress(JOB, 2) == {}


async def test_save_now_is_delivered_once_to_each_rank(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel]
) -> None:
    monitor.begin(JOB, 1)
    ranks = [channel(path, rank=0), channel(path, rank=1)]
    channels += ranks

    for n, ch in enumerate(ranks):  # only ranks that report steps can hear of it
        ch.step(0, loss=1.0)
        await reported(monitor, n, 0)
    assert monitor.request_save(JOB, 1, [0, 1, 2]) == [0, 1]
    seen: dict[int, list[bool]] = {0: [], 1: []}
    for step in range(1, 5):
        for n, ch in enumerate(ranks):
            seen[n].append(ch.step(step, loss=1.0).save_now)
            await reported(monitor, n, step)  # the reply is read by the next call

    assert seen == {0: [False, True, False, False], 1: [False, True, False, False]}


async def test_save_now_for_another_generation_asks_nobody(monitor: ProgressMonitor) -> None:
    monitor.begin(JOB, 2)

    assert monitor.request_save(JOB, 1, [0]) == []
    assert monitor.request_save(JOB, 3, [0]) == []


def test_replies_from_another_socket_than_the_agents_are_ignored(
    path: Path, channels: list[RankChannel]
) -> None:
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as agent,
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as other,
    ):
        agent.bind(str(path))
        ch = channel(path)
        channels.append(ch)
        ch.step(0)
        _, rank_address = agent.recvfrom(4096)
        save = progress.encode_requests(Requests(save_now=True))
        other.sendto(save, rank_address)
        assert not ch.step(1)
        agent.sendto(save, rank_address)
        assert ch.step(2).save_now


def test_decode_raises_progress_error_on_garbage() -> None:
    for data in (b"nope", b"{}", b'{"v": 1, "save_now": 1}'):
        with pytest.raises(ProgressError):
            progress.decode_requests(data)
    with pytest.raises(ProgressError):
        progress.decode_report(b'{"v": 1}')


def test_a_report_round_trips_through_its_encoding() -> None:
    report = StepReport(
        JOB,
        3,
        7,
        4242,
        120,
        1718000000.2534964,
        {
            "loss": 2.0,
            "lr": 1e-05,
            "up": math.inf,
            "down": -math.inf,
            "tiny": 5e-324,
            "big": 1.7976931348623157e308,
            "tokens": 4096,
        },
    )

    assert progress.decode_report(progress.encode_report(report)) == report


def test_a_nan_scalar_is_encoded_as_json_nan() -> None:
    data = progress.encode_report(StepReport(JOB, 1, 0, 1, 0, 0.0, {"loss": math.nan}))

    assert json.loads(data)["scalars"]["loss"] != json.loads(data)["scalars"]["loss"]
    assert math.isnan(progress.decode_report(data).scalars["loss"])


def test_the_channels_limits_are_the_wires() -> None:
    assert (progress.JOB_ID_PATTERN, progress.MAX_STEP, progress.MAX_RANK) == (
        wire.JOB_ID_PATTERN,
        wire.MAX_STEP,
        wire.MAX_RANK,
    )


def test_the_automatic_hang_timeout_is_ten_median_steps_never_under_the_floor() -> None:
    assert hang_timeout(None, []) == HANG_FLOOR_S
    assert hang_timeout(None, [1.0, 2.0, 30.0]) == HANG_FLOOR_S
    assert hang_timeout(None, [9.0, 10.0, 11.0, 500.0]) == pytest.approx(105.0)
    assert hang_timeout(5.0, [10.0]) == 5.0


def test_the_progress_socket_lies_beside_the_rank_socket(tmp_path: Path) -> None:
    assert socket_beside(tmp_path / "agent.sock") == tmp_path / "agent.progress"
    long = tmp_path / ("x" * 120) / "agent.sock"
    assert len(os.fsencode(socket_beside(long))) <= 107


async def test_the_progress_socket_is_private_to_the_agents_user(
    monitor: ProgressMonitor, path: Path
) -> None:
    assert (await asyncio.to_thread(path.stat)).st_mode & 0o777 == 0o600


# --- hang detection over real rank processes -------------------------------------------------

# A rank that reports a step every 20 ms until LAST_STEP_<rank> (then keeps living) or until
# FREEZE_FILE exists (as ranks blocked in a collective do).
RANK_SCRIPT = r"""
import os, sys, time
import phalanx.rank
rank = int(os.environ["RANK"])
last = int(os.environ.get(f"LAST_STEP_{rank}", "1000000000"))
freeze = os.environ.get("FREEZE_FILE", "")
step = 0
while True:
    if step <= last and not (freeze and os.path.exists(freeze)):
        phalanx.rank.step(step, loss=1.0 / (step + 1))
        if step == last and os.environ.get("FINISH"):
            phalanx.rank.finished(step)  # then lives on, as in an evaluation or a barrier
        step += 1
    time.sleep(0.02)
"""


def start(
    monitor: ProgressMonitor,
    script: str = RANK_SCRIPT,
    *,
    generation: int = 1,
    env: dict[str, str] | None = None,
    hang_s: float | None = HANG_S,
    ranks: tuple[int, ...] = (0, 1),
) -> wire.StartRanksArgs:
    args = wire.StartRanksArgs(
        job=JOB,
        generation=generation,
        command=[sys.executable, "-c", script],
        workdir="/",
        env=dict(env or {}),
        world_size=len(ranks),
        group_rank=0,
        master_addr="127.0.0.1",
        master_port=29511,
        grace_s=1.0,
        hang_timeout_s=hang_s,
        ranks=[wire.RankSlot(rank=r, local_rank=i) for i, r in enumerate(ranks)],
    )
    monitor.begin(JOB, generation, hang_s)  # as the agent does, before the ranks start
    return args


async def test_a_stopped_rank_is_named_when_the_ranks_hang(
    monitor: ProgressMonitor, runner: RankRunner, reporter: Reporter, tmp_path: Path
) -> None:
    freeze = tmp_path / "freeze"
    pids = (await runner.start(start(monitor, env={"FREEZE_FILE": str(freeze)})))["pids"]
    await reported(monitor, 0, 3)
    await reported(monitor, 1, 3)

    os.kill(pids[1], signal.SIGSTOP)
    freeze.touch()  # rank 0 now waits on rank 1, as in a collective
    await eventually(lambda: bool(reporter.of("hung")), "a hung event")

    (event,) = reporter.of("hung")
    assert (event.node, event.job, event.generation, event.rank) == (NODE, JOB, 1, 1)
    assert event.stopped is True
    assert event.pid == pids[1]
    assert event.step == monitor.last_step(JOB, 1, 1)
    assert f"process {pids[1]} stopped (state T) since step {event.step}" == event.detail
    assert event.idle_s is not None and event.idle_s >= HANG_S


async def test_the_rank_furthest_behind_is_named_when_none_is_stopped(
    monitor: ProgressMonitor, runner: RankRunner, reporter: Reporter, tmp_path: Path
) -> None:
    # torch names a dump TORCH_FR_DUMP_TEMP_FILE + the rank; this one is no dump inside
    # (its verdict is left out, and logged), but it is named all the same.
    dump = tmp_path / "data" / "jobs" / JOB / "g1" / "nccl-trace-rank-0-0"
    freeze = tmp_path / "freeze"
    await runner.start(start(monitor, env={"LAST_STEP_1": "5", "FREEZE_FILE": str(freeze)}))
    dump.parent.mkdir(parents=True, exist_ok=True)
    dump.write_text("flight recorder")
    await reported(monitor, 1, 5)
    await reported(monitor, 0, 10)
    freeze.touch()

    await eventually(lambda: bool(reporter.of("hung")), "a hung event")

    (event,) = reporter.of("hung")
    assert (event.rank, event.step, event.stopped) == (1, 5, False)
    assert "behind the others at step 5" in event.detail
    assert event.dumps == [str(dump)]
    assert event.flight == []


# RANK_SCRIPT whose flight recorder (phalanx.rank.FLIGHT_DUMPER) says: rank 0 waits in
# all-reduce #8 of the default group, which rank 1 (its newest #7) never entered.
FLIGHT_SCRIPT = (
    r"""
import os, pickle
import phalanx.rank
def entry(seq, state):
    return {"process_group": ("0", "default_pg"), "collective_seq_id": seq,
            "profiling_name": "nccl:all_reduce", "state": state, "is_p2p": False}
waits = [entry(8, "started")] if os.environ["RANK"] == "0" else []
phalanx.rank.FLIGHT_DUMPER = lambda: pickle.dumps(
    {"version": "2.10", "entries": [entry(7, "completed"), *waits]})
"""
    + RANK_SCRIPT
)


async def test_a_hang_report_carries_what_the_ranks_flight_recorders_say(
    monitor: ProgressMonitor, runner: RankRunner, reporter: Reporter, tmp_path: Path
) -> None:
    freeze = tmp_path / "freeze"
    await runner.start(start(monitor, FLIGHT_SCRIPT, env={"FREEZE_FILE": str(freeze)}))
    await reported(monitor, 0, 3)
    await reported(monitor, 1, 3)
    freeze.touch()

    await eventually(lambda: bool(reporter.of("hung")), "a hung event")

    (event,) = reporter.of("hung")
    folder = tmp_path / "data" / "jobs" / JOB / "g1"
    assert event.dumps == [str(folder / "nccl-trace-rank-0-0"), str(folder / "nccl-trace-rank-1-1")]
    assert [(p.rank, p.pg, p.seq, p.completed, p.state) for p in event.flight] == [
        (0, "0:default_pg", 8, 7, "started"),
        (1, "0:default_pg", 7, 7, "completed"),
    ]
    assert sorted(a.read_text() for a in folder.glob("fr-answer-*")) == ["dumped\n", "dumped\n"]


async def test_no_hang_is_reported_before_the_first_step(
    monitor: ProgressMonitor, runner: RankRunner, reporter: Reporter, clock: Clock
) -> None:
    await runner.start(start(monitor, "import time; time.sleep(300)", hang_s=0.1))

    clock.advance(0.5)  # five hang timeouts

    assert await monitor.check() == []
    assert reporter.events == []


async def test_a_hang_is_told_again_each_timeout_and_a_new_generation_rearms_it(
    monitor: ProgressMonitor, runner: RankRunner, reporter: Reporter, clock: Clock
) -> None:
    env = {"LAST_STEP_0": "3", "LAST_STEP_1": "3"}
    await runner.start(start(monitor, env=env))
    await reported(monitor, 0, 3)
    await reported(monitor, 1, 3)
    clock.freeze()  # the ranks took their last step: the monitor's time moves by hand now

    clock.advance(HANG_S + CHECK_S)
    await eventually(lambda: len(reporter.of("hung")) == 1, "a hung event")
    clock.advance(HANG_S / 2)
    await monitor.check()
    assert [e.generation for e in reporter.of("hung")] == [1]  # not before a timeout more
    clock.advance(HANG_S / 2 + CHECK_S)
    await eventually(lambda: len(reporter.of("hung")) == 2, "the hang told again")

    await runner.start(start(monitor, env=env, generation=2))
    await reported(monitor, 0, 3, generation=2)
    await reported(monitor, 1, 3, generation=2)
    clock.advance(HANG_S + CHECK_S)
    await eventually(
        lambda: reporter.of("hung")[-1].generation == 2, "a hung event of generation 2"
    )
    assert {e.generation for e in reporter.of("hung")} == {1, 2}


async def test_no_hang_is_reported_once_the_generation_is_stopped(
    monitor: ProgressMonitor, runner: RankRunner, reporter: Reporter, clock: Clock
) -> None:
    await runner.start(start(monitor, env={"LAST_STEP_0": "3", "LAST_STEP_1": "3"}))
    await reported(monitor, 0, 3)
    monitor.end(JOB, 1)  # as the agent does, before it stops the ranks

    clock.advance(HANG_S + 10 * CHECK_S)

    assert await monitor.check() == []
    assert reporter.of("hung") == []


async def test_no_hang_is_reported_while_a_rank_waits_for_its_checkpoints_to_commit(
    monitor: ProgressMonitor, runner: RankRunner, reporter: Reporter, clock: Clock
) -> None:
    await runner.start(start(monitor, env={"LAST_STEP_0": "3", "LAST_STEP_1": "3"}))
    await reported(monitor, 0, 3)

    with monitor.waiting(JOB, 0):  # Checkpointer.wait after the last step, a long commit
        clock.advance(HANG_S + 10 * CHECK_S)
        assert await monitor.check() == []
        assert reporter.of("hung") == []
    # Once the wait is over, silence counts again, from then on.
    await eventually(lambda: bool(reporter.of("hung")), "the hang after the wait")


async def test_no_hang_is_reported_after_a_rank_says_it_took_its_last_step(
    monitor: ProgressMonitor, runner: RankRunner, reporter: Reporter, clock: Clock, path: Path
) -> None:
    await runner.start(start(monitor, env={"LAST_STEP_0": "3", "LAST_STEP_1": "5", "FINISH": "1"}))
    await reported(monitor, 1, 5)
    await caught_up(monitor, path)  # the rank's "finished", sent right after its step 5

    clock.advance(HANG_S + 10 * CHECK_S)

    assert await monitor.check() == []
    assert reporter.of("hung") == []


async def test_the_exit_event_carries_the_last_step_the_rank_reported(
    monitor: ProgressMonitor, runner: RankRunner, reporter: Reporter
) -> None:
    script = "import phalanx.rank\nfor s in range(8): phalanx.rank.step(s, loss=1.0)"
    await runner.start(start(monitor, script, ranks=(0,)))

    await eventually(lambda: bool(reporter.of("exited")), "the rank's exit")

    (event,) = reporter.of("exited")
    assert (event.code, event.step) == (0, 7)
    assert reporter.of("hung") == []


async def test_the_exit_event_of_a_rank_that_never_reported_has_no_step(
    monitor: ProgressMonitor, runner: RankRunner, reporter: Reporter
) -> None:
    await runner.start(start(monitor, "pass", ranks=(0,)))

    await eventually(lambda: bool(reporter.of("exited")), "the rank's exit")

    assert reporter.of("exited")[0].step is None


async def test_only_the_current_generations_steps_reach_the_metrics_window(
    tmp_path: Path, path: Path, reporter: Reporter, channels: list[RankChannel]
) -> None:
    window = MetricsWindow(NODE)
    monitor = ProgressMonitor(
        NODE, path, tmp_path / "data", reporter, lambda job, gen: {}, on_step=window.add
    )
    async with monitor:
        monitor.begin(JOB, 2)
        old, new = channel(path, generation=1), channel(path, rank=1, generation=2)
        channels.extend([old, new])
        old.step(5, loss=9.0)
        new.restored(3, 0.5)
        new.step(3, loss=1.0)
        new.step(4, loss=0.5)
        await reported(monitor, 1, 4, generation=2)
        await eventually(lambda: monitor.fenced == 1, "the old generation's step fenced")
    [batch] = window.flush(time.time())
    assert (batch.generation, [r.rank for r in batch.ranks]) == (2, [1])
    assert (batch.ranks[0].step_first, batch.ranks[0].step_last) == (3, 4)
    assert batch.ranks[0].scalars["loss"][0] == 0.5


# --- the loss guard ---------------------------------------------------------------------


def guarded(path: Path, rule: str, *, rank: int = 0) -> RankChannel:
    return RankChannel(path, job=JOB, generation=1, rank=rank, guard=LossGuard(parse_rule(rule)))


async def test_a_tripped_loss_guard_is_reported_once_with_its_onset_and_baseline(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel], reporter: Reporter
) -> None:
    monitor.begin(JOB, 1)
    ch = guarded(path, '{"ratio": 2, "window": 3, "patience": 2}', rank=2)
    channels.append(ch)

    answers = [ch.step(s, loss=loss) for s, loss in enumerate([1.0, 1.0, 1.0, 4.0, 5.0, 6.0])]
    await eventually(lambda: bool(reporter.of("guard")), "the guard's event")

    assert [a.rollback for a in answers] == [False] * 4 + [True, True]
    (event,) = reporter.of("guard")
    assert (event.rank, event.step, event.onset, event.guard) == (2, 4, 3, "loss_spike")
    assert (event.value, event.baseline) == (4.0, 1.0)
    await reported(monitor, 2, 4)
    assert monitor.progress(JOB, 1)[2].step == 4  # nothing is reported past the trip


async def test_a_nan_loss_is_reported_as_a_nan_trip_without_a_value(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel], reporter: Reporter
) -> None:
    monitor.begin(JOB, 1)
    ch = guarded(path, '{"window": 100}')
    channels.append(ch)

    assert ch.step(0, loss=math.nan).rollback
    await eventually(lambda: bool(reporter.of("guard")), "the guard's event")

    (event,) = reporter.of("guard")
    assert (event.guard, event.step, event.onset, event.value, event.baseline) == (
        "nan",
        0,
        0,
        None,
        None,
    )


async def test_the_ranks_of_a_node_whose_guards_trip_are_told_once(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel], reporter: Reporter
) -> None:
    monitor.begin(JOB, 1)
    ranks = [guarded(path, '{"window": 2, "patience": 1}', rank=r) for r in (0, 1)]
    channels.extend(ranks)
    for ch in ranks:
        ch.step(0, loss=math.nan)
        ch.step(1, loss=1.0)
    await reported(monitor, 1, 0)
    await eventually(lambda: bool(reporter.of("guard")), "the guard's event")

    assert len(reporter.of("guard")) == 1


async def test_no_hang_is_reported_once_a_ranks_guard_tripped(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel], reporter: Reporter
) -> None:
    monitor.begin(JOB, 1, hang_timeout_s=0.2)
    ch = guarded(path, '{"window": 2, "patience": 1}')
    channels.append(ch)
    ch.step(0, loss=math.nan)
    await eventually(lambda: bool(reporter.of("guard")), "the guard's event")

    assert await monitor.check() == []


def test_an_unreadable_guard_rule_leaves_the_guard_off(path: Path) -> None:
    env = {
        "PHALANX_PROGRESS_SOCKET": str(path),
        "PHALANX_JOB_ID": JOB,
        "PHALANX_GENERATION": "1",
        "PHALANX_GUARD": '{"ratio": 0.5}',
    }
    ch = RankChannel.from_environment(env)
    try:
        assert ch.enabled and ch.guard is None
    finally:
        ch.close()


def test_the_ranks_read_the_skipped_steps_and_the_lr_scale_from_their_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PHALANX_SKIP", "[[30, 35], [10, 12]]")
    monkeypatch.setenv("PHALANX_LR_SCALE", '{"factor": 0.25, "from": 35, "until": 40}')

    assert phalanx.rank.skip() == ((10, 12), (30, 35))
    assert [phalanx.rank.next_step(s) for s in (10, 29, 30, 34)] == [12, 29, 35, 35]
    assert [phalanx.rank.lr_scale(s) for s in (34, 35, 39, 40)] == [1.0, 0.25, 0.25, 1.0]


def test_without_a_rollback_nothing_is_skipped_and_the_lr_is_not_scaled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PHALANX_SKIP", raising=False)
    monkeypatch.delenv("PHALANX_LR_SCALE", raising=False)

    assert (phalanx.rank.skip(), phalanx.rank.next_step(7), phalanx.rank.lr_scale(7)) == (
        (),
        7,
        1.0,
    )


def test_a_checkpoint_is_not_saved_once_the_guard_tripped(
    path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt import Checkpointer

    ch = guarded(path, '{"window": 2, "patience": 1}')
    monkeypatch.setattr(phalanx.rank, "_default", ch)
    ckpt = Checkpointer(dir=tmp_path / "c", tiers=[], ram_dir=tmp_path, ram_namespace="guard-t")
    try:
        assert ckpt.save(1, {"w": 1})
        ch.step(1, loss=math.nan)

        assert phalanx.rank.tripped() is not None
        assert not ckpt.save(2, {"w": 2})
        assert ckpt.skipped == [2]
    finally:
        ckpt.close()
        ch.close()


async def test_a_ranks_parameter_digest_reaches_the_supervisor_as_a_digest_event(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel], reporter: Reporter
) -> None:
    monitor.begin(JOB, 1)
    ch = channel(path, rank=1)
    channels.append(ch)

    ch.digest(15, 0xFEDC_BA98_7654_3210)
    await eventually(lambda: bool(reporter.of("digest")), "the digest's event")

    (event,) = reporter.of("digest")
    assert (event.rank, event.step, event.digest) == (1, 15, 0xFEDC_BA98_7654_3210)


def test_digest_reports_only_every_n_steps_the_job_asks_for(
    path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    monkeypatch.setattr(phalanx.rank, "_default", RankChannel(None))
    model = torch.nn.Linear(2, 2)
    monkeypatch.delenv("PHALANX_DIGEST_EVERY", raising=False)
    assert phalanx.rank.digest(10, model) is None
    monkeypatch.setenv("PHALANX_DIGEST_EVERY", "5")

    assert [phalanx.rank.digest(s, model) is not None for s in (9, 10, 11, 15)] == [
        False,
        True,
        False,
        True,
    ]


async def test_dumps_are_read_in_a_bounded_child_and_a_crafted_one_is_left_out(
    tmp_path: Path,
) -> None:
    # A 9-byte pickle whose memo index asks for gigabytes, a name whose two ranks
    # differ, and a good dump: only the good one is read, and the agent lives on.
    good = {
        "entries": [
            {"process_group": ("0", "default_pg"), "collective_seq_id": 3, "state": "completed"}
        ]
    }
    (tmp_path / "nccl-trace-rank-1-1").write_bytes(pickle.dumps(good))
    (tmp_path / "nccl-trace-rank-0-0").write_bytes(b"\x80\x02}r\x00\x00\x00\x10.")
    (tmp_path / "nccl-trace-rank-2-3").write_bytes(pickle.dumps(good))

    dumps, points = await progress_module._flight(tmp_path)

    assert [Path(d).name for d in dumps] == [
        "nccl-trace-rank-0-0",
        "nccl-trace-rank-1-1",
        "nccl-trace-rank-2-3",
    ]
    assert [(p.rank, p.pg, p.seq, p.completed) for p in points] == [(1, "0:default_pg", 3, 3)]


# --- in-process restart: a rank parked, then resumed --------------------------------------


async def test_a_parked_rank_of_the_failed_generation_is_resumed_with_its_order(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel]
) -> None:
    monitor.begin(JOB, 1)
    ch = channel(path, rank=3)
    channels.append(ch)
    monitor.begin(JOB, 2)  # the next generation's start: its step reports are fenced ...
    waiting = asyncio.get_running_loop().run_in_executor(None, ch.park, 41, WAIT_S)
    # ... its word that it parked is not
    await eventually(lambda: monitor.parked(JOB, 3) is not None, "rank 3 parked")
    assert monitor.parked(JOB, 3) == (1, os.getpid())
    assert monitor.resume(JOB, 3, "/data/jobs/j/g2/.resume-rank-3.json")
    assert await waiting == "/data/jobs/j/g2/.resume-rank-3.json"
    assert monitor.parked(JOB, 3) is None and not monitor.resume(JOB, 3, "/again")


async def test_a_parked_rank_nobody_resumes_hears_nothing_and_its_exit_forgets_it(
    monitor: ProgressMonitor, path: Path, channels: list[RankChannel]
) -> None:
    monitor.begin(JOB, 1)
    ch = channel(path, rank=1)
    channels.append(ch)
    assert await asyncio.get_running_loop().run_in_executor(None, ch.park, 7, 0.3) is None
    assert monitor.parked(JOB, 1) == (1, os.getpid())
    monitor.rank_exited(JOB, 1, 1)
    assert monitor.parked(JOB, 1) is None


def test_a_resume_answer_round_trips_and_garbage_is_refused() -> None:
    data = progress.encode_requests(Requests(resume="/a/b.json"))
    assert progress.decode_requests(data) == Requests(resume="/a/b.json")
    assert progress.decode_requests(progress.encode_requests(Requests())).resume is None
    for bad in (
        '{"v":1,"resume":3}',
        '{"v":1,"resume":""}',
        '{"v":1,"resume":"' + "x" * 2000 + '"}',
    ):
        with pytest.raises(ProgressError, match="resume"):
            progress.decode_requests(bad.encode())
