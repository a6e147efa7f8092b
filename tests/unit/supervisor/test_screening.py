"""Pre-flight screening (supervisor.fleet.screening): a node's burn-in speed against the
median of the nodes of its GPU model. Pure."""

from __future__ import annotations

from supervisor.fleet.screening import Perf, parse_perf, screen, screen_p2p

PEERS = [Perf(0.010, 400.0), Perf(0.011, 380.0), Perf(0.009, 420.0)]


def judged(perf: Perf, peers: list[Perf] = PEERS, min_peers: int = 3) -> list[str]:
    return screen(perf, peers, model="H200", max_slowdown=0.05, min_link=0.5, min_peers=min_peers)


def test_a_node_as_fast_as_the_fleet_joins() -> None:
    assert judged(Perf(0.0104, 300.0)) == []


def test_a_slow_gpu_and_a_slow_link_are_each_a_reason() -> None:
    reasons = judged(Perf(0.020, 150.0, {"0": 0.010, "3": 0.020}))
    assert reasons == [
        "slow_gpu: GPU 3's synthetic step took 20.0 ms, 100% slower than the median of 3 "
        "H200 nodes (10.0 ms; the limit is 5%)",
        "slow_link: the all-reduce between its GPUs ran at 150.0 GB/s, under 50% of the "
        "median of 3 H200 nodes (400.0 GB/s)",
    ]


def test_too_few_peers_judge_nothing() -> None:
    assert judged(Perf(1.0, 1.0), PEERS[:2]) == []
    assert judged(Perf(1.0, 1.0), PEERS[:2], min_peers=2) != []


def test_a_figure_not_measured_is_not_judged() -> None:
    assert judged(Perf(None, 1.0), [Perf(None, 400.0)] * 3) != []
    assert judged(Perf(1.0, None), [Perf(0.01, None)] * 3) != []
    assert judged(Perf(1.0, None), [Perf(None, 400.0)] * 3) == []


def test_a_burn_ins_speed_is_parsed_and_garbage_left_out() -> None:
    assert parse_perf({"step_s": 0.01, "gpu_step_s": {"0": 0.01}, "allreduce_gbps": None}) == Perf(
        0.01, None, {"0": 0.01}
    )
    assert parse_perf(None) is None and parse_perf([1]) is None
    assert parse_perf({"step_s": True, "allreduce_gbps": -3}) is None
    assert parse_perf({"step_s": float("inf"), "allreduce_gbps": 7}) == Perf(None, 7.0)
    assert parse_perf({"step_s": 1, "gpu_step_s": {"0": "x", "1": 2}}) == Perf(
        1.0, None, {"1": 2.0}
    )


def test_a_link_is_judged_against_the_fleets_median_once_there_are_enough() -> None:
    fleet = [900.0, 1000.0, 1100.0]
    link = "the link from node a to node b"

    assert screen_p2p(600.0, fleet, link=link, min_fraction=0.5, min_peers=3) is None
    slow = screen_p2p(400.0, fleet, link=link, min_fraction=0.5, min_peers=3)
    assert slow == (
        "slow_p2p: the link from node a to node b carried 400.0 MB/s, 40% of the median of "
        "the 3 links probed lately (1000.0 MB/s; the limit is 50%)"
    )
    assert screen_p2p(1.0, fleet[:2], link=link, min_fraction=0.5, min_peers=3) is None
