"""The intake (supervisor.recovery.intake): a failure signal in, a report out, pure.

Every shape a failure reaches the supervisor in (a rank's exit, a node's state, a
gang's hang reports) is turned into the one ``Report`` the controller routes; nothing
here sends, stores or reads a clock."""

from __future__ import annotations

from phalanx import wire
from phalanx.jobspec import validate_spec
from supervisor.fleet.registry import Drain, Node
from supervisor.jobs import Job, JobState, RankPlace
from supervisor.recovery import intake
from supervisor.recovery.planner import FailureKind

NOW = 1_800_000_000.0


def running(nodes: tuple[str, ...] = ("n0", "n1"), rpn: int = 2) -> Job:
    spec = validate_spec(
        {
            "name": "j",
            "team": "t",
            "command": ["true"],
            "workdir": "/tmp",
            "nodes": len(nodes),
            "ranks_per_node": rpn,
        }
    )
    job = Job("j-1", spec, state=JobState.RUNNING, generation=3, nodes=list(nodes))
    job.ranks = [
        RankPlace(rank=i * rpn + lr, node=n, local_rank=lr)
        for i, n in enumerate(nodes)
        for lr in range(rpn)
    ]
    return job


def up(node_id: str) -> Node:
    return Node(node_id, online=True, last_seen=1.0)


def test_a_rank_that_exits_badly_is_a_failure_of_its_generation_and_one_that_exits_0_is_not() -> (
    None
):
    job = running()
    place = job.ranks[2]
    job.rank_exited(place, 1, None)

    report = intake.rank_exit(job, place, step=41, at=NOW)

    assert report is not None and report.fault_at == NOW
    f = report.failure
    assert (f.kind, f.node, f.rank, f.code, f.step, f.generation) == (
        FailureKind.RANK_EXIT,
        "n1",
        2,
        1,
        41,
        3,
    )
    clean = job.ranks[0]
    job.rank_exited(clean, 0, None)
    assert intake.rank_exit(job, clean) is None


def test_a_rank_lost_with_its_node_says_so_and_no_exit_of_a_job_not_running_is_one() -> None:
    job = running()
    job.ranks_lost([job.ranks[1]])
    report = intake.rank_exit(job, job.ranks[1])
    assert report is not None and "no longer runs it" in report.failure.detail

    job.state = JobState.STOPPING
    assert intake.rank_exit(job, job.ranks[1]) is None


def test_a_node_gone_for_sure_or_drained_for_its_health_is_a_failure_operators_drains_are_not() -> (
    None
):
    job = running()
    nodes = {"n0": up("n0"), "n1": up("n1")}

    def judge(confirmed: bool = True, settling: bool = False) -> intake.Report | None:
        return intake.node_failure(
            job, nodes, settling=settling, offline_confirmed=lambda _since: confirmed
        )

    assert judge() is None
    nodes["n1"].drain = Drain("operator", "upgrade", NOW)
    assert judge() is None  # an operator's drain lets the job finish
    nodes["n1"].drain = Drain("auto", "XID 79", NOW - 5)
    report = judge()
    assert report is not None and report.fault_at == NOW - 5
    assert (report.failure.kind, report.failure.node, report.failure.detail) == (
        FailureKind.NODE_DRAIN,
        "n1",
        "XID 79",
    )
    nodes["n1"].drain = None
    nodes["n0"].online, nodes["n0"].offline_cause = False, "last will"
    assert judge(confirmed=False) is None  # perhaps the broker restarting
    report = judge()
    assert report is not None and report.failure.kind is FailureKind.NODE_OFFLINE
    assert report.failure.quarantine
    nodes["n0"].offline_cause = "clean shutdown"
    report = judge()
    assert report is not None and not report.failure.quarantine  # replaced, not drained


def test_a_restarted_supervisor_does_not_judge_a_node_it_has_not_heard_from_yet() -> None:
    job = running()
    nodes = {"n0": Node("n0"), "n1": up("n1")}  # n0 unseen since the restart
    assert intake.node_failure(job, nodes, settling=True, offline_confirmed=lambda _s: True) is None
    report = intake.node_failure(job, nodes, settling=False, offline_confirmed=lambda _s: True)
    assert report is not None and report.failure.node == "n0"


def hung(node: str, rank: int, *, step: int, idle: float, stopped: bool = False) -> wire.RankEvent:
    return wire.RankEvent(
        node=node,
        job="j-1",
        generation=3,
        rank=rank,
        event="hung",
        step=step,
        stopped=stopped,
        idle_s=idle,
        detail=f"no step for {idle:.1f}s; rank {rank} behind",
        at=NOW,
    )


def test_hang_reports_are_gathered_until_every_node_of_the_gang_reported() -> None:
    job = running()
    reports = intake.HangReports()
    assert reports.add(job, hung("n0", 0, step=40, idle=30.0)) == (True, False)
    assert reports.add(job, hung("n0", 1, step=40, idle=30.0)) == (False, False)
    assert reports.add(job, hung("n1", 2, step=40, idle=30.0)) == (False, True)
    assert len(reports.take(("j-1", 3))) == 3
    assert reports.take(("j-1", 3)) == []


def test_a_hangs_culprit_is_the_stopped_process_then_the_rank_furthest_behind() -> None:
    job = running()
    behind = [hung("n0", 0, step=40, idle=30.0), hung("n1", 3, step=38, idle=20.0)]
    report = intake.hang(job, 3, behind, now=NOW)
    assert report is not None
    assert (report.failure.kind, report.failure.node, report.failure.rank) == (
        FailureKind.HANG,
        "n1",
        3,
    )
    assert report.fault_at == NOW - 30.0  # the longest silence
    stopped = [*behind, hung("n0", 1, step=40, idle=5.0, stopped=True)]
    report = intake.hang(job, 3, stopped, now=NOW)
    assert report is not None and report.failure.rank == 1


def test_no_hang_of_an_older_generation_nor_of_a_gang_one_of_whose_ranks_finished() -> None:
    job = running()
    reports = [hung("n0", 0, step=40, idle=30.0)]
    assert intake.hang(job, 2, reports, now=NOW) is None
    job.rank_exited(job.ranks[3], 0, None)  # the others wait for it at the end
    assert intake.hang(job, 3, reports, now=NOW) is None
