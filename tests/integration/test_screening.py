"""Pre-flight screening over a real fleet (issue 23): a node whose burn-in finds it much
slower than the fleet's nodes of the same GPU model does not join. Four healthy nodes
pass their burn-in as spares; then a node with a slow GPU, and after it one with a slow
link between its GPUs (the simulated backend's ``slow-gpu`` and ``slow-nvlink`` faults, which
leave the health clean) come up, fail it, and are drained with the reason."""

from __future__ import annotations

import pytest

from phalanx.simgpu import inject, new_state, write_state
from tests.harness import Fleet, wait_for

pytestmark = pytest.mark.integration

MODEL = "Simulated H100 80GB HBM3"  # the agents' sim_model default


def test_a_slow_gpu_or_a_slow_link_keeps_a_node_out_of_the_fleet(fleet: Fleet) -> None:
    fleet.start_supervisor(spares=6)
    healthy = fleet.start_nodes(4)
    for node in healthy:  # burned in, screened: their figures are the fleet's
        wait_for(lambda n=node: fleet.node(n).get("spare") or None, 60, f"{node} a spare")
    drained = {}
    for node, fault in (("n05", "slow-gpu"), ("n06", "slow-nvlink")):
        write_state(fleet.sim_file(node), new_state(node, 2, MODEL))
        inject(fleet.sim_file(node), 1, fault)
        fleet.start_agent(node)
        drained[node] = fleet.wait_state(node, "drain", timeout=60)
    slow_gpu, slow_link = drained["n05"], drained["n06"]

    assert slow_gpu["health"] == slow_link["health"] == "ok"  # nothing else is wrong
    assert slow_gpu["drain"]["reason"].startswith(
        "failed burn-in: slow_gpu: GPU 1's synthetic step took 15.0 ms, 50% slower than "
        f"the median of 4 2-GPU {MODEL} nodes"
    )
    assert slow_link["drain"]["reason"].startswith(
        "failed burn-in: slow_link: the all-reduce between its GPUs ran at 100.0 GB/s, "
        f"under 50% of the median of 5 2-GPU {MODEL} nodes (400.0 GB/s)"  # n05's counts
    )
    assert all(fleet.node(n)["spare"] for n in healthy)
