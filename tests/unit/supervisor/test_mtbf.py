"""The fleet's node MTBF, learned from the supervisor's event log (real SQLite)."""

from __future__ import annotations

from pathlib import Path

from supervisor.fleet.mtbf import node_mtbf
from tests.unit.supervisor.conftest import OpenStore

HOUR = 3600.0


def test_the_configured_mtbf_holds_until_enough_failures_are_seen_then_it_is_learned(
    tmp_path: Path,
    open_store: OpenStore,
) -> None:
    store = open_store()
    for node in ("n01", "n02", "n03", "n04"):
        store.add_event("node_joined", node, {"rack": "r1"})
    joined = store.first_events("node_joined")
    now = max(joined.values()) + 100 * HOUR  # 4 nodes x ~100 h = ~400 node-hours

    def mtbf() -> tuple[str, int, float]:
        found = node_mtbf(store, configured_s=5000 * HOUR, min_failures=3, now=now)
        return found.source, found.failures, found.seconds

    assert mtbf() == ("configured", 0, 5000 * HOUR)
    # No failures: an operator's drain, a clean agent stop, a node coming back.
    store.add_event("node_drained", "n01", {"by": "operator", "reason": "maintenance"})
    store.add_event(
        "state_changed", "n02", {"state": "offline", "previous": "up", "cause": "clean shutdown"}
    )
    store.add_event(
        "state_changed", "n02", {"state": "up", "previous": "offline", "cause": "birth"}
    )
    assert mtbf()[:2] == ("configured", 0)
    # Failures: a lost node (last will, heartbeat timeout) and an automatic drain.
    store.add_event(
        "state_changed", "n03", {"state": "offline", "previous": "up", "cause": "last will"}
    )
    store.add_event(
        "state_changed",
        "n04",
        {"state": "offline", "previous": "up", "cause": "no heartbeat for 15.2s"},
    )
    assert mtbf()[:2] == ("configured", 2)
    store.add_event("node_drained", "n01", {"by": "auto", "reason": "ecc_dbe"})

    source, failures, seconds = mtbf()

    assert (source, failures) == ("learned", 3)
    exposure = sum(now - ts for ts in joined.values())
    assert seconds == exposure / 3
    assert node_mtbf(store, configured_s=1.0, min_failures=3, now=now).for_job(4) == seconds / 4
