from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness import Broker, Fleet
from tests.pg import PgCluster
from tests.rig.sweep import RigSweep


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(RigSweep(), "rig-sweep")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    b = Broker(tmp_path / "broker").start()
    yield b
    b.stop()


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """A PostgreSQL cluster of this test session's own (``tests.pg``), started on first use;
    each test that needs one makes its own database (``PgCluster.new_database``)."""
    cluster = PgCluster()
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def fleet(tmp_path: Path, broker: Broker, request: pytest.FixtureRequest) -> Iterator[Fleet]:
    f = Fleet(tmp_path, broker)
    yield f
    f.stop()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:  # show the daemons' logs with the failure
        ranks = sorted((tmp_path / "nodes").glob("*/data/jobs/*/g*/rank-*.log"))
        for log in [*sorted((tmp_path / "logs").glob("*.log")), *ranks]:
            name = log.relative_to(tmp_path)
            sys.stderr.write(f"\n----- {name} -----\n{log.read_text(errors='replace')[-4000:]}")


# In a parallel run (make test: pytest-xdist, --dist loadfile) a file's tests run in one
# worker, one after another: the tests that train tinylm hard (test_recovery_training and
# test_recovery_moves, and the undisturbed run they compare with, computed once per worker)
# never run four at once on 2 cores, where they starve each other past their timeouts; two
# files, so that they take two workers, not one for over ten minutes. (--dist loadgroup
# would group them across files, but pytest-xdist 3.8 cannot set a group on pytest 9.2's
# node ids.) The longest files first (by a run of 2026-11-29), so that none of them starts
# last with the other workers idle until it ends; the rest keep their order.
LONGEST_FIRST = (
    "tests/integration/test_recovery_training.py",
    "tests/integration/test_ha.py",
    "tests/integration/test_elastic.py",
    "tests/integration/test_recovery_moves.py",
    "tests/integration/test_ckpt_fleet.py",
    "tests/integration/test_broker_list.py",
    "tests/integration/test_guard_rollback.py",
    "tests/integration/test_jobs.py",
    "tests/integration/test_dashboard.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        found = (i for i, path in enumerate(LONGEST_FIRST) if item.nodeid.startswith(path))
        return next(found, len(LONGEST_FIRST))

    items.sort(key=rank)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    rep = yield
    if rep.when == "call":
        item.rep_call = rep  # type: ignore[attr-defined]
    return rep
